"""Pure region geometry: segments, pre-fault shares and CUDA registration ranges.

Everything here is arithmetic on byte offsets *within one region* (offset 0 = the first byte of
the mapping).  The syscall and CUDA layers only execute the ranges these functions return, so
the rules of DESIGN.md sections 4 and 5 are tested exhaustively without touching memory.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from offload.config import TierConfig
from offload.control.plan import Plan
from offload.errors import OffloadError
from offload.sizes import format_size, round_up


@dataclass(frozen=True, order=True)
class ByteRange:
    """``length`` bytes starting at ``offset``."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class RegionGeometry:
    """The shape of one rank's region and of its slot inside each row."""

    layout: str
    rows: int
    row_stride: int
    slot_offset: int
    slot_bytes: int
    page_size: int

    @property
    def total_bytes(self) -> int:
        return self.rows * self.row_stride


def segment_ranges(geometry: RegionGeometry, config: TierConfig) -> list[ByteRange]:
    """Split a region into shm files by whole rows.

    Below ``segment_threshold`` one file; above it as many files as fit
    ``min_segment_bytes`` each, at most ``max_segments``, rows spread evenly (the first files
    take the remainder).  Segments are contiguous and cover the region exactly.
    """
    total = geometry.total_bytes
    if total < config.segment_threshold or geometry.rows <= 1:
        return [ByteRange(0, total)]
    count = max(1, min(config.max_segments, total // config.min_segment_bytes, geometry.rows))
    base, extra = divmod(geometry.rows, count)
    ranges, offset = [], 0
    for i in range(count):
        length = (base + (1 if i < extra else 0)) * geometry.row_stride
        ranges.append(ByteRange(offset, length))
        offset += length
    return ranges


def shard_range(total: int, count: int, index: int, page_size: int) -> ByteRange:
    """Share ``index`` of ``count`` contiguous page-rounded shares of ``total`` bytes.

    Used by the replicated layout: every local rank populates one share once; shares are
    disjoint, cover ``[0, total)`` and the last ones may be empty.
    """
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} outside 0..{count - 1}")
    share = round_up(-(-total // count), page_size) if total else 0
    start = min(total, index * share)
    return ByteRange(start, min(total, start + share) - start)


def slot_ranges(geometry: RegionGeometry) -> list[ByteRange]:
    """The bytes this rank itself reads and writes: its slot in every row (merged when the slot
    is the whole row)."""
    if geometry.slot_bytes == geometry.row_stride:
        return [ByteRange(0, geometry.total_bytes)] if geometry.rows else []
    return [ByteRange(r * geometry.row_stride + geometry.slot_offset, geometry.slot_bytes)
            for r in range(geometry.rows)]


def prefault_ranges(geometry: RegionGeometry, local_index: int, local_count: int
                    ) -> list[ByteRange]:
    """What this rank populates: replicated -> its shard of the node's region (a stage's ranks
    share their slot, so shards over the whole region spread the work evenly whatever the
    stages); shared -> its own slots (pages are never shared between slots); private ->
    everything."""
    if geometry.layout == "replicated":
        shard = shard_range(geometry.total_bytes, local_count, local_index, geometry.page_size)
        return [shard] if shard.length else []
    return slot_ranges(geometry)


def registration_ranges(geometry: RegionGeometry, config: TierConfig) -> list[ByteRange]:
    """CUDA host registrations for this rank (DESIGN.md section 5).

    Shared layout: one registration per row over the page-aligned slot when the slot is at least
    one page smaller than the row and there are at most ``max_slot_rows`` rows; otherwise whole
    rows.  Replicated: the same over its stage's slot, which every rank of the stage reads
    (with one stage on the node the slot is the row: whole rows, i.e. the region).  Every
    registration is at most ``max_registration_bytes`` and starts and ends on row boundaries
    (or is exactly one slot), so no copy of one block ever spans two registrations.
    """
    if geometry.rows == 0:
        return []
    per_slot = registers_slots(geometry, config)
    unit, what = (geometry.slot_bytes, "slot") if per_slot else (geometry.row_stride, "row")
    if unit > config.max_registration_bytes:
        raise OffloadError(
            f"one {what} of {format_size(unit)} exceeds the "
            f"{format_size(config.max_registration_bytes)} registration cap; lower "
            "--blocks-per-chunk"
        )
    if per_slot:
        return slot_ranges(geometry)
    rows_per = config.max_registration_bytes // geometry.row_stride
    return [ByteRange(r * geometry.row_stride,
                      min(rows_per, geometry.rows - r) * geometry.row_stride)
            for r in range(0, geometry.rows, rows_per)]


def registers_slots(geometry: RegionGeometry, config: TierConfig) -> bool:
    """Whether this rank registers one range per row over its slot (else whole rows)."""
    return (geometry.layout in ("shared", "replicated")
            and geometry.slot_bytes <= geometry.row_stride - geometry.page_size
            and not node_registers_whole_rows(geometry, config))


def node_registers_whole_rows(geometry: RegionGeometry, config: TierConfig) -> bool:
    """Whether every rank of a node region registers whole rows: more rows than
    ``config.max_slot_rows`` (a registration per row would be too many).  The rows are the
    node's, so this holds for all of its ranks alike, which then populate the same pages."""
    return geometry.layout in ("shared", "replicated") and geometry.rows > config.max_slot_rows


@dataclass(frozen=True)
class SetupUnit:
    """One step of background set-up (DESIGN.md section 3.9): populate ``ranges``, then
    register each of them; after it, this rank's rows below ``rows_end`` are usable."""

    rows_end: int
    ranges: tuple[ByteRange, ...]

    @property
    def length(self) -> int:
        return sum(r.length for r in self.ranges)


@dataclass(frozen=True, eq=False)
class SetupUnits(Sequence[SetupUnit]):
    """Background set-up's units as three arrays, each unit a `SetupUnit` when indexed.

    Arrays, not a list of objects: at 100 GiB that list is ~13,000 units and ~38,000 Python
    objects, made inside ``create``, where their allocation set off a full garbage collection
    of the engine's heap (0.11 s on the CI machine with torch loaded; a 1.6 ms list without
    it).  ``populate.c`` reads ``ranges`` and ``first`` as they are."""

    ranges: np.ndarray  # int64 (m, 2): (offset, length) of every range, unit by unit
    first: np.ndarray  # int64 (n + 1,): unit i registers ranges[first[i]:first[i + 1]]
    rows_end: np.ndarray  # int64 (n,): after unit i, rows below rows_end[i] are usable

    def __len__(self) -> int:
        return len(self.rows_end)

    @overload
    def __getitem__(self, i: int) -> SetupUnit: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[SetupUnit]: ...

    def __getitem__(self, i: int | slice) -> SetupUnit | Sequence[SetupUnit]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"unit {i} of {len(self)}")
        i %= len(self)
        lo, hi = self.first[i], self.first[i + 1]
        return SetupUnit(int(self.rows_end[i]),
                         tuple(ByteRange(int(o), int(n)) for o, n in self.ranges[lo:hi]))

    @property
    def total_bytes(self) -> int:
        return int(self.ranges[:, 1].sum())

    @property
    def rows(self) -> int:
        """The rows usable once every unit is done (0 without units)."""
        return int(self.rows_end[-1]) if len(self.rows_end) else 0

    @classmethod
    def of(cls, offsets: np.ndarray, lengths: np.ndarray, first: np.ndarray,
           rows_end: np.ndarray) -> SetupUnits:
        """Own, read-only, contiguous int64 copies: ``populate.c`` reads them raw, from
        threads that outlive the caller's arrays."""
        arrays = [np.array(a, dtype=np.int64, order="C")
                  for a in (np.stack([offsets, lengths], axis=1), first, rows_end)]
        for a in arrays:
            a.flags.writeable = False
        ranges, first, rows_end = arrays
        if len(first) != len(rows_end) + 1 or first[0] != 0 or first[-1] != len(ranges):
            raise ValueError(f"unit bounds {first[:3]}..{first[-1:]} do not index "
                             f"{len(ranges)} ranges in {len(rows_end)} units")
        return cls(ranges, first, rows_end)


def registered_span(geometry: RegionGeometry, config: TierConfig) -> ByteRange:
    """The bytes of each row this rank registers, row-relative: its slot, or the whole row
    (`registers_slots`)."""
    if registers_slots(geometry, config):
        return ByteRange(geometry.slot_offset, geometry.slot_bytes)
    return ByteRange(0, geometry.row_stride)


def copy_starts(slot_offset: int, tensor_offsets: Sequence[int], page_bytes: Sequence[int],
                blocks_per_chunk: int, trailer_offset: int | None) -> list[int]:
    """Row-relative offsets where a copy of this rank's slot may begin: every page of every
    tensor, and the checksum trailer (``trailer_offset``, slot-relative; None: none)."""
    starts = [slot_offset + offset + b * page
              for offset, page in zip(tensor_offsets, page_bytes, strict=True)
              for b in range(blocks_per_chunk)]
    if trailer_offset is not None:
        starts.append(slot_offset + trailer_offset)
    return starts


def registration_cuts(geometry: RegionGeometry, config: TierConfig, starts: Iterable[int],
                      unit_bytes: int) -> tuple[int, ...]:
    """Where background set-up begins a registration inside a row (row-relative, the same in
    every row): the registered span (`registered_span`) cut into the nearest whole number of
    pieces of ``unit_bytes``; none where the span is under one and a half units.

    A registration holds the CUDA driver for its whole duration (an engine launch waits for
    it), and each call also costs a fixed ~0.1 ms, so pieces are about a unit: not smaller
    (no short trailing piece for a row's checksums where the cuts allow), not much larger.
    A batched copy whose host range spans two registrations fails, so the copy paths split
    every copy at these cuts (`offload.transfer.layout.SlotLayout.cuts`).

    Cuts lie on page boundaries of the region's page size (a page is never split, and
    registrations never share a page) where no copy of this rank runs across: at ``starts``,
    the offsets where its copies may begin (a page of one tensor, the checksum trailer), or
    anywhere outside its slot (a node row registered whole holds the other ranks' slots,
    which this rank never copies).  Each cut is the usable offset nearest its even share of
    the span; where usable offsets are sparse (huge pages, pages of odd sizes) the pieces are
    as even as they allow, and with none the span stays whole.
    """
    span = registered_span(geometry, config)
    pieces = int(span.length / unit_bytes + 0.5)
    if pieces <= 1:
        return ()
    page = geometry.page_size
    slot_start = geometry.slot_offset // page * page
    slot_end = round_up(geometry.slot_offset + geometry.slot_bytes, page)
    usable = sorted({c for c in starts if span.offset < c < span.end and c % page == 0})

    def nearest(target: int) -> int | None:
        """The usable offset nearest ``target`` (the lower on a tie), or None."""
        at = bisect.bisect_left(usable, target)
        near = list(usable[max(0, at - 1):at + 1])
        below = target // page * page  # the page boundaries either side of the target
        if target < slot_start:  # before the slot: any page boundary up to its start
            near += [below, min(slot_start, below + page)]
        elif target >= slot_end:  # after it: any page boundary from its end
            near += [max(slot_end, below), below + page]
        else:  # inside: the slot's page-rounded edges
            near += [slot_start, slot_end]
        near = [c for c in near if span.offset < c < span.end]
        return min(near, key=lambda c: (abs(c - target), c)) if near else None

    cuts: list[int] = []
    for i in range(1, pieces):
        cut = nearest(span.offset + i * span.length // pieces)
        if cut is not None and (not cuts or cut > cuts[-1]):
            cuts.append(cut)
    return tuple(cuts)


def sized_setup(geometry: RegionGeometry, config: TierConfig, starts: Sequence[int],
                unit_bytes: int, max_calls: int, max_unit: int
                ) -> tuple[tuple[int, ...], SetupUnits]:
    """Background set-up's cuts (`registration_cuts`) and units (`setup_units`) with units of
    ``unit_bytes``, doubled while the rank would make more than ``max_calls`` registration
    calls (one per range), up to ``max_unit`` (and the config's largest registration).

    Why a cap on calls: one process's ~8,500th-11,800th host registration waits 50-130 ms
    inside the CUDA driver, and the engine's launches with it; no process measured with at
    most ``max_calls`` stalled (docs/BENCHMARKS.md, "Fewer registrations, no stall").  Why a
    cap on the unit: a longer call holds the driver longer, and the engine's launches wait
    for that too (19 ms behind 256 MiB pieces, measured).
    """
    limit = max(unit_bytes, min(max_unit, config.max_registration_bytes))

    def cut(unit: int) -> tuple[tuple[int, ...], SetupUnits]:
        cuts = registration_cuts(geometry, config, starts, unit)
        return cuts, setup_units(geometry, config, unit, cuts)

    cuts, units = cut(unit_bytes)
    while len(units.ranges) > max_calls and 2 * unit_bytes <= limit:
        unit_bytes *= 2
        cuts, units = cut(unit_bytes)
    return cuts, units


def setup_units(geometry: RegionGeometry, config: TierConfig, unit_bytes: int,
                cuts: Sequence[int] = ()) -> SetupUnits:
    """Background set-up's work, in row order: runs of whole rows of at most ``unit_bytes``
    of registered bytes (at least one row each), or, with ``cuts`` (`registration_cuts`),
    each row's registered span cut there, one piece a unit.

    A unit registers what `registration_ranges` would -- one range per slot, or its rows as
    one range -- cut at row boundaries (and at ``cuts``), so no copy of one block spans two
    registrations and no registration is much longer than a unit where the cuts allow (a
    registration holds the CUDA driver for its whole duration, delaying the engine's own
    launches).  A rank populates exactly the bytes it registers, so a unit never waits for
    another rank: in the replicated layout the stage's ranks each walk the stage's slots, each
    writing its own share of every range first (`BackgroundSetup`'s ``share``), where the
    blocking path splits the population into node shards.  A row is usable after its last
    piece: ``rows_end`` repeats until then.
    """
    rows = np.arange(geometry.rows, dtype=np.int64)
    if geometry.rows == 0:
        return SetupUnits.of(rows, rows, np.zeros(1, dtype=np.int64), rows)
    registration_ranges(geometry, config)  # its caps and their one-line errors
    per_slot = registers_slots(geometry, config)
    stride = geometry.row_stride
    if cuts:  # row after row, each row's span in len(cuts) + 1 pieces
        span = registered_span(geometry, config)
        edges = np.array([span.offset, *cuts, span.end], dtype=np.int64)
        lo, pieces = edges[:-1], len(edges) - 1
        last = np.arange(pieces) == pieces - 1  # a row is usable after its last piece
        return SetupUnits.of((rows[:, None] * stride + lo).ravel(),
                             np.tile(np.diff(edges), geometry.rows),
                             np.arange(geometry.rows * pieces + 1),
                             (rows[:, None] + last).ravel())
    rows_per = max(1, unit_bytes // (geometry.slot_bytes if per_slot else stride))
    starts = rows[::rows_per]
    ends = np.minimum(starts + rows_per, geometry.rows)
    if per_slot:  # one range per row's slot, a unit's rows together
        return SetupUnits.of(rows * stride + geometry.slot_offset,
                             np.full(geometry.rows, geometry.slot_bytes),
                             np.append(starts, geometry.rows), ends)
    return SetupUnits.of(starts * stride, (ends - starts) * stride,
                         np.arange(len(starts) + 1), ends)


def merge_ranges(ranges: Iterable[ByteRange]) -> list[ByteRange]:
    """Sort and coalesce touching or overlapping ranges."""
    merged: list[ByteRange] = []
    for r in sorted(x for x in ranges if x.length):
        if merged and r.offset <= merged[-1].end:
            last = merged[-1]
            merged[-1] = ByteRange(last.offset, max(last.end, r.end) - last.offset)
        else:
            merged.append(r)
    return merged


def split_work(ranges: Sequence[ByteRange], piece_bytes: int, page_size: int
               ) -> list[ByteRange]:
    """Cut ranges into page-aligned pieces of at most ``piece_bytes`` for a thread pool."""
    piece = max(page_size, piece_bytes - piece_bytes % page_size)
    out = []
    for r in ranges:
        for start in range(r.offset, r.end, piece):
            out.append(ByteRange(start, min(piece, r.end - start)))
    return out


def interleave_by_segment(pieces: Sequence[ByteRange], segments: Sequence[ByteRange]
                          ) -> list[ByteRange]:
    """Reorder work so consecutive pieces fall in different segments: threads that start
    together then insert pages into different shm files instead of queueing on one."""
    buckets: list[list[ByteRange]] = [[] for _ in segments]
    for p in pieces:
        index = next((i for i, s in enumerate(segments) if s.offset <= p.offset < s.end),
                     len(segments) - 1)
        buckets[index].append(p)
    out: list[ByteRange] = []
    depth = max((len(b) for b in buckets), default=0)
    for level in range(depth):
        out.extend(b[level] for b in buckets if level < len(b))
    return out


def region_geometry(plan: Plan, rank: int) -> RegionGeometry:
    """The region ``rank`` maps under ``plan`` (its layout, rows, row stride and slot)."""
    slot = plan.slots[rank]
    return RegionGeometry(plan.layout, plan.chunk_count, plan.row_stride(rank),
                          slot.slot_offset, slot.slot_bytes, plan.page_size)
