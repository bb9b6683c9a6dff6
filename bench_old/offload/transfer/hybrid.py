"""The default CUDA backend: DMA for the PCIe leg wherever a job allows, the kernel elsewhere.

A copy kernel holds its SMs for the whole PCIe transfer and slows a concurrent forward pass
(docs/BENCHMARKS.md, "Copies beside compute"); the copy engines hold none but win only on
long contiguous copies (the driver's host time per descriptor outweighs a small copy).  Which
path a job gets is decided without per-page host work:

* every page at least ``COPY_ENGINE_MIN_RUN`` (e.g. 1 MiB pages): every job goes to the copy
  engines, one descriptor per page;
* else a job of whole chunks, each filled in position order (what engines store and load),
  takes the *staged* path (`offload.transfer.staged`): one short GPU pass gathers or scatters
  every page between the KV tensors and a small ring of staging rows laid out like the host
  slot, and the copy engines move each row with one DMA;
* anything else (partial chunks, scattered pages) runs on the kernel.

All paths share the engine's stream, so jobs still complete in submission order.  With
integrity on, the kernel computes the checksums in its pass on every path: the staged pass
sums what it gathers or scatters; a per-page copy-engine job gets the kernel in sum-only mode
over its GPU pages (`offload.transfer.kernel`), before its DMA on a store, after it on a load.
``routes`` counts the jobs each path ran.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from offload.config import DEFAULT_STAGING_BYTES
from offload.cuda_driver import allocation_ranges
from offload.transfer.base import Direction
from offload.transfer.batch_copy import BatchCopier, kv_allocations, page_copies
from offload.transfer.cuda import StreamEngine
from offload.transfer.kernel import NUM_WARPS, kernel_copier
from offload.transfer.layout import Job, SlotLayout
from offload.transfer.staged import StagedCopier
from offload.transfer.staging import merged_ranges, stage_plan, whole_chunks

log = logging.getLogger(__name__)

COPY_ENGINE_MIN_RUN = 512 << 10
# A layer-wise load through the staging ring issues one DMA per (chunk, layer group), two with
# checksums apart from the pages, and the driver spends ~1 us of host time on each: at 80
# groups, 1,280 DMAs cost `submit` 2.0 ms (the kernel's 80 launches 2.1 ms), 10,240 cost 12 ms
# and blocked the next `submit` for the whole copy (docs/BENCHMARKS.md, "Layer-wise loads
# through the staging ring").  Past this many, consecutive layer groups move together.
MAX_LAYER_COPIES = 1536


class HybridEngine(StreamEngine):
    """Holds a kernel, a staged path (where the slot fits the staging budget) and a copy-engine
    path over one stream; ``routes`` counts the jobs each one ran (``"kernel"``, ``"staged"``,
    ``"copy_engine"``)."""

    name = "hybrid"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int,
                 programs: Mapping[Direction, int] | None = None, num_warps: int = NUM_WARPS,
                 priority: int = 0, min_run: int = COPY_ENGINE_MIN_RUN,
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count, priority)
        self.kernel = kernel_copier(self, programs, num_warps)
        self.batch = BatchCopier(self._stream)
        self.page_runs = bool(min(layout.page_bytes) >= min_run)
        # the allocations the copy engines' runs may not span
        self.allocations = (kv_allocations(kv_tensors, self._geometry) if self.page_runs
                            else np.zeros(0, dtype=np.int64))
        self.staged: StagedCopier | None = None
        if not self.page_runs:
            plan = stage_plan(layout, staging_bytes) if staging_bytes else "staging is off"
            if isinstance(plan, str):
                log.info("rank's transfer engine runs whole chunks on the kernel: %s", plan)
            else:
                staged = StagedCopier(self.kernel, plan, layout, self._region.data_ptr(),
                                      self._stream, priority)
                # one DMA per slice of the ring, which may not span two device allocations
                # (a ring in memory mapped piecewise, as under expandable segments)
                try:
                    pieces = len(allocation_ranges(staged.staging.data_ptr(), plan.ring_bytes))
                except RuntimeError:  # the driver cannot say: one tensor, one segment
                    pieces = 1
                if pieces == 1:
                    self.staged = staged
                else:
                    log.warning("rank's staging ring lies in %d device allocations, which a "
                                "DMA may not span: whole chunks run on the kernel", pieces)
        self.routes = {"kernel": 0, "staged": 0, "copy_engine": 0}
        self.max_layer_copies = MAX_LAYER_COPIES
        if not self.page_runs:  # every job's indices go to the kernel
            self._pack_target = self.kernel.staging

    def _launch(self, direction: Direction, job: Job) -> object:
        return self._route(direction, job, None)

    def _launch_after(self, caller: int, direction: Direction, job: Job) -> object:
        return self._route(direction, job, caller)

    def _launch_layers(self, job: Job, ranges: list[tuple[int, int]], caller: int | None
                       ) -> tuple[object, list[torch.cuda.Event | None]]:
        """A layer-wise load of whole chunks takes the staged path group by group (the copy
        engines move it, so the forward pass it overlaps keeps its SMs), joining as few
        consecutive groups as keep it within `MAX_LAYER_COPIES` DMAs (the groups joined share
        one event); any other on the kernel, one launch per group; with every page on the copy
        engines, as one job."""
        if self.page_runs:
            return super()._launch_layers(job, ranges, caller)
        staged = self.staged
        chunks = whole_chunks(job, self._layout.blocks_per_chunk) if staged is not None else None
        if staged is not None and chunks is not None:
            self.routes["staged"] += 1
            runs = staged.layer_runs(int(chunks.size), ranges, self.max_layer_copies)
            held, events = staged.launch_layers(job, chunks, merged_ranges(ranges, runs),
                                                caller)
            return held, [events[g // runs] for g in range(len(ranges))]
        self.routes["kernel"] += 1
        return self.kernel.launch_layers(job, ranges, caller)

    def _route(self, direction: Direction, job: Job, caller: int | None) -> object:
        """Run ``job`` on the staged path, the kernel or the copy engines, after the raw
        stream ``caller`` when given (the kernel orders itself, natively where it can)."""
        if not self.page_runs:
            chunks = (whole_chunks(job, self._layout.blocks_per_chunk)
                      if self.staged is not None else None)
            if chunks is None:
                self.routes["kernel"] += 1
                if self.staged is not None and direction == "store":
                    self.staged.engine_wrote()
                return self.kernel.launch(direction, job, caller)
            self.routes["staged"] += 1
            return self.staged.launch(direction, job, chunks, caller)  # type: ignore[union-attr]
        if caller is not None:
            self._wait_for(caller)
        self.routes["copy_engine"] += 1
        sums = None
        if self._layout.integrity and direction == "store":
            sums = self.kernel.launch(direction, job, copy=False)
        copies = self.batch.launch_runs(*page_copies(self, self.allocations, direction, job))
        if self._layout.integrity and direction == "load":
            sums = self.kernel.launch(direction, job, copy=False)
        return copies if sums is None else (sums, copies)
