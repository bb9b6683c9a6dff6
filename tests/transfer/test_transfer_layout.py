"""check_job, page_addresses and SlotLayout against the slot rules of plan.py, on random layouts
and jobs."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config import TierConfig
from offload.control.plan import RankDescriptor, compute_plan
from offload.errors import OffloadError
from offload.transfer import Job, SlotLayout, check_job, page_addresses
from offload.transfer.layout import (
    UniqueDestinations,
    as_index_array,
    common_alignment,
    index_sections,
    index_words,
    pack_generations,
    tensor_ranges,
)


@st.composite
def layouts(draw: st.DrawFn) -> SlotLayout:
    """A slot with 1-4 tensors of arbitrary page sizes somewhere inside a padded row."""
    pages = tuple(draw(st.lists(st.integers(1, 5000), min_size=1, max_size=4)))
    bpc = draw(st.integers(1, 8))
    offsets = tuple(bpc * sum(pages[:t]) for t in range(len(pages)))
    slot_offset = draw(st.integers(0, 3000))
    padding = draw(st.integers(0, 3000))
    return SlotLayout(slot_offset + bpc * sum(pages) + padding, slot_offset, bpc, pages, offsets)


@st.composite
def jobs(draw: st.DrawFn, layout: SlotLayout, num_blocks: int, chunk_count: int
         ) -> tuple[list[int], list[int], list[int]]:
    n = draw(st.integers(0, 20))
    index = st.tuples(st.integers(0, num_blocks - 1), st.integers(0, chunk_count - 1),
                      st.integers(0, layout.blocks_per_chunk - 1))
    triples = draw(st.lists(index, min_size=n, max_size=n))
    return ([b for b, _, _ in triples], [c for _, c, _ in triples], [p for _, _, p in triples])


def addresses(layout: SlotLayout, job: Job, strides: list[int] | None = None,
              bases: list[int] | None = None, region: int = 0) -> tuple[np.ndarray, np.ndarray]:
    t = layout.num_tensors
    kv_bases = np.asarray(bases if bases is not None else [0] * t, dtype=np.int64)
    block_strides = np.asarray(strides if strides is not None else layout.page_bytes,
                               dtype=np.int64)
    return page_addresses(kv_bases, block_strides, region, layout, job)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_addresses_follow_the_slot_formula(data: st.DataObject) -> None:
    layout = data.draw(layouts())
    num_blocks, chunk_count = data.draw(st.integers(1, 50)), data.draw(st.integers(1, 10))
    blocks, chunks, positions = data.draw(jobs(layout, num_blocks, chunk_count))
    job = check_job(layout, blocks, chunks, positions, num_blocks=num_blocks,
                    chunk_count=chunk_count)
    strides = [p * data.draw(st.integers(1, 3)) for p in layout.page_bytes]
    bases = [data.draw(st.integers(0, 1 << 40)) for _ in layout.page_bytes]
    kv, host = addresses(layout, job, strides, bases, region=12345)
    assert kv.shape == host.shape == (layout.num_tensors, len(blocks))
    for t, page in enumerate(layout.page_bytes):
        for i, (b, chunk, pos) in enumerate(zip(blocks, chunks, positions, strict=True)):
            assert kv[t, i] == bases[t] + b * strides[t]
            assert host[t, i] == (12345 + chunk * layout.row_stride + layout.slot_offset
                                  + layout.tensor_offsets[t] + pos * page)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_host_pages_are_disjoint_and_inside_the_slot(data: st.DataObject) -> None:
    """Every (chunk, position, tensor) page owns distinct bytes inside its chunk's slot."""
    layout = data.draw(layouts())
    chunk_count = data.draw(st.integers(1, 4))
    pairs = [(c, p) for c in range(chunk_count) for p in range(layout.blocks_per_chunk)]
    job = check_job(layout, [0] * len(pairs), [c for c, _ in pairs], [p for _, p in pairs],
                    num_blocks=1, chunk_count=chunk_count)
    _, host = addresses(layout, job)
    owner = np.full(layout.region_bytes(chunk_count), -1)
    slot_end = layout.slot_offset + sum(layout.blocks_per_chunk * p for p in layout.page_bytes)
    for t, page in enumerate(layout.page_bytes):
        for (chunk, _), start in zip(pairs, host[t].tolist(), strict=True):
            row = chunk * layout.row_stride
            assert row + layout.slot_offset <= start
            assert start + page <= row + slot_end
            assert (owner[start:start + page] == -1).all()
            owner[start:start + page] = t
    assert (owner >= 0).sum() == chunk_count * (slot_end - layout.slot_offset)


