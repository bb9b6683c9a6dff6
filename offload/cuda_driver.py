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
