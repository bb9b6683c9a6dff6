# SPDX-License-Identifier: Apache-2.0
"""Host memory regions: their geometry, pre-fault, pinning, signal-safe clean-up and the
per-rank ``HostRegion``, built on the shared-memory segments of `offload.system.shm`.  Public
names are imported lazily, so that the pure geometry (`offload.region.geometry`) does not pull
in the syscall layers."""

from __future__ import annotations

from offload.exports import lazy_exports

_EXPORTS = {
    "HostRegion": "offload.region.host_region",
    "RegionStats": "offload.region.host_region",
    "CudaRegistrar": "offload.region.pin",
    "RecordingRegistrar": "offload.region.pin",
    "Registrar": "offload.region.pin",
    "choose_registrar": "offload.region.pin",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