@pytest.mark.parametrize("layout_name", ["private", "shared", "replicated"])
def test_from_plan_matches_the_ranks_slot(layout_name: str) -> None:
    config = TierConfig(cpu_bytes_per_node=1 << 24, layout=layout_name, blocks_per_chunk=4,
                        tp=2)
    pages = (512, 60, 1000)
    plan = compute_plan([RankDescriptor(r, "n0", r, 2, r, 0, pages, config) for r in range(2)])
    for rank in range(2):
        layout = SlotLayout.from_plan(plan, rank)
        slot = plan.slots[rank]
        assert layout == SlotLayout(plan.row_stride(rank), slot.slot_offset, 4, pages,
                                    slot.tensor_offsets, slot.trailer_offset,
                                    slot.integrity_seed)
        assert layout.trailer_offset == 4 * sum(pages) and layout.integrity
        trailer_end = (layout.slot_offset + layout.trailer_offset
                       + 8 * 4 * sum(layout.units))
        assert trailer_end <= slot.slot_offset + slot.slot_bytes
        assert layout.region_bytes(plan.chunk_count) == plan.region_bytes(rank)
    if layout_name == "shared":
        assert SlotLayout.from_plan(plan, 1).slot_offset > 0


LAYOUT = SlotLayout(row_stride=10_000, slot_offset=100, blocks_per_chunk=4, page_bytes=(512, 60),
                    tensor_offsets=(0, 2048))


@pytest.mark.parametrize(("job", "message"), [
    (([64], [0], [0]), "gpu block 64 (entry 0 of the job) is out of range: the KV cache has 64"),
    (([0, -1], [0, 0], [0, 1]), "gpu block -1 (entry 1"),
    (([0], [3], [0]), "chunk id 3 (entry 0 of the job) is out of range: the region has 3 chunks"),
    (([0], [-2], [0]), "chunk id -2"),
    (([0], [0], [4]), "position 4 (entry 0 of the job) is out of range: a chunk holds 4 blocks"),
    (([0, 1], [0], [0, 1]), "equally long arrays, got 2 gpu_blocks, 1 chunk_ids and 2"),
    (([[0]], [0], [0]), "gpu_blocks must be a 1-D array of integers"),
    (([0], [0.5], [0]), "chunk_ids must be a 1-D array of integers"),
    (([0], [0], [True]), "positions must be a 1-D array of integers"),
])
def test_bad_jobs_raise_one_line_errors(job: tuple[list[object], ...], message: str) -> None:
    with pytest.raises(OffloadError, match=re.escape(message)) as e:
        check_job(LAYOUT, *job, num_blocks=64, chunk_count=3)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(page_bytes=(512,)), "1 page sizes and 2 tensor offsets"),
    (dict(page_bytes=(), tensor_offsets=()), "0 page sizes"),
    (dict(blocks_per_chunk=0), "positive blocks_per_chunk"),
    (dict(page_bytes=(512, 0)), "positive blocks_per_chunk and page sizes"),
    (dict(row_stride=2000), "must lie inside its row"),
    (dict(slot_offset=-1), "must lie inside its row"),
    (dict(trailer_offset=2048), "trailer at slot byte 2048 overlaps the pages"),
    (dict(trailer_offset=2292), "not 8-byte aligned"),
    (dict(trailer_offset=9880), "must lie inside its row"),
])
def test_bad_layouts_raise(fields: dict[str, object], message: str) -> None:
    base = dict(row_stride=10_000, slot_offset=100, blocks_per_chunk=4, page_bytes=(512, 60),
                tensor_offsets=(0, 2048))
    with pytest.raises(OffloadError, match=message):
        SlotLayout(**{**base, **fields})  # type: ignore[arg-type]


