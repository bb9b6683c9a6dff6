"""Secondary tiers behind host memory.  `FileTier` keeps chunk rows in files on local disk."""

from offload.tiers.file_format import geometry_fingerprint
from offload.tiers.file_tier import FileTier, FileTierStats, Spill, host_view

__all__ = ["FileTier", "FileTierStats", "Spill", "geometry_fingerprint", "host_view"]
