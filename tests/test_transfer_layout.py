"""job_offsets and SlotLayout against the slot rules of plan.py, on random layouts and jobs."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config import TierConfig
from offload.errors import OffloadError
from offload.plan import RankDescriptor, compute_plan
from offload.transfer import SlotLayout, job_offsets
from offload.transfer.layout import as_index_array, lowest_common_alignment, split_tiles


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


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_offsets_follow_the_slot_formula(data: st.DataObject) -> None:
    layout = data.draw(layouts())
    num_blocks, chunk_count = data.draw(st.integers(1, 50)), data.draw(st.integers(1, 10))
    blocks, chunks, positions = data.draw(jobs(layout, num_blocks, chunk_count))
    copies = job_offsets(layout, blocks, chunks, positions,
                         num_blocks=num_blocks, chunk_count=chunk_count)
    assert len(copies) == layout.num_tensors
    for t, c in enumerate(copies):
        page = layout.page_bytes[t]
        assert c.page_bytes == page
        assert c.kv_offsets.dtype == np.int64 and c.host_offsets.dtype == np.int64
        for i, (b, chunk, pos) in enumerate(zip(blocks, chunks, positions, strict=True)):
            assert c.kv_offsets[i] == b * page
            assert c.host_offsets[i] == (chunk * layout.row_stride + layout.slot_offset
                                         + layout.tensor_offsets[t] + pos * page)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_host_pages_are_disjoint_and_inside_the_slot(data: st.DataObject) -> None:
    """Every (chunk, position, tensor) page owns distinct bytes inside its chunk's slot."""
    layout = data.draw(layouts())
    chunk_count = data.draw(st.integers(1, 4))
    pairs = [(c, p) for c in range(chunk_count) for p in range(layout.blocks_per_chunk)]
    copies = job_offsets(layout, [0] * len(pairs), [c for c, _ in pairs], [p for _, p in pairs],
                         num_blocks=1, chunk_count=chunk_count)
    owner = np.full(layout.region_bytes(chunk_count), -1)
    slot_end = layout.slot_offset + sum(layout.blocks_per_chunk * p for p in layout.page_bytes)
    for t, c in enumerate(copies):
        for (chunk, _), start in zip(pairs, c.host_offsets.tolist(), strict=True):
            row = chunk * layout.row_stride
            assert row + layout.slot_offset <= start
            assert start + c.page_bytes <= row + slot_end
            assert (owner[start:start + c.page_bytes] == -1).all()
            owner[start:start + c.page_bytes] = t
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
                                    slot.tensor_offsets)
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
        job_offsets(LAYOUT, *job, num_blocks=64, chunk_count=3)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(page_bytes=(512,)), "1 page sizes and 2 tensor offsets"),
    (dict(page_bytes=(), tensor_offsets=()), "0 page sizes"),
    (dict(blocks_per_chunk=0), "positive blocks_per_chunk"),
    (dict(page_bytes=(512, 0)), "positive blocks_per_chunk and page sizes"),
    (dict(row_stride=2000), "must lie inside its row"),
    (dict(slot_offset=-1), "must lie inside its row"),
])
def test_bad_layouts_raise(fields: dict[str, object], message: str) -> None:
    base = dict(row_stride=10_000, slot_offset=100, blocks_per_chunk=4, page_bytes=(512, 60),
                tensor_offsets=(0, 2048))
    with pytest.raises(OffloadError, match=message):
        SlotLayout(**{**base, **fields})  # type: ignore[arg-type]


def test_job_arrays_accept_lists_numpy_and_tensors() -> None:
    expected = np.array([3, 1], dtype=np.int64)
    for values in ([3, 1], np.array([3, 1], dtype=np.uint16), torch.tensor([3, 1])):
        out = as_index_array(values, "x")
        assert out.dtype == np.int64 and (out == expected).all()
    assert as_index_array([], "x").shape == (0,)
    assert job_offsets(LAYOUT, [], [], [], num_blocks=1, chunk_count=1)[0].kv_offsets.size == 0


def test_lowest_common_alignment() -> None:
    def arrays(*values: int) -> list[np.ndarray]:
        return [np.array(values, dtype=np.int64)]

    assert lowest_common_alignment(arrays(4096, 8192), cap=16) == 16
    assert lowest_common_alignment(arrays(4096, 8200), cap=16) == 8
    assert lowest_common_alignment(arrays(4096, 6), cap=16) == 2
    assert lowest_common_alignment(arrays(3), cap=16) == 1
    assert lowest_common_alignment(arrays(-48, 32), cap=16) == 16
    assert lowest_common_alignment([np.zeros(0, dtype=np.int64)], cap=16) == 16


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 100), max_size=12), tile=st.sampled_from([1, 2, 8, 32]))
def test_split_tiles_covers_each_copy_in_order(counts: list[int], tile: int) -> None:
    count = np.array(counts, dtype=np.int64)
    src = np.arange(count.size, dtype=np.int64) * 1000 + 5
    dst = src * 2 + 1
    s, d, c = split_tiles(src, dst, count, tile)
    assert ((c >= 1) & (c <= tile)).all()
    moved = [(int(a) + i, int(b) + i) for a, b, n in zip(s, d, c, strict=True) for i in range(n)]
    expected = [(int(a) + i, int(b) + i) for a, b, n in zip(src, dst, count, strict=True)
                for i in range(n)]
    assert moved == expected


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
