"""The CPU backend: KV tensors in host memory (CI, CPU-only runs); jobs finish inside submit."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from offload.transfer.base import CopySide, Direction, EngineBase
from offload.transfer.layout import IndexArray, SlotLayout


class HostEngine(EngineBase):
    """Copies with vectorised indexing; each job is done when ``submit`` returns."""

    name = "host"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count)
        self._done: list[int] = []

    def _issue(self, job_id: int, direction: Direction, sides: list[CopySide]) -> None:
        for side in sides:
            copy_pages(side)
        self._done.append(job_id)

    def poll(self) -> list[int]:
        done, self._done = self._done, []
        return done

    def wait_all(self) -> list[int]:
        return self.poll()


def copy_pages(side: CopySide) -> None:
    """One gather/scatter per tensor: both buffers are viewed as rows of ``granule`` bytes, the
    largest size dividing every offset and the page, so the index holds ``page / granule``
    entries per page rather than one per byte."""
    if side.dst_offsets.size == 0:
        return
    granule = int(np.gcd.reduce(np.concatenate(
        [side.dst_offsets, side.src_offsets, [side.page_bytes]])))
    per_page = side.page_bytes // granule
    src = _rows(side.src, granule)[_row_index(side.src_offsets, granule, per_page)]
    _rows(side.dst, granule)[_row_index(side.dst_offsets, granule, per_page)] = src


def _rows(flat: torch.Tensor, granule: int) -> torch.Tensor:
    return flat[: flat.numel() // granule * granule].view(-1, granule)


def _row_index(offsets: IndexArray, granule: int, per_page: int) -> torch.Tensor:
    first = torch.from_numpy(offsets // granule)
    return (first[:, None] + torch.arange(per_page)).reshape(-1)
