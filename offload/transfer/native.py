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
`offload.transfer.build_cache` says what it trusts), loaded with ctypes, and needs no CUDA
headers: the driver's entry points are handed over as function pointers, which also lets the
tests drive it with stand-ins on hosts without CUDA.  Where no compiler works, or
``OFFLOAD_NATIVE=0``, `library` returns None and the kernel keeps its Python launch path.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

from offload.cuda_driver import check, libcuda
from offload.transfer.build_cache import SOURCES, load

SOURCE = SOURCES["issue"]
STEPS = ("", "size check", "cuEventRecord", "cuStreamWaitEvent", "cuMemcpyHtoDAsync_v2",
         "cuLaunchKernel")  # issue.c's failed_step, by value
DRIVER_ENTRY_POINTS = ("cuEventRecord", "cuStreamWaitEvent", "cuMemcpyHtoDAsync_v2",
                       "cuLaunchKernel")


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
    return lib


def driver_entry_points() -> tuple[int, ...] | None:
    """Addresses of the four driver functions issue.c calls, or None without a driver."""
    lib = libcuda()
    if lib is None or not all(hasattr(lib, name) for name in DRIVER_ENTRY_POINTS):
        return None
    return tuple(int(ctypes.cast(lib[name], ctypes.c_void_p).value or 0)
                 for name in DRIVER_ENTRY_POINTS)


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
