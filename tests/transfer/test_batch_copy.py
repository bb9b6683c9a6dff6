"""The copy engines' descriptors (`offload.transfer.batch_copy.copy_runs`): pages merged into
runs that never span two host registrations or two device allocations, and KV tensors whose
pages straddle two allocations refused (`allocation_starts`).  Pure numpy: the addresses are
numbers, the driver's allocation ranges given."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import OffloadError
from offload.transfer.batch_copy import allocation_starts, copy_runs
from offload.transfer.layout import Job
from tests.transfer.helpers import slot_layout, with_cuts

KiB = 1024
REGION = 1 << 40  # the host region's address: far from the KV tensors'


def _job(blocks: list[int], host_pages: list[int]) -> Job:
    return Job(np.array(blocks, dtype=np.int64), np.array(host_pages, dtype=np.int64))


def test_a_run_of_pages_stops_where_the_next_tensor_is_another_allocation() -> None:
    """Two KV tensors back to back in the address space, a whole chunk of each: one run when
    they are one allocation (views of one buffer), two when they are two (the caching
    allocator's neighbouring segments, which ``cuMemcpyBatchAsync`` refuses to span)."""
    pages, bpc = [16 * KiB] * 2, 4
    layout = slot_layout(pages, bpc, integrity=False)
    base = 1 << 30
    kv_bases = np.array([base, base + bpc * pages[0]], dtype=np.int64)
    strides = np.array(pages, dtype=np.int64)
    job = _job(list(range(bpc)), list(range(bpc)))  # chunk 0, positions 0..3
    for direction in ("store", "load"):
        one = copy_runs(layout, REGION, kv_bases, strides, np.array([base]), direction, job)
        two = copy_runs(layout, REGION, kv_bases, strides, kv_bases, direction, job)
        assert one[2].tolist() == [2 * bpc * 16 * KiB]
        assert sorted(two[2].tolist()) == [bpc * 16 * KiB] * 2
        gpu = two[0] if direction == "store" else two[1]
        assert sorted(gpu.tolist()) == kv_bases.tolist()


def _pieces(starts: np.ndarray, at: np.ndarray) -> np.ndarray:
    return np.searchsorted(starts, at, side="right")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([4 * KiB, 16 * KiB, 64 * KiB]), min_size=1, max_size=5),
       st.sampled_from([2, 4, 8]), st.integers(0, 2**32 - 1), st.integers(0, 3),
       st.sampled_from(["store", "load"]))
def test_runs_move_every_page_and_span_no_allocation_or_registration(
        pages: list[int], bpc: int, seed: int, cut_count: int, direction: str) -> None:
    """Tensors packed back to back or apart, allocations starting at random tensors and
    blocks, rows registered in random pieces, random jobs: the runs move exactly the job's
    pages, each within one device allocation and one host registration."""
    rng = np.random.default_rng(seed)
    layout = with_cuts(slot_layout(pages, bpc, integrity=bool(seed % 2)), cut_count, seed)
    num_blocks, chunk_count = 3 * bpc, 3
    gaps = rng.choice([0, 4 * KiB], size=len(pages))
    sizes = np.array(pages, dtype=np.int64) * num_blocks
    kv_bases = (1 << 30) + np.concatenate(([0], np.cumsum(sizes + gaps)[:-1])).astype(np.int64)
    strides = np.array(pages, dtype=np.int64)
    starts = {int(kv_bases[0])}
    for t, base in enumerate(kv_bases.tolist()):
        if rng.random() < 0.5:
            starts.add(base)
        for block in rng.choice(num_blocks, size=2, replace=False).tolist():
            if rng.random() < 0.3:
                starts.add(base + block * pages[t])
    allocations = np.array(sorted(starts), dtype=np.int64)
    n = int(rng.integers(1, num_blocks + 1))
    blocks = rng.permutation(num_blocks)[:n]
    host_pages = rng.permutation(chunk_count * bpc)[:n]
    if rng.random() < 0.5:  # runs: consecutive blocks to consecutive positions
        first = int(rng.integers(0, num_blocks - n + 1))
        blocks = np.arange(first, first + n)
        host_pages = np.arange(n) + int(rng.integers(0, chunk_count * bpc - n + 1))
    job = _job(blocks.tolist(), host_pages.tolist())
    src, dst, count = copy_runs(layout, REGION, kv_bases, strides, allocations, direction, job)

    expected = set()
    for t, page in enumerate(pages):
        for b, h in zip(blocks.tolist(), host_pages.tolist(), strict=True):
            chunk, position = divmod(h, bpc)
            host = (REGION + chunk * layout.row_stride + layout.slot_offset
                    + layout.tensor_offsets[t] + position * page)
            kv = int(kv_bases[t]) + b * page
            pair = (kv, host) if direction == "store" else (host, kv)
            expected.update((pair[0] + i, pair[1] + i) for i in range(0, page, 4 * KiB))
    moved = {(int(s) + i, int(d) + i) for s, d, c in zip(src, dst, count, strict=True)
             for i in range(0, int(c), 4 * KiB)}
    assert moved == expected and int(count.sum()) == n * sum(pages)
    gpu, host = (src, dst) if direction == "store" else (dst, src)
    last_gpu, last_host = gpu + count - 1, host + count - 1
    assert (_pieces(allocations, gpu) == _pieces(allocations, last_gpu)).all()
    row, last_row = (host - REGION) // layout.row_stride, (last_host - REGION) // layout.row_stride
    assert (row == last_row).all()
    within = host - REGION - row * layout.row_stride
    last_within = last_host - REGION - row * layout.row_stride
    assert (layout.piece_of(within) == layout.piece_of(last_within)).all()


