"""The CUDA backends on a real device: byte-exact round trips at 4 KiB - 1 MiB pages, odd pages
and unaligned regions (narrow elements), stream ordering against the compute stream, and the
unpinned fallback."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
import torch

from offload.transfer import make_engine, triton_available
from offload.transfer.base import TransferEngine
from offload.transfer.batch_copy import batch_copy_available
from offload.transfer.registration import host_registered
from tests.test_transfer_helpers import HYBRID_PAGES, kv_set, round_trip, scattered_job, slot_layout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton")
KiB, MiB = 1 << 10, 1 << 20
SLEEP_CYCLES = 300_000_000  # ~0.2 s of GPU time: long enough for a copy to overtake if it could


@contextmanager
def cuda_engine(backend: str, pages: Sequence[int], num_blocks: int, chunk_count: int,
                bpc: int = 4, skew: int = 0
                ) -> Iterator[tuple[TransferEngine, list[torch.Tensor], torch.Tensor]]:
    """An engine over random CUDA KV tensors and a random host region starting ``skew`` bytes
    into its allocation; registered with CUDA for the pinned backends only."""
    layout = slot_layout(pages, bpc)
    kv = kv_set(num_blocks, pages, device="cuda")
    buffer = torch.randint(0, 256, (layout.region_bytes(chunk_count) + skew,), dtype=torch.uint8)
    region = buffer[skew:]
    pinned = backend in ("hybrid", "triton", "copy_engine")
    with host_registered(buffer) if pinned else nullcontext():
        engine = make_engine(kv, region, region.data_ptr(), layout, chunk_count, pinned, backend)
        try:
            yield engine, kv, region
        finally:
            engine.close()

needs_batch = pytest.mark.skipif(not batch_copy_available(), reason="needs a CUDA 13 driver")
BACKENDS = [pytest.param("hybrid", marks=[needs_triton, needs_batch]),
            pytest.param("triton", marks=needs_triton),
            pytest.param("copy_engine", marks=needs_batch), "per_block"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [4 * KiB, 16 * KiB, 64 * KiB, 1 * MiB])
def test_round_trip_is_byte_exact(backend: str, page: int) -> None:
    num_blocks = max(8, min(256, (64 * MiB) // page))
    chunk_count = num_blocks // 4 + 1
    with cuda_engine(backend, [page], num_blocks, chunk_count) as (engine, kv, region):
        assert engine.name == backend
        job = scattered_job(np.random.default_rng(page), num_blocks - 3, num_blocks,
                            chunk_count, 4)
        round_trip(engine, kv, region, slot_layout([page], 4), job)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("skew", [0, 1, 4, 8])
def test_hybrid_pages_and_unaligned_regions(backend: str, skew: int) -> None:
    """Odd page sizes (60 B) and a region that starts off 16-byte alignment force narrower
    elements in the kernel."""
    with cuda_engine(backend, HYBRID_PAGES, 40, 12, skew=skew) as (engine, kv, region):
        job = scattered_job(np.random.default_rng(skew), 30, 40, 12, 4)
        round_trip(engine, kv, region, slot_layout(HYBRID_PAGES, 4), job)


@pytest.mark.parametrize(("pinned", "expected"), [
    pytest.param(True, "hybrid", marks=[needs_triton, needs_batch]), (False, "per_block")])
def test_auto_picks_by_pinning(pinned: bool, expected: str) -> None:
    layout = slot_layout([4096], 4)
    region = torch.zeros(layout.region_bytes(2), dtype=torch.uint8)
    engine = make_engine(kv_set(8, [4096], "cuda"), region, None, layout, 2, pinned)
    assert engine.name == expected


def _slow_write(kv: torch.Tensor, block: int, value: int) -> None:
    """Queue on the compute stream a long sleep, then a write of ``value`` over ``block``."""
    torch.cuda._sleep(SLEEP_CYCLES)
    kv.view(torch.uint8)[block].fill_(value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_does_not_overtake_pending_compute_writes(backend: str) -> None:
    with cuda_engine(backend, [16 * KiB], 8, 2) as (engine, kv, region):
        engine.submit(0, "store", [5], [1], [2])
        engine.wait_all()
        stored = kv[0].view(torch.uint8)[5].clone()
        _slow_write(kv[0], 3, 0x11)
        engine.submit(1, "load", [3], [1], [2])
        seen = engine.poll()
        if backend != "per_block":  # pageable copies may block in submit; pinned ones never do
            assert seen == []  # the compute stream is still asleep and poll must not wait
        assert seen + engine.wait_all() == [1]
        assert torch.equal(kv[0].view(torch.uint8)[3], stored)


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_sees_pending_compute_writes(backend: str) -> None:
    with cuda_engine(backend, [16 * KiB], 8, 2) as (engine, kv, region):
        _slow_write(kv[0], 6, 0x5A)
        engine.submit(0, "store", [6], [0], [3])
        assert engine.wait_all() == [0]
        start = slot_layout([16 * KiB], 4).slot_offset + 3 * 16 * KiB
        assert (region[start:start + 16 * KiB] == 0x5A).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_jobs_complete_in_submission_order(backend: str) -> None:
    with cuda_engine(backend, [64 * KiB], 16, 4) as (engine, kv, region):
        torch.cuda._sleep(SLEEP_CYCLES)
        for job_id in range(5):
            engine.submit(job_id, "store" if job_id % 2 else "load", [job_id], [job_id % 4],
                          [job_id % 4])
        seen = engine.poll()
        seen += engine.wait_all()
        assert seen == list(range(5))


@needs_triton
@needs_batch
def test_hybrid_routes_long_runs_to_copy_engines_and_keeps_order() -> None:
    from offload.transfer import job_offsets
    from offload.transfer.base import job_runs

    with cuda_engine("hybrid", [64 * KiB], 64, 4, bpc=16) as (engine, kv, region):
        original = kv[0].view(torch.uint8).clone()  # bytes: random bf16 bits hold NaNs
        whole_chunk = (list(range(16)), [2] * 16, list(range(16)))  # one 1 MiB run per chunk
        scattered = ([40, 7, 63], [0, 3, 1], [5, 9, 2])  # three separate 64 KiB pages
        copies = job_offsets(engine.layout, *whole_chunk, num_blocks=64, chunk_count=4)
        sides = list(engine._orient("store", copies))
        assert job_runs(sides, engine._region, engine.layout.row_stride)[2].tolist() == [MiB]
        engine.submit(0, "store", *whole_chunk)
        engine.submit(1, "store", *scattered)
        assert engine.wait_all() == [0, 1]
        kv[0].zero_()
        engine.submit(2, "load", *scattered)
        engine.submit(3, "load", *whole_chunk)
        assert engine.wait_all() == [2, 3]
        for block in [*range(16), 40, 7, 63]:
            assert torch.equal(kv[0].view(torch.uint8)[block], original[block])
