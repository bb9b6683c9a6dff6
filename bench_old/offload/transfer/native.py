# SPDX-License-Identifier: Apache-2.0
"""A kernel job's whole issue in one native call: ordering, index upload and launch.

Issued from Python, a kernel job converts ctypes arguments and sets parameter cells between
five driver calls, most of a small job's `submit` (docs/BENCHMARKS.md, "A kernel job issued in
one native call").  ``issue.c`` makes those calls from C -- record the ordering event on the
caller's stream, make the copy stream wait for it, upload the staged indices, set the two sizes
in the kernel's parameter block, ``cuLaunchKernel`` -- after one ctypes call over a context
built once per kernel (`IssueContext`).

The C file is compiled on first use with the host's C compiler into the build cache (the way
Triton builds its own launchers, so a host that runs the Triton backend has one;
`offload.build_cache` says what it trusts), loaded with ctypes, and needs no CUDA
headers: the driver's entry points are handed over as function pointers, which also lets the
tests drive it with stand-ins on hosts without CUDA.  Where no compiler works, or
``OFFLOAD_NATIVE=0``, `library` returns None and the kernel keeps its Python launch path.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import numpy as np

from offload.build_cache import SOURCES, load
from offload.cuda_driver import check, libcuda

SOURCE = SOURCES["issue"]
STEPS = ("", "size check", "cuEventRecord", "cuStreamWaitEvent", "cuMemcpyHtoDAsync_v2",
         "cuLaunchKernel")  # issue.c's failed_step, by value
DRIVER_ENTRY_POINTS = ("cuEventRecord", "cuStreamWaitEvent", "cuMemcpyHtoDAsync_v2",
                       "cuLaunchKernel")
STAGED_STEPS = ("", "size check", "cuEventRecord", "cuStreamWaitEvent", "cuMemcpyBatchAsync_v2",
                "cuLaunchKernel")  # offload_issue_staged's failed_step, by value
STAGED_CELLS = 7  # issue.c's STAGED_CELLS
SLICE_FIELDS = 8  # issue.c's SLICE_FIELDS: a slice's row of the table it takes


class IssueContext(ctypes.Structure):
    """``struct offload_issue`` of issue.c, field by field."""

    _fields_ = [("event_record", ctypes.c_void_p), ("stream_wait_event", ctypes.c_void_p),
                ("memcpy_htod_async", ctypes.c_void_p), ("launch_kernel", ctypes.c_void_p),
                ("function", ctypes.c_void_p), ("params", ctypes.c_void_p),
                ("count_cell", ctypes.c_void_p), ("items_cell", ctypes.c_void_p),
                ("count_size", ctypes.c_int32), ("items_size", ctypes.c_int32),
                ("threads", ctypes.c_uint32), ("shared_bytes", ctypes.c_uint32),
                ("stream", ctypes.c_void_p), ("ordered", ctypes.c_void_p),
                ("device_index", ctypes.c_uint64), ("failed_step", ctypes.c_int32)]


@cache
def library() -> ctypes.CDLL | None:
    """The compiled ``issue.c``, or None (`load`)."""
    lib = load(SOURCE, "kernel jobs' launches", "offload_issue")
    if lib is not None:
        lib.offload_issue.argtypes = [ctypes.POINTER(IssueContext), ctypes.c_int32,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64,
                                      ctypes.c_int64, ctypes.c_int64, ctypes.c_uint32]
        lib.offload_issue.restype = ctypes.c_int
        lib.offload_issue_staged.argtypes = [ctypes.POINTER(StagedContext), ctypes.c_int32,
                                             ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.c_void_p, ctypes.c_void_p]
        lib.offload_issue_staged.restype = ctypes.c_int
    return lib


def driver_entry_points() -> tuple[int, ...] | None:
    """Addresses of the four driver functions issue.c calls, or None without a driver."""
    lib = libcuda()
    if lib is None or not all(hasattr(lib, name) for name in DRIVER_ENTRY_POINTS):
        return None
    return tuple(int(ctypes.cast(lib[name], ctypes.c_void_p).value or 0)
                 for name in DRIVER_ENTRY_POINTS)


def staged_entry_points() -> tuple[int, int, int, int] | None:
    """Addresses of the driver functions ``offload_issue_staged`` calls, or None."""
    lib = libcuda()
    names = ("cuEventRecord", "cuStreamWaitEvent", "cuLaunchKernel", "cuMemcpyBatchAsync_v2")
    if lib is None or not all(hasattr(lib, name) for name in names):
        return None
    a, b, c, d = (int(ctypes.cast(lib[name], ctypes.c_void_p).value or 0) for name in names)
    return a, b, c, d


class NativeIssuer:
    """`issue` runs issue.c's ``offload_issue`` over one kernel's context.  ``kernel`` is the
    `offload.transfer.launcher.BoundKernel` whose parameter block it launches with (its n and
    items cells are parameters ``count_index`` and ``count_index + 1``); the issuer keeps it
    alive, since the context points into its parameter block and cells."""

    def __init__(self, lib: ctypes.CDLL, entry_points: tuple[int, ...], kernel: Any,
                 count_index: int, stream: int, ordered_event: int, device_index: int) -> None:
        count_cell, count_size = kernel.cell(count_index)
        items_cell, items_size = kernel.cell(count_index + 1)
        self.context = IssueContext(*entry_points, kernel.function, kernel.params_address,
                                    count_cell, items_cell, count_size, items_size,
                                    kernel.threads, kernel.shared, stream, ordered_event,
                                    device_index, 0)
        self._pointer = ctypes.pointer(self.context)
        self._issue = lib.offload_issue
        self._kernel = kernel

    def set_device_index(self, address: int) -> None:
        self.context.device_index = address

    def issue(self, order: bool, caller: int, staging: int, nbytes: int, count: int,
              items: int, grid: int) -> bool:
        """Issue one job; False (nothing issued) when ``count`` or ``items`` overflows the
        kernel's compiled integer types.  A failed driver call raises with its name."""
        result = self._issue(self._pointer, order, caller, staging, nbytes, count, items, grid)
        if result == -1:
            return False
        check(result, STEPS[self.context.failed_step])  # raises unless result is 0
        return True


