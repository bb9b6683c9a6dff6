"""The host backend end to end: raw region bytes after stores, KV bytes after loads, job
ordering and every error path of the engine and of make_engine."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import OffloadError
from offload.transfer import SlotLayout, make_engine
from offload.transfer.base import TransferEngine
from offload.transfer.host import SMALL_JOB
from tests.transfer.helpers import (
    HYBRID_PAGES,
    engine_kv_set,
    kv_set,
    page_sizes,
    round_trip,
    scattered_job,
    slot_layout,
)


def host_engine(pages: Sequence[int] = HYBRID_PAGES, bpc: int = 4, num_blocks: int = 32,
                chunk_count: int = 5) -> tuple[TransferEngine, list[torch.Tensor], torch.Tensor,
                                               SlotLayout]:
    layout = slot_layout(pages, bpc)
    kv = kv_set(num_blocks, pages)
    region = torch.randint(0, 256, (layout.region_bytes(chunk_count),), dtype=torch.uint8)
    engine = make_engine(kv, region, region.data_ptr(), layout, chunk_count, pinned=False)
    return engine, kv, region, layout


def test_hybrid_round_trip_writes_exact_bytes() -> None:
    engine, kv, region, layout = host_engine()
    assert engine.name == "host"
    round_trip(engine, kv, region, layout, scattered_job(np.random.default_rng(0), 20, 32, 5, 4))


def test_engine_layouts_round_trip_exact_bytes() -> None:
    """K/V views of [blocks, 2, ...] tensors and padded per-layer tensors, mixed page sizes."""
    kv = engine_kv_set(24, (512, 61, 1000))
    assert [t.stride(0) * t.element_size() for t in kv[:3]] == [1024, 1024, 576]
    layout = slot_layout(page_sizes(kv), 4)
    region = torch.randint(0, 256, (layout.region_bytes(6),), dtype=torch.uint8)
    engine = make_engine(kv, region, None, layout, 6, pinned=False)
    round_trip(engine, kv, region, layout, scattered_job(np.random.default_rng(1), 20, 24, 6, 4))


def test_submit_returns_no_event_and_refuses_a_destination_twice() -> None:
    engine, kv, region, _ = host_engine()
    assert engine.submit(1, "store", [0], [0], [0], after=None) is None
    before = region.clone()
    with pytest.raises(OffloadError, match="entries 0 and 1 of the job both write chunk 2 "
                       "position 1"):
        engine.submit(2, "store", [3, 4], [2, 2], [1, 1])
    with pytest.raises(OffloadError, match="entries 1 and 2 of the job both write GPU block 4"):
        engine.submit(3, "load", [3, 4, 4], [2, 2, 3], [1, 2, 1])
    assert torch.equal(region, before) and engine.poll() == [1]
    engine.submit(4, "store", [4, 4], [2, 3], [1, 1])  # one block to two places is fine
    with pytest.raises(OffloadError, match="both write chunk 2 position 1"):
        engine.check(5, [3, 4], [2, 2], [1, 1])


@settings(max_examples=60, deadline=None)
@given(pages=st.lists(st.integers(1, 3000), min_size=1, max_size=3), bpc=st.integers(1, 6),
       chunk_count=st.integers(1, 8), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_random_round_trips(pages: list[int], bpc: int, chunk_count: int, seed: int,
                            data: st.DataObject) -> None:
    """Small jobs (copied page by page) and larger ones (one gather/scatter per tensor)."""
    engine, kv, region, layout = host_engine(pages, bpc, 40, chunk_count)
    n = data.draw(st.integers(0, min(40, chunk_count * bpc)))
    round_trip(engine, kv, region, layout,
               scattered_job(np.random.default_rng(seed), n, 40, chunk_count, bpc))


@pytest.mark.parametrize("n", [1, SMALL_JOB, SMALL_JOB + 1, 40])
def test_both_copy_paths_round_trip(n: int) -> None:
    engine, kv, region, layout = host_engine([4096, 1000], 8, 64, 8)
    round_trip(engine, kv, region, layout,
               scattered_job(np.random.default_rng(n), n, 64, 8, 8))


def test_jobs_are_reported_once_in_submission_order() -> None:
    engine, *_ = host_engine()
    assert engine.poll() == [] and engine.wait_all() == []
    for job_id in (7, 3, 9):
        engine.submit(job_id, "store", [job_id], [0], [job_id % 4])
    assert engine.poll() == [7, 3, 9]
    assert engine.poll() == []
    engine.submit(4, "load", torch.tensor([1]), np.array([2]), [3])
    engine.submit(5, "store", [], [], [])
    assert engine.wait_all() == [4, 5]
    assert engine.poll() == [] and engine.wait_all() == []


def test_close_is_idempotent_and_final() -> None:
    engine, *_ = host_engine()
    engine.close()
    engine.close()
    with pytest.raises(OffloadError, match="job 1 submitted to a closed host engine"):
        engine.submit(1, "store", [0], [0], [0])


def test_bad_direction_and_range_errors_leave_region_untouched() -> None:
    engine, _, region, _ = host_engine()
    before = region.clone()
    with pytest.raises(OffloadError, match="direction 'save'; use 'store' or 'load'"):
        engine.submit(1, "save", [0], [0], [0])  # type: ignore[arg-type]
    with pytest.raises(OffloadError, match="chunk id 5 .* the region has 5 chunks"):
        engine.submit(2, "store", [0, 1], [0, 5], [0, 0])
    assert torch.equal(region, before) and engine.poll() == []


def _engine_error(kv: list[torch.Tensor] | None = None, region: torch.Tensor | None = None,
                  address: int | None = None, pinned: bool = False,
                  backend: str = "auto") -> str:
    layout = slot_layout(HYBRID_PAGES, 4)
    kv = kv_set(8, HYBRID_PAGES) if kv is None else kv
    region = torch.zeros(layout.region_bytes(3), dtype=torch.uint8) if region is None else region
    with pytest.raises(OffloadError) as e:
        make_engine(kv, region, address, layout, 3, pinned, backend)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_kv_tensor_errors() -> None:
    good = kv_set(8, HYBRID_PAGES)
    assert "got 2 KV tensors but the plan has 3" in _engine_error(kv=good[:2])
    assert "KV tensor 0 has shape (); dimension 0 must index" in _engine_error(
        kv=[torch.tensor(1.0), *good[1:]])
    assert "KV tensor 1 has 4 blocks on cpu but tensor 0 has 8" in _engine_error(
        kv=[good[0], good[1][:4], good[2]])
    transposed = torch.zeros(250, 8, dtype=torch.bfloat16).t()
    assert ("KV tensor 0 (shape (8, 250), strides (1, 8)) does not hold each block as one "
            "contiguous page") in _engine_error(kv=[transposed, *good[1:]])
    overlapping = torch.zeros(300, dtype=torch.bfloat16).as_strided((8, 256), (2, 1))
    assert "KV tensor 0 (shape (8, 256), strides (2, 1)) has blocks 4 bytes apart but " \
        "512-byte pages, so its blocks overlap" in _engine_error(kv=[overlapping, *good[1:]])
    wrong_page = torch.zeros(8, 30, dtype=torch.float32)
    assert "KV tensor 1 holds 120 bytes per block but the plan says 60" in _engine_error(
        kv=[good[0], wrong_page, good[2]])


def test_region_errors() -> None:
    need = slot_layout(HYBRID_PAGES, 4).region_bytes(3)
    assert "is torch.float32 of shape" in _engine_error(region=torch.zeros(need))
    assert "shape (2, " in _engine_error(region=torch.zeros(2, need, dtype=torch.uint8))
    short = _engine_error(region=torch.zeros(need - 1, dtype=torch.uint8))
    assert f"has {need - 1} bytes but 3 chunks" in short and f"need {need}" in short
    region = torch.zeros(need, dtype=torch.uint8)
    assert "is not where the region tensor starts" in _engine_error(
        region=region, address=region.data_ptr() + 1)


@pytest.mark.parametrize(("backend", "pinned", "message"), [
    ("fast", False, "unknown transfer backend 'fast'; use one of auto, host, hybrid, triton, "
     "copy_engine, per_block"),
    ("triton", False, "needs a region registered with CUDA; pin the region"),
    ("triton", True, "backend 'triton' needs CUDA KV tensors"),
    ("per_block", False, "backend 'per_block' needs CUDA KV tensors"),
])
def test_backend_errors(backend: str, pinned: bool, message: str) -> None:
    assert message in _engine_error(backend=backend, pinned=pinned)


def test_auto_and_host_pick_the_host_backend() -> None:
    layout = slot_layout(HYBRID_PAGES, 4)
    region = torch.zeros(layout.region_bytes(3), dtype=torch.uint8)
    for backend in ("auto", "host"):
        engine = make_engine(kv_set(8, HYBRID_PAGES), region, None, layout, 3, True, backend)
        assert engine.name == "host"


def test_a_layer_wise_load_brings_every_group_back_with_one_event_each() -> None:
    """The host backend finishes inside the call: one None per group, every byte loaded, the
    job reported once; a bad group count is refused before anything moves."""
    engine, kv, region, layout = host_engine(pages=[512, 256, 64, 1024, 128])
    job = scattered_job(np.random.default_rng(8), 9, 32, 5, 4)
    engine.submit(1, "store", *job)
    original = [t.clone() for t in kv]
    for t in kv:
        t.zero_()
    assert engine.load_layers(2, *job, groups=3) == [None, None, None]
    assert engine.wait_all() == [1, 2] and engine.job_error(2) is None
    index = torch.from_numpy(job[0])
    for now, before in zip(kv, original, strict=True):  # bytes: random bits hold NaNs
        assert torch.equal(now.view(torch.uint8)[index], before.view(torch.uint8)[index])
    with pytest.raises(OffloadError, match="layer_groups = 6 for 5 KV tensors"):
        engine.load_layers(3, *job, groups=6)
    assert engine.wait_all() == []
