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
A layer-wise load (`layer_plan`) cuts those groups again at its layer groups' bounds and moves
them layer group by layer group, so the first layers' pages are back before the last ones'.

Pure numpy, no torch and no CUDA (`offload.transfer.staged` executes what this module says), so
the rules are tested exhaustively on any host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from offload import integrity
from offload.config import DEFAULT_STAGING_BYTES
from offload.errors import OffloadError
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
    """The ring: ``slots`` slices of ``slice_bytes``, each holding up to ``rows_per_slice``
    staged rows of ``row_bytes``; each staged row holds one chunk of one group of ``groups``.
    Every plan over one ring (a layer plan included) has the ring's ``slots`` and
    ``slice_bytes``: its slot ``r`` starts at byte ``r * slice_bytes``."""

    groups: tuple[TensorGroup, ...]
    row_bytes: int
    rows_per_slice: int
    slots: int
    slice_bytes: int

    @property
    def ring_bytes(self) -> int:
        return self.slots * self.slice_bytes


@dataclass(frozen=True)
class LayerPlan:
    """A layer-wise load's plan over a ring: ``plan``'s groups each lie in one layer group,
    ``layer[g]`` being that of group ``g`` (non-decreasing: groups are in tensor order)."""

    plan: StagePlan
    layer: tuple[int, ...]


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
    words = [integrity.WORD * bpc * u for u in layout.units] if layout.integrity else None
    groups: list[TensorGroup] = []
    first = 0
    while first < len(pages):
        last = first
        while last + 1 < len(pages) and _row(layout, first, last + 1, words) <= limit:
            last += 1
        if _row(layout, first, last, words) > limit:
            return None
        groups.append(_group(layout, first, last - first + 1))
        first = last + 1
    return tuple(groups)


def _group(layout: SlotLayout, first: int, count: int) -> TensorGroup:
    """Tensors ``first`` .. ``first + count - 1`` of a slot whose pages are back to back in
    tensor order, as one group."""
    last = first + count - 1
    pages_bytes = (layout.tensor_offsets[last] + layout.blocks_per_chunk * layout.page_bytes[last]
                   - layout.tensor_offsets[first])
    if not layout.integrity:
        return TensorGroup(first, count, layout.slot_offset + layout.tensor_offsets[first],
                           pages_bytes, None, 0)
    words = integrity.WORD * layout.blocks_per_chunk * sum(layout.units[first:last + 1])
    return TensorGroup(first, count, layout.slot_offset + layout.tensor_offsets[first],
                       pages_bytes, int(layout.trailer_offsets()[first]), words)


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
    return StagePlan(groups, row_bytes, rows, slots, rows * row_bytes)


def layer_plan(plan: StagePlan, layout: SlotLayout, ranges: list[tuple[int, int]]
               ) -> LayerPlan:
    """``plan``'s ring for a load in layer groups ``ranges`` (first tensor, count; in order,
    covering every tensor): each of ``plan``'s groups cut where a layer group ends, so a
    staged row never holds two layer groups, and as many rows to a slice as the ring's slices
    hold (a layer group's chunks move in as few slices as fit)."""
    groups: list[TensorGroup] = []
    layer: list[int] = []
    for index, (first, count) in enumerate(ranges):
        for group in plan.groups:
            lo, hi = max(first, group.first), min(first + count, group.first + group.count)
            if lo < hi:
                groups.append(_group(layout, lo, hi - lo))
                layer.append(index)
    row_bytes = max(round_up(g.row_bytes, ROW_ALIGN) for g in groups)  # <= plan.row_bytes
    rows = plan.slice_bytes // row_bytes
    return LayerPlan(StagePlan(tuple(groups), row_bytes, rows, plan.slots, plan.slice_bytes),
                     tuple(layer))


def merged_ranges(ranges: list[tuple[int, int]], runs: int) -> list[tuple[int, int]]:
    """Layer groups ``ranges`` (first tensor, count) joined ``runs`` at a time, in order (the
    last join may hold fewer)."""
    return [(ranges[i][0], sum(count for _, count in ranges[i:i + runs]))
            for i in range(0, len(ranges), runs)]


def layer_runs(plan: StagePlan, layout: SlotLayout, ranges: list[tuple[int, int]],
               chunks: int, max_copies: int,
               plan_of: Callable[[list[tuple[int, int]]], LayerPlan] | None = None) -> int:
    """How many consecutive layer groups a layer-wise load of ``chunks`` chunks moves
    together (`merged_ranges`): the fewest whose `layer_plan` issues at most ``max_copies``
    DMAs (`row_copies` per chunk), or all of them, which is a whole load's DMAs.
    ``plan_of``: the layer plan of given ranges where the caller keeps them (the staged
    copier, which then issues the chosen one), else `layer_plan`."""
    for runs in range(1, len(ranges)):
        merged = merged_ranges(ranges, runs)
        cut = (plan_of(merged) if plan_of else layer_plan(plan, layout, merged)).plan
        if chunks * row_copies(cut, layout) <= max_copies:
            return runs
    return len(ranges)


