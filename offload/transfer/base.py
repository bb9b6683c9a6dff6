"""The engine protocol and what every backend shares: tensor checks, job checks, ordering.

A backend only decides *how* one job's pages move (`_issue`); checking the KV tensors and the
region once, turning a job into offsets and keeping jobs in submission order live here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple, Protocol

import numpy as np
import torch

from offload.errors import OffloadError
from offload.transfer.layout import IndexArray, SlotLayout, TensorCopies, coalesce, job_offsets

Direction = Literal["store", "load"]
DIRECTIONS: tuple[Direction, ...] = ("store", "load")


class TransferEngine(Protocol):
    """Moves one rank's blocks between its KV tensors and its host region.

    ``store`` copies GPU → host, ``load`` host → GPU.  Jobs complete in submission order; a job
    id is reported exactly once, by ``poll`` or ``wait_all``.
    """

    name: str

    def submit(self, job_id: int, direction: Direction, gpu_blocks: object, chunk_ids: object,
               positions: object) -> None: ...

    def check(self, gpu_blocks: object, chunk_ids: object, positions: object) -> None: ...

    def poll(self) -> list[int]: ...

    def wait_all(self) -> list[int]: ...

    def close(self) -> None: ...


class CopySide(NamedTuple):
    """One tensor's share of a job, oriented: ``page_bytes`` bytes go from each
    ``src_offsets[i]`` of ``src`` to ``dst_offsets[i]`` of ``dst`` (both flat uint8)."""

    dst: torch.Tensor
    dst_offsets: IndexArray
    src: torch.Tensor
    src_offsets: IndexArray
    page_bytes: int


def absolute_copies(sides: Sequence[CopySide]
                    ) -> tuple[IndexArray, IndexArray, IndexArray]:
    """A job's copies as absolute (source address, destination address, bytes) arrays."""
    src = np.concatenate([s.src_offsets + s.src.data_ptr() for s in sides])
    dst = np.concatenate([s.dst_offsets + s.dst.data_ptr() for s in sides])
    count = np.repeat(np.array([s.page_bytes for s in sides], dtype=np.int64),
                      [s.src_offsets.size for s in sides])
    return src, dst, count


def job_runs(sides: Sequence[CopySide], region: torch.Tensor, row_stride: int
             ) -> tuple[IndexArray, IndexArray, IndexArray]:
    """A job's copies with consecutive pages of one host row merged (`coalesce`); ``region``
    is the side that is host memory, whose rows bound every run."""
    row = np.concatenate([(s.dst_offsets if s.dst is region else s.src_offsets) // row_stride
                          for s in sides])
    return coalesce(*absolute_copies(sides), row)


def flat_kv_bytes(kv_tensors: Sequence[torch.Tensor], layout: SlotLayout) -> list[torch.Tensor]:
    """Check that KV tensor ``t`` is ``[num_blocks, ...]`` with each block a contiguous page of
    ``layout.page_bytes[t]`` bytes (so block ``b`` starts at ``b * page``), all tensors on one
    device with the same block count; return flat uint8 views of them."""
    if len(kv_tensors) != layout.num_tensors:
        raise OffloadError(
            f"got {len(kv_tensors)} KV tensors but the plan has {layout.num_tensors} page sizes; "
            "pass the same tensors the plan was computed from"
        )
    first = kv_tensors[0]
    if first.dim() == 0:
        raise OffloadError("KV tensor 0 is a scalar; KV tensors are [num_blocks, ...]")
    num_blocks = first.shape[0]
    views = []
    for t, (kv, page) in enumerate(zip(kv_tensors, layout.page_bytes, strict=True)):
        if kv.dim() == 0 or kv.shape[0] != num_blocks or kv.device != first.device:
            raise OffloadError(
                f"KV tensor {t} has shape {tuple(kv.shape)} on {kv.device} but tensor 0 has "
                f"{num_blocks} blocks on {first.device}; all KV tensors need dim 0 = blocks, "
                "the same block count and one device"
            )
        if not kv.is_contiguous():
            raise OffloadError(
                f"KV tensor {t} (shape {tuple(kv.shape)}, strides {kv.stride()}) is not "
                "contiguous; each block must be one contiguous page with blocks in dim 0 "
                "(pass a [num_blocks, ...] tensor, not a view with the block dim inside)"
            )
        block_bytes = kv.numel() // max(num_blocks, 1) * kv.element_size()
        if block_bytes != page:
            raise OffloadError(
                f"KV tensor {t} holds {block_bytes} bytes per block but the plan says {page}; "
                "compute the plan from these tensors"
            )
        views.append(kv.view(-1).view(torch.uint8))
    return views


