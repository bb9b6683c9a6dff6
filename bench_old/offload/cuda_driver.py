"""The CUDA driver through ctypes: the library, its entry points and one error check.

Used by the copy paths (raw pointer arrays, no Python object per page; the calls act on the
calling thread's current context, which torch has made current by the time an engine issues)
and by host registration (`offload.region.pin`, which binds its context itself).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from typing import Any


@cache
def libcuda() -> ctypes.CDLL | None:
    """The driver library, or None on hosts without one."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def has_entry_point(name: str) -> bool:
    lib = libcuda()
    return lib is not None and hasattr(lib, name)


def require_libcuda() -> ctypes.CDLL:
    lib = libcuda()
    if lib is None:
        raise RuntimeError("no CUDA driver (libcuda.so.1) on this host")
    return lib


def error_name(result: int) -> str:
    """A driver result in words: ``CUDA error 2 (out of memory)``."""
    text = ctypes.c_char_p()
    lib = libcuda()
    if lib is not None:
        lib.cuGetErrorString(result, ctypes.byref(text))
    message = text.value.decode() if text.value else "unknown error"
    return f"CUDA error {result} ({message})"


def check(result: int, what: str) -> None:
    """Raise with the driver's own message when a driver call returned non-zero."""
    if result != 0:
        raise RuntimeError(f"{what} failed: {error_name(result)}")


def bound_function(name: str, *argtypes: Any) -> Callable[..., int]:
    """Driver function ``name`` with its argument types fixed, for hot paths: a call converts
    plain ints without building ctypes objects per call.  A fresh function object, so other
    callers of the same entry point keep theirs; the caller checks the result."""
    function = require_libcuda()[name]
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


def driver_call(name: str, *args: object) -> None:
    """Call driver function ``name``; a non-zero result raises with the driver's message."""
    check(getattr(require_libcuda(), name)(*args), name)


CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12


def allocation_ranges(address: int, nbytes: int) -> list[tuple[int, int]]:
    """The device allocations, as (start, bytes) in address order, that the ``nbytes`` from
    ``address`` lie in: the driver's own ranges, which a batched copy may not span (two
    allocations can be neighbours in the address space, as the caching allocator's segments
    often are)."""
    lib, ranges, at = require_libcuda(), [], address
    while at < address + nbytes:
        start, size = ctypes.c_uint64(), ctypes.c_uint64()
        for value, attribute in ((start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR),
                                 (size, CU_POINTER_ATTRIBUTE_RANGE_SIZE)):
            check(lib.cuPointerGetAttribute(ctypes.byref(value), attribute, ctypes.c_uint64(at)),
                  f"cuPointerGetAttribute of {at:#x}")
        if start.value > at or start.value + size.value <= at:
            raise RuntimeError(f"the driver's range of {at:#x} is {start.value:#x} + "
                               f"{size.value} B, which does not hold it")
        ranges.append((start.value, size.value))
        at = start.value + size.value
    return ranges
