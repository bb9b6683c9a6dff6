"""Host memory regions: shm segments, pre-fault, pinning and the per-rank ``HostRegion``."""

from offload.region.host_region import HostRegion, RegionStats
from offload.region.pin import CudaRegistrar, RecordingRegistrar, Registrar, choose_registrar

__all__ = ["CudaRegistrar", "HostRegion", "RecordingRegistrar", "RegionStats", "Registrar",
           "choose_registrar"]