def region_bytes_view(region: torch.Tensor, layout: SlotLayout, chunk_count: int) -> torch.Tensor:
    """Check that ``region`` is a flat uint8 CPU tensor spanning the plan's rows; return it."""
    need = layout.region_bytes(chunk_count)
    if region.dtype != torch.uint8 or region.dim() != 1 or not region.is_contiguous():
        raise OffloadError(
            f"the region tensor is {region.dtype} of shape {tuple(region.shape)}; pass a flat "
            "contiguous uint8 tensor over the whole mapping"
        )
    if region.device.type != "cpu":
        raise OffloadError(f"the region tensor is on {region.device}; it must be host memory")
    if region.numel() < need:
        raise OffloadError(
            f"the region tensor has {region.numel()} bytes but {chunk_count} chunks of "
            f"{layout.row_stride} bytes need {need}; map the whole region"
        )
    return region


class EngineBase:
    """Checks tensors and jobs and hands each job's oriented copies to ``_issue``."""

    name = "base"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int) -> None:
        self._kv = flat_kv_bytes(kv_tensors, layout)
        self._region = region_bytes_view(region, layout, chunk_count)
        self._layout = layout
        self._num_blocks = kv_tensors[0].shape[0]
        self._chunk_count = chunk_count
        self._closed = False

    @property
    def layout(self) -> SlotLayout:
        return self._layout

    def submit(self, job_id: int, direction: Direction, gpu_blocks: object, chunk_ids: object,
               positions: object) -> None:
        """Queue job ``job_id``; validation errors are raised here, before anything moves."""
        if self._closed:
            raise OffloadError(f"job {job_id} submitted to a closed {self.name} engine")
        if direction not in DIRECTIONS:
            raise OffloadError(f"job {job_id} has direction {direction!r}; use 'store' or 'load'")
        copies = self._offsets(gpu_blocks, chunk_ids, positions)
        self._issue(job_id, direction, list(self._orient(direction, copies)))

    def check(self, gpu_blocks: object, chunk_ids: object, positions: object) -> None:
        """Validate a job without moving anything (a replicated store's non-writer ranks)."""
        self._offsets(gpu_blocks, chunk_ids, positions)

    def _offsets(self, gpu_blocks: object, chunk_ids: object, positions: object
                 ) -> tuple[TensorCopies, ...]:
        return job_offsets(self._layout, gpu_blocks, chunk_ids, positions,
                           num_blocks=self._num_blocks, chunk_count=self._chunk_count)

    def _orient(self, direction: Direction,
                copies: Sequence[TensorCopies]) -> Iterator[CopySide]:
        for kv, c in zip(self._kv, copies, strict=True):
            if direction == "store":
                yield CopySide(self._region, c.host_offsets, kv, c.kv_offsets, c.page_bytes)
            else:
                yield CopySide(kv, c.kv_offsets, self._region, c.host_offsets, c.page_bytes)

    def _issue(self, job_id: int, direction: Direction, sides: list[CopySide]) -> None:
        raise NotImplementedError

    def poll(self) -> list[int]:
        raise NotImplementedError

    def wait_all(self) -> list[int]:
        raise NotImplementedError

    def close(self) -> None:
        """Finish in-flight jobs and refuse new ones; idempotent."""
        if not self._closed:
            self.wait_all()
            self._closed = True
