"""The settings of one host tier, shared by the library API and the main job.

Every field here must be identical on every rank; the plan step checks that and names the ranks
and the field that differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from offload.errors import OffloadError

LAYOUTS = ("private", "shared", "replicated")
GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class TierConfig:
    """Geometry and mechanics settings of a tier.

    ``segment_threshold`` / ``min_segment_bytes`` / ``max_segments`` control how a region is
    split into several shm files (one file serialises page-cache insertion); tests shrink them
    to MiB.  ``max_registration_bytes`` caps one CUDA host registration (a single call of
    512 GiB fails on current drivers; 64 GiB is safe).
    """

    cpu_bytes_per_node: int
    layout: str = "private"
    blocks_per_chunk: int = 16
    tp: int = 1
    pp: int = 1
    page_size: int = 4096
    shm_dir: str = "/dev/shm"
    segment_threshold: int = 2 * GiB
    min_segment_bytes: int = 1 * GiB
    max_segments: int = 32
    max_registration_bytes: int = 64 * GiB
    max_slot_rows: int = 65536
    prefault_threads: int = 8
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise OffloadError(
                f"unknown layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}"
            )
        for name in ("cpu_bytes_per_node", "blocks_per_chunk", "tp", "pp", "page_size",
                     "max_segments", "max_registration_bytes", "max_slot_rows",
                     "prefault_threads"):
            value = getattr(self, name)
            if value < 1:
                raise OffloadError(f"{name} = {value} must be at least 1")
        if self.page_size & (self.page_size - 1):
            raise OffloadError(f"page_size = {self.page_size} must be a power of two")
        if self.timeout_s <= 0:
            raise OffloadError(f"timeout_s = {self.timeout_s} must be positive")

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)
