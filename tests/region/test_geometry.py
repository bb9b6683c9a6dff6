"""Region geometry against DESIGN.md sections 4 and 5: segments, shares, registrations, work."""

from __future__ import annotations

import bisect
import gc
from collections.abc import Iterable, Sequence
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config import TierConfig
from offload.control.plan import Plan, RankDescriptor, compute_plan
from offload.errors import OffloadError
from offload.region.geometry import (
    ByteRange,
    RegionGeometry,
    SetupUnit,
    SetupUnits,
    interleave_by_segment,
    merge_ranges,
    prefault_ranges,
    registered_span,
    registration_cuts,
    registration_ranges,
    segment_ranges,
    setup_units,
    shard_range,
    sized_setup,
    slot_ranges,
    split_work,
)
from tests.control.test_plan import grids

PAGES = (512, 4096)


def geometry_of(plan: Plan, rank: int) -> RegionGeometry:
    slot = plan.slots[rank]
    return RegionGeometry(plan.layout, plan.chunk_count, plan.row_stride(rank),
                          slot.slot_offset, slot.slot_bytes, plan.page_size)


@st.composite
def node_geometries(draw: st.DrawFn, layout: str | None = None) -> list[RegionGeometry]:
    """The geometries of every rank of one node: private regions are per rank (one each
    here), shared and replicated ranks all map one region.  A shared row holds one slot per
    rank; a replicated row one slot per pipeline stage, shared by that stage's ranks."""
    layout = layout or draw(st.sampled_from(("private", "shared", "replicated")))
    page = draw(st.sampled_from(PAGES))
    rows = draw(st.integers(0, 600))
    ranks = draw(st.integers(1, 5))
    if layout == "private":
        slot = page * draw(st.integers(1, 40))
        return [RegionGeometry(layout, rows, slot, 0, slot, page) for _ in range(ranks)]
    owner = list(range(ranks))  # shared: rank i owns slot i
    if layout == "replicated":  # rank i belongs to stage owner[i]; stages ascend with ranks
        stages = draw(st.integers(1, ranks))
        cuts = sorted(draw(st.sets(st.integers(1, ranks - 1), min_size=stages - 1,
                                   max_size=stages - 1))) if stages > 1 else []
        owner = [sum(1 for c in cuts if c <= i) for i in range(ranks)]
    slots = [page * draw(st.integers(1, 40)) for _ in range(owner[-1] + 1)]
    offsets = [sum(slots[:i]) for i in range(len(slots))]
    return [RegionGeometry(layout, rows, sum(slots), offsets[owner[i]], slots[owner[i]], page)
            for i in range(ranks)]