class StagedContext(ctypes.Structure):
    """``struct offload_staged`` of issue.c, field by field."""

    _fields_ = [("event_record", ctypes.c_void_p), ("stream_wait_event", ctypes.c_void_p),
                ("launch_kernel", ctypes.c_void_p), ("memcpy_batch", ctypes.c_void_p),
                ("function", ctypes.c_void_p), ("params", ctypes.c_void_p),
                ("cells", ctypes.c_void_p * STAGED_CELLS),
                ("sizes", ctypes.c_int32 * STAGED_CELLS),
                ("threads", ctypes.c_uint32), ("shared_bytes", ctypes.c_uint32),
                ("stream", ctypes.c_void_p), ("dma_stream", ctypes.c_void_p),
                ("start", ctypes.c_void_p), ("pass_streams", ctypes.c_void_p),
                ("staged", ctypes.c_void_p),
                ("free_slot", ctypes.c_void_p), ("slots", ctypes.c_int64),
                ("pieces", ctypes.c_int64), ("rows_per_step", ctypes.c_int64),
                ("max_programs", ctypes.c_int64), ("attrs", ctypes.c_void_p),
                ("attr_indices", ctypes.c_void_p), ("failed_step", ctypes.c_int32)]


class StagedIssuer:
    """`issue` runs issue.c's ``offload_issue_staged``: a whole staged job (every slice's pass,
    batched copy and ring events) in one call.  ``passes`` are the ring slots' streams for a
    load's scatters.  ``cells`` are the indices of the kernel's
    parameters a slice sets (n, items, tensors, first entry, first tensor, stage, stage sums);
    ``driver`` the addresses of cuEventRecord, cuStreamWaitEvent, cuLaunchKernel and
    cuMemcpyBatchAsync_v2; ``attrs`` the batched copies' attribute block and index (kept
    alive by the caller, as are the events)."""

    def __init__(self, lib: ctypes.CDLL, driver: tuple[int, int, int, int], kernel: Any,
                 cells: tuple[int, ...], streams: tuple[int, int], start: int,
                 passes: list[int], ring: list[tuple[int, int]], shape: tuple[int, int, int],
                 attrs: tuple[int, int]) -> None:
        places = [kernel.cell(i) for i in cells]
        self._passes = (ctypes.c_void_p * len(passes))(*passes)
        self._staged = (ctypes.c_void_p * len(ring))(*[s for s, _ in ring])
        self._free = (ctypes.c_void_p * len(ring))(*[f for _, f in ring])
        pieces, rows, programs = shape
        self.context = StagedContext(
            *driver, kernel.function, kernel.params_address,
            (ctypes.c_void_p * STAGED_CELLS)(*[a for a, _ in places]),
            (ctypes.c_int32 * STAGED_CELLS)(*[size for _, size in places]),
            kernel.threads, kernel.shared, *streams, start, ctypes.addressof(self._passes),
            ctypes.addressof(self._staged), ctypes.addressof(self._free), len(ring), pieces,
            rows, programs, *attrs, 0)
        self._pointer = ctypes.pointer(self.context)
        self._issue = lib.offload_issue_staged
        self.kernel = kernel  # the bound pass whose cells the context points into

    def issue(self, load: bool, after_engine: bool, first_slot: int, n: int,
              slices: np.ndarray, srcs: np.ndarray, dsts: np.ndarray, sizes: np.ndarray,
              marks: tuple[np.ndarray, np.ndarray] | None = None) -> bool:
        """Issue one job of ``n`` entries from ring slot ``first_slot`` on (``slices``: int64
        rows of `SLICE_FIELDS`; the copies as uint64 arrays; a load after the engine stream's
        work so far where ``after_engine``; a layer-wise load's ``marks``: the int64 slices
        after which the engine stream records the uint64 event handles beside them); False
        (nothing issued) when a value overflows the kernel's compiled integer types or the
        marks are not increasing slices of a load.  A failed driver call raises with its
        name."""
        after, events = marks if marks is not None else (None, None)
        result = self._issue(self._pointer, load, after_engine, first_slot, n, len(slices),
                             slices.ctypes.data, srcs.ctypes.data, dsts.ctypes.data,
                             sizes.ctypes.data, 0 if after is None else len(after),
                             None if after is None else after.ctypes.data,
                             None if events is None else events.ctypes.data)
        if result == -1:
            return False
        check(result, STAGED_STEPS[self.context.failed_step])
        return True
