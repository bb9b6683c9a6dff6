"""The CUDA backends on a real device: byte-exact round trips at 4 KiB - 1 MiB pages, engine
tensor layouts (K/V views, padded per-layer tensors, mixed page sizes, many tensors), odd pages
and unaligned regions (narrow words), stream ordering and events, routing of the default
backend, and the unpinned fallback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import pytest
import torch

from offload import integrity
from offload.errors import OffloadError
from offload.transfer import make_engine, triton_available
from offload.transfer.batch_copy import batch_copy_available
from offload.transfer.fast_check import checker_library
from offload.transfer.layout import tensor_ranges
from offload.transfer.native import library
from offload.transfer.registration import host_registered
from tests.transfer.helpers import (
    HYBRID_PAGES,
    engine_kv_set,
    expected_region,
    kv_set,
    page_sizes,
    round_trip,
    scattered_job,
    slot_layout,
)
from tests.transfer.test_integrity import ERROR_CLASSES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton")
needs_batch = pytest.mark.skipif(not batch_copy_available(), reason="needs a CUDA 13 driver")
needs_native = pytest.mark.skipif(library() is None, reason="native issue path off "
                                  "(OFFLOAD_NATIVE=0 or no C compiler)")
KiB, MiB = 1 << 10, 1 << 20
SLEEP_CYCLES = 300_000_000  # ~0.2 s of GPU time: long enough for a copy to overtake if it could
BACKENDS = [pytest.param("hybrid", marks=[needs_triton, needs_batch]),
            pytest.param("triton", marks=needs_triton),
            pytest.param("copy_engine", marks=needs_batch), "per_block"]


@contextmanager
def cuda_engine(backend: str, kv: list[torch.Tensor], chunk_count: int, bpc: int = 4,
                skew: int = 0, integrity: bool = True, **options: Any
                ) -> Iterator[tuple[Any, list[torch.Tensor], torch.Tensor]]:
    """An engine over CUDA KV tensors ``kv`` and a random host region starting ``skew`` bytes
    into its allocation; registered with CUDA for the pinned backends only."""
    layout = slot_layout(page_sizes(kv), bpc, integrity=integrity)
    buffer = torch.randint(0, 256, (layout.region_bytes(chunk_count) + skew,), dtype=torch.uint8)
    region = buffer[skew:]
    pinned = backend in ("hybrid", "triton", "copy_engine")
    with host_registered(buffer) if pinned else nullcontext():
        if options:
            engine = _engine_class(backend)(kv, region, layout, chunk_count, **options)
        else:
            engine = make_engine(kv, region, region.data_ptr(), layout, chunk_count, pinned,
                                 backend)
        try:
            yield engine, kv, region
        finally:
            engine.close()


def _engine_class(backend: str) -> Any:
    from offload.transfer.hybrid import HybridEngine
    from offload.transfer.kernel import TritonEngine

    return {"hybrid": HybridEngine, "triton": TritonEngine}[backend]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [4 * KiB, 16 * KiB, 64 * KiB, 1 * MiB])
def test_round_trip_is_byte_exact(backend: str, page: int) -> None:
    num_blocks = max(8, min(256, (64 * MiB) // page))
    chunk_count = num_blocks // 4 + 1
    kv = kv_set(num_blocks, [page], "cuda")
    with cuda_engine(backend, kv, chunk_count) as (engine, kv, region):
        assert engine.name == backend
        job = scattered_job(np.random.default_rng(page), num_blocks - 3, num_blocks,
                            chunk_count, 4)
        round_trip(engine, kv, region, slot_layout([page], 4), job)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("skew", [0, 1, 4, 8])
def test_hybrid_pages_and_unaligned_regions(backend: str, skew: int) -> None:
    """Odd page sizes (60 B) and a region that starts off 16-byte alignment force narrower
    words in the kernel.  Checksum trailers need 8-byte alignment: off it, without integrity."""
    kv = kv_set(40, HYBRID_PAGES, "cuda")
    aligned = skew % 8 == 0
    with cuda_engine(backend, kv, 12, skew=skew, integrity=aligned) as (engine, kv, region):
        job = scattered_job(np.random.default_rng(skew), 30, 40, 12, 4)
        round_trip(engine, kv, region, slot_layout(HYBRID_PAGES, 4, integrity=aligned), job)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pages", [(16 * KiB, 4 * KiB, 64 * KiB), (16 * KiB, 61, 1000, 48)])
def test_engine_layouts_many_tensors_both_directions(backend: str,
                                                     pages: tuple[int, ...]) -> None:
    """K/V views of [blocks, 2, ...] tensors plus padded per-layer tensors, 3 per page size,
    repeated to dozens of tensors: the kernel's one launch covers them all."""
    kv = engine_kv_set(48, pages * (4 if backend == "per_block" else 12), "cuda")
    with cuda_engine(backend, kv, 14) as (engine, kv, region):
        if backend == "triton":
            from offload.transfer.kernel import MAX_WORD

            aligned = all(p % 16 == 0 for p in pages)
            assert engine.kernel.word == (MAX_WORD if aligned else 1)
        job = scattered_job(np.random.default_rng(len(kv)), 40, 48, 14, 4)
        round_trip(engine, kv, region, slot_layout(page_sizes(kv), 4), job)


