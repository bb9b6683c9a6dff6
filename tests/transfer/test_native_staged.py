"""The native staged issue (issue.c's ``offload_issue_staged``) built with this host's compiler
and driven with stand-in driver functions: per slice, the pass and the batched copy in the
order the ring needs, each ring slot's events, the kernel's cells at every launch, and its
refusals and failures.  The real driver runs it in tests/gpu/test_transfer_gpu.py."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.system import build_cache
from offload.transfer import native
from offload.transfer.layout import tensor_ranges
from offload.transfer.staging import job_slices, layer_ends, layer_plan
from tests.transfer.helpers import staging_ring

pytestmark = pytest.mark.skipif(build_cache.compiler() is None, reason="needs a C compiler")

RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                          ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
BATCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                         ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                         ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                         ctypes.c_void_p)
MAIN, DMA, START, FUNCTION, ATTRS, INDEX = 0x5000, 0x5100, 0x6000, 0x7000, 0x7100, 0x7200
RING = [(0x6100, 0x6200), (0x6101, 0x6201)]  # (staged, free) per slot
PASSES = [0x5200, 0x5201]  # per slot: the stream of a load's scatters
CELLS = (3, 4, 5, 9, 10, 12, 13)
SIZES = {3: 4, 4: 8, 5: 4, 9: 4, 10: 4, 12: 8, 13: 8}  # as Triton may type them


class FakeKernel:
    """A parameter block of 14 cells, the staged pass's."""

    function, threads, shared = FUNCTION, 128, 0

    def __init__(self) -> None:
        self.cells: list[Any] = [(ctypes.c_int32 if SIZES.get(i) == 4 else ctypes.c_int64)(0)
                                 for i in range(14)]
        self.params = (ctypes.c_void_p * 14)(*[ctypes.addressof(c) for c in self.cells])
        self.params_address = ctypes.addressof(self.params)

    def cell(self, index: int) -> tuple[int, int]:
        return ctypes.addressof(self.cells[index]), ctypes.sizeof(self.cells[index])


