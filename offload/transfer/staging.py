# SPDX-License-Identifier: Apache-2.0
"""Byte arithmetic of the staged path: whole chunks through a small ring of GPU staging rows.

A whole-chunk job moves in two legs (DESIGN.md section 6): a short GPU pass gathers (store) or
scatters (load) every tensor's pages between the KV tensors and *staging rows* in GPU memory
laid out exactly like the chunk's slot in the host row, and the copy engines move each staged
row to or from the region with one DMA (two where the checksum trailer is not contiguous with
the pages).  No SM is held for the PCIe leg, and the HBM pass is ~80x shorter than it.

Staging is bounded (``staging_bytes``, default 128 MiB) whatever the job size: a ring of
``slots`` slices of ``rows_per_slice`` rows each, taken in turn, job after job, so the
gather of one slice overlaps the DMA of the one before.  A slot image too
large for half the ring is cut into *tensor groups* (consecutive tensors, whose pages and sums
are each contiguous in the slot, tensor-major): a staged row then holds one (chunk, group).

Pure numpy, no torch and no CUDA (`offload.transfer.staged` executes what this module says), so
the rules are tested exhaustively on any host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from offload import integrity
from offload.config import DEFAULT_STAGING_BYTES
from offload.sizes import round_up
from offload.transfer.layout import IndexArray, Job, SlotLayout

ROW_ALIGN = 256  # staged rows start on this boundary (DMA- and vector-friendly)
MAX_SLOTS = 4  # ring slices: enough to keep the copy engines fed; more only adds host calls
MAX_ROW_BYTES = 1 << 31  # the pass may compute a row's offset in 32 bits


@dataclass(frozen=True)
class TensorGroup:
    """Tensors ``first`` .. ``first + count - 1``: their pages span ``pages_bytes`` bytes from
    slot byte ``pages_offset`` (row-relative, the slot's offset included) and their sums
    ``trailer_bytes`` from ``trailer_offset`` (None without integrity).  A staged row holds
    the pages from byte 0 and the sums from ``stage_trailer``."""

    first: int
    count: int
    pages_offset: int
    pages_bytes: int
    trailer_offset: int | None
    trailer_bytes: int

    @property
    def stage_trailer(self) -> int:
        return round_up(self.pages_bytes, integrity.WORD)

    @property
    def row_bytes(self) -> int:
        return self.stage_trailer + self.trailer_bytes

    @property
    def one_copy(self) -> bool:
        """Whether pages and sums are one run in the region and in staging (one DMA)."""
        return (self.trailer_offset is None
                or (self.stage_trailer == self.pages_bytes
                    and self.trailer_offset == self.pages_offset + self.pages_bytes))


@dataclass(frozen=True)
class StagePlan:
    """The ring: ``slots`` slices of ``rows_per_slice`` rows of ``row_bytes``; each staged row
    holds one chunk of one group of ``groups``."""

    groups: tuple[TensorGroup, ...]
    row_bytes: int
    rows_per_slice: int
    slots: int

    @property
    def slice_bytes(self) -> int:
        return self.rows_per_slice * self.row_bytes

    @property
    def ring_bytes(self) -> int:
        return self.slots * self.slice_bytes


@dataclass(frozen=True)
class JobSlices:
    """A whole-chunk job of a given number of chunks cut into slices, in order (the same for
    every job of that many chunks, so an engine keeps it).  Slice ``s`` covers job entries
    ``first_entry[s]`` .. ``+ entries[s]`` and group ``group[s]``; its DMAs are copies
    ``bounds[s]`` .. ``bounds[s + 1]``.  Copy ``c`` moves ``size[c]`` bytes between ``stage[c]``
    (counted from the ring's first byte) and byte ``host[c]`` of the row of the job's
    ``chunk_index[c]``-th chunk (`host_offsets`)."""

    first_entry: list[int]
    entries: list[int]
    group: list[int]
    bounds: list[int]
    chunk_index: IndexArray
    host: IndexArray
    stage: IndexArray
    size: IndexArray

    def __len__(self) -> int:
        return len(self.first_entry)

    def host_offsets(self, chunks: IndexArray, row_stride: int) -> IndexArray:
        """Each copy's byte offset in the region for a job of these ``chunks``."""
        return chunks[self.chunk_index] * row_stride + self.host


def tensor_groups(layout: SlotLayout, limit: int) -> tuple[TensorGroup, ...] | None:
    """Cut the tensors, in order, into as few groups as keep every staged row within
    ``limit`` bytes; None where one tensor alone does not fit, or the slot's pages are not
    back to back in tensor order (only such a slot stages as contiguous runs)."""
    bpc, pages = layout.blocks_per_chunk, layout.page_bytes
    ends = [o + bpc * p for o, p in zip(layout.tensor_offsets, pages, strict=True)]
    if any(layout.tensor_offsets[t + 1] != ends[t] for t in range(len(pages) - 1)):
        return None
    sums = [int(o) for o in layout.trailer_offsets()] if layout.integrity else None
    words = [integrity.WORD * bpc * u for u in layout.units] if layout.integrity else None
    groups: list[TensorGroup] = []
    first = 0
    while first < len(pages):
        last = first
        while last + 1 < len(pages) and _row(layout, first, last + 1, words) <= limit:
            last += 1
        if _row(layout, first, last, words) > limit:
            return None
        pages_bytes = ends[last] - layout.tensor_offsets[first]
        groups.append(TensorGroup(
            first, last - first + 1, layout.slot_offset + layout.tensor_offsets[first],
            pages_bytes, sums[first] if sums is not None else None,
            sum(words[first:last + 1]) if words is not None else 0))
        first = last + 1
    return tuple(groups)


def _row(layout: SlotLayout, first: int, last: int, words: list[int] | None) -> int:
    """Staged row bytes of tensors ``first`` .. ``last``."""
    pages = layout.tensor_offsets[last] + layout.blocks_per_chunk * layout.page_bytes[last] \
        - layout.tensor_offsets[first]
    trailer = sum(words[first:last + 1]) if words is not None else 0
    return round_up(round_up(pages, integrity.WORD) + trailer, ROW_ALIGN)


def stage_plan(layout: SlotLayout, staging_bytes: int = DEFAULT_STAGING_BYTES
               ) -> StagePlan | str:
    """The ring for ``layout`` within ``staging_bytes``, or why there is none (a one-line
    reason: the engine then runs whole chunks on the kernel)."""
    limit = staging_bytes // 2 // ROW_ALIGN * ROW_ALIGN  # at least two slices in flight
    groups = tensor_groups(layout, limit)
    if groups is None:
        return (f"staging of {staging_bytes} B holds no two rows of one tensor's chunk "
                "(or the slot's pages are not back to back); whole chunks run on the kernel")
    row_bytes = max(round_up(g.row_bytes, ROW_ALIGN) for g in groups)
    if row_bytes >= MAX_ROW_BYTES:
        return (f"a staged row of {row_bytes} B is past the pass's 32-bit row arithmetic; "
                f"give staging_bytes below {2 * MAX_ROW_BYTES} B")
    slots = min(MAX_SLOTS, staging_bytes // row_bytes)
    rows = staging_bytes // (slots * row_bytes) if len(groups) == 1 else 1
    return StagePlan(groups, row_bytes, rows, slots)


def whole_chunks(job: Job, bpc: int) -> IndexArray | None:
    """If ``job`` is whole chunks, each filled in position order (from any blocks), the chunk
    of each run of ``bpc`` entries; else None.  Three whole-array operations: entry ``i`` of
    a run must hold host page ``run start + i``, and every run must start a chunk."""
    n = len(job)
    if n == 0 or n % bpc:
        return None
    pages = job.host_pages.reshape(-1, bpc)
    starts = pages - np.arange(bpc)  # a run in order: one value per row
    if (starts != starts[:, :1]).any() or (starts[:, 0] % bpc).any():
        return None
    return starts[:, 0] // bpc


def job_slices(plan: StagePlan, layout: SlotLayout, count: int, first_slot: int = 0
               ) -> JobSlices:
    """Cut a whole-chunk job of ``count`` chunks into slices and their DMAs.  One group:
    ``rows_per_slice`` chunks a slice; several: one (chunk, group) a slice, chunk by chunk,
    groups in order.  Slice ``s`` uses ring slot ``(first_slot + s) % slots`` (jobs take
    the slots in turn, so a job's first slice need not wait for the last job's)."""
    bpc, groups = layout.blocks_per_chunk, plan.groups
    g = len(groups)
    if g == 1:
        per = plan.rows_per_slice
        unit_chunk = np.arange(count)  # one row per chunk
        unit_group = np.zeros(count, dtype=np.int64)
        unit_slice = unit_chunk // per
        unit_row = unit_chunk % per
        slices = -(-count // per)
        first_entry = np.arange(slices) * per * bpc
        entries = np.minimum(per, count - np.arange(slices) * per) * bpc
        slice_group = np.zeros(slices, dtype=np.int64)
    else:
        unit_chunk = np.repeat(np.arange(count), g)
        unit_group = np.tile(np.arange(g), count)
        unit_slice = np.arange(count * g)
        unit_row = np.zeros(count * g, dtype=np.int64)
        first_entry = unit_chunk * bpc
        entries = np.full(count * g, bpc)
        slice_group = unit_group
    start = ((unit_slice + first_slot) % plan.slots) * plan.slice_bytes + unit_row * plan.row_bytes

    def per_group(field: str) -> IndexArray:
        return np.array([getattr(gr, field) for gr in groups], dtype=np.int64)[unit_group]

    pages_at, pages_bytes = per_group("pages_offset"), per_group("pages_bytes")
    if layout.integrity:
        one = np.array([gr.one_copy for gr in groups])[unit_group]
        sums_bytes = per_group("trailer_bytes")
        # one copy where pages and sums are one run, else two: pages, then sums
        host = np.stack([pages_at, per_group("trailer_offset")], axis=1)
        stage = np.stack([start, start + per_group("stage_trailer")], axis=1)
        size = np.stack([np.where(one, pages_bytes + sums_bytes, pages_bytes),
                         np.where(one, 0, sums_bytes)], axis=1)
        keep = size > 0
        per_unit = keep.sum(axis=1)
        chunk_index = np.broadcast_to(unit_chunk[:, None], keep.shape)[keep]
        host, stage, size = host[keep], stage[keep], size[keep]
    else:
        host, stage, size, chunk_index = pages_at, start, pages_bytes, unit_chunk
        per_unit = np.ones(unit_chunk.size, dtype=np.int64)
    per_slice = np.bincount(unit_slice, weights=per_unit, minlength=first_entry.size)
    bounds = np.concatenate(([0], np.cumsum(per_slice))).astype(np.int64)
    return JobSlices(first_entry.tolist(), entries.tolist(), slice_group.tolist(),
                     bounds.tolist(), chunk_index.astype(np.int64), host.astype(np.int64),
                     stage.astype(np.int64), size.astype(np.int64))