@needs_triton
def test_many_jobs_in_flight_reuse_staging_and_stay_exact() -> None:
    """Jobs queued behind a sleeping compute stream: each holds its own staging slot until it
    completes (submit never waits; more slots are made while all are held) and two of them
    grow the buffers.  Every job must move the indices it was submitted with, in order, and
    the second pass reuses the slots the first one released."""
    from offload.transfer.kernel import STAGING_SLOTS

    sizes = [3, 9, 1, 300, 20, 600, 40, 5, 40, 6]
    assert len(sizes) > STAGING_SLOTS and max(sizes[:3]) <= 256
    kv = kv_set(sum(sizes), [4 * KiB, 1000], "cuda")
    layout = slot_layout([4 * KiB, 1000], 4)
    with cuda_engine("triton", kv, sum(sizes) // 4) as (engine, kv, region):
        rng = np.random.default_rng(7)
        blocks, pages = rng.permutation(sum(sizes)), rng.permutation(sum(sizes))
        cuts = np.cumsum([0, *sizes])
        jobs = [(blocks[a:b], pages[a:b] // 4, pages[a:b] % 4)
                for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        engine.submit(-2, "store", *jobs[0])  # compiles both directions before the sleep
        engine.submit(-1, "load", *jobs[0])
        engine.wait_all()
        expected = region.clone()
        for job_id, job in enumerate(jobs):
            expected = expected_region(expected, kv, layout, job, job_id)
        original = [t.clone() for t in kv]
        made = []
        for direction in ("store", "load"):
            torch.cuda._sleep(SLEEP_CYCLES)
            for job_id, job in enumerate(jobs):
                engine.submit(job_id, direction, *job)
            assert engine.poll() == []  # every job staged behind the sleep, none waited
            assert engine.wait_all() == list(range(len(jobs)))
            made.append(engine.kernel.slots_made)
            if direction == "store":
                assert torch.equal(region, expected)
                for t in kv:
                    t.zero_()
        # bytes, not values: random bits viewed as bf16 / float32 hold NaNs, and NaN != NaN
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(kv, original, strict=True))
        assert engine.kernel._capacity == 1024  # grew twice, to the largest job rounded up
        # the store pass released 5 slots of 1024 entries (jobs 5-9; the 4 the last growth
        # made went to jobs 5-8); the load pass holds 10 at once: 5 reused, 5 made
        assert made[1] - made[0] == 5


@needs_triton
def test_back_to_back_jobs_reuse_the_same_staging_slots() -> None:
    """A job's slot is free again once the engine found the job complete: jobs that complete
    one after another never make a slot beyond the first ones."""
    from offload.transfer.kernel import STAGING_SLOTS

    kv = kv_set(64, [4 * KiB], "cuda")
    with cuda_engine("triton", kv, 16) as (engine, kv, region):
        rng = np.random.default_rng(3)
        for job_id in range(20):
            round_trip(engine, kv, region, slot_layout([4 * KiB], 4),
                       scattered_job(rng, 1 + job_id % 7, 64, 16, 4))
        assert engine.kernel.slots_made == STAGING_SLOTS


@needs_triton
@pytest.mark.parametrize("path", [pytest.param("native", marks=needs_native), "bound", "triton"])
def test_jobs_after_the_first_launch_skip_tritons_launcher(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first job of a direction bound the kernel (loaded from the kernel cache),
    every later one is issued in one native call (ordering, upload, ``cuLaunchKernel``; on this
    device's driver, Triton and compiler it must build and bind), or, without it, launched with
    ``cuLaunchKernel`` over the pre-bound parameter block; all three paths move the same bytes
    as Triton's own launcher (compiled in this process where binding is refused)."""
    pages = [16 * KiB, 4 * KiB, 1000]
    kv = kv_set(320, pages, "cuda")
    layout = slot_layout(pages, 4)
    with cuda_engine("triton", kv, 80) as (engine, kv, region):
        rng = np.random.default_rng(11)
        engine.submit(0, "store", *scattered_job(rng, 2, 320, 80, 4))
        engine.submit(1, "load", *scattered_job(rng, 2, 320, 80, 4))
        engine.wait_all()
        kernel = engine.kernel
        keys = {(False, True, False), (True, True, False)}  # (load, copy, staged)
        assert all(kernel._bound[key] is not None for key in keys)
        assert set(kernel._native) == (keys if library() is not None else set())
        if path != "native":
            kernel._native = {}
        if path == "triton":
            kernel._bound = dict.fromkeys(keys)
            monkeypatch.setattr("offload.transfer.kernel.bind", lambda *args: None)
        for size in (1, 7, 300):  # 300 grows the device index buffer: a new pointer
            round_trip(engine, kv, region, layout, scattered_job(rng, size, 320, 80, 4))
        expected = {"native": 0, "bound": 2, "triton": 0}
        expected[path] += 6
        assert kernel.launches == expected


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton),
                                     pytest.param("hybrid", marks=[needs_triton, needs_batch])])
def test_the_job_check_packs_kernel_jobs_straight_into_staging(backend: str) -> None:
    """With the native job check, a kernel job is written packed into the staging slot its
    launch uploads, so the launch copies nothing; a column the C does not read (a CPU tensor)
    takes the numpy path and is copied in.  Both move the same bytes, also across a growth of
    the staging buffers (300 entries)."""
    pages = [16 * KiB, 1000]
    kv = kv_set(400, pages, "cuda")
    layout = slot_layout(pages, 4)
    with cuda_engine(backend, kv, 100) as (engine, kv, region):
        rng = np.random.default_rng(5)
        for size in (1, 9, 300):
            job = scattered_job(rng, size, 400, 100, 4)
            checked = engine._check(*job, "store", engine._pack_target)
            assert (checked.staged_in is not None) == (checker_library() is not None)
            if checked.staged_in is not None:
                assert checked.staged_in is engine.kernel._next
            round_trip(engine, kv, region, layout, job)
            tensors = (torch.from_numpy(job[0]), *job[1:])
            assert engine._check(*tensors, "store", engine._pack_target).staged_in is None
            round_trip(engine, kv, region, layout, tensors)
        # a non-writer rank's check reserves and grows nothing
        kernel, capacity = engine.kernel, engine.kernel._capacity
        kernel._next = None
        engine.check(3, *scattered_job(rng, 2 * capacity, 400, 100, 4))
        assert kernel._next is None and kernel._capacity == capacity


@needs_triton
def test_a_slot_reserved_by_the_check_is_never_one_a_job_in_flight_holds() -> None:
    """Jobs queued behind a sleeping compute stream hold their slots; each next check must
    reserve a free one (or a new one), and every job must still move its own indices."""
    pages = [4 * KiB]
    kv = kv_set(256, pages, "cuda")
    layout = slot_layout(pages, 4)
    with cuda_engine("triton", kv, 64) as (engine, kv, region):
        rng = np.random.default_rng(9)
        jobs = [scattered_job(rng, 4, 256, 64, 4) for _ in range(10)]
        engine.submit(-1, "store", *jobs[0])
        engine.wait_all()
        expected = region.clone()
        for job_id, job in enumerate(jobs):
            expected = expected_region(expected, kv, layout, job, job_id)
        torch.cuda._sleep(SLEEP_CYCLES)
        held = []
        for job_id, job in enumerate(jobs):
            engine.submit(job_id, "store", *job)
            held.append(engine._pending[-1][2])
            engine.kernel.staging(4)
            assert engine.kernel._next not in held
        assert engine.wait_all() == list(range(len(jobs)))
        assert torch.equal(region, expected)


@needs_triton
@needs_native
def test_native_issue_orders_after_the_callers_stream() -> None:
    """Jobs issued natively wait for the caller's current stream, whether it is the legacy
    default stream (raw handle 0) or a side stream made current."""
    with cuda_engine("triton", kv_set(8, [16 * KiB], "cuda"), 2) as (engine, kv, region):
        engine.submit(-2, "store", [0], [1], [0])  # both directions compiled: later jobs are
        engine.submit(-1, "load", [7], [1], [0])   # issued natively
        engine.wait_all()
        start = slot_layout([16 * KiB], 4).slot_offset
        for job_id, stream in enumerate((None, torch.cuda.Stream())):
            value = 0x30 + job_id
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                _slow_write(kv[0], 2, value)
                engine.submit(job_id, "store", [2], [0], [job_id])
            engine.wait_all()
            page = region[start + job_id * 16 * KiB:start + (job_id + 1) * 16 * KiB]
            assert (page == value).all()
        assert engine.kernel.launches["native"] == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_engine_on_another_gpu_than_the_current_one(backend: str) -> None:
    """KV tensors on GPU 1 while GPU 0 is current: every job (the first, compiled, and the later
    native or bound ones) is issued on GPU 1 and moves the right bytes; GPU 0 stays current."""
    pages = [16 * KiB, 4 * KiB]
    kv = kv_set(64, pages, "cuda:1")
    layout = slot_layout(pages, 4)
    torch.cuda.set_device(0)
    with cuda_engine(backend, kv, 16) as (engine, kv, region):
        rng = np.random.default_rng(5)
        for size in (3, 1, 9):
            round_trip(engine, kv, region, layout, scattered_job(rng, size, 64, 16, 4))
            assert torch.cuda.current_device() == 0


@pytest.mark.parametrize(("pinned", "expected"), [
    pytest.param(True, "hybrid", marks=[needs_triton, needs_batch]), (False, "per_block")])
def test_auto_picks_by_pinning(pinned: bool, expected: str) -> None:
    layout = slot_layout([4096], 4)
    region = torch.zeros(layout.region_bytes(2), dtype=torch.uint8)
    engine = make_engine(kv_set(8, [4096], "cuda"), region, None, layout, 2, pinned)
    assert engine.name == expected


def _slow_write(kv: torch.Tensor, block: int, value: int,
                stream: torch.cuda.Stream | None = None) -> None:
    """Queue on ``stream`` (default: current) a long sleep, then a write over ``block``.  The
    block is first filled with the complement: a process's first launch of a kernel loads its
    module (CUDA's lazy loading), which waits for the device — behind the sleep, so the write
    would be done before the copy under test was even submitted."""
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        kv.view(torch.uint8)[block].fill_(value ^ 0xFF)
        torch.cuda._sleep(SLEEP_CYCLES)
        kv.view(torch.uint8)[block].fill_(value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_does_not_overtake_pending_compute_writes(backend: str) -> None:
    with cuda_engine(backend, kv_set(8, [16 * KiB], "cuda"), 2) as (engine, kv, region):
        engine.submit(0, "store", [5], [1], [2])
        engine.submit(-1, "load", [6], [0], [0])  # compiles the load kernel before the sleep:
        engine.wait_all()  # a compile inside the timed submit outlasted the sleep on the H200
        stored = kv[0].view(torch.uint8)[5].clone()
        _slow_write(kv[0], 3, 0x11)
        done = engine.submit(1, "load", [3], [1], [2])
        seen = engine.poll()
        if backend != "per_block":  # pageable copies may block in submit; pinned ones never do
            assert seen == [] and not done.query()  # compute still asleep; poll must not wait
        assert seen + engine.wait_all() == [1] and done.query()
        assert torch.equal(kv[0].view(torch.uint8)[3], stored)


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_sees_pending_compute_writes(backend: str) -> None:
    with cuda_engine(backend, kv_set(8, [16 * KiB], "cuda"), 2) as (engine, kv, region):
        _slow_write(kv[0], 6, 0x5A)
        engine.submit(0, "store", [6], [0], [3])
        assert engine.wait_all() == [0]
        start = slot_layout([16 * KiB], 4).slot_offset + 3 * 16 * KiB
        assert (region[start:start + 16 * KiB] == 0x5A).all()


@needs_triton
def test_after_orders_on_a_given_stream_or_event_and_the_event_orders_compute() -> None:
    """``after=`` a side stream or event: the store waits for that stream's pending write, not
    for the (idle) current stream; a compute stream that waits on a load's returned event reads
    the loaded bytes."""
    with cuda_engine("triton", kv_set(8, [16 * KiB], "cuda"), 2) as (engine, kv, region):
        start = slot_layout([16 * KiB], 4).slot_offset
        for value, as_event in ((0x21, False), (0x42, True)):
            side = torch.cuda.Stream()
            _slow_write(kv[0], 1, value, side)
            after = side.record_event() if as_event else side
            engine.submit(0, "store", [1], [0], [0], after=after)
            engine.wait_all()
            assert (region[start:start + 16 * KiB] == value).all()
        kv[0].zero_()
        compute = torch.cuda.Stream()
        done = engine.submit(1, "load", [4], [0], [0])
        compute.wait_event(done)
        with torch.cuda.stream(compute):
            seen = kv[0].view(torch.uint8)[4].clone()
        compute.synchronize()
        assert (seen == 0x42).all()
        with pytest.raises(OffloadError, match="after=3 is neither a torch.cuda.Event"):
            engine.submit(2, "load", [4], [0], [0], after=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_jobs_complete_in_submission_order(backend: str) -> None:
    with cuda_engine(backend, kv_set(16, [64 * KiB], "cuda"), 4) as (engine, kv, region):
        torch.cuda._sleep(SLEEP_CYCLES)
        for job_id in range(5):
            engine.submit(job_id, "store" if job_id % 2 else "load", [job_id], [job_id % 4],
                          [job_id % 4])
        seen = engine.poll()
        seen += engine.wait_all()
        assert seen == list(range(5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_destination_written_twice_is_refused(backend: str) -> None:
    with cuda_engine(backend, kv_set(16, [4 * KiB], "cuda"), 4) as (engine, kv, region):
        with pytest.raises(OffloadError, match="entries 0 and 2 of the job both write chunk 1"):
            engine.submit(0, "store", [1, 2, 3], [1, 2, 1], [0, 0, 0])
        with pytest.raises(OffloadError, match="entries 0 and 1 of the job both write GPU "
                           "block 7"):
            engine.submit(1, "load", [7, 7], [1, 2], [0, 0])
        assert engine.wait_all() == []


def _whole_chunks(rng: np.random.Generator, chunks: list[int], num_blocks: int, bpc: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Whole chunks in position order from blocks scattered over the KV tensors (what an
    engine stores and loads)."""
    blocks = rng.permutation(num_blocks)[:len(chunks) * bpc]
    return blocks, np.repeat(chunks, bpc), np.tile(np.arange(bpc), len(chunks))


@needs_triton
@needs_batch
@pytest.mark.parametrize("staging", [128 * MiB, 0])
def test_hybrid_stages_whole_chunks_and_keeps_order(staging: int) -> None:
    """Whole chunks from scattered blocks take the staged path, scattered pages the kernel --
    counted, so a router that never stages fails; with staging off everything runs on the
    kernel.  Jobs of both paths queued behind each other stay in order and byte-exact."""
    kv = kv_set(64, [64 * KiB, 16 * KiB], "cuda")
    with cuda_engine("hybrid", kv, 6, bpc=16, staging_bytes=staging) as (engine, kv, region):
        assert (engine.staged is not None) == bool(staging)
        original = [t.view(torch.uint8).clone() for t in kv]
        rng = np.random.default_rng(5)
        whole = _whole_chunks(rng, [2, 4], 64, 16)
        scattered = ([40, 7, 63], [0, 3, 1], [5, 9, 2])
        expected = expected_region(expected_region(region, kv, engine.layout, whole, 0), kv,
                                   engine.layout, scattered, 1)
        engine.submit(0, "store", *whole)
        engine.submit(1, "store", *scattered)
        assert engine.wait_all() == [0, 1]
        assert torch.equal(region, expected)
        staged = 1 if staging else 0
        assert engine.routes == {"kernel": 2 - staged, "staged": staged, "copy_engine": 0}
        for t in kv:
            t.zero_()
        engine.submit(2, "load", *scattered)
        engine.submit(3, "load", *whole)
        assert engine.wait_all() == [2, 3]
        assert engine.routes["staged"] == 2 * staged
        for t, before in zip(kv, original, strict=True):
            for block in [*whole[0].tolist(), 40, 7, 63]:
                assert torch.equal(t.view(torch.uint8)[block], before[block])


@needs_triton
@needs_batch
@pytest.mark.parametrize(("pages", "staging"), [
    ((16 * KiB,) * 6, 2 * 6 * 16 * KiB * 4 + 4 * KiB),  # two chunks of rows: the ring wraps
    ((16 * KiB, 4 * KiB, 61, 64 * KiB), 2 * 64 * KiB * 4 + 2 * KiB),  # tensor groups, padding
    ((32 * KiB,) * 8, 128 * MiB),  # many chunks per slice
])
@pytest.mark.parametrize("checked", [True, False])
def test_staged_jobs_larger_than_the_ring_are_exact(pages: tuple[int, ...], staging: int,
                                                    checked: bool) -> None:
    """A job of 9 chunks through a ring of a few rows (slice after slice reusing each slot,
    gathers and DMAs overlapping), cut into tensor groups where one chunk's slot does not fit
    half the ring, with and without checksums; stored bytes equal the page-by-page reference
    (padding untouched), loaded blocks equal the originals; the GPU memory stays within
    the budget."""
    kv = engine_kv_set(160, pages, "cuda")
    bpc = 4
    with cuda_engine("hybrid", kv, 12, bpc=bpc, integrity=checked,
                     staging_bytes=staging) as (engine, kv, region):
        staged = engine.staged
        assert staged is not None and staged.staging.numel() <= staging
        chunks = [11, 0, 5, 3, 7, 1, 9, 2, 6]
        job = _whole_chunks(np.random.default_rng(len(pages)), chunks, 160, bpc)
        round_trip(engine, kv, region, engine.layout, job)
        assert engine.routes["staged"] == 2
        if checked:
            assert engine.mismatches == 0


@needs_triton
@needs_batch
@needs_native
def test_staged_jobs_after_the_first_are_issued_in_one_native_call() -> None:
    """Each direction's first staged job compiles and binds its pass from Python; later ones
    go through ``offload_issue_staged`` and move the same bytes."""
    kv = kv_set(96, [16 * KiB] * 6, "cuda")
    with cuda_engine("hybrid", kv, 10, bpc=8, staging_bytes=3 * 6 * 16 * KiB * 8
                     ) as (engine, kv, region):
        rng = np.random.default_rng(9)
        for chunks in ([3, 1, 7, 0, 9], [2], [4, 8, 6, 5]):
            round_trip(engine, kv, region, engine.layout, _whole_chunks(rng, chunks, 96, 8))
        assert engine.staged.issued == {"python": 2, "native": 4}


@needs_triton
@needs_batch
def test_staged_load_follows_a_staged_store_of_the_same_rows() -> None:
    """Store then load of the same chunks submitted back to back behind a sleeping compute
    stream, without waiting: the load's DMA must wait for the store's (it reads the rows the
    store writes), and the store must see the compute stream's pending write."""
    kv = kv_set(64, [16 * KiB] * 4, "cuda")
    with cuda_engine("hybrid", kv, 8, bpc=8, staging_bytes=2 * 4 * 16 * KiB * 8 + 4 * KiB
                     ) as (engine, kv, region):
        blocks = np.random.default_rng(1).permutation(64)
        store = (blocks[:24], np.repeat([6, 2, 4], 8), np.tile(np.arange(8), 3))
        load = (blocks[24:48], store[1], store[2])  # into other blocks
        engine.submit(-1, "store", *store)  # compiles the staged passes before the sleep
        engine.submit(-2, "load", *load)
        engine.wait_all()
        _slow_write(kv[2], int(store[0][13]), 0x3C)
        engine.submit(0, "store", *store)
        engine.submit(1, "load", *load)
        assert engine.poll() == []
        assert engine.wait_all() == [0, 1] and engine.job_error(1) is None
        for t in kv:
            for src, dst in zip(store[0].tolist(), load[0].tolist(), strict=True):
                assert torch.equal(t.view(torch.uint8)[dst], t.view(torch.uint8)[src])
        assert (kv[2].view(torch.uint8)[int(load[0][13])] == 0x3C).all()


@needs_triton
@needs_batch
@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_staged_job_that_fails_part_way_leaves_nothing_running(direction: str) -> None:
    """The second slice's DMA call fails (Python issue path): the error reaches the caller,
    the work already issued is fenced, the job's index slot is free again, the next load
    waits for the engine stream, and the engine goes on byte-exact."""
    kv = kv_set(96, [16 * KiB] * 4, "cuda")
    with cuda_engine("hybrid", kv, 10, bpc=8, staging_bytes=3 * 4 * 16 * KiB * 8
                     ) as (engine, kv, region):
        staged = engine.staged
        job = _whole_chunks(np.random.default_rng(2), [1, 5, 7, 2], 96, 8)
        engine.submit(0, "store", *job)
        engine.wait_all()
        real, calls = staged._batch.launch_part, []

        def failing(*args: object) -> None:
            calls.append(args)
            if len(calls) == 2:
                raise RuntimeError("cuMemcpyBatchAsync_v2 failed: CUDA error 1 (injected)")
            real(*args)

        staged._batch.launch_part = failing
        staged._native = {}  # the Python path, whose calls the stand-in sees
        staged._kernel._bound.pop((direction == "load", True, True), None)
        free = len(engine.kernel._free)
        with pytest.raises(RuntimeError, match="injected"):
            engine.submit(1, direction, *job)
        assert len(engine.kernel._free) == free  # the job's slot came back after the fence
        assert staged._engine_wrote and engine.wait_all() == []
        staged._batch.launch_part = real
        round_trip(engine, kv, region, engine.layout, job)


@needs_triton
@needs_batch
def test_a_staged_load_follows_a_kernel_store_of_the_same_rows() -> None:
    """A kernel store (positions shuffled) delayed behind a sleeping compute stream, then at
    once a staged load of the same chunk: the load's DMAs must wait for the engine stream's
    store, or they read the rows (and sums) from before it."""
    kv = kv_set(64, [16 * KiB] * 4, "cuda")
    with cuda_engine("hybrid", kv, 4, bpc=8) as (engine, kv, region):
        order = np.random.default_rng(4).permutation(8)
        engine.submit(-1, "store", np.arange(8), np.full(8, 1), np.arange(8))  # compiles
        engine.submit(-2, "load", np.arange(8, 16), np.full(8, 1), np.arange(8))
        engine.wait_all()
        _slow_write(kv[1], 20, 0x77)
        engine.submit(0, "store", np.arange(20, 28), np.full(8, 1), order)
        engine.submit(1, "load", np.arange(40, 48), np.full(8, 1), np.arange(8))
        assert engine.wait_all() == [0, 1] and engine.job_error(1) is None
        assert engine.routes["kernel"] == 1 and engine.routes["staged"] == 3
        for t in kv:  # block 40 + p holds position p, stored from block 20 + order^-1(p)
            pages = t.view(torch.uint8)
            assert torch.equal(pages[40 + order], pages[20:28])
        assert (kv[1].view(torch.uint8)[40 + order[0]] == 0x77).all()


@needs_triton
@needs_batch
def test_hybrid_sends_jobs_of_long_pages_to_copy_engines() -> None:
    """Pages of at least the threshold: every job (scattered too) goes to the copy engines."""
    kv = kv_set(16, [1 * MiB], "cuda")
    with cuda_engine("hybrid", kv, 5) as (engine, kv, region):
        assert engine.page_runs and engine.staged is None
        job = scattered_job(np.random.default_rng(3), 12, 16, 5, 4)
        round_trip(engine, kv, region, slot_layout([1 * MiB], 4), job)
        assert engine.routes == {"kernel": 0, "staged": 0, "copy_engine": 2}


@needs_triton
@needs_batch
def test_hybrid_stages_strided_tensors() -> None:
    """K/V views hold a block every two pages: the staged pass gathers any block stride."""
    kv = engine_kv_set(64, [64 * KiB], "cuda")
    with cuda_engine("hybrid", kv, 4, bpc=16) as (engine, kv, region):
        round_trip(engine, kv, region, slot_layout(page_sizes(kv), 16),
                   (np.arange(16)[::-1].copy(), np.full(16, 1), np.arange(16)))
        assert engine.routes == {"kernel": 0, "staged": 2, "copy_engine": 0}


# ------------------------------------------------------------------ integrity
INTEGRITY_PATHS = [
    pytest.param("hybrid", "kernel", marks=[needs_triton, needs_batch]),
    pytest.param("hybrid", "staged", marks=[needs_triton, needs_batch]),
    pytest.param("triton", "kernel", marks=needs_triton),
    pytest.param("copy_engine", "copy_engine", marks=[needs_triton, needs_batch]),
]


@pytest.mark.parametrize(("backend", "route"), INTEGRITY_PATHS)
def test_a_flipped_byte_fails_the_load_on_every_path(backend: str, route: str) -> None:
    """Store a whole chunk (its trailer must hold the CPU definition's sums), load it back
    cleanly, flip one byte of one page in host memory, load it three times (the kernel's
    launch paths: Triton's, then bound or native): each load finishes, names the damaged
    unit and is counted; a clean load after that still passes."""
    kv = kv_set(64, [64 * KiB, 32 * KiB], "cuda")
    with cuda_engine(backend, kv, 4, bpc=16) as (engine, kv, region):
        assert engine.integrity
        layout = engine.layout
        store = (np.arange(16, 32), np.full(16, 2), np.arange(16))
        # whole chunk in order: the staged or copy engines' route; shuffled: the kernel's
        rng = np.random.default_rng(0)
        order = np.arange(16) if route != "kernel" else rng.permutation(16)
        load = (np.arange(40, 56), np.full(16, 2), order)
        expected = expected_region(region, kv, layout, store, 1)
        engine.submit(1, "store", *store)
        assert engine.wait_all() == [1] and engine.job_error(1) is None
        assert torch.equal(region, expected)
        engine.submit(2, "load", *load)
        assert engine.wait_all() == [2] and engine.job_error(2) is None
        for t in kv:  # block 40 + i holds position order[i], stored from block 16 + order[i]
            pages = t.view(torch.uint8)
            assert torch.equal(pages[40:56], pages[16:32][torch.from_numpy(order).cuda()])
        start = (2 * layout.row_stride + layout.slot_offset + layout.tensor_offsets[1]
                 + 5 * 32 * KiB)
        region[start + 20_000] ^= 0x04
        for job_id in (3, 4, 5):
            for t in kv:
                t.view(torch.uint8)[40:56] = 0x11  # what a reader would see if nothing landed
            engine.submit(job_id, "load", *load)
            assert engine.wait_all() == [job_id]
            assert engine.job_error(job_id) == (
                "integrity: tensor 1 chunk 2 position 5 (bytes from 16384) does not match "
                "what was stored")
            # the damaged piece's loaded copy is poison; every other byte was loaded
            at = int(np.flatnonzero(order == 5)[0]) + 40
            damaged = kv[1].view(torch.uint8)[at]
            assert bool((damaged[16 * KiB:32 * KiB] == 0xFF).all())
            assert torch.equal(damaged[:16 * KiB], kv[1].view(torch.uint8)[16 + 5][:16 * KiB])
            assert torch.equal(kv[0].view(torch.uint8)[40:56],
                               kv[0].view(torch.uint8)[16:32][torch.from_numpy(order).cuda()])
        assert engine.mismatches == 3
        region[start + 20_000] ^= 0x04
        engine.submit(6, "load", *load)
        assert engine.wait_all() == [6] and engine.job_error(6) is None
        if backend == "hybrid":
            assert engine.routes[route] > 0


@pytest.mark.parametrize("error", ERROR_CLASSES)
@pytest.mark.parametrize(("backend", "route"), INTEGRITY_PATHS)
def test_every_damaged_page_is_caught_on_every_path(backend: str, route: str, error: str
                                                    ) -> None:
    """The GPU form of the host test of the same name: every page of tensor 1 damaged with one
    error of the class (two top-bit flips, a swap of neighbours that differ only in bit 63,
    1-4 random bits) comes back poisoned; tensor 0 comes back byte-exact."""
    rng = np.random.default_rng(len(error))
    kv = kv_set(128, [16 * KiB, 16 * KiB], "cuda")
    with cuda_engine(backend, kv, 4, bpc=16) as (engine, kv, region):
        layout = engine.layout
        words = kv[1].view(torch.uint8).view(torch.int64)  # plant the swap's neighbours
        for block in range(64):
            i = int(rng.integers(0, 16 * KiB // 8 - 1))
            words[block, i + 1] = words[block, i] ^ torch.tensor(-(1 << 63), device="cuda")
        chunks, positions = np.repeat(np.arange(4), 16), np.tile(np.arange(16), 4)
        if route == "kernel":  # shuffled pages: the kernel's route; whole chunks: the others'
            order = rng.permutation(64)
            chunks, positions = chunks[order], positions[order]
        engine.submit(1, "store", np.arange(64), chunks, positions)
        assert engine.wait_all() == [1] and engine.job_error(1) is None
        for c, p in zip(chunks, positions, strict=True):
            start = (int(c) * layout.row_stride + layout.slot_offset + layout.tensor_offsets[1]
                     + int(p) * 16 * KiB)
            ERROR_CLASSES[error](region[start:start + 16 * KiB].numpy().view(np.uint64), rng)
        engine.submit(2, "load", np.arange(64, 128), chunks, positions)
        assert engine.wait_all() == [2] and engine.job_error(2) is not None
        assert torch.equal(kv[0].view(torch.uint8)[64:], kv[0].view(torch.uint8)[:64])
        assert bool((kv[1].view(torch.uint8)[64:] == 0xFF).all()), "a damaged page loaded"
        if backend == "hybrid":
            assert engine.routes[route] > 0


@pytest.mark.parametrize(("backend", "route"), INTEGRITY_PATHS)
def test_a_page_left_by_an_earlier_store_fails_the_load_on_every_path(backend: str,
                                                                       route: str) -> None:
    """A store whose copy went missing leaves the earlier store's page and sum, which agree:
    renewing position 5 as that store would (and not copying) makes the load fail there, on
    every path and layer-wise too -- each job carries its pages' generations to the GPU -- and
    giving the page its old generation back makes it load again."""
    kv = kv_set(64, [64 * KiB, 32 * KiB], "cuda")
    with cuda_engine(backend, kv, 4, bpc=16) as (engine, kv, region):
        store = (np.arange(16, 32), np.full(16, 2), np.arange(16))
        rng = np.random.default_rng(0)
        order = np.arange(16) if route != "kernel" else rng.permutation(16)
        load = (np.arange(40, 56), np.full(16, 2), order)
        engine.submit(1, "store", *store)
        assert engine.wait_all() == [1] and engine.job_error(1) is None
        page = 2 * engine.layout.blocks_per_chunk + 5
        assert int(engine.generations[page]) == integrity.store_generation(1)
        engine.renew([page], integrity.store_generation(7))  # store 7's copy never ran
        for job_id, layered in ((2, False), (3, True)):
            if layered:
                engine.load_layers(job_id, *load, groups=2)
            else:
                engine.submit(job_id, "load", *load)
            assert engine.wait_all() == [job_id]
            error = engine.job_error(job_id)  # either tensor's page at position 5
            assert error is not None and " chunk 2 position 5" in error, error
        engine.renew([page], integrity.store_generation(1))
        engine.submit(4, "load", *load)
        assert engine.wait_all() == [4] and engine.job_error(4) is None
        for t in kv:
            pages = t.view(torch.uint8)
            assert torch.equal(pages[40:56], pages[16:32][torch.from_numpy(order).cuda()])


@pytest.mark.parametrize(("backend", "route"), INTEGRITY_PATHS)
def test_a_queued_job_keeps_the_generations_it_was_issued_under(backend: str,
                                                                route: str) -> None:
    """A load and a store held behind a busy stream check and write under their pages'
    generations as they were at ``submit``: renewing those pages meanwhile (a later store's
    renewal) neither fails the queued load nor changes what the queued store writes."""
    kv = kv_set(64, [64 * KiB, 32 * KiB], "cuda")
    with cuda_engine(backend, kv, 4, bpc=16) as (engine, kv, region):
        rng = np.random.default_rng(1)
        order = np.arange(16) if route != "kernel" else rng.permutation(16)
        engine.submit(1, "store", np.arange(16, 32), np.full(16, 2), np.arange(16))
        assert engine.wait_all() == [1] and engine.job_error(1) is None
        # a load first, so no job below waits for the JIT while its stream runs ahead
        engine.submit(9, "load", np.arange(40, 56), np.full(16, 2), order)
        assert engine.wait_all() == [9] and engine.job_error(9) is None
        pages = 2 * engine.layout.blocks_per_chunk + np.arange(16)
        busy = torch.cuda.Stream()
        for job_id, direction in ((2, "load"), (3, "store")):
            with torch.cuda.stream(busy):
                torch.cuda._sleep(100_000_000)  # tens of ms: the job waits behind it
            if direction == "load":
                engine.submit(job_id, "load", np.arange(40, 56), np.full(16, 2), order,
                              after=busy)
                engine.renew(pages, integrity.store_generation(7))
            else:
                engine.submit(job_id, "store", np.arange(16, 32), np.full(16, 2),
                              np.arange(16), after=busy)
                engine.renew(pages, integrity.store_generation(8))
            assert not busy.query()  # the job had not started when its pages were renewed
            assert engine.wait_all() == [job_id] and engine.job_error(job_id) is None
        engine.renew(pages, integrity.store_generation(3))  # what store 3 wrote under
        engine.submit(4, "load", np.arange(40, 56), np.full(16, 2), order)
        assert engine.wait_all() == [4] and engine.job_error(4) is None
        for t in kv:
            blocks = t.view(torch.uint8)
            assert torch.equal(blocks[40:56], blocks[16:32][torch.from_numpy(order).cuda()])
        if backend == "hybrid":
            assert engine.routes[route] > 0


@pytest.mark.parametrize(("backend", "route"), INTEGRITY_PATHS)
def test_generations_past_32_bits_reach_the_gpu_whole(backend: str, route: str) -> None:
    """Store generations whose low word has its top bit set and whose high word is not zero
    (a promotion's range): the trailer holds the CPU definition's sums under exactly that
    generation, and the load checks against it (a join that lost either word would fail)."""
    kv = kv_set(64, [64 * KiB, 32 * KiB], "cuda")
    with cuda_engine(backend, kv, 4, bpc=16) as (engine, kv, region):
        rng = np.random.default_rng(2)
        order = np.arange(16) if route != "kernel" else rng.permutation(16)
        for job_id in (integrity.PROMOTED | 0x80000000, integrity.PROMOTED | 0xFFFFFFFE):
            store = (np.arange(16, 32), np.full(16, 2), np.arange(16))
            expected = expected_region(region, kv, engine.layout, store, job_id)
            engine.submit(job_id, "store", *store)
            assert engine.wait_all() == [job_id] and engine.job_error(job_id) is None
            assert torch.equal(region, expected)
            for t in kv:
                t.view(torch.uint8)[40:56] = 0x11
            engine.submit(job_id + 1, "load", np.arange(40, 56), np.full(16, 2), order)
            assert engine.wait_all() == [job_id + 1] and engine.job_error(job_id + 1) is None
            for t in kv:
                blocks = t.view(torch.uint8)
                assert torch.equal(blocks[40:56], blocks[16:32][torch.from_numpy(order).cuda()])


@needs_triton
def test_a_page_of_another_chunk_fails_the_kernels_load() -> None:
    """Chunk 1's page and its sum copied over chunk 2's: valid bytes, the wrong identity."""
    kv = kv_set(32, [16 * KiB], "cuda")
    with cuda_engine("triton", kv, 4) as (engine, kv, region):
        layout = engine.layout
        engine.submit(1, "store", list(range(8)), [1] * 4 + [2] * 4, [0, 1, 2, 3] * 2)
        engine.wait_all()
        row, page = layout.row_stride, layout.slot_offset
        region[2 * row + page:2 * row + page + 16 * KiB] = region[row + page:row + page + 16 * KiB]
        at = int(layout.trailer_offsets()[0])
        region[2 * row + at:2 * row + at + 8] = region[row + at:row + at + 8]
        engine.submit(2, "load", [20, 21], [2, 2], [0, 1])
        engine.wait_all()
        assert engine.job_error(2) == ("integrity: tensor 0 chunk 2 position 0 does not match "
                                       "what was stored")


def test_per_block_runs_without_checksums_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    kv = kv_set(16, [16 * KiB], "cuda")
    with caplog.at_level("WARNING"), cuda_engine("per_block", kv, 4) as (engine, kv, region):
        assert engine.layout.integrity and not engine.integrity
    assert "does not checksum pages" in caplog.text


# ------------------------------------------------------------------ layer-wise loads
def _flip_in_tensor_4_names_it(engine: Any, region: torch.Tensor, job: Any, page: int,
                               job_id: int) -> None:
    """A flipped byte in tensor 4's page of the job's first entry (pages of ``page`` bytes):
    a layer-wise load in 3 groups fails, naming the tensor among all tensors; the byte is
    put back."""
    layout = engine.layout
    chunk, position = int(job[1][0]), int(job[2][0])
    start = (chunk * layout.row_stride + layout.slot_offset + layout.tensor_offsets[4]
             + position * page + 10)
    region[start] ^= 0x01
    engine.load_layers(job_id, *job, groups=3)
    assert engine.wait_all() == [job_id]
    assert engine.job_error(job_id) == (f"integrity: tensor 4 chunk {chunk} position "
                                        f"{position} does not match what was stored")
    region[start] ^= 0x01


def _read_each_group(kv: list[torch.Tensor], events: list[Any], index: torch.Tensor
                     ) -> list[torch.Tensor]:
    """What a forward pass reads: on a compute stream, for each group of two tensors, wait
    for its event and copy the blocks ``index`` of both; returns the copies, in tensor order."""
    compute = torch.cuda.Stream()
    seen = []
    with torch.cuda.stream(compute):
        for group, event in enumerate(events):
            compute.wait_event(event)
            seen += [kv[t].view(torch.uint8)[index].clone() for t in (2 * group, 2 * group + 1)]
    compute.synchronize()
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layer_wise_load_gives_each_group_its_event(backend: str) -> None:
    """Three groups of two tensors: a compute stream that waits for group g's event reads
    group g's loaded blocks; the job is reported once; a flipped byte in group 2 names its
    tensor by its place among all tensors; a whole-job load after it (the native issue,
    whose cells the group launches changed) is still exact."""
    pages = [16 * KiB, 4 * KiB, 64 * KiB, 16 * KiB, 1000, 32 * KiB]
    kv = kv_set(64, pages, "cuda")
    with cuda_engine(backend, kv, 8) as (engine, kv, region):
        layout = engine.layout
        job = scattered_job(np.random.default_rng(21), 20, 64, 8, 4)
        engine.submit(1, "store", *job)
        engine.wait_all()
        original = [t.view(torch.uint8).clone() for t in kv]
        for t in kv:
            t.zero_()
        torch.cuda._sleep(SLEEP_CYCLES // 4)  # the groups queue behind the compute stream
        events = engine.load_layers(2, *job, groups=3)
        assert len(events) == 3 and all(e is not None for e in events)
        if backend == "copy_engine":  # no group launches: the job's completion, thrice
            assert events[0] is events[1] is events[2]
        index = torch.from_numpy(np.asarray(job[0])).cuda()
        seen = _read_each_group(kv, events, index)
        assert engine.wait_all() == [2] and engine.job_error(2) is None
        for t, got in enumerate(seen):
            assert torch.equal(got, original[t][index]), f"tensor {t}"
        if backend == "hybrid":  # scattered pages: the kernel, group by group
            assert engine.routes["kernel"] >= 1 and engine.routes["staged"] == 0
        if engine.integrity:
            _flip_in_tensor_4_names_it(engine, region, job, 1000, 3)
        round_trip(engine, kv, region, layout, job)


@needs_triton
@needs_batch
@needs_native
@pytest.mark.parametrize("staging", [128 * MiB, 2 * 3 * 4 * 64 * KiB + 8 * KiB])
def test_a_staged_layer_wise_load_gives_each_group_its_event_once_it_is_back(staging: int
                                                                            ) -> None:
    """Whole chunks load layer-wise through the staging ring (the copy engines, not the
    kernel), once from Python and once natively.  The DMA stream and the first slice's
    scatter stream are held back by sleeps, so a group's event that did not follow its own
    scatters fires before its pages are back: a compute stream that waits for group g's
    event and reads its blocks would then see zeros.
    The small ring cuts its tensor groups (3 tensors) across the layer groups (2).  A flipped
    byte in group 2 names its tensor."""
    kv = kv_set(64, [64 * KiB] * 6, "cuda")
    with cuda_engine("hybrid", kv, 16, staging_bytes=staging) as (engine, kv, region):
        staged, layout = engine.staged, engine.layout
        assert staged is not None and len(staged.plan.groups) == (1 if staging > 64 * MiB else 2)
        job = _whole_chunks(np.random.default_rng(3), [9, 2, 14, 5, 0], 64, 4)
        engine.submit(1, "store", *job)
        engine.wait_all()
        original = [t.view(torch.uint8).clone() for t in kv]
        index = torch.from_numpy(np.asarray(job[0])).cuda()
        for job_id in (2, 3):  # the load pass is compiled by the first: the Python issue
            for t in kv:
                t.zero_()
            for held in (staged.dma_stream, staged._pass_streams[staged._next_slot]):
                with torch.cuda.stream(held):  # the DMAs, and the first slice's scatter
                    torch.cuda._sleep(SLEEP_CYCLES // 4)
            seen = _read_each_group(kv, engine.load_layers(job_id, *job, groups=3), index)
            assert engine.wait_all() == [job_id] and engine.job_error(job_id) is None
            for t, got in enumerate(seen):
                assert torch.equal(got, original[t][index]), f"job {job_id} tensor {t}"
        assert engine.routes["staged"] == 3 and engine.routes["kernel"] == 0
        assert staged.issued == {"python": 2, "native": 1}
        _flip_in_tensor_4_names_it(engine, region, job, 64 * KiB, 4)
        # a bound on its DMAs joins layer groups, which then share one event
        # 5 chunks x 2 DMAs per cut group: 30 (one ring group) or 40 (two) group by group, 20
        # or 30 two groups at a time, 10 or 20 all at once
        engine.max_layer_copies = 25
        runs = staged.layer_runs(5, tensor_ranges(6, 3), 25)
        assert runs == (2 if staging > 64 * MiB else 3)
        for t in kv:
            t.zero_()
        events = engine.load_layers(5, *job, groups=3)
        assert len({id(e) for e in events}) == -(-3 // runs) and events[0] is events[1]
        engine.wait_all()
        assert engine.routes["staged"] == 5 and engine.routes["kernel"] == 0
        for t, before in zip(kv, original, strict=True):
            assert torch.equal(t.view(torch.uint8)[index], before[index])
        round_trip(engine, kv, region, layout, job)


@needs_triton
def test_a_layer_wise_load_that_fails_part_way_leaves_whole_jobs_whole() -> None:
    """The second group's launch fails: the error reaches the caller, the job's index slot is
    free again after the fence, and the kernel's tensor cells are the whole job's again, so a
    later load issued natively still moves every tensor."""
    kv = kv_set(32, [16 * KiB] * 6, "cuda")
    with cuda_engine("triton", kv, 8) as (engine, kv, region):
        job = scattered_job(np.random.default_rng(31), 10, 32, 8, 4)
        engine.submit(1, "store", *job)
        engine.submit(2, "load", *job)  # compiles and binds both directions
        engine.wait_all()
        real, calls = engine.kernel._run, []

        def failing(*args: Any, **kwargs: Any) -> None:
            calls.append(args)
            if len(calls) == 2:
                raise RuntimeError("cuLaunchKernel failed: CUDA error 701 (injected)")
            real(*args, **kwargs)

        engine.kernel._run = failing
        free = len(engine.kernel._free)
        with pytest.raises(RuntimeError, match="injected"):
            engine.load_layers(3, *job, groups=3)
        engine.kernel._run = real
        assert len(engine.kernel._free) == free and engine.wait_all() == []
        round_trip(engine, kv, region, engine.layout, job)


def _refused_store(engine: Any, job: tuple[np.ndarray, ...]) -> str | None:
    """Store ``job`` as job 9 and return why it failed (the driver's refusal, raised at the
    issue or recorded as the job's error), or None if it passed."""
    try:
        engine.submit(9, "store", *job)
        engine.wait_all()
        return engine.job_error(9)
    except Exception as exc:
        return str(exc)


@contextmanager
def _registered_in_pieces(region: torch.Tensor, row_stride: int, rows: int,
                          cuts: tuple[int, ...]) -> Iterator[None]:
    """``region`` registered as background set-up registers it: every row in pieces, cut at
    the row-relative ``cuts``."""
    from offload.region.pin import CudaRegistrar

    registrar = CudaRegistrar(torch.device("cuda"))
    edges = [0, *cuts, row_stride]
    starts = [region.data_ptr() + r * row_stride + lo for r in range(rows) for lo in edges[:-1]]
    done = []
    try:
        for r in range(rows):
            for lo, hi in zip(edges, edges[1:], strict=False):
                registrar.register(region.data_ptr() + r * row_stride + lo, hi - lo)
                done.append(region.data_ptr() + r * row_stride + lo)
        yield
    finally:
        torch.cuda.synchronize()
        for address in done:
            registrar.unregister(address)
    assert done == starts


@needs_triton
@needs_batch
@pytest.mark.parametrize("backend", ["hybrid", "copy_engine", "triton"])
def test_rows_registered_in_pieces_move_exactly_on_every_path(backend: str) -> None:
    """Rows registered in pieces (a cut inside a tensor's pages, one at a tensor's start, one
    at the trailer): whole chunks (staged), scattered pages (kernel), per-page copies (copy
    engines) and a layer-wise load (staged, group by group) are byte-exact.  The same rows
    with the staged path's DMAs not split at the cuts fail: a batched copy of a staged row
    may not span two registrations (the copy engines' runs of a few pages spanning one
    were seen to pass)."""
    import dataclasses
    import mmap

    from offload.region.geometry import copy_starts

    pages, bpc, chunk_count = [64 * KiB] * 6, 4, 6
    layout = slot_layout(pages, bpc)
    starts = copy_starts(layout.slot_offset, layout.tensor_offsets, layout.page_bytes, bpc,
                         layout.trailer_offset)
    chosen = (layout.slot_offset + layout.tensor_offsets[1] + 2 * pages[1],
              layout.slot_offset + layout.tensor_offsets[3], layout.slot_offset
              + (layout.trailer_offset or 0))
    assert all(c in starts and c % 4096 == 0 for c in chosen) and layout.row_stride % 4096 == 0
    cut = dataclasses.replace(layout, cuts=chosen)
    memory = mmap.mmap(-1, layout.region_bytes(chunk_count))  # page-aligned, as a region
    region = torch.frombuffer(memory, dtype=torch.uint8)
    region.random_(0, 256)
    kv = kv_set(64, pages, "cuda")
    with _registered_in_pieces(region, layout.row_stride, chunk_count, chosen):
        engine = make_engine(kv, region, region.data_ptr(), cut, chunk_count, True, backend)
        try:
            rng = np.random.default_rng(3)
            whole = _whole_chunks(rng, [4, 1, 5], 64, bpc)
            round_trip(engine, kv, region, cut, whole)
            original = [t.view(torch.uint8).clone() for t in kv]  # the whole job's blocks
            for t in kv:
                t.zero_()
            events = engine.load_layers(3, *whole, groups=3)
            index = torch.from_numpy(whole[0]).cuda()
            seen = _read_each_group(kv, events, index)
            assert engine.wait_all() == [3] and engine.job_error(3) is None
            for t, got in enumerate(seen):
                assert torch.equal(got, original[t][index]), f"tensor {t}"
            round_trip(engine, kv, region, cut, scattered_job(rng, 9, 64, chunk_count, bpc))
            if backend == "hybrid":
                assert engine.routes["staged"] >= 3 and engine.routes["kernel"] >= 2
        finally:
            engine.close()
        if backend == "hybrid":  # the kernel reads through the mapping: pieces are moot
            uncut = make_engine(kv, region, region.data_ptr(), layout, chunk_count, True,
                                backend)
            try:
                assert _refused_store(uncut, whole), "a copy spanning two registrations passed"
            finally:
                with contextlib.suppress(Exception):
                    uncut.close()


@needs_batch
@pytest.mark.parametrize(("backend", "page"), [
    ("copy_engine", 16 * KiB), pytest.param("hybrid", 1 * MiB, marks=needs_triton)])
def test_copy_engine_runs_stop_where_neighbouring_allocations_meet(backend: str, page: int
                                                                  ) -> None:
    """KV tensors of 1 MiB from the caching allocator fill its 2 MiB segments two by two, and
    segments are often neighbours in the address space, so a chunk of every tensor continues
    from one segment into the next: the copy engines' runs stop at each allocation
    (`kv_allocations`) and the job round-trips byte-exact; the same engine told of no
    allocations merges the run across them, which the driver refuses -- so the job does cross
    neighbours.  (Tensors smaller than half a segment rarely end where one does: anything
    else of the process in a segment shifts them off its end.)"""
    from offload.system.cuda_driver import allocation_ranges

    bpc = MiB // page  # one chunk is one tensor of 1 MiB, the small pool's largest request
    kv = [torch.empty((bpc, page), dtype=torch.uint8, device="cuda").random_(0, 256)
          for _ in range(64)]
    neighbours = [t for t in range(len(kv) - 1)
                  if kv[t + 1].data_ptr() == kv[t].data_ptr() + bpc * page
                  and allocation_ranges(kv[t].data_ptr(), 1)
                  != allocation_ranges(kv[t + 1].data_ptr(), 1)]
    if not neighbours:
        pytest.skip("no two of the KV tensors were neighbouring allocations")
    job = (np.arange(bpc), np.zeros(bpc, dtype=np.int64), np.arange(bpc))
    with cuda_engine(backend, kv, 2, bpc, integrity=backend == "hybrid") as (engine, _, region):
        assert len(engine.allocations) > 1
        round_trip(engine, kv, region, engine.layout, job)
        engine.allocations = np.zeros(0, dtype=np.int64)
        failed = _refused_store(engine, job)
        assert failed and "invalid argument" in failed, failed
