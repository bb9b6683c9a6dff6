"""The default CUDA backend: the kernel, except where the copy engines' runs are long.

Copy engines win only on long contiguous copies (the driver's host time per descriptor
outweighs a small copy; no SM is taken from compute); the kernel wins on pages.  Which one a
job gets is decided without per-page host work, at engine start where possible:

* every page at least ``COPY_ENGINE_MIN_RUN`` (e.g. 1 MiB pages): every job goes to the copy
  engines, one descriptor per page;
* else, if every KV tensor holds its blocks back to back and a chunk's run (``blocks_per_chunk
  x page``) averages at least ``COPY_ENGINE_MIN_RUN``: a chunk-granular job (whole chunks,
  positions 0..bpc-1 from consecutive blocks -- a few whole-array comparisons) is one descriptor
  per tensor per chunk by construction and goes to the copy engines;
* anything else runs on the kernel.

Both share the engine's one stream, so jobs still complete in submission order.  With
integrity on, a copy-engine job also gets the kernel in sum-only mode over its GPU pages
(`offload.transfer.kernel`): before the DMA on a store (it writes the trailer), after it on a
load (it checks the loaded pages against the trailer).  Whole chunks of consecutive blocks
run closer to the link on the copy engines than on the kernel, and scattered small pages far
slower (docs/BENCHMARKS.md, "Engine-shaped transfers" and "Transfers").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from offload.transfer.base import Direction
from offload.transfer.batch_copy import BatchCopier, page_copies
from offload.transfer.cuda import StreamEngine
from offload.transfer.kernel import NUM_WARPS, kernel_copier
from offload.transfer.layout import Job, SlotLayout, chunk_starts

COPY_ENGINE_MIN_RUN = 512 << 10


class HybridEngine(StreamEngine):
    """Holds a kernel and a copy-engine path over one stream; ``routes`` counts the jobs each
    one ran (``"kernel"``, ``"copy_engine"``)."""

    name = "hybrid"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int,
                 programs: Mapping[Direction, int] | None = None, num_warps: int = NUM_WARPS,
                 priority: int = 0, min_run: int = COPY_ENGINE_MIN_RUN) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count, priority)
        self.kernel = kernel_copier(self, programs, num_warps)
        self.batch = BatchCopier(self._stream)
        pages = np.asarray(layout.page_bytes, dtype=np.int64)
        back_to_back = bool((self._block_strides == pages).all())
        self.page_runs = bool(pages.min() >= min_run)
        self.chunk_runs = back_to_back and layout.blocks_per_chunk * pages.mean() >= min_run
        self._run_bytes = layout.blocks_per_chunk * pages[:, None]
        self._host_bases = self._region.data_ptr() + layout.host_page_offsets()[:, None]
        self.routes = {"kernel": 0, "copy_engine": 0}
        if not (self.page_runs or self.chunk_runs):  # every job runs on the kernel
            self._pack_target = self.kernel.staging

    def _launch(self, direction: Direction, job: Job) -> object:
        return self._route(direction, job, None)

    def _launch_after(self, caller: int, direction: Direction, job: Job) -> object:
        return self._route(direction, job, caller)

    def _route(self, direction: Direction, job: Job, caller: int | None) -> object:
        """Run ``job`` on the kernel or the copy engines, after the raw stream ``caller``
        when given (the kernel orders itself, natively where it can)."""
        starts = None
        if not self.page_runs:
            bpc = self._layout.blocks_per_chunk
            starts = chunk_starts(job, bpc) if self.chunk_runs else None
            if starts is None:
                self.routes["kernel"] += 1
                return self.kernel.launch(direction, job, caller)
        if caller is not None:
            self._wait_for(caller)
        self.routes["copy_engine"] += 1
        sums = None
        if self._layout.integrity and direction == "store":
            sums = self.kernel.launch(direction, job, copy=False)
        if starts is None:
            copies = self.batch.launch_runs(*page_copies(self, direction, job))
        else:
            first_block, chunk = starts
            kv = self._kv_bases[:, None] + first_block[None, :] * self._block_strides[:, None]
            host = self._host_bases + chunk[None, :] * self._layout.row_stride
            sizes = np.broadcast_to(self._run_bytes, kv.shape)
            src, dst = (kv, host) if direction == "store" else (host, kv)
            copies = self.batch.launch_runs(src.ravel(), dst.ravel(), sizes.ravel())
        if self._layout.integrity and direction == "load":
            sums = self.kernel.launch(direction, job, copy=False)
        return copies if sums is None else (sums, copies)
