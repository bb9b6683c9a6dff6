"""The staged path's byte arithmetic (`offload.transfer.staging`), on any host.

The GPU pass is emulated here from the kernel's staged addressing rules (row ``(entry -
first_entry) // bpc`` of the slice, tensors laid out as in the slot from the group's first,
sums after the pages), slice by slice through the ring, and the DMAs are executed from the
arrays `job_slices` returns.  A store must leave the region exactly as the page-by-page
reference writes it (so nothing outside pages and sums is touched, padding included), and a
load must bring every page back with matching sums, for any page sizes, chunk size,
integrity setting and staging budget.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import integrity
from offload.errors import OffloadError
from offload.transfer.layout import Job, SlotLayout, check_job, tensor_ranges
from offload.transfer.staging import (
    ROW_ALIGN,
    StagePlan,
    check_layer_ends,
    job_slices,
    layer_ends,
    layer_plan,
    layer_runs,
    merged_ranges,
    row_copies,
    split_at_cuts,
    stage_plan,
    tensor_groups,
    whole_chunks,
)
from tests.transfer.helpers import expected_region, slot_layout, staging_ring, with_cuts

PAGES = st.sampled_from([8, 60, 64, 256, 1000, 4096, 20_000])


JOB_ID = 5  # the job id the emulated store has, whose generation its sums carry
GENERATION = integrity.store_generation(JOB_ID)


def _emulate(plan: StagePlan, layout: object, kv: list[np.ndarray], job: Job,
             region: np.ndarray, load: bool, first_slot: int,
             after_slice: Callable[[int], None] | None = None) -> None:
    """Run ``job`` as the staged path would: per slice, the GPU pass over its ring slot and
    the DMAs `job_slices` lists (a load checks every page's sums before taking it), then
    ``after_slice(s)``."""
    assert isinstance(layout, SlotLayout)
    bpc = layout.blocks_per_chunk
    chunks = whole_chunks(job, bpc)
    assert chunks is not None
    parts = job_slices(plan, layout, int(chunks.size), first_slot)
    host = parts.host_offsets(chunks, layout.row_stride)
    # no DMA spans two registrations: each lies in one piece of its row
    within = parts.host_offsets(np.zeros_like(chunks), layout.row_stride)
    assert np.array_equal(layout.piece_of(within), layout.piece_of(within + parts.size - 1))
    ring = np.full(plan.ring_bytes, 0xEE, dtype=np.uint8)  # what earlier jobs left there
    keys, offsets = layout.tensor_keys(), integrity.unit_offsets(layout.page_bytes)
    for s in range(len(parts)):
        base = ((first_slot + s) % plan.slots) * plan.slice_bytes
        if len(parts) >= plan.slots:  # within a job, slot reuse needs a full ring turn
            assert {int(x) // plan.slice_bytes for x in parts.stage} == set(range(plan.slots))
        group = plan.groups[parts.group[s]]
        copies = range(parts.bounds[s], parts.bounds[s + 1])
        if load:
            for c in copies:
                h, g, n = int(host[c]), int(parts.stage[c]), int(parts.size[c])
                ring[g:g + n] = region[h:h + n]
        first = parts.first_entry[s]
        for e in range(first, first + parts.entries[s]):
            row = base + (e - first) // bpc * plan.row_bytes
            chunk, position = divmod(int(job.host_pages[e]), bpc)
            block = int(job.blocks[e])
            for t in range(group.first, group.first + group.count):
                page = layout.page_bytes[t]
                at = (row + layout.tensor_offsets[t] - layout.tensor_offsets[group.first]
                      + position * page)
                sums_at = (row + group.stage_trailer + integrity.WORD * (
                    bpc * (offsets[t] - offsets[group.first]) + position * layout.units[t]))
                words = integrity.WORD * layout.units[t]
                if load:
                    if layout.integrity:
                        want = integrity.page_sums(ring[None, at:at + page], keys[t], [chunk],
                                                   [GENERATION], [position])
                        assert ring[sums_at:sums_at + words].view(np.uint64).tolist() == \
                            want.reshape(-1).tolist()
                    kv[t][block] = ring[at:at + page]
                else:
                    ring[at:at + page] = kv[t][block]
                    if layout.integrity:
                        ring[sums_at:sums_at + words] = integrity.page_sums(
                            kv[t][None, block], keys[t], [chunk], [GENERATION],
                            [position]).view(np.uint8)
        if not load:
            for c in copies:
                h, g, n = int(host[c]), int(parts.stage[c]), int(parts.size[c])
                region[h:h + n] = ring[g:g + n]
        if after_slice is not None:
            after_slice(s)


def _three_chunks(layout: SlotLayout, seed: int
                  ) -> tuple[Job, np.ndarray, list[np.ndarray], np.ndarray]:
    """A whole-chunk job of 3 random chunks (of 7) from random blocks, random KV tensors and
    a random region: (job, its blocks, the tensors, the region)."""
    bpc, pages = layout.blocks_per_chunk, layout.page_bytes
    rng = np.random.default_rng(seed)
    chunk_count, num_blocks = 7, 3 * bpc + 2
    chunks = rng.permutation(chunk_count)[:3]
    blocks = rng.permutation(num_blocks)[:3 * bpc]
    host = (chunks[:, None] * bpc + np.arange(bpc)).ravel()
    job = check_job(layout, blocks, host // bpc, host % bpc, num_blocks=num_blocks,
                    chunk_count=chunk_count)
    kv = [rng.integers(0, 256, (num_blocks, p), dtype=np.uint8) for p in pages]
    return job, blocks, kv, rng.integers(0, 256, layout.region_bytes(chunk_count),
                                         dtype=np.uint8)


@settings(max_examples=60, deadline=None)
@given(pages=st.lists(PAGES, min_size=1, max_size=6), bpc=st.sampled_from([1, 2, 4, 5]),
       checked=st.booleans(), budget_rows=st.sampled_from([0.6, 1.0, 2.5, 9.0]),
       seed=st.integers(0, 2**16), cuts=st.integers(0, 6))
def test_staged_store_and_load_match_the_page_by_page_reference(
        pages: list[int], bpc: int, checked: bool, budget_rows: float, seed: int,
        cuts: int) -> None:
    """Byte for byte what the page-by-page reference writes and reads, also with the rows
    registered in pieces (``cuts`` of them, at random copy starts)."""
    layout, plan = staging_ring(pages, bpc, checked, budget_rows)
    if isinstance(plan, str):  # one tensor's chunk alone is larger than half the budget
        assert tensor_groups(layout, 0) is None
        return
    layout = with_cuts(layout, cuts, seed)
    job, blocks, kv, before = _three_chunks(layout, seed)
    region = before.copy()
    first = seed % plan.slots
    _emulate(plan, layout, kv, job, region, load=False, first_slot=first)
    expected = expected_region(torch.from_numpy(before), [torch.from_numpy(k) for k in kv],
                               layout, (job.blocks, job.host_pages // bpc, job.host_pages % bpc),
                               JOB_ID, checked)
    assert np.array_equal(region, expected.numpy())
    loaded = [np.zeros_like(k) for k in kv]
    _emulate(plan, layout, loaded, job, region, load=True, first_slot=(first + 1) % plan.slots)
    for t in range(len(pages)):
        assert np.array_equal(loaded[t][blocks], kv[t][blocks])


@settings(max_examples=200, deadline=None)
@given(pages=st.lists(PAGES, min_size=1, max_size=12), bpc=st.sampled_from([1, 3, 16]),
       checked=st.booleans(), budget=st.integers(1 << 10, 1 << 22))
def test_the_ring_fits_the_budget_with_the_fewest_groups(pages: list[int], bpc: int,
                                                        checked: bool, budget: int) -> None:
    layout = slot_layout(pages, bpc, integrity=checked)
    plan = stage_plan(layout, budget)
    if isinstance(plan, str):
        assert "whole chunks run on the kernel" in plan
        return
    assert plan.ring_bytes <= budget and plan.slots >= 2 and plan.rows_per_slice >= 1
    assert plan.row_bytes % ROW_ALIGN == 0
    covered = [t for g in plan.groups for t in range(g.first, g.first + g.count)]
    assert covered == list(range(len(pages)))
    for group in plan.groups:
        assert group.row_bytes <= plan.row_bytes
    # greedy in order: no group could have taken the next tensor too
    limit = budget // 2 // ROW_ALIGN * ROW_ALIGN
    for left, right in zip(plan.groups, plan.groups[1:], strict=False):
        span = (layout.tensor_offsets[right.first] + bpc * pages[right.first]
                - layout.tensor_offsets[left.first])
        sums = integrity.WORD * bpc * sum(layout.units[left.first:right.first + 1])
        row = -(-(-(-span // 8) * 8 + (sums if checked else 0)) // ROW_ALIGN) * ROW_ALIGN
        assert row > limit


def test_one_group_moves_a_chunk_as_one_dma_and_several_as_two() -> None:
    layout = slot_layout([16 << 10] * 4, 16)
    one = stage_plan(layout, 128 << 20)
    assert not isinstance(one, str) and len(one.groups) == 1 and one.groups[0].one_copy
    parts = job_slices(one, layout, 3)
    assert parts.size.tolist() == [one.groups[0].row_bytes] * 3
    assert parts.host_offsets(np.array([5, 2, 9]), layout.row_stride).tolist() == [
        c * layout.row_stride + layout.slot_offset for c in (5, 2, 9)]
    cut = stage_plan(layout, 2 * 2 * (16 << 10) * 16 + 4 * ROW_ALIGN)
    assert not isinstance(cut, str) and len(cut.groups) == 2
    parts = job_slices(cut, layout, 1)
    assert len(parts) == 2 and parts.bounds == [0, 2, 4]  # pages, sums per group


@pytest.mark.parametrize(("blocks", "chunks", "positions", "expected"), [
    (range(8, 12), [2] * 4, range(4), [2]),
    ([9, 3, 30, 1, 4, 5, 6, 7], [1] * 4 + [0] * 4, [*range(4), *range(4)], [1, 0]),
    (range(8, 12), [2] * 4, [1, 0, 2, 3], None),  # positions out of order
    (range(8, 11), [2] * 3, range(3), None),  # not a whole chunk
    (range(4), [1, 1, 2, 2], range(4), None),  # two half chunks
    ([], [], [], None),
])
def test_whole_chunks_takes_blocks_from_anywhere(blocks: object, chunks: object,
                                                 positions: object,
                                                 expected: list[int] | None) -> None:
    layout = slot_layout([64], 4)
    job = check_job(layout, list(blocks), list(chunks), list(positions),  # type: ignore[call-overload]
                    num_blocks=64, chunk_count=3)
    found = whole_chunks(job, 4)
    assert (None if found is None else found.tolist()) == expected


def test_a_slot_too_large_for_half_the_budget_says_why() -> None:
    layout = slot_layout([1 << 20], 16)
    reason = stage_plan(layout, 8 << 20)
    assert isinstance(reason, str) and "whole chunks run on the kernel" in reason


@settings(max_examples=80, deadline=None)
@given(pages=st.lists(PAGES, min_size=1, max_size=8), bpc=st.sampled_from([1, 2, 4, 5]),
       checked=st.booleans(), budget_rows=st.sampled_from([0.6, 1.0, 2.5, 9.0]),
       layers=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_a_layer_wise_load_brings_each_layer_group_back_by_its_last_slice(
        pages: list[int], bpc: int, checked: bool, budget_rows: float, layers: int,
        seed: int) -> None:
    """Stored through the ring's own plan, loaded through its layer plan: every page comes
    back, every staged row lies in one layer group and fits its ring slot, and once a layer
    group's last slice ran (`layer_ends`) all its pages are back and no later group's are."""
    layout, plan = staging_ring(pages, bpc, checked, budget_rows)
    if isinstance(plan, str):
        return
    ranges = tensor_ranges(len(pages), min(layers, len(pages)))
    layered = layer_plan(plan, layout, ranges)
    cut = layered.plan
    assert (cut.slots, cut.slice_bytes) == (plan.slots, plan.slice_bytes)
    assert cut.rows_per_slice >= 1 and cut.rows_per_slice * cut.row_bytes <= cut.slice_bytes
    assert [t for g in cut.groups for t in range(g.first, g.first + g.count)] == \
        list(range(len(pages)))
    for group, index in zip(cut.groups, layered.layer, strict=True):
        first, count = ranges[index]
        assert first <= group.first and group.first + group.count <= first + count
    job, blocks, kv, region = _three_chunks(layout, seed)
    _emulate(plan, layout, kv, job, region, load=False, first_slot=seed % plan.slots)
    loaded = [np.zeros_like(k) for k in kv]
    ends = layer_ends(job_slices(cut, layout, 3), layered.layer, len(ranges))
    assert ends == sorted(ends) and ends[-1] == len(job_slices(cut, layout, 3)) - 1
    assert job_slices(cut, layout, 3).size.size <= 3 * len(cut.groups) * (2 if checked else 1)

    def check_layers(s: int) -> None:
        for index, (first, count) in enumerate(ranges):
            back = all(np.array_equal(loaded[t][blocks], kv[t][blocks])
                       for t in range(first, first + count))
            untouched = all(not loaded[t].any() or not kv[t][blocks].any()
                            for t in range(first, first + count))
            if ends[index] <= s:
                assert back, f"layer group {index} incomplete after its last slice {s}"
            elif index > 0 and ends[index - 1] >= s:
                assert untouched, f"layer group {index} moved before group {index - 1} ended"

    _emulate(cut, layout, loaded, job, region, load=True, first_slot=seed % plan.slots,
             after_slice=check_layers)


def test_layer_groups_of_one_staging_group_move_in_few_slices() -> None:
    """160 tensors of 16 KiB pages, 16 blocks a chunk, 128 MiB of staging (the engine shape):
    one staging group of 40 MiB rows; in 80 layer groups each row is 512 KiB, and a layer
    group's 4 chunks move in one slice, not four."""
    layout = slot_layout([16 << 10] * 160, 16)
    plan = stage_plan(layout, 128 << 20)
    assert not isinstance(plan, str) and len(plan.groups) == 1
    layered = layer_plan(plan, layout, tensor_ranges(160, 80))
    assert len(layered.plan.groups) == 80 and layered.layer == tuple(range(80))
    parts = job_slices(layered.plan, layout, 4)
    assert len(parts) == 80 and parts.entries == [4 * 16] * 80
    assert layer_ends(parts, layered.layer, 80) == list(range(80))


@settings(max_examples=200, deadline=None)
@given(tensors=st.integers(1, 40), groups=st.integers(1, 40), runs=st.integers(1, 40))
def test_merged_ranges_join_consecutive_groups_in_order(tensors: int, groups: int,
                                                        runs: int) -> None:
    ranges = tensor_ranges(tensors, min(groups, tensors))
    merged = merged_ranges(ranges, runs)
    assert len(merged) == -(-len(ranges) // runs)
    for index, (first, count) in enumerate(merged):
        joined = ranges[index * runs:(index + 1) * runs]
        assert (first, count) == (joined[0][0], sum(c for _, c in joined))


@settings(max_examples=100, deadline=None)
@given(pages=st.lists(PAGES, min_size=1, max_size=10), checked=st.booleans(),
       budget_rows=st.sampled_from([0.6, 1.0, 2.5]), groups=st.integers(1, 10),
       chunks=st.integers(1, 9), max_copies=st.integers(1, 200))
def test_layer_runs_are_the_fewest_joins_within_the_bound(
        pages: list[int], checked: bool, budget_rows: float, groups: int, chunks: int,
        max_copies: int) -> None:
    """The DMAs `job_slices` issues for the joined groups stay within the bound (unless
    every group is joined: a whole load's DMAs), and one join fewer would pass it."""
    layout, plan = staging_ring(pages, 4, checked, budget_rows)
    if isinstance(plan, str):
        return
    layout = with_cuts(layout, chunks % 4, max_copies)
    ranges = tensor_ranges(len(pages), min(groups, len(pages)))
    runs = layer_runs(plan, layout, ranges, chunks, max_copies)

    def copies(k: int) -> int:
        """DMAs of ``k`` groups joined, as `job_slices` lists them."""
        cut = layer_plan(plan, layout, merged_ranges(ranges, k)).plan
        issued = int(job_slices(cut, layout, chunks).size.size)
        assert issued == chunks * row_copies(cut, layout)
        return issued

    if runs < len(ranges):
        assert copies(runs) <= max_copies
    if runs > 1:
        assert copies(runs - 1) > max_copies


@pytest.mark.parametrize(("ends", "events", "slices"), [
    ([1, 0, 2], 3, 3), ([0, 0, 2], 3, 3), ([0, 1, 3], 3, 3), ([-1, 1], 2, 3), ([0, 2], 3, 3)])
def test_group_ends_that_leave_an_event_unrecorded_are_refused(ends: list[int], events: int,
                                                                slices: int) -> None:
    with pytest.raises(OffloadError, match="are not increasing slices"):
        check_layer_ends(np.array(ends, dtype=np.int64), events, slices)
    check_layer_ends(np.arange(events, dtype=np.int64), events, max(events, slices))


@settings(max_examples=300, deadline=None)
@given(copies=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 80)), max_size=8),
       cuts=st.lists(st.integers(1, 299), max_size=6, unique=True))
def test_copies_split_at_cuts_cover_the_same_bytes_and_span_none(
        copies: list[tuple[int, int]], cuts: list[int]) -> None:
    """Each copy's parts are consecutive, in order, move the same bytes to the same places,
    and none holds a cut inside it."""
    host = np.array([h for h, _ in copies], dtype=np.int64)
    size = np.array([n for _, n in copies], dtype=np.int64)
    stage = 1000 + 3 * host
    edges = tuple(sorted(cuts))
    lo, at, length, tag = split_at_cuts(host, stage, size, np.arange(host.size), edges)
    assert tag.tolist() == sorted(tag.tolist()) and (length > 0).all()
    for c in range(host.size):
        mine = tag == c
        parts = list(zip(lo[mine].tolist(), length[mine].tolist(), at[mine].tolist(),
                         strict=True))
        assert parts[0][0] == host[c] and sum(n for _, n, _ in parts) == size[c]
        for (h, n, g), (h2, _, _) in zip(parts, parts[1:] + [(host[c] + size[c], 0, 0)],
                                         strict=True):
            assert h + n == h2 and g == stage[c] + (h - host[c])
            assert not any(h < x < h + n for x in edges)
