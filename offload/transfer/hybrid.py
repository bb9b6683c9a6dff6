"""The default CUDA backend: per job, the copy engines or the Triton kernel, by run length.

Measured on an H200 (1 GiB of scattered blocks, docs/BENCHMARKS.md): one
``cuMemcpyBatchAsync`` moves 1 MiB runs at 0.96-0.97x the single-buffer rate while a concurrent
matmul keeps ~100% of its rate, but each descriptor costs the driver about a microsecond, so
64 KiB runs reach only 0.70x and 4 KiB runs 0.05x; the Triton kernel holds 0.82-0.86x from
16 KiB up (0.5-0.6x at 4 KiB) and takes 30-45% of a concurrent matmul.  So a job whose
coalesced copies (`base.job_runs`) average at least ``COPY_ENGINE_MIN_RUN`` bytes goes
to the copy engines, any other job to the kernel.  Both run on the engine's one stream, so
jobs still complete in submission order.
"""

from __future__ import annotations

from offload.transfer.base import CopySide, Direction, job_runs
from offload.transfer.batch_copy import BatchCopyEngine
from offload.transfer.triton_copy import TritonEngine

COPY_ENGINE_MIN_RUN = 512 << 10


class HybridEngine(TritonEngine, BatchCopyEngine):
    """Routes each job by its mean run length; needs a pinned region, Triton and a CUDA 13
    driver."""

    name = "hybrid"

    def _launch(self, direction: Direction, sides: list[CopySide]) -> None:
        runs = job_runs(sides, self._region, self._layout.row_stride)  # merged once, used twice
        if runs[2].size and runs[2].mean() >= COPY_ENGINE_MIN_RUN:
            self._launch_runs(runs)
        else:
            TritonEngine._launch(self, direction, sides)
            self._keep.append(())  # keeps the per-job bookkeeping of the batch path aligned