class FakeDriver:
    """Stand-ins that append what they were given to ``calls`` and return ``fail.get(name,
    0)``; the launch reads the cells it runs with, the copy the addresses it was given."""

    def __init__(self, kernel: FakeKernel, fail: dict[str, int] | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail or {}

        def record(event: int | None, stream: int | None) -> int:
            self.calls.append(("record", event, stream))
            return self.fail.get("record", 0)

        def wait(stream: int | None, event: int | None, flags: int) -> int:
            self.calls.append(("wait", stream, event))
            return self.fail.get("wait", 0)

        def launch(function: int | None, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
                   shared: int, stream: int | None, params: Any, extra: int | None) -> int:
            cells = tuple(kernel.cells[i].value for i in CELLS)
            self.calls.append(("launch", stream, gx, cells))
            return self.fail.get("launch", 0)

        def batch(dsts: Any, srcs: Any, sizes: Any, count: int, attrs: int | None,
                  indices: int | None, num: int, stream: int | None) -> int:
            self.calls.append(("copy", stream, [(srcs[i], dsts[i], sizes[i])
                                                for i in range(count)], attrs, indices, num))
            return self.fail.get("copy", 0)

        self._functions = [RECORD(record), WAIT(wait), LAUNCH(launch), BATCH(batch)]
        self.entry_points = tuple(int(ctypes.cast(f, ctypes.c_void_p).value or 0)
                                  for f in self._functions)


def _issuer(fail: dict[str, int] | None = None, slots: int = 2
            ) -> tuple[native.StagedIssuer, FakeDriver]:
    """An issuer over stand-ins, with `RING` and `PASSES` (or ``slots`` ring slots)."""
    lib = native.library()
    assert lib is not None, "the native issue path must build on this host"
    kernel = FakeKernel()
    driver = FakeDriver(kernel, fail)
    a, b, c, d = driver.entry_points
    ring = RING if slots == 2 else [(0x6100 + r, 0x6200 + r) for r in range(slots)]
    passes = PASSES if slots == 2 else [0x5200 + r for r in range(slots)]
    # 4 work items per page, 64 per program step, at most 8 programs
    return native.StagedIssuer(lib, (a, b, c, d), kernel, CELLS, (MAIN, DMA), START, passes,
                               ring, (4, 64, 8), (ATTRS, INDEX)), driver


# three slices through two ring slots: (first entry, entries, first tensor, tensors, stage,
# stage sums, first copy, copies); the second cut into two copies
SLICES = np.array([[0, 16, 0, 10, 0xA000, 0xA800, 0, 1],
                   [16, 16, 0, 10, 0xB000, 0xB800, 1, 2],
                   [32, 8, 2, 3, 0xA000, 0xA400, 3, 1]], dtype=np.int64)
SRCS = np.array([1, 2, 3, 4], dtype=np.uint64) << np.uint64(20)
DSTS = np.array([5, 6, 7, 8], dtype=np.uint64) << np.uint64(20)
SIZES_ = np.array([100, 200, 8, 300], dtype=np.uint64)


def _launch(first: int, entries: int, first_tensor: int, tensors: int, stage: int,
            sums: int, stream: int = MAIN) -> tuple[Any, ...]:
    items = entries * tensors * 4
    grid = min(8, -(-items // 64))
    return ("launch", stream, grid, (40, items, tensors, first, first_tensor, stage, sums))


def _copy(first: int, count: int) -> tuple[Any, ...]:
    pairs = [(int(SRCS[i]), int(DSTS[i]), int(SIZES_[i])) for i in range(first, first + count)]
    return ("copy", DMA, pairs, ATTRS, INDEX, 1)


def test_a_store_gathers_then_copies_each_slice_and_reuses_a_slot_after_its_copy() -> None:
    issuer, driver = _issuer()
    assert issuer.issue(False, True, 0, 40, SLICES, SRCS, DSTS, SIZES_)
    (s0, f0), (s1, f1) = RING
    assert driver.calls == [
        _launch(0, 16, 0, 10, 0xA000, 0xA800), ("record", s0, MAIN), ("wait", DMA, s0),
        _copy(0, 1), ("record", f0, DMA),
        _launch(16, 16, 0, 10, 0xB000, 0xB800), ("record", s1, MAIN), ("wait", DMA, s1),
        _copy(1, 2), ("record", f1, DMA),
        ("wait", MAIN, f0),  # slot 0 again: after slice 0's copy
        _launch(32, 8, 2, 3, 0xA000, 0xA400), ("record", s0, MAIN), ("wait", DMA, s0),
        _copy(3, 1), ("record", f0, DMA),
        ("wait", MAIN, f0)]  # the job's completion follows its last copy


@pytest.mark.parametrize("after_engine", [True, False])
def test_a_load_copies_into_each_slot_after_its_last_use_then_scatters(after_engine: bool
                                                                       ) -> None:
    """From ring slot 1 on: every copy into a slot waits for that slot's last use (by this
    job or an earlier one), each slot's scatters run on its own stream after the engine
    stream's work so far, and the engine stream ends after every slot's last scatter.  Only
    after a job that wrote host rows on the engine stream do the copies wait for it too."""
    issuer, driver = _issuer()
    assert issuer.issue(True, after_engine, 1, 40, SLICES, SRCS, DSTS, SIZES_)
    (s0, f0), (s1, f1) = RING
    p0, p1 = PASSES
    first = [("wait", DMA, START)] if after_engine else []
    assert driver.calls == [("record", START, MAIN), *first,
                            ("wait", p1, START), ("wait", p0, START),
        ("wait", DMA, f1), _copy(0, 1), ("record", s1, DMA), ("wait", p1, s1),
        _launch(0, 16, 0, 10, 0xA000, 0xA800, p1), ("record", f1, p1),
        ("wait", DMA, f0), _copy(1, 2), ("record", s0, DMA), ("wait", p0, s0),
        _launch(16, 16, 0, 10, 0xB000, 0xB800, p0), ("record", f0, p0),
        ("wait", DMA, f1), _copy(3, 1), ("record", s1, DMA), ("wait", p1, s1),
        _launch(32, 8, 2, 3, 0xA000, 0xA400, p1), ("record", f1, p1),
        ("wait", MAIN, f1), ("wait", MAIN, f0)]


def test_a_store_from_another_slot_waits_for_that_slot_in_turn() -> None:
    issuer, driver = _issuer()
    assert issuer.issue(False, False, 1, 40, SLICES, SRCS, DSTS, SIZES_)
    waits = [c for c in driver.calls if c[0] == "wait" and c[1] == MAIN]
    assert waits == [("wait", MAIN, RING[1][1]), ("wait", MAIN, RING[1][1])]  # slice 2, end


def test_values_beyond_the_compiled_types_issue_nothing() -> None:
    issuer, driver = _issuer()
    assert not issuer.issue(False, True, 0, 2**31, SLICES, SRCS, DSTS, SIZES_)  # an int32 n
    wide = SLICES.copy()
    wide[2, 0] = 2**31  # a first entry beyond int32
    assert not issuer.issue(True, True, 0, 40, wide, SRCS, DSTS, SIZES_)
    assert driver.calls == []


@pytest.mark.parametrize(("step", "name", "issued"), [
    ("launch", "cuLaunchKernel", 1), ("record", "cuEventRecord", 2),
    ("wait", "cuStreamWaitEvent", 3), ("copy", "cuMemcpyBatchAsync_v2", 4)])
def test_a_failed_driver_call_raises_with_its_name_and_stops_there(step: str, name: str,
                                                                   issued: int) -> None:
    issuer, driver = _issuer({step: 700})
    with pytest.raises(RuntimeError, match=f"{name} failed: CUDA error 700"):
        issuer.issue(False, True, 0, 40, SLICES, SRCS, DSTS, SIZES_)
    assert len(driver.calls) == issued


def test_a_layer_wise_load_records_each_mark_after_its_slices_scatters() -> None:
    """Marks after slices 0 and 2: the engine stream follows slice 0's scatter, records the
    first layer event, then follows slices 1 and 2's (each ring slot's last use) and records
    the second; the job's completion then needs no further wait."""
    issuer, driver = _issuer()
    l0, l1 = 0x8000, 0x8001
    marks = (np.array([0, 2], dtype=np.int64), np.array([l0, l1], dtype=np.uint64))
    assert issuer.issue(True, False, 0, 40, SLICES, SRCS, DSTS, SIZES_, marks)
    (s0, f0), (s1, f1) = RING
    p0, p1 = PASSES
    assert driver.calls == [("record", START, MAIN), ("wait", p0, START), ("wait", p1, START),
        ("wait", DMA, f0), _copy(0, 1), ("record", s0, DMA), ("wait", p0, s0),
        _launch(0, 16, 0, 10, 0xA000, 0xA800, p0), ("record", f0, p0),
        ("wait", MAIN, f0), ("record", l0, MAIN),
        ("wait", DMA, f1), _copy(1, 2), ("record", s1, DMA), ("wait", p1, s1),
        _launch(16, 16, 0, 10, 0xB000, 0xB800, p1), ("record", f1, p1),
        ("wait", DMA, f0), _copy(3, 1), ("record", s0, DMA), ("wait", p0, s0),
        _launch(32, 8, 2, 3, 0xA000, 0xA400, p0), ("record", f0, p0),
        ("wait", MAIN, f0), ("wait", MAIN, f1), ("record", l1, MAIN)]


@pytest.mark.parametrize("after", [[1, 0], [0, 3], [-1], [1, 1]])
def test_marks_out_of_order_or_outside_the_job_issue_nothing(after: list[int]) -> None:
    """A mark that no slice reaches would leave its event unrecorded: nothing is issued."""
    issuer, driver = _issuer()
    events = np.arange(0x8000, 0x8000 + len(after), dtype=np.uint64)
    assert not issuer.issue(True, False, 0, 40, SLICES, SRCS, DSTS, SIZES_,
                            (np.array(after, dtype=np.int64), events))
    assert driver.calls == []


def test_a_store_takes_no_marks() -> None:
    issuer, driver = _issuer()
    marks = (np.array([2], dtype=np.int64), np.array([0x8000], dtype=np.uint64))
    assert not issuer.issue(False, False, 0, 40, SLICES, SRCS, DSTS, SIZES_, marks)
    assert driver.calls == []


def _follows(calls: list[tuple[Any, ...]]) -> list[set[int]]:
    """Per driver call, every earlier call it waits for: the one before it on its stream, and
    for a wait the record of the event it names (as recorded at that point), transitively."""
    before: list[set[int]] = []
    last: dict[Any, int] = {}
    recorded: dict[Any, int] = {}
    for i, call in enumerate(calls):
        stream = call[2] if call[0] == "record" else call[1]
        direct = {last[stream]} if stream in last else set()
        if call[0] == "wait" and call[2] in recorded:
            direct.add(recorded[call[2]])
        before.append(set().union(*[before[d] | {d} for d in direct]) if direct else set())
        last[stream] = i
        if call[0] == "record":
            recorded[call[1]] = i
    return before


@settings(max_examples=150, deadline=None)
@given(pages=st.lists(st.sampled_from([64, 1000, 4096, 20_000]), min_size=1, max_size=8),
       checked=st.booleans(), budget=st.sampled_from([0.6, 1.0, 2.5, 9.0]),
       groups=st.integers(1, 8), chunks=st.integers(1, 7), first_slot=st.integers(0, 3))
def test_each_layer_groups_event_follows_every_scatter_of_its_slices(
        pages: list[int], checked: bool, budget: float, groups: int, chunks: int,
        first_slot: int) -> None:
    """Real layer plans through the native issue: each group's event is recorded after (in
    stream order and through the events waited on) every scatter of its group's slices and of
    those before; every DMA into a ring slot follows the slot's previous scatter; the job's
    last wait on the engine stream follows every scatter."""
    layout, plan = staging_ring(pages, 4, checked, budget)
    if isinstance(plan, str):
        return
    ranges = tensor_ranges(len(pages), min(groups, len(pages)))
    layered = layer_plan(plan, layout, ranges)
    cut = layered.plan
    parts = job_slices(cut, layout, chunks, first_slot % cut.slots)
    first = first_slot % cut.slots
    table = np.array([[parts.first_entry[s], parts.entries[s], cut.groups[g].first,
                       cut.groups[g].count, at, at + cut.groups[g].stage_trailer,
                       parts.bounds[s], parts.bounds[s + 1] - parts.bounds[s]]
                      for s, g in enumerate(parts.group)
                      for at in [0x100000 + ((first + s) % cut.slots) * cut.slice_bytes]],
                     dtype=np.int64)
    host = (parts.host_offsets(np.arange(chunks), layout.row_stride) + (1 << 40)
            ).astype(np.uint64)
    stage = (parts.stage + 0x100000).astype(np.uint64)
    ends = np.array(layer_ends(parts, layered.layer, len(ranges)), dtype=np.int64)
    events = np.arange(0x8000, 0x8000 + len(ranges), dtype=np.uint64)
    issuer, driver = _issuer(slots=cut.slots)
    assert issuer.issue(True, False, first, 4 * chunks, table, host, stage,
                        parts.size.astype(np.uint64), (ends, events))
    calls = driver.calls
    follows = _follows(calls)
    scatters = [i for i, c in enumerate(calls) if c[0] == "launch"]
    copies = [i for i, c in enumerate(calls) if c[0] == "copy"]
    assert len(scatters) == len(copies) == len(parts)
    for k, end in enumerate(ends.tolist()):
        marks = [i for i, c in enumerate(calls) if c[:2] == ("record", int(events[k]))]
        assert len(marks) == 1 and calls[marks[0]][2] == MAIN
        assert all(scatters[s] in follows[marks[0]] for s in range(end + 1)), f"group {k}"
    for s in range(cut.slots, len(parts)):
        assert scatters[s - cut.slots] in follows[copies[s]], f"slice {s} reused its slot early"
    last = max(i for i, c in enumerate(calls) if c[0] in ("wait", "record") and MAIN in c[1:3])
    assert all(x in follows[last] | {last} for x in scatters)