def row_copies(plan: StagePlan, layout: SlotLayout) -> int:
    """The DMAs `job_slices` issues per chunk under ``plan``: per group its pages and its
    sums (one copy where they are one run), each split at the layout's registration cuts."""
    host: list[int] = []
    size: list[int] = []
    for g in plan.groups:
        if g.trailer_offset is None or g.one_copy:
            host.append(g.pages_offset)
            size.append(g.pages_bytes + g.trailer_bytes)
        else:
            host += [g.pages_offset, g.trailer_offset]
            size += [g.pages_bytes, g.trailer_bytes]
    at = np.array(host, dtype=np.int64)
    return int(split_at_cuts(at, at, np.array(size, dtype=np.int64), at, layout.cuts)[0].size)


def layer_ends(parts: JobSlices, layer: tuple[int, ...], layers: int) -> list[int]:
    """The last slice of each of ``layers`` layer groups in a job cut by a `LayerPlan`
    (``layer``: its groups' layer groups): once that slice's pages are scattered, the layer
    group's are all back."""
    ends = [-1] * layers
    for s, group in enumerate(parts.group):
        ends[layer[group]] = s
    return ends


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


def check_layer_ends(ends: IndexArray, events: int, slices: int) -> None:
    """A layer-wise load's group ends must be increasing slices of the job, one per event:
    an event no slice reaches keeps the record made before the issue and fires before its
    pages are back.  Both issue paths rely on it (the native one refuses such ends, the
    Python one would skip them), so the staged path checks before it issues anything."""
    if (ends.size != events or (ends.size and (ends[0] < 0 or ends[-1] >= slices))
            or bool((np.diff(ends) <= 0).any())):
        raise OffloadError(f"layer-wise load: group ends {ends.tolist()} are not increasing "
                           f"slices of its {slices}, one for each of {events} events")


def job_slices(plan: StagePlan, layout: SlotLayout, count: int, first_slot: int = 0
               ) -> JobSlices:
    """Cut a whole-chunk job of ``count`` chunks into slices and their DMAs: group by group,
    in order, each group's chunks ``rows_per_slice`` to a slice (one row per chunk).  Slice
    ``s`` uses ring slot ``(first_slot + s) % slots`` (jobs take the slots in turn, so a job's
    first slice need not wait for the last job's)."""
    bpc, groups, per = layout.blocks_per_chunk, plan.groups, plan.rows_per_slice
    g = len(groups)
    group_slices = -(-count // per)
    unit_group = np.repeat(np.arange(g), count)  # one unit per (group, chunk), group-major
    unit_chunk = np.tile(np.arange(count), g)
    unit_slice = unit_group * group_slices + unit_chunk // per
    unit_row = unit_chunk % per
    run = np.arange(group_slices)  # a group's slices
    first_entry = np.tile(run * per * bpc, g)
    entries = np.tile(np.minimum(per, count - run * per) * bpc, g)
    slice_group = np.repeat(np.arange(g), group_slices)
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
        unit = np.broadcast_to(np.arange(unit_chunk.size)[:, None], keep.shape)[keep]
        host, stage, size = host[keep], stage[keep], size[keep]
    else:
        host, stage, size, unit = pages_at, start, pages_bytes, np.arange(unit_chunk.size)
    host, stage, size, unit = split_at_cuts(host, stage, size, unit, layout.cuts)
    per_slice = np.bincount(unit_slice[unit], minlength=first_entry.size)
    bounds = np.concatenate(([0], np.cumsum(per_slice))).astype(np.int64)
    return JobSlices(first_entry.tolist(), entries.tolist(), slice_group.tolist(),
                     bounds.tolist(), unit_chunk[unit].astype(np.int64), host.astype(np.int64),
                     stage.astype(np.int64), size.astype(np.int64))


def split_at_cuts(host: IndexArray, stage: IndexArray, size: IndexArray, tag: IndexArray,
                  cuts: tuple[int, ...]) -> tuple[IndexArray, IndexArray, IndexArray, IndexArray]:
    """Copies of ``size`` bytes between row-relative host offset ``host`` and ``stage``, each
    cut where it crosses one of ``cuts`` (the row's registration pieces: a batched copy
    spanning two registrations fails), in order; ``tag`` follows each copy into its parts."""
    if not cuts:
        return host, stage, size, tag
    edges = np.asarray(cuts, dtype=np.int64)
    first_cut = np.searchsorted(edges, host, side="right")  # the first cut past the start
    parts = 1 + np.searchsorted(edges, host + size, side="left") - first_cut
    copy = np.repeat(np.arange(host.size), parts)
    k = np.arange(copy.size) - np.repeat(np.cumsum(parts) - parts, parts)  # part in copy
    inner = np.concatenate((edges, np.zeros(1, dtype=np.int64)))  # [len(cuts)]: masked
    lo = np.where(k == 0, host[copy], inner[first_cut[copy] + k - 1])
    hi = np.where(k == parts[copy] - 1, host[copy] + size[copy],
                  inner[np.minimum(first_cut[copy] + k, edges.size)])
    at = (stage[copy] + (lo - host[copy])).astype(np.int64)
    return lo.astype(np.int64), at, (hi - lo).astype(np.int64), tag[copy].astype(np.int64)