def test_allocation_starts_are_sorted_and_unique() -> None:
    base = 1 << 30
    ranges = [[(base, 64 * KiB)], [(base, 64 * KiB)], [(base + 64 * KiB, 32 * KiB)]]
    starts = allocation_starts([base, base + 32 * KiB, base + 64 * KiB], [16 * KiB] * 3,
                               [16 * KiB] * 3, 2, ranges)
    assert starts.tolist() == [base, base + 64 * KiB]


def test_a_page_straddling_two_allocations_is_refused_with_the_way_out() -> None:
    """Memory mapped piecewise can end an allocation inside a page: the copy engines would
    move that page in one piece across two, so such a tensor is refused at engine creation.
    An end at a page's end, or in the gap between a page and the next block, is fine."""
    base, page = 1 << 30, 16 * KiB
    with pytest.raises(OffloadError, match=r"KV tensor 0's block 2 spans two CUDA allocations"
                                           r".*expandable segments.*'triton'"):
        allocation_starts([base], [page], [page], 4,
                          [[(base, 2 * page + 4 * KiB), (base + 2 * page + 4 * KiB, page * 4)]])
    at_end = [[(base, 2 * page), (base + 2 * page, 2 * page)]]
    assert allocation_starts([base], [page], [page], 4, at_end).tolist() == [base, base + 2 * page]
    in_gap = [[(base, page + 8 * KiB), (base + page + 8 * KiB, 4 * page)]]  # stride 2 pages
    assert len(allocation_starts([base], [2 * page], [page], 4, in_gap)) == 2


@pytest.mark.parametrize(("stride", "num_blocks", "end", "block"), [
    (16 * KiB, 4, 3 * 16 * KiB + 100, 3),  # the last block
    (16 * KiB, 4, 4 * 16 * KiB, None),  # the tensor's end
    (0, 1, 100, 0),  # one block: any stride, even 0
    (8, 1, 100, 0),  # one block, a stride under the page
    (8, 1, 16 * KiB, None),
    (32 * KiB, 3, 2 * 32 * KiB + 16 * KiB + 1, None),  # past the last page, in its padding
])
def test_straddled_block_at_the_edges(stride: int, num_blocks: int, end: int,
                                      block: int | None) -> None:
    from offload.transfer.batch_copy import straddled_block

    base = 1 << 30
    assert straddled_block(base + end, base, stride, 16 * KiB, num_blocks) == block


def test_without_the_drivers_answer_runs_stop_at_every_tensor(
        caplog: pytest.LogCaptureFixture) -> None:
    """No driver here: the engines' allocation lookup falls back to each tensor's start, with
    a warning, so a run never joins two tensors."""
    import torch

    from offload.transfer.batch_copy import kv_allocations
    from offload.transfer.tensors import kv_geometry

    buffer = torch.zeros((8, 4 * KiB), dtype=torch.uint8)
    kv = [buffer[0:4], buffer[4:8], buffer[0:4]]  # neighbours, and one tensor twice
    with caplog.at_level("WARNING"):
        starts = kv_allocations(kv, kv_geometry(kv))
    assert starts.tolist() == sorted({t.data_ptr() for t in kv})
    assert "runs stop at every tensor" in caplog.text
