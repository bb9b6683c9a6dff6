"""The CPU backend: KV tensors in host memory (CI, CPU-only runs); jobs finish inside submit."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from offload.transfer.base import After, Direction, EngineBase
from offload.transfer.layout import Job, SlotLayout

# Jobs of at most this many entries copy page by page: torch's vectorised index_put into the
# region's [chunks, positions, page] view wakes its thread pool, which on a busy 2-core host cost
# 1.9 ms for one 8 KiB page against ~7 us for a single page copy (and ~60 us for the gather).
SMALL_JOB = 16


class HostEngine(EngineBase):
    """One gather and one scatter per tensor over ``[blocks, page]`` views of the KV tensors
    (any block stride) and ``[chunks, positions, page]`` views of the region; each job is done
    when ``submit`` returns."""

    name = "host"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count)
        self._pages = self._page_views()
        self._done: list[int] = []

    def _issue(self, job_id: int, direction: Direction, job: Job, after: After) -> None:
        chunks, positions = divmod(job.host_pages, self._layout.blocks_per_chunk)
        if 0 < len(job) <= SMALL_JOB:
            entries = list(zip(job.blocks.tolist(), chunks.tolist(), positions.tolist(),
                               strict=True))
            for kv, host in self._pages:
                for block, chunk, position in entries:
                    if direction == "store":
                        host[chunk, position].copy_(kv[block])
                    else:
                        kv[block].copy_(host[chunk, position])
        elif len(job):
            blocks = torch.from_numpy(job.blocks)
            chunk, position = torch.from_numpy(chunks), torch.from_numpy(positions)
            for kv, host in self._pages:
                if direction == "store":
                    host[chunk, position] = kv[blocks]
                else:
                    kv[blocks] = host[chunk, position]
        self._done.append(job_id)
        return None

    def poll(self) -> list[int]:
        done, self._done = self._done, []
        return done

    def wait_all(self) -> list[int]:
        return self.poll()