@st.composite
def configs(draw: st.DrawFn, geometry: RegionGeometry) -> TierConfig:
    """Thresholds scaled to the region, as tests shrink GiB settings to MiB."""
    total, row = max(1, geometry.total_bytes), geometry.row_stride
    return TierConfig(
        cpu_bytes_per_node=max(1, total),
        page_size=geometry.page_size,
        segment_threshold=draw(st.integers(1, 2 * total)),
        min_segment_bytes=draw(st.integers(1, total)),
        max_segments=draw(st.integers(1, 40)),
        max_registration_bytes=draw(st.integers(max(1, row // 2), max(row, 4 * total))),
        max_slot_rows=draw(st.integers(1, 800)),
    )


@st.composite
def geometry_and_config(draw: st.DrawFn, layout: str | None = None
                        ) -> tuple[RegionGeometry, TierConfig]:
    nodes = draw(node_geometries(layout))
    geometry = nodes[draw(st.integers(0, len(nodes) - 1))]
    return geometry, draw(configs(geometry))


def covered(ranges: Iterable[ByteRange]) -> list[ByteRange]:
    return merge_ranges(ranges)


def assert_tiles(ranges: Sequence[ByteRange], start: int, end: int) -> None:
    """``ranges`` in order are back to back and cover ``[start, end)`` exactly."""
    position = start
    for r in ranges:
        assert r.offset == position and r.length >= 0
        position = r.end
    assert position == end


def contains(outer: Sequence[ByteRange], inner: Iterable[ByteRange]) -> bool:
    merged = covered(outer)
    starts = [m.offset for m in merged]
    for r in inner:
        i = bisect.bisect_right(starts, r.offset) - 1
        if r.length and (i < 0 or r.end > merged[i].end):
            return False
    return True


# ---------------------------------------------------------------- segments


@settings(max_examples=300, deadline=None)
@given(geometry_and_config())
def test_segments_split_whole_rows(case: tuple[RegionGeometry, TierConfig]) -> None:
    geometry, config = case
    segments = segment_ranges(geometry, config)
    assert_tiles(segments, 0, geometry.total_bytes)
    assert all(s.length % geometry.row_stride == 0 for s in segments)
    assert 1 <= len(segments) <= max(1, min(config.max_segments, geometry.rows))
    if geometry.total_bytes < config.segment_threshold:
        assert len(segments) == 1
    if len(segments) > 1:
        rows = [s.length // geometry.row_stride for s in segments]
        assert rows == sorted(rows, reverse=True) and rows[0] - rows[-1] <= 1
        assert min(s.length for s in segments) > config.min_segment_bytes - geometry.row_stride
    elif geometry.total_bytes >= config.segment_threshold and geometry.rows > 1:
        assert min(config.max_segments, geometry.total_bytes // config.min_segment_bytes) <= 1


def test_segments_at_the_documented_scale() -> None:
    config = TierConfig(cpu_bytes_per_node=1)
    row = 2 << 20
    assert len(segment_ranges(RegionGeometry("private", 1023, row, 0, row, 4096), config)) == 1
    assert len(segment_ranges(RegionGeometry("private", 1024, row, 0, row, 4096), config)) == 2
    assert len(segment_ranges(RegionGeometry("private", 128 << 10, row, 0, row, 4096),
                              config)) == 32


# ---------------------------------------------------------------- replicated shares


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1 << 24), st.integers(1, 20), st.sampled_from(PAGES))
def test_shards_cover_the_region_once(total: int, count: int, page: int) -> None:
    shards = [shard_range(total, count, i, page) for i in range(count)]
    assert_tiles(shards, 0, total)
    nonempty = [s for s in shards if s.length]
    assert all(s.offset % page == 0 for s in nonempty)
    assert all(not s.length for s in shards[len(nonempty):])  # only trailing shares are empty
    assert all(s.length == nonempty[0].length for s in nonempty[:-1])
    assert all(s.length <= -(-total // count) + page for s in shards)


@pytest.mark.parametrize("index", [-1, 3])
def test_shard_index_out_of_range(index: int) -> None:
    with pytest.raises(ValueError, match="outside 0..2"):
        shard_range(4096, 3, index, 4096)


# ---------------------------------------------------------------- pre-fault


@settings(max_examples=300, deadline=None)
@given(node_geometries())
def test_prefault_covers_each_node_region_once(node: list[RegionGeometry]) -> None:
    """Together a node's ranks populate every byte of a shared or replicated region exactly
    once, each on page boundaries; a private region is populated whole by its owner."""
    page = node[0].page_size
    per_rank = [prefault_ranges(g, i, len(node)) for i, g in enumerate(node)]
    for ranges in per_rank:
        assert all(r.offset % page == 0 and r.length % page == 0 for r in ranges)
    if node[0].layout == "private":
        for g, ranges in zip(node, per_rank, strict=True):
            assert covered(ranges) == covered([ByteRange(0, g.total_bytes)])
        return
    pieces = sorted(r for ranges in per_rank for r in ranges if r.length)
    assert_tiles(pieces, 0, node[0].total_bytes)


@settings(max_examples=200, deadline=None)
@given(node_geometries(layout="shared"))
def test_shared_prefault_touches_only_the_own_slot(node: list[RegionGeometry]) -> None:
    for i, g in enumerate(node):
        own = [ByteRange(r * g.row_stride + g.slot_offset, g.slot_bytes) for r in range(g.rows)]
        assert covered(prefault_ranges(g, i, len(node))) == covered(own)


# ---------------------------------------------------------------- registrations


def per_slot(g: RegionGeometry, config: TierConfig) -> bool:
    """DESIGN.md section 5's condition for registering slots (a shared rank's, a replicated
    rank's stage's) instead of rows."""
    return (g.layout in ("shared", "replicated") and g.slot_bytes <= g.row_stride - g.page_size
            and g.rows <= config.max_slot_rows)


@settings(max_examples=500, deadline=None)
@given(geometry_and_config())
def test_registrations(case: tuple[RegionGeometry, TierConfig]) -> None:
    g, config = case
    unit = g.slot_bytes if per_slot(g, config) else g.row_stride
    if g.rows and unit > config.max_registration_bytes:
        with pytest.raises(OffloadError, match="registration cap"):
            registration_ranges(g, config)
        return
    regs = registration_ranges(g, config)
    assert all(0 < r.length <= config.max_registration_bytes for r in regs)
    assert contains(regs, slot_ranges(g))  # every byte this rank touches is registered
    if per_slot(g, config):
        assert regs == [ByteRange(r * g.row_stride + g.slot_offset, g.slot_bytes)
                        for r in range(g.rows)]
        assert all(r.offset % g.page_size == 0 for r in regs)
        assert all(r.offset // g.row_stride == (r.end - 1) // g.row_stride for r in regs)
        assert sum(r.length for r in regs) == g.rows * g.slot_bytes
    else:
        assert_tiles(regs, 0, g.total_bytes)
        assert all(r.offset % g.row_stride == 0 and r.length % g.row_stride == 0 for r in regs)
        rows_per = config.max_registration_bytes // g.row_stride if g.rows else 1
        assert len(regs) == -(-g.rows // rows_per)


@settings(max_examples=200, deadline=None)
@given(grids())
def test_registered_bytes_per_rank_equal_slot_bytes(descriptors: list[RankDescriptor]) -> None:
    """Section 8: registered bytes per rank = its own slot in every row (1.00x); for the
    replicated layout that slot is its stage's, which every rank of the stage reads."""
    plan = compute_plan(descriptors)
    config = descriptors[0].config
    for d in descriptors:
        registered = registration_ranges(geometry_of(plan, d.rank), config)
        assert sum(r.length for r in registered) == (
            plan.chunk_count * plan.slots[d.rank].slot_bytes)


@settings(max_examples=300, deadline=None)
@given(node_geometries(layout="replicated"), st.integers(1, 800))
def test_replicated_ranks_register_their_stage_slot_and_shards_cover_the_region(
        node: list[RegionGeometry], max_slot_rows: int) -> None:
    """A stage's ranks register the same ranges: their stage's slot in every row, or whole rows
    when the node holds one stage (the slot is the row) or the rows are too many.  The node's
    pre-fault shards still cover the whole region, so every registered byte is populated."""
    config = TierConfig(cpu_bytes_per_node=1, max_slot_rows=max_slot_rows)
    g0 = node[0]
    region = [ByteRange(0, g0.total_bytes)] if g0.rows else []
    shards = [r for i in range(len(node)) for r in prefault_ranges(node[i], i, len(node))]
    assert covered(shards) == covered(region)
    by_stage: dict[int, list[ByteRange]] = {}
    for g in node:
        regs = registration_ranges(g, config)
        assert by_stage.setdefault(g.slot_offset, regs) == regs  # one stage, one set
        if per_slot(g, config):  # several stages on the node, few enough rows
            assert regs == [ByteRange(r * g.row_stride + g.slot_offset, g.slot_bytes)
                            for r in range(g.rows)]
        else:
            assert covered(regs) == covered(region)
    if per_slot(g0, config):  # the stages' registrations are disjoint and tile the region
        all_stages = [r for regs in by_stage.values() for r in regs]
        assert sum(r.length for r in all_stages) == g0.total_bytes
        assert covered(all_stages) == covered(region)


def test_replicated_two_stages_register_one_slot_per_row_each() -> None:
    config = TierConfig(cpu_bytes_per_node=1)
    stage0 = RegionGeometry("replicated", 3, 3 * 4096, 0, 2 * 4096, 4096)
    stage1 = RegionGeometry("replicated", 3, 3 * 4096, 2 * 4096, 4096, 4096)
    assert registration_ranges(stage0, config) == [ByteRange(r * 12288, 8192) for r in range(3)]
    assert registration_ranges(stage1, config) == [ByteRange(r * 12288 + 8192, 4096)
                                                   for r in range(3)]
    one_stage = RegionGeometry("replicated", 3, 4096, 0, 4096, 4096)
    assert registration_ranges(one_stage, config) == [ByteRange(0, 3 * 4096)]


def test_shared_falls_back_to_rows_when_there_are_too_many_rows() -> None:
    g = RegionGeometry("shared", 10, 3 * 4096, 4096, 4096, 4096)
    config = TierConfig(cpu_bytes_per_node=1, max_slot_rows=9, max_registration_bytes=4 * 12288)
    assert registration_ranges(g, config) == [ByteRange(0, 4 * 12288),
                                              ByteRange(4 * 12288, 4 * 12288),
                                              ByteRange(8 * 12288, 2 * 12288)]


def test_row_larger_than_the_cap_is_a_clear_error() -> None:
    g = RegionGeometry("private", 4, 8192, 0, 8192, 4096)
    config = TierConfig(cpu_bytes_per_node=1, max_registration_bytes=4096)
    with pytest.raises(OffloadError, match=r"8.00 KiB exceeds the 4.00 KiB registration cap"):
        registration_ranges(g, config)


def test_slot_larger_than_the_cap_is_a_clear_error() -> None:
    # per-slot registrations obey the cap too (they used to be returned unchecked)
    g = RegionGeometry("shared", 4, 3 * 8192, 8192, 8192, 4096)
    config = TierConfig(cpu_bytes_per_node=1, max_registration_bytes=4096)
    with pytest.raises(OffloadError, match=r"one slot of 8.00 KiB exceeds"):
        registration_ranges(g, config)


# ---------------------------------------------------------------- work lists

small_ranges = st.lists(st.builds(ByteRange, st.integers(0, 300), st.integers(0, 40)),
                        max_size=12)


def points(ranges: Iterable[ByteRange]) -> set[int]:
    return {b for r in ranges for b in range(r.offset, r.end)}


@given(small_ranges)
def test_merge_ranges(ranges: list[ByteRange]) -> None:
    merged = merge_ranges(ranges)
    assert points(merged) == points(ranges)
    assert all(r.length > 0 for r in merged)
    assert all(a.end < b.offset for a, b in pairwise(merged))


@st.composite
def page_ranges(draw: st.DrawFn) -> tuple[list[ByteRange], int]:
    page = draw(st.sampled_from((1, 8, 64)))
    starts = sorted(draw(st.sets(st.integers(0, 200), max_size=8)))
    ranges = [ByteRange(s * page, draw(st.integers(0, 12)) * page
                        + draw(st.integers(0, page - 1)))
              for s in starts]
    return merge_ranges(ranges), page


@given(page_ranges(), st.integers(-5, 600))
def test_split_work(case: tuple[list[ByteRange], int], piece_bytes: int) -> None:
    ranges, page = case
    pieces = split_work(ranges, piece_bytes, page)
    limit = max(page, piece_bytes - piece_bytes % page)
    assert points(pieces) == points(ranges)
    assert sum(p.length for p in pieces) == sum(r.length for r in ranges)
    assert all(0 < p.length <= limit and p.offset % page == 0 for p in pieces)
    assert all(any(r.offset <= p.offset and p.end <= r.end for r in ranges) for p in pieces)
    assert pieces == sorted(pieces)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.integers(1, 25))
def test_interleave_by_segment(segment_rows: list[int], piece: int) -> None:
    segments, offset = [], 0
    for rows in segment_rows:
        segments.append(ByteRange(offset, rows * 10))
        offset += rows * 10
    pieces = split_work([ByteRange(0, offset)], piece, 1)
    order = interleave_by_segment(pieces, segments)
    assert sorted(order) == sorted(pieces)

    def seg(p: ByteRange) -> int:
        return next(i for i, s in enumerate(segments) if s.offset <= p.offset < s.end)

    for i in range(len(segments)):
        mine = [p for p in order if seg(p) == i]
        assert mine == sorted(mine)  # each file is still populated front to back
    starting = {seg(p) for p in pieces}
    assert len({seg(p) for p in order[:len(starting)]}) == len(starting)


# ---------------------------------------------------------------- background set-up units


@settings(max_examples=500, deadline=None)
@given(geometry_and_config(), st.integers(1, 1 << 22))
def test_setup_units_register_what_the_blocking_path_does_in_row_order(
        case: tuple[RegionGeometry, TierConfig], unit_bytes: int) -> None:
    g, config = case
    unit = g.slot_bytes if per_slot(g, config) else g.row_stride
    if g.rows and unit > config.max_registration_bytes:
        with pytest.raises(OffloadError, match="registration cap"):
            setup_units(g, config, unit_bytes)
        return
    units = setup_units(g, config, unit_bytes)
    if not g.rows:
        assert len(units) == 0 and units.total_bytes == 0
        return
    # rows come online in order, a unit at a time, up to the whole region
    ends = [u.rows_end for u in units]
    assert ends == sorted(set(ends)) and ends[-1] == g.rows
    first = 0
    for u in units:
        rows = u.rows_end - first
        # each range lies in the unit's rows, on row boundaries or exactly one slot ...
        for r in u.ranges:
            assert first * g.row_stride <= r.offset and r.end <= u.rows_end * g.row_stride
            assert (r.offset % g.row_stride == 0 and r.length % g.row_stride == 0) or (
                r.offset % g.row_stride == g.slot_offset and r.length == g.slot_bytes)
        # ... and a unit is one row (or slot) or fits the unit size
        assert rows == 1 or u.length <= unit_bytes
        first = u.rows_end
    # together: exactly the bytes the blocking path registers (and so everything touched)
    everything = [r for u in units for r in u.ranges]
    assert covered(everything) == covered(registration_ranges(g, config))
    assert sum(r.length for r in everything) == sum(r.length for r in covered(everything))
    # the arrays populate.c reads as they are: int64, contiguous, every range a unit's
    assert units.ranges.dtype == units.first.dtype == np.int64
    assert units.ranges.flags.c_contiguous and units.first.flags.c_contiguous
    assert units.first[0] == 0 and units.first[-1] == len(units.ranges) == len(everything)
    assert units.total_bytes == sum(r.length for r in everything)


@st.composite
def cut_case(draw: st.DrawFn) -> tuple[RegionGeometry, TierConfig, list[int], int]:
    """A geometry, its config, copy starts at random inside its rows (some off the page
    size) and a unit size from a fraction of a row to more than one."""
    g, config = draw(geometry_and_config())
    starts = draw(st.lists(st.integers(0, max(0, g.row_stride)), max_size=24))
    starts += [draw(st.integers(0, g.row_stride // max(1, g.page_size))) * g.page_size
               for _ in range(draw(st.integers(0, 12)))]
    unit = draw(st.integers(1, max(1, 2 * g.row_stride)))
    return g, config, starts, unit


@settings(max_examples=500, deadline=None)
@given(cut_case())
def test_registration_cuts_are_the_usable_starts_nearest_even_shares(
        case: tuple[RegionGeometry, TierConfig, list[int], int]) -> None:
    """The span is cut into the nearest whole number of units: each cut is the usable offset
    strictly inside the span nearest its even share (one cut for two shares that pick the
    same one), none for a span under one and a half units.  Usable: a copy start on a page
    boundary, or any page boundary outside the rank's slot (a whole node row holds the other
    ranks' slots, which this rank never copies)."""
    g, config, starts, unit = case
    if g.rows and (g.slot_bytes if per_slot(g, config) else g.row_stride) \
            > config.max_registration_bytes:
        return
    cuts = registration_cuts(g, config, starts, unit)
    span = registered_span(g, config)
    page = g.page_size
    outside = {c for c in range(0, span.end, page)
               if c <= g.slot_offset or c >= g.slot_offset + g.slot_bytes}
    usable = sorted({c for c in {*starts, *outside}
                     if span.offset < c < span.end and c % page == 0})
    pieces = int(span.length / unit + 0.5)  # the nearest whole number, halves up
    if pieces <= 1 or not usable:
        assert cuts == ()
        return
    nearest = [min(usable, key=lambda c, t=span.offset + i * span.length // pieces:
                   (abs(c - t), c)) for i in range(1, pieces)]
    assert list(cuts) == sorted(set(nearest))


@pytest.mark.parametrize(("span_pages", "unit_pages"), [(10, 4), (10, 5), (10, 3), (7, 2),
                                                        (1000, 7), (3, 2)])
def test_cuts_among_every_page_make_even_pieces_of_about_a_unit(span_pages: int,
                                                               unit_pages: int) -> None:
    """Where every page starts a copy, the pieces differ by a page at most and each is
    within half a unit of one unit (a row of whole units takes exactly that many)."""
    page = 4096
    g = RegionGeometry("private", 4, span_pages * page, 0, span_pages * page, page)
    config = TierConfig(cpu_bytes_per_node=1 << 30)
    unit = unit_pages * page
    cuts = registration_cuts(g, config, range(0, g.row_stride, page), unit)
    sizes = [b - a for a, b in pairwise([0, *cuts, g.row_stride])]
    assert max(sizes) - min(sizes) <= page
    assert all(abs(size - unit) <= unit / 2 + page for size in sizes)
    if span_pages % unit_pages == 0:
        assert sizes == [unit] * (span_pages // unit_pages)


@settings(max_examples=300, deadline=None)
@given(cut_case())
def test_setup_units_in_pieces_register_each_row_once_and_finish_it_last(
        case: tuple[RegionGeometry, TierConfig, list[int], int]) -> None:
    """With cuts, every row's registered span is registered in pieces cut exactly there, in
    order; a row counts as usable after its last piece only; and together the pieces are
    the bytes the blocking path registers."""
    g, config, starts, unit = case
    if not g.rows or (g.slot_bytes if per_slot(g, config) else g.row_stride) \
            > config.max_registration_bytes:
        return
    cuts = registration_cuts(g, config, starts, unit)
    if not cuts:
        return
    units = setup_units(g, config, unit, cuts)
    span = registered_span(g, config)
    pieces = len(cuts) + 1
    assert len(units) == g.rows * pieces
    edges = [span.offset, *cuts, span.end]
    for i, u in enumerate(units):
        row, piece = divmod(i, pieces)
        assert u.ranges == (ByteRange(row * g.row_stride + edges[piece],
                                      edges[piece + 1] - edges[piece]),)
        assert u.rows_end == row + (piece == pieces - 1)
    everything = [r for u in units for r in u.ranges]
    assert covered(everything) == covered(registration_ranges(g, config))


@settings(max_examples=300, deadline=None)
@given(cut_case(), st.integers(1, 64), st.integers(0, 4))
def test_sized_setup_doubles_units_while_the_calls_exceed_the_cap(
        case: tuple[RegionGeometry, TierConfig, list[int], int], max_calls: int,
        doublings: int) -> None:
    """The units are the first of unit, 2 x unit, 4 x unit ... whose registration calls (one
    per range) fit ``max_calls``, or the largest within ``max_unit`` and the config's largest
    registration; cuts and units are what `registration_cuts` and `setup_units` give then."""
    g, config, starts, unit = case
    if not g.rows or (g.slot_bytes if per_slot(g, config) else g.row_stride) \
            > config.max_registration_bytes:
        return
    max_unit = unit << doublings
    cuts, units = sized_setup(g, config, starts, unit, max_calls, max_unit)

    def calls(size: int) -> int:
        return len(setup_units(g, config, size, registration_cuts(g, config, starts, size))
                   .ranges)

    limit = max(unit, min(max_unit, config.max_registration_bytes))
    chosen = unit
    while calls(chosen) > max_calls and 2 * chosen <= limit:
        chosen *= 2
    assert chosen <= max(unit, max_unit)
    assert cuts == registration_cuts(g, config, starts, chosen)
    assert np.array_equal(units.ranges, setup_units(g, config, chosen, cuts).ranges)


@pytest.mark.parametrize(("gib", "piece_mib", "calls"), [
    (48, 8, 6140), (100, 40 / 3, 7680), (200, 40, 5120), (1024, 240, 4370)])
def test_a_large_region_registers_in_larger_units_within_the_caps(
        gib: int, piece_mib: float, calls: int) -> None:
    """Engine-shaped 40 MiB rows (160 tensors of 16 blocks of 16 KiB) of a private region:
    8 MiB pieces up to 7,680 calls (48 GiB), then pieces of 16 MiB units (three a row), whole
    rows, and at 1 TiB runs of six rows (256 MiB units), the largest allowed."""
    MiB = 1 << 20
    row = 40 * MiB
    g = RegionGeometry("private", gib * 1024 // 40, row, 0, row, 4096)
    config = TierConfig(cpu_bytes_per_node=gib << 30)
    _, units = sized_setup(g, config, range(0, row, 16 << 10), 8 * MiB, 7680, 256 * MiB)
    sizes = units.ranges[:, 1]
    assert abs(len(units.ranges) - calls) <= 1
    assert abs(float(np.median(sizes)) - piece_mib * MiB) <= 16 << 10  # cut at a page


def test_setup_units_index_like_a_list_and_allocate_no_object_per_unit() -> None:
    """100 GiB of 40 MiB rows in 8 MiB pieces: ~13,000 units made inside ``create``, which
    as objects set off full garbage collections of the engine's heap; as arrays they make a
    handful of objects, and each unit is built only when indexed."""
    slot = 40 << 20
    g = RegionGeometry("private", 2560, slot, 0, slot, 16384)
    config = TierConfig(cpu_bytes_per_node=100 << 30)
    cuts = registration_cuts(g, config, range(0, slot, 16384), 8 << 20)
    gc.collect()
    before = len(gc.get_objects())
    units = setup_units(g, config, 8 << 20, cuts)
    assert len(gc.get_objects()) - before < 100 and len(units) == 2560 * 5
    assert units[-1] == units[len(units) - 1] and units[-1].rows_end == 2560
    assert units[0] == SetupUnit(0, (ByteRange(0, 8 << 20),))
    assert list(units[3:6]) == [units[3], units[4], units[5]]
    with pytest.raises(IndexError):
        units[len(units)]
    # what populate.c reads raw cannot change under it, and bounds that do not index the
    # ranges are refused before any thread could read past them
    assert units.rows == 2560 and not units.ranges.flags.writeable
    assert not units.first.flags.writeable
    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="do not index 1 ranges"):
        SetupUnits.of(one, one, np.array([0, 2]), one)


def test_a_node_row_registered_whole_is_cut_among_the_other_slots_too() -> None:
    """Shared, 8 ranks of 8 MiB slots past ``max_slot_rows``: each rank registers whole
    64 MiB rows, and cuts at page boundaries outside its own slot make them eight even
    pieces, whichever rank (its own copy starts alone would leave pieces of up to 56 MiB)."""
    page, slot, ranks = 4096, 8 << 20, 8
    config = TierConfig(cpu_bytes_per_node=1 << 30, layout="shared", max_slot_rows=1)
    for rank in range(ranks):
        g = RegionGeometry("shared", 4, ranks * slot, rank * slot, slot, page)
        starts = range(rank * slot, (rank + 1) * slot, 64 << 10)  # its pages
        cuts = registration_cuts(g, config, starts, 8 << 20)
        assert [b - a for a, b in pairwise([0, *cuts, g.row_stride])] == [slot] * ranks
