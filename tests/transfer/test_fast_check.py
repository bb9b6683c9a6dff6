"""The native job check (offload/transfer/job_check.c) against the numpy check it stands in for:
on any input it returns the numpy path's job or None (the numpy path then raises or accepts), it
takes every input type it is meant to take, it finds repeats across reused stamps, and engines
use it."""

from __future__ import annotations

import array
import ctypes
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import OffloadError
from offload.transfer import fast_check
from offload.transfer.fast_check import LAST_STAMP, FastCheck, checker_library
from offload.transfer.host import HostEngine
from offload.transfer.layout import SlotLayout, UniqueDestinations, check_job

pytestmark = pytest.mark.skipif(checker_library() is None,
                                reason="needs a C compiler and Python.h")

LAYOUT = SlotLayout(row_stride=10_000, slot_offset=100, blocks_per_chunk=4, page_bytes=(512, 60),
                    tensor_offsets=(0, 2048))
NUM_BLOCKS, CHUNKS = 64, 3
FIELDS = {"store": "host_pages", "load": "blocks"}
DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]


def uniques() -> dict[str, UniqueDestinations]:
    return {"store": UniqueDestinations("host_pages", CHUNKS * LAYOUT.blocks_per_chunk,
                                        LAYOUT.blocks_per_chunk),
            "load": UniqueDestinations("blocks", NUM_BLOCKS, LAYOUT.blocks_per_chunk)}


def checker() -> FastCheck:
    lib = checker_library()
    assert lib is not None
    return FastCheck(lib, LAYOUT, NUM_BLOCKS, CHUNKS, uniques())


def reference(direction: str, columns: tuple[Any, ...]) -> tuple[list[int], list[int]] | None:
    """The numpy path's job, or None where it raises."""
    try:
        job = check_job(LAYOUT, *columns, num_blocks=NUM_BLOCKS, chunk_count=CHUNKS,
                        unique=uniques()[direction])
    except OffloadError:
        return None
    return job.blocks.tolist(), job.host_pages.tolist()


def as_kind(values: list[int], kind: str) -> Any:
    """``values`` as a list, tuple, or numpy array of ``kind`` (strided when it starts with
    "every other"), where the dtype holds them; else as an int64 array."""
    if kind == "list":
        return values
    if kind == "tuple":
        return tuple(values)
    strided = kind.startswith("every other ")
    dtype = np.dtype(kind.removeprefix("every other "))
    info = np.iinfo(dtype)
    if not all(info.min <= v <= info.max for v in values):
        dtype = np.dtype(np.int64)
    if strided:
        return np.repeat(np.array(values, dtype=dtype), 2)[::2]
    return np.array(values, dtype=dtype)


KINDS = ["list", "tuple", *DTYPES, "every other int32", "every other uint64"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(-3, 67), st.integers(-1, 4),
                                   st.integers(-1, 5)), max_size=20), min_size=1, max_size=4),
       st.sampled_from(sorted(FIELDS)),
       st.tuples(*[st.sampled_from(KINDS)] * 3),
       st.sampled_from([None, np.int32, np.int64]))
def test_the_native_check_agrees_with_the_numpy_check(
        jobs: list[list[tuple[int, int, int]]], direction: str, kinds: tuple[str, ...],
        target: type | None) -> None:
    """Job after job on one checker (stamps reused), packed into a new array or a reused
    target of either width: the same job where numpy accepts it, None where numpy raises —
    and never None on an input it reads that numpy accepts."""
    check = checker()
    staging = np.full(64, -1, dtype=target or np.int64)
    for triples in jobs:
        columns = tuple(as_kind([t[i] for t in triples], kinds[i]) for i in range(3))
        expected = reference(direction, columns)
        job = check.check(direction, *columns,
                          None if target is None else lambda n: (staging, "slot"))
        if expected is None:
            assert job is None
        else:
            assert job is not None
            assert (job.blocks.tolist(), job.host_pages.tolist()) == expected
            assert job.packed is not None
            assert job.packed.tolist() == expected[0] + expected[1]


