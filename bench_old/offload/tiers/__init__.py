"""Secondary tiers behind host memory.  `FileTier` keeps chunk rows in files on local disk."""

from offload.tiers.file_format import chunk_file_bytes, geometry_fingerprint
from offload.tiers.file_tier import FileTier, FileTierStats, Spill, host_view

__all__ = ["FileTier", "FileTierStats", "Spill", "chunk_file_bytes", "geometry_fingerprint",
           "host_view"]