def test_job_arrays_accept_lists_numpy_and_tensors() -> None:
    for values in ([3, 1], (3, 1), np.array([3, 1], dtype=np.uint16), torch.tensor([3, 1])):
        assert as_index_array(values, "x").tolist() == [3, 1]
    assert as_index_array([], "x").shape == (0,)
    job = check_job(LAYOUT, np.array([3], dtype=np.int32), [2], [1], num_blocks=4,
                    chunk_count=3)
    assert job.blocks.tolist() == [3] and job.host_pages.tolist() == [2 * 4 + 1]
    assert len(check_job(LAYOUT, [], [], [], num_blocks=1, chunk_count=1)) == 0


PATHS: dict[str, dict[str, int]] = {"scatter": {},
                                     "sort": {"SCRATCH_LIMIT": 0}}  # settings forcing each way


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("field", "job", "message"), [
    ("host_pages", ([0, 1, 2], [1, 2, 1], [3, 0, 3]),
     "entries 0 and 2 of the job both write chunk 1 position 3; two copies to one destination"),
    ("blocks", ([5, 1, 5], [0, 1, 2], [0, 0, 0]),
     "entries 0 and 2 of the job both write GPU block 5"),
])
def test_a_destination_written_twice_is_refused(field: str, job: tuple[list[int], ...],
                                                message: str, path: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in PATHS[path].items():
        monkeypatch.setattr(UniqueDestinations, name, value)

    def unique(name: str) -> UniqueDestinations:
        return UniqueDestinations(name, 64 if name == "blocks" else 12, 4)

    with pytest.raises(OffloadError, match=re.escape(message)) as e:
        check_job(LAYOUT, *job, num_blocks=64, chunk_count=3, unique=unique(field))
    assert "\n" not in str(e.value)
    check_job(LAYOUT, *job, num_blocks=64, chunk_count=3)  # the sources may repeat
    other = "blocks" if field == "host_pages" else "host_pages"
    check = unique(other)
    for _ in range(2):  # the scratch array is reused: a second job sees no stale entries
        check_job(LAYOUT, *job, num_blocks=64, chunk_count=3, unique=check)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 15), max_size=12), min_size=1, max_size=3),
       st.sampled_from(sorted(PATHS)))
