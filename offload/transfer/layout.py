"""Pure byte arithmetic of a job: where each page lives on the GPU and in the host region.

No torch and no CUDA: the backends only execute the offsets computed here, so the placement
rules (plan.py: tensor-major slots, one row per chunk) are tested exhaustively on any host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from offload.errors import OffloadError
from offload.plan import Plan

IndexArray = np.ndarray[Any, np.dtype[np.int64]]


@dataclass(frozen=True)
class SlotLayout:
    """One rank's view of its region: rows of ``row_stride`` bytes (one per chunk); its slot
    starts ``slot_offset`` bytes into each row; inside the slot KV tensor ``t`` holds
    ``blocks_per_chunk`` pages of ``page_bytes[t]`` bytes back to back from
    ``tensor_offsets[t]``."""

    row_stride: int
    slot_offset: int
    blocks_per_chunk: int
    page_bytes: tuple[int, ...]
    tensor_offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.page_bytes) != len(self.tensor_offsets) or not self.page_bytes:
            raise OffloadError(
                f"slot layout has {len(self.page_bytes)} page sizes and "
                f"{len(self.tensor_offsets)} tensor offsets; give one of each per KV tensor"
            )
        if self.blocks_per_chunk <= 0 or min(self.page_bytes) <= 0:
            raise OffloadError(
                f"slot layout needs positive blocks_per_chunk and page sizes, got "
                f"{self.blocks_per_chunk} and {list(self.page_bytes)}"
            )
        end = self.slot_offset + max(
            o + self.blocks_per_chunk * p
            for o, p in zip(self.tensor_offsets, self.page_bytes, strict=True)
        )
        if self.slot_offset < 0 or min(self.tensor_offsets) < 0 or end > self.row_stride:
            raise OffloadError(
                f"slot layout spans bytes {self.slot_offset}..{end} of a {self.row_stride}-byte "
                "row; the slot must lie inside its row (rebuild the plan)"
            )

    @classmethod
    def from_plan(cls, plan: Plan, rank: int) -> SlotLayout:
        slot = plan.slots[rank]
        return cls(plan.row_stride(rank), slot.slot_offset, plan.blocks_per_chunk,
                   slot.page_bytes, slot.tensor_offsets)

    @property
    def num_tensors(self) -> int:
        return len(self.page_bytes)

    def region_bytes(self, chunk_count: int) -> int:
        """Bytes a region must span to hold ``chunk_count`` rows."""
        return chunk_count * self.row_stride


@dataclass(frozen=True)
class TensorCopies:
    """The pages one job moves for one KV tensor: byte offsets into the KV tensor and into the
    region, ``page_bytes`` each."""

    page_bytes: int
    kv_offsets: IndexArray
    host_offsets: IndexArray


def as_index_array(values: object, what: str) -> IndexArray:
    """A 1-D int64 copy of a job array (list, numpy array or CPU/GPU torch tensor)."""
    if hasattr(values, "detach"):  # a torch tensor, kept free of a torch import here
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise OffloadError(
            f"{what} must be a 1-D array of integers, got shape {array.shape} of {array.dtype}"
        )
    return array.astype(np.int64, copy=False)


def job_offsets(layout: SlotLayout, gpu_blocks: object, chunk_ids: object, positions: object,
                *, num_blocks: int, chunk_count: int) -> tuple[TensorCopies, ...]:
    """Turn a job (block ``gpu_blocks[i]`` goes to page ``positions[i]`` of chunk
    ``chunk_ids[i]``) into per-tensor byte offsets, after checking every index is in range.

    KV tensor ``t`` is ``[num_blocks, page_bytes[t]]`` contiguous, so block ``b`` starts at
    ``b * page_bytes[t]``; its host page is at ``chunk * row_stride + slot_offset +
    tensor_offsets[t] + position * page_bytes[t]``.
    """
    blocks = as_index_array(gpu_blocks, "gpu_blocks")
    chunks = as_index_array(chunk_ids, "chunk_ids")
    slots = as_index_array(positions, "positions")
    if not len(blocks) == len(chunks) == len(slots):
        raise OffloadError(
            f"a job needs equally long arrays, got {len(blocks)} gpu_blocks, {len(chunks)} "
            f"chunk_ids and {len(slots)} positions"
        )
    _check_range(blocks, num_blocks, "gpu block", "the KV cache has {} blocks")
    _check_range(chunks, chunk_count, "chunk id", "the region has {} chunks")
    _check_range(slots, layout.blocks_per_chunk, "position", "a chunk holds {} blocks")
    rows = chunks * layout.row_stride + layout.slot_offset
    return tuple(
        TensorCopies(page, blocks * page, rows + offset + slots * page)
        for page, offset in zip(layout.page_bytes, layout.tensor_offsets, strict=True)
    )


def _check_range(values: IndexArray, limit: int, what: str, meaning: str) -> None:
    if values.size == 0 or (values.min() >= 0 and values.max() < limit):
        return
    i = int(np.flatnonzero((values < 0) | (values >= limit))[0])
    raise OffloadError(
        f"{what} {int(values[i])} (entry {i} of the job) is out of range: "
        f"{meaning.format(limit)}, valid ids are 0..{limit - 1}"
    )


def lowest_common_alignment(arrays: Sequence[IndexArray], cap: int) -> int:
    """The largest power of two ≤ ``cap`` dividing every value of ``arrays``: the widest memory
    access a copy of these addresses and sizes may use."""
    acc = cap
    for array in arrays:
        if array.size:
            acc |= int(np.bitwise_or.reduce(array))
    return acc & -acc


def split_tiles(src: IndexArray, dst: IndexArray, count: IndexArray, tile: int
                ) -> tuple[IndexArray, IndexArray, IndexArray]:
    """Split copies (``count[i]`` units from ``src[i]`` to ``dst[i]``) into pieces of at most
    ``tile`` units, in order, so a kernel's work items are bounded whatever the page size."""
    pieces = -(-count // tile)
    if (pieces <= 1).all():
        return src, dst, count
    page = np.repeat(np.arange(count.size), pieces)
    skip = (np.arange(page.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * tile
    return src[page] + skip, dst[page] + skip, np.minimum(count[page] - skip, tile)


def coalesce(src: IndexArray, dst: IndexArray, count: IndexArray,
             row: IndexArray | None = None) -> tuple[IndexArray, IndexArray, IndexArray]:
    """Merge copies that continue each other on both sides into one longer copy.

    Copies are first ordered by source; copy ``i + 1`` joins copy ``i`` when it starts where
    ``i`` ends in both the source and the destination and, when ``row`` is given, lies in the
    same host row: registrations end on row boundaries, and a batched copy that spans two of
    them fails (DESIGN.md section 5).  A chunk's consecutive blocks going to consecutive
    positions become one copy per KV tensor (16 blocks of 64 KiB → one 1 MiB copy), which a copy
    engine moves far faster than sixteen small ones.  The bytes moved are the same.
    """
    if src.size <= 1:
        return src, dst, count
    order = np.argsort(src, kind="stable")
    src, dst, count = src[order], dst[order], count[order]
    joins = (src[1:] == src[:-1] + count[:-1]) & (dst[1:] == dst[:-1] + count[:-1])
    if row is not None:
        row = row[order]
        joins &= row[1:] == row[:-1]
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(count, starts)