def test_a_repeat_is_found_after_many_jobs_over_the_same_destinations() -> None:
    check = checker()
    for _ in range(3):
        assert check.check("load", [1, 2, 3], [0, 0, 0], [0, 1, 2]) is not None
        assert check.check("load", [1, 2, 1], [0, 0, 0], [0, 1, 2]) is None
        assert check.check("store", [1, 2, 3], [2, 2, 2], [0, 1, 2]) is not None
        assert check.check("store", [1, 2, 3], [2, 1, 2], [0, 1, 0]) is None


def test_stamps_are_cleared_when_they_run_out() -> None:
    check = checker()
    side = check._directions["load"]
    side.stamp = LAST_STAMP - 1
    for _ in range(3):  # the last stamp, then a wrap to 1 over a cleared array
        assert check.check("load", [5, 6], [0, 0], [0, 1]) is not None
    assert side.stamp == 2
    assert side.stamps[5] == 2 and np.count_nonzero(side.stamps) == 2


def test_past_the_stamp_limit_repeats_are_sorted_out_with_numpy_s_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(UniqueDestinations, "SCRATCH_LIMIT", 0)
    check = checker()
    assert check.check("load", [1, 2], [0, 0], [0, 1]) is not None
    with pytest.raises(OffloadError, match="entries 0 and 2 of the job both write GPU block 1"):
        check.check("load", [1, 2, 1], [0, 0, 0], [0, 1, 2])


@pytest.mark.parametrize("columns", [
    (torch.tensor([1, 2]), [0, 0], [0, 1]),  # a CPU tensor: no buffer protocol
    ([np.int64(1), 2], [0, 0], [0, 1]),  # numpy scalars in a list
    ([True, 2], [0, 0], [0, 1]),  # bools: numpy's to read
    (b"\x01\x02", [0, 0], [0, 1]),  # numpy refuses bytes
    (np.array([1, 2], dtype=">i8"), [0, 0], [0, 1]),  # not native byte order
    (np.array([True, False]), [0, 0], [0, 1]),
    (np.array([1.0, 2.0]), [0, 0], [0, 1]),
    (np.array([[1, 2]]), [0, 0], [0, 1]),
    (np.array(1), [0], [0]),  # no length
    (7, [0], [0]),
    (np.array([1, 2**63], dtype=np.uint64), [0, 0], [0, 1]),
    ([1, 2**70], [0, 0], [0, 1]),
    (np.array([1, -2], dtype=np.int8), [0, 0], [0, 1]),
    ([1, 2], [0], [0, 1]),  # lengths differ
    ([1, 2], [0, 0], np.array([0, 1, 2])),
])
def test_inputs_the_c_does_not_take_go_to_the_numpy_path(columns: tuple[Any, ...]) -> None:
    assert checker().check("store", *columns) is None


@pytest.mark.parametrize("column", [
    bytearray(b"\x01\x02"), memoryview(np.array([1, 2])), memoryview(b"\x01\x02"),
    array.array("i", [1, 2]), array.array("Q", [1, 2]), np.array([1, 2], dtype="<i4"),
    (ctypes.c_long * 2)(1, 2)])  # ctypes exports neither shape nor strides
def test_other_buffers_of_integers_are_read_as_numpy_reads_them(column: Any) -> None:
    job = checker().check("store", column, [0, 0], [0, 1])
    assert job is not None
    assert (job.blocks.tolist(), job.host_pages.tolist()) == reference(
        "store", (column, [0, 0], [0, 1]))


