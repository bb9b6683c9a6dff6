"""Stream ordering shared by the CUDA backends, and the slow per-block fallback.

Every job runs on the engine's own stream, after whatever the compute stream had queued when the
job was submitted: a store then sees the compute kernels' pending writes and a load does not
overtake them.  One event per job, queried without blocking, reports completion.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from offload.transfer.base import CopySide, Direction, EngineBase
from offload.transfer.layout import SlotLayout

# Programs (so SMs) a kernel-driven copy may occupy, per direction.  Loads are latency-bound
# and want more in flight; stores are posted writes that, issued from many SMs, back up the
# memory system and stall concurrent compute.  Measured on an H200, 1 GiB of scattered 1 MiB
# blocks next to a bf16 matmul (757 TFLOP/s alone): stores with 4 / 8 / 16 programs ran at
# 47.1 / 47.6 / 47.4 GB/s with the matmul at 533 / 385 / 102 TFLOP/s; loads with 16 / 32 at
# 45.5 / 45.9 GB/s, matmul 594 / 543 TFLOP/s.
DEFAULT_COPY_PROGRAMS: dict[Direction, int] = {"load": 32, "store": 4}


class StreamEngine(EngineBase):
    """Orders jobs after the compute stream and tracks them with events; ``_launch`` moves the
    bytes on the transfer stream (the current stream while it runs)."""

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count)
        self._device = kv_tensors[0].device
        self._stream = torch.cuda.Stream(self._device)
        self._pending: deque[tuple[int, torch.cuda.Event]] = deque()

    @property
    def stream(self) -> torch.cuda.Stream:
        return self._stream

    def _issue(self, job_id: int, direction: Direction, sides: list[CopySide]) -> None:
        with torch.cuda.device(self._device):
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._launch(direction, sides)
                done = torch.cuda.Event()
                done.record(self._stream)
        self._pending.append((job_id, done))

    def _launch(self, direction: Direction, sides: list[CopySide]) -> None:
        raise NotImplementedError

    def poll(self) -> list[int]:
        finished = []
        while self._pending and self._pending[0][1].query():
            finished.append(self._pending.popleft()[0])
        return finished

    def wait_all(self) -> list[int]:
        if self._pending:
            self._pending[-1][1].synchronize()
        finished = [job_id for job_id, _ in self._pending]
        self._pending.clear()
        return finished


class PerBlockEngine(StreamEngine):
    """One ``copy_`` per page: correct with unpinned host memory (CUDA stages pageable copies
    itself) but slow for small blocks (1.6 GB/s at 16 KiB, DESIGN.md section 7)."""

    name = "per_block"

    def _launch(self, direction: Direction, sides: list[CopySide]) -> None:
        for side in sides:
            page = side.page_bytes
            for dst, src in zip(side.dst_offsets.tolist(), side.src_offsets.tolist(),
                                strict=True):
                side.dst[dst:dst + page].copy_(side.src[src:src + page], non_blocking=True)