def test_unique_destinations_matches_a_set(jobs: list[list[int]], path: str) -> None:
    """Every way agrees with a set, also on a reused checker (stale marks and scratch), and
    names the same entries: the first two writing the lowest repeated destination."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in PATHS[path].items():
            patch.setattr(UniqueDestinations, name, value)
        check = UniqueDestinations("blocks", 16, 4)
        for dest in jobs:
            job = Job(np.array(dest, dtype=np.int64), np.zeros(len(dest), dtype=np.int64))
            if len(set(dest)) == len(dest):
                check.check(job)
            else:
                value = min(d for d in dest if dest.count(d) > 1)
                first, second = [i for i, d in enumerate(dest) if d == value][:2]
                with pytest.raises(OffloadError, match=f"entries {first} and {second} of the "
                                   f"job both write GPU block {value};"):
                    check.check(job)


def _outcome(job: tuple[object, ...], field: str | None) -> tuple[list[int], list[int]] | str:
    unique = UniqueDestinations(field, 64 if field == "blocks" else 12, 4) if field else None
    try:
        checked = check_job(LAYOUT, *job, num_blocks=64, chunk_count=3, unique=unique)
    except OffloadError as exc:
        return str(exc)
    return checked.blocks.tolist(), checked.host_pages.tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 66), st.integers(-1, 4), st.integers(-1, 5)),
                max_size=20),
       st.sampled_from([None, "blocks", "host_pages"]),
       st.sampled_from(["lists", "tuples", "arrays"]))
def test_lists_tuples_and_arrays_of_a_job_have_one_outcome(
        triples: list[tuple[int, int, int]], field: str | None, kind: str) -> None:
    """Whatever container a job comes in, the result and every error are those of int64
    arrays."""
    columns = [[t[i] for t in triples] for i in range(3)]
    given_as = tuple(tuple(c) if kind == "tuples" else np.array(c, dtype=np.int32)
                     if kind == "arrays" else c for c in columns)
    assert _outcome(given_as, field) == _outcome(
        tuple(np.array(c, dtype=np.int64) for c in columns), field)


def test_a_cuda_index_tensor_is_refused_without_a_sync() -> None:
    class FakeCuda:  # a stand-in: no CUDA here, and the check must not touch the data
        is_cuda = True

        def detach(self) -> None:
            raise AssertionError("read the device tensor")

    with pytest.raises(OffloadError, match="gpu_blocks is a CUDA tensor; pass job indices"):
        as_index_array(FakeCuda(), "gpu_blocks")


def test_common_alignment() -> None:
    assert common_alignment([4096, 8192], cap=16) == 16
    assert common_alignment([4096, 8200], cap=16) == 8
    assert common_alignment([4096, 6], cap=16) == 2
    assert common_alignment([3], cap=16) == 1
    assert common_alignment([], cap=16) == 16


def _byte_map(src: np.ndarray, dst: np.ndarray, count: np.ndarray) -> dict[int, int]:
    return {int(s) + i: int(d) + i for s, d, n in zip(src, dst, count, strict=True)
            for i in range(int(n))}


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=0, max_size=30,
                unique_by=lambda t: t[0]),
       st.integers(1, 8))
def test_coalesce_moves_exactly_the_same_bytes(pairs: list[tuple[int, int]], page: int) -> None:
    from offload.transfer.layout import coalesce

    src = np.array([p[0] * page for p in pairs], dtype=np.int64)
    dst = np.array([p[1] * page for p in pairs], dtype=np.int64)
    count = np.full(len(pairs), page, dtype=np.int64)
    merged = coalesce(src, dst, count)
    assert _byte_map(*merged) == _byte_map(src, dst, count)
    assert merged[0].size <= max(1, src.size)


def test_coalesce_joins_a_chunk_of_consecutive_blocks_into_one_copy() -> None:
    from offload.transfer.layout import coalesce

    src = np.arange(16, dtype=np.int64)[::-1] * 4096 + 65536
    dst = np.arange(16, dtype=np.int64)[::-1] * 4096 + 8192
    src_m, dst_m, count_m = coalesce(src, dst, np.full(16, 4096, dtype=np.int64))
    assert (src_m.tolist(), dst_m.tolist(), count_m.tolist()) == ([65536], [8192], [65536])


@pytest.mark.parametrize("num_tensors", range(1, 13))
def test_tensor_ranges_cover_every_tensor_once_in_order(num_tensors: int) -> None:
    for groups in range(1, num_tensors + 1):
        ranges = tensor_ranges(num_tensors, groups)
        assert len(ranges) == groups
        assert [t for first, count in ranges for t in range(first, first + count)] == list(
            range(num_tensors))
        sizes = [count for _, count in ranges]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert tensor_ranges(160, 80) == [(2 * layer, 2) for layer in range(80)]  # K and V a layer
    for bad in (0, num_tensors + 1):
        with pytest.raises(OffloadError, match=f"layer_groups = {bad} for {num_tensors} KV "
                           "tensors; give 1 to"):
            tensor_ranges(num_tensors, bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=40), st.data())
def test_packed_generations_join_back_as_the_kernel_reads_them(generations: list[int],
                                                                data: st.DataObject) -> None:
    """Each entry's page generation, packed after its blocks and host pages into int32 or
    int64 words, comes back from words 2n + 2i and 2n + 2i + 1 as ``(low & 0xFFFFFFFF) |
    high << 32`` (the kernel's join), and nothing outside those 2n words is written."""
    table = np.array(generations, dtype=np.int64)
    n = data.draw(st.integers(0, 30))
    pages = np.array(data.draw(st.lists(st.integers(0, len(table) - 1), min_size=n,
                                        max_size=n)), dtype=np.int64)
    for dtype in (np.int32, np.int64):
        words = np.full(index_words(n, integrity=True), 7, dtype=dtype)
        pack_generations(words, n, pages.astype(dtype), table)
        low = words[2 * n:4 * n:2].astype(np.int64) & 0xFFFFFFFF
        high = words[2 * n + 1:4 * n:2].astype(np.int64)
        assert np.array_equal(low | (high << 32), table[pages])
        assert (words[:2 * n] == 7).all() and (words[4 * n:] == 7).all()
    assert np.array_equal(table, np.array(generations, dtype=np.int64))  # the table unchanged


def test_an_upload_holds_its_sections_and_the_result_words() -> None:
    """Blocks and host pages, with integrity two words of generation per entry, then the
    two words that locate a checked load's result: every upload fits a buffer of this size."""
    assert (index_sections(False), index_sections(True)) == (2, 4)
    assert index_words(256, integrity=False) == 2 * 256 + 2
    assert index_words(256, integrity=True) == 4 * 256 + 2