def test_a_repeat_check_over_another_space_is_refused() -> None:
    lib = checker_library()
    assert lib is not None
    with pytest.raises(ValueError, match="blocks destinations span 64 ids but the repeat check "
                       "covers 32"):
        FastCheck(lib, LAYOUT, NUM_BLOCKS, CHUNKS,
                  {"load": UniqueDestinations("blocks", 32, LAYOUT.blocks_per_chunk)})


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_a_job_is_packed_into_the_target_it_is_given(dtype: type) -> None:
    staging, owner = np.full(16, -1, dtype=dtype), object()
    job = checker().check("load", np.array([7, 3]), [2, 0], [1, 3],
                          lambda n: (staging, owner))
    assert job is not None and job.staged_in is owner
    assert staging.tolist() == [7, 3, 9, 3] + [-1] * 12
    assert job.blocks.tolist() == [7, 3] and job.host_pages.tolist() == [9, 3]
    assert checker().check("load", [1, 2, 3], [0, 0, 0], [0, 1, 2],
                           lambda n: (staging[:5], owner)) is None  # no room: numpy's


def test_a_malformed_job_reserves_nothing_and_a_huge_one_overflows_nothing() -> None:
    def target(n: int) -> tuple[np.ndarray, object]:
        raise AssertionError("reserved staging for a job whose lengths differ")

    assert checker().check("store", [1, 2], [0, 0], [0], target) is None
    huge = np.broadcast_to(np.int64(0), (1 << 59,))  # 2 x 2^59 x 8 bytes wraps int64
    assert checker().check("store", huge, huge, huge,
                           lambda n: (np.zeros(16, dtype=np.int64), None)) is None


@pytest.mark.parametrize("dtype", [np.float32, np.uint32, np.int16, np.float64])
def test_a_target_that_is_not_4_or_8_byte_signed_ints_is_refused(dtype: type) -> None:
    staging = np.zeros(16, dtype=dtype)
    assert checker().check("store", [1], [0], [0], lambda n: (staging, None)) is None
    assert not staging.any()


def test_an_empty_job() -> None:
    job = checker().check("store", [], np.zeros(0, dtype=np.int32), ())
    assert job is not None and len(job) == 0


def region_engine() -> HostEngine:
    kv = [torch.zeros(NUM_BLOCKS, p, dtype=torch.uint8) for p in LAYOUT.page_bytes]
    region = torch.zeros(LAYOUT.region_bytes(CHUNKS), dtype=torch.uint8)
    return HostEngine(kv, region, LAYOUT, CHUNKS)


def test_engines_check_natively_and_numpy_words_the_errors() -> None:
    engine = region_engine()
    assert engine._fast is not None
    with pytest.raises(OffloadError, match="gpu block 64 .entry 1 of the job. is out of range"):
        engine.submit(0, "store", [1, 64], [0, 0], [0, 1])
    with pytest.raises(OffloadError, match="entries 0 and 1 of the job both write GPU block 3"):
        engine.submit(1, "load", np.array([3, 3]), [0, 0], [0, 1])
    engine.submit(2, "store", torch.tensor([1, 2]), [0, 0], [0, 1])  # the numpy path takes it
    assert engine.poll() == [2]


def test_offload_native_0_or_no_python_headers_turns_it_off(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
        ) -> None:
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    checker_library.cache_clear()
    try:
        monkeypatch.setenv("OFFLOAD_NATIVE", "0")
        assert checker_library() is None
        assert region_engine()._fast is None
        checker_library.cache_clear()
        monkeypatch.delenv("OFFLOAD_NATIVE")
        monkeypatch.setattr(fast_check.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
        with caplog.at_level(logging.INFO, logger="offload.transfer.fast_check"):
            assert checker_library() is None
        assert "no Python.h" in caplog.text
        assert list(tmp_path.iterdir()) == []
        checker_library.cache_clear()
        monkeypatch.undo()
        monkeypatch.setattr(fast_check.sysconfig, "get_config_var",
                            lambda name: 1 if name == "Py_GIL_DISABLED" else None)
        assert checker_library() is None
        checker_library.cache_clear()
        monkeypatch.undo()
        monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
        assert checker_library() is not None
        assert len(list(tmp_path.glob("job_check-*.so"))) == 1
    finally:
        checker_library.cache_clear()
