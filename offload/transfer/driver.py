"""The CUDA driver entry points the copy paths call through ctypes (no Python object per page).

The calls act on the calling thread's current context, which torch has made current by the
time an engine issues (its stream and event calls come first).
"""

from __future__ import annotations

import ctypes
from functools import cache


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


def driver_call(name: str, *args: object) -> None:
    """Call driver function ``name``; a non-zero result raises with the driver's message."""
    lib = libcuda()
    if lib is None:
        raise RuntimeError("no CUDA driver (libcuda.so.1) on this host")
    result = getattr(lib, name)(*args)
    if result != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(text))
        message = text.value.decode() if text.value else "unknown error"
        raise RuntimeError(f"{name} failed: CUDA error {result} ({message})")
