"""Registering host ranges with CUDA (page-locking them for DMA), behind a narrow protocol.

The driver API (``cuMemHostRegister``) is used instead of ``cudaHostRegister``: a failed runtime
registration leaves a sticky error that surfaces later in an unrelated call, the driver's does
not.  Registration may run on a pin thread while pre-fault continues, so the CUDA registrar binds
the device's context in whatever thread calls it.  Without CUDA the ``RecordingRegistrar`` keeps
the ranges it would have registered, which is what CPU-only CI checks.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from offload.cuda_driver import bound_function, check, require_libcuda
from offload.geometry import ByteRange
from offload.sizes import format_size

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02


class Registrar(Protocol):
    """Registers and unregisters host ranges.  ``counts_as_pinned`` is False for stand-ins
    whose registrations lock nothing (their bytes are not reported as pinned)."""

    name: str
    counts_as_pinned: bool

    def register(self, address: int, length: int) -> None: ...

    def unregister(self, address: int) -> None: ...


class RecordingRegistrar:
    """CPU-only stand-in: records what would be registered."""

    name = "recording"
    counts_as_pinned = False

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls = 0

    def register(self, address: int, length: int) -> None:
        if address in self.registered:
            raise RuntimeError(f"{address:#x} registered twice")
        self.calls += 1
        self.registered[address] = length

    def unregister(self, address: int) -> None:
        del self.registered[address]


class CudaRegistrar:
    """``cuMemHostRegister``/``cuMemHostUnregister`` on one device's primary context.

    The constructor resolves the context once (the primary context is the one the CUDA runtime
    and therefore torch use); each call makes it current in the calling thread first, since a
    fresh thread has no current context.
    """

    name = "cuda"
    counts_as_pinned = True

    def __init__(self, device: torch.device) -> None:
        torch.cuda.init()
        index = device.index if device.index is not None else torch.cuda.current_device()
        cuda = require_libcuda()
        check(cuda.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        check(cuda.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        self._context = ctypes.c_void_p()
        # Retained for the process's life, like the runtime's own reference to it.
        check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), dev),
                    "cuDevicePrimaryCtxRetain")
        self._register = bound_function("cuMemHostRegister_v2", ctypes.c_void_p,
                                        ctypes.c_size_t, ctypes.c_uint)
        self._unregister = bound_function("cuMemHostUnregister", ctypes.c_void_p)
        self._set_current = bound_function("cuCtxSetCurrent", ctypes.c_void_p)

    def register(self, address: int, length: int) -> None:
        self._bind()
        flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
        check(self._register(address, length, flags),
                    f"cuMemHostRegister of {length} B ({format_size(length)}) at {address:#x}")

    def unregister(self, address: int) -> None:
        self._bind()
        check(self._unregister(address), f"cuMemHostUnregister at {address:#x}")

    def _bind(self) -> None:
        check(self._set_current(self._context), "cuCtxSetCurrent")


class Pinner:
    """Registers ranges one at a time and can undo all of them: the unit of rollback."""

    def __init__(self, registrar: Registrar, base_address: int) -> None:
        self.registrar = registrar
        self.base = base_address
        self.registered: list[ByteRange] = []

    def pin(self, r: ByteRange) -> None:
        self.registrar.register(self.base + r.offset, r.length)
        self.registered.append(r)

    def unpin_all(self) -> None:
        """Unregister everything, newest first; keeps going past failures and raises the first
        one at the end, so one bad range never leaves the others locked."""
        first: BaseException | None = None
        while self.registered:
            r = self.registered.pop()
            try:
                self.registrar.unregister(self.base + r.offset)
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    @property
    def pinned_bytes(self) -> int:
        if not self.registrar.counts_as_pinned:
            return 0
        return sum(r.length for r in self.registered)


def choose_registrar(device: torch.device | str) -> Registrar:
    """CUDA registration when the KV cache lives on a CUDA device that is present; otherwise
    the recording stand-in (nothing to pin for CPU tensors)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaRegistrar(device)
    return RecordingRegistrar()

