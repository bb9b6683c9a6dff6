"""Registering host ranges with CUDA (page-locking them for DMA), behind a narrow protocol.

The driver API (``cuMemHostRegister``) is used instead of ``cudaHostRegister``: a failed runtime
registration leaves a sticky error that surfaces later in an unrelated call, the driver's does
not.  Registration may run on a pin thread while pre-fault continues, so the CUDA registrar
pushes its context around each call in whatever thread makes it, and leaves the caller's
current context as it found it.  Without CUDA the ``RecordingRegistrar`` keeps the ranges it
would have registered, which is what CPU-only CI checks.

Background set-up registers while the engine serves, and a registration holds its context's
driver lock for the whole call: a kernel launch of the engine waits behind it.  With
``own_context`` (`TierConfig.setup_context`) the registrar registers in a context of its own,
with ``PORTABLE``: the memory is pinned and mapped for the engine's (primary) context all the
same, and the engine's launches need not wait for it.  Measured on its own on an H200 host,
beside populating threads and a thread mapping memory every millisecond (8 MiB registrations of
up to 15 ms): the engine's longest launch took 0.58 ms, against 6.9 ms with the registrations
in the engine's context, and copies from the memory ran at 54.8 GB/s (docs/BENCHMARKS.md, "What
the engine's launches wait for during set-up").  Inside the tier, with registrations beside
populating, it cut the launch p99 during set-up from 3.8-3.9 to 0.9-1.0 ms ("Registering beside
write faults"), so background set-up uses it by default.  The context costs GPU memory (about
260 MiB with its stack, printf and heap limits at 0), is made as set-up starts (`prepare`), and
lives as long as the registrations: destroying it unregisters them.  Where a second context
cannot be made (a GPU in exclusive-process mode) the registrar falls back to the primary
context and says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator
from typing import Protocol

import torch

from offload.cuda_driver import bound_function, check, error_name, require_libcuda
from offload.geometry import ByteRange
from offload.sizes import format_size

log = logging.getLogger(__name__)

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
# cuCtxSetLimit: a context that never launches a kernel needs no stack, printf FIFO nor heap
# (measured on an H200: 524 MiB for a fresh context, 260 MiB with these at 0)
_UNUSED_LIMITS = (0x00, 0x01, 0x02)  # CU_LIMIT_STACK_SIZE, _PRINTF_FIFO_SIZE, _MALLOC_HEAP_SIZE


class Registrar(Protocol):
    """Registers and unregisters host ranges.  ``counts_as_pinned`` is False for stand-ins
    whose registrations lock nothing (their bytes are not reported as pinned)."""

    name: str
    counts_as_pinned: bool
    own_context: bool  # registers in a CUDA context of its own (known once prepared)

    def prepare(self) -> None:
        """Make ready what the first registration needs (a context of its own), so that
        background set-up pays for it on its pin thread, not inside ``create``."""

    def register(self, address: int, length: int) -> None: ...

    def unregister(self, address: int) -> None: ...

    def close(self) -> None:
        """Release what the registrar holds, once every range is unregistered."""


class RecordingRegistrar:
    """CPU-only stand-in: records what would be registered."""

    name = "recording"
    counts_as_pinned = False
    own_context = False

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls = 0

    def prepare(self) -> None:
        pass

    def register(self, address: int, length: int) -> None:
        if address in self.registered:
            raise RuntimeError(f"{address:#x} registered twice")
        self.calls += 1
        self.registered[address] = length

    def unregister(self, address: int) -> None:
        del self.registered[address]

    def close(self) -> None:
        pass


class CudaRegistrar:
    """``cuMemHostRegister``/``cuMemHostUnregister`` in one device's primary context, or with
    ``own_context`` in a context of the registrar's own on that device (the module's
    docstring: background set-up).

    The primary context (the one the CUDA runtime and therefore torch use) is resolved in the
    constructor; a context of its own is made by `prepare`, or by the first call that needs
    it, so that ``create`` does not wait for it.  Each call pushes the context onto the calling
    thread's context stack and pops it after, so a caller's current context (torch's, on the
    engine's threads) is never changed.
    """

    name = "cuda"
    counts_as_pinned = True

    def __init__(self, device: torch.device, own_context: bool = False) -> None:
        torch.cuda.init()
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        cuda = require_libcuda()
        check(cuda.cuInit(0), "cuInit")
        self._device = ctypes.c_int()
        check(cuda.cuDeviceGet(ctypes.byref(self._device), self._index), "cuDeviceGet")
        self._push = bound_function("cuCtxPushCurrent_v2", ctypes.c_void_p)
        self._pop = bound_function("cuCtxPopCurrent_v2", ctypes.c_void_p)
        self._register = bound_function("cuMemHostRegister_v2", ctypes.c_void_p,
                                        ctypes.c_size_t, ctypes.c_uint)
        self._unregister = bound_function("cuMemHostUnregister", ctypes.c_void_p)
        # held across every call in the context and across `close`: a closer on another
        # thread (the file tier's late closer, an exit handler) must never destroy the
        # context while a call is inside it
        self._lock = threading.Lock()
        self._context = ctypes.c_void_p()  # None until resolved, and again once closed
        self._closed = False  # an own context was destroyed, or never will be made
        self.own_context = False  # registers in a context of its own (once `prepare`d)
        if not own_context:
            self._retain_primary()

    def prepare(self) -> None:
        """Make the registrar's own context now (with ``own_context``), from whichever thread
        should pay for it: background set-up's pin thread, beside the copy kernel's JIT.  Made
        in ``create`` it cost ``create`` 0.15-0.3 s (0.42-0.46 s against 0.13-0.27 s, 48 GiB
        over 2 ranks on an H200 host; docs/BENCHMARKS.md, "Populating by write faults on the
        GPU host")."""
        with self._lock:
            self._resolved()

    def _resolved(self) -> ctypes.c_void_p:
        """The context to register in, made on first use; under ``_lock``."""
        if self._closed:
            raise RuntimeError("the registrar was closed (its CUDA context destroyed)")
        if not self._context.value:
            self.own_context = self._create_context()
            if not self.own_context:
                self._retain_primary()
        return self._context

    def _retain_primary(self) -> None:
        # retained for the process's life, like the runtime's own reference to it
        check(require_libcuda().cuDevicePrimaryCtxRetain(ctypes.byref(self._context),
                                                         self._device),
              "cuDevicePrimaryCtxRetain")

    def _create_context(self) -> bool:
        """Make the registrar's own context and leave the calling thread's current one as it
        was; False, logged, where the device refuses a second context or its limits."""
        cuda = require_libcuda()
        context = ctypes.c_void_p()
        result = cuda.cuCtxCreate_v2(ctypes.byref(context), 0, self._device)
        if result == 0:  # cuCtxCreate made it current: set its limits, then pop it
            try:
                for limit in _UNUSED_LIMITS:
                    result = result or cuda.cuCtxSetLimit(limit, ctypes.c_size_t(0))
            finally:
                self._pop_checked(context)
            if result != 0:
                cuda.cuCtxDestroy_v2(context)
        if result != 0:
            log.warning("background set-up registers in the engine's own CUDA context, whose "
                        "launches then wait behind each registration: a context of its own on "
                        "device %d failed (%s)", self._index, error_name(result))
            return False
        self._context = context
        return True

    def register(self, address: int, length: int) -> None:
        flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
        with self._bound():
            check(self._register(address, length, flags),
                  f"cuMemHostRegister of {length} B ({format_size(length)}) at {address:#x}")

    def unregister(self, address: int) -> None:
        with self._bound():
            check(self._unregister(address), f"cuMemHostUnregister at {address:#x}")

    def close(self) -> None:
        """Destroy the registrar's own context, if it made one, and make none after: no call
        runs in it any more (idempotent).  Call it once every range is unregistered: destroying
        the context unregisters what is left.  In the primary context (the default, or the
        fallback) it does nothing: that context outlives the tier, and a second closer still
        unpinning (the file tier's late closer beside an exit handler) must be able to."""
        with self._lock:
            in_primary = self._context.value and not self.own_context
            if self._closed or in_primary:
                return
            self._closed = True
            context, self._context = self._context, ctypes.c_void_p()
            if context.value:
                check(require_libcuda().cuCtxDestroy_v2(context), "cuCtxDestroy")

    @contextlib.contextmanager
    def _bound(self) -> Iterator[None]:
        """The registrar's context, current on the calling thread inside (pushed, then
        popped: the thread's own context stack is as it was after)."""
        with self._lock:
            context = self._resolved()
            check(self._push(context), "cuCtxPushCurrent")
            try:
                yield
            finally:
                self._pop_checked(context)

    def _pop_checked(self, expected: ctypes.c_void_p) -> None:
        """Pop the calling thread's current context, which must be ``expected``."""
        popped = ctypes.c_void_p()
        check(self._pop(ctypes.byref(popped)), "cuCtxPopCurrent")
        if popped.value != expected.value:
            raise RuntimeError(f"popped CUDA context {popped.value:#x}, expected "
                               f"{expected.value or 0:#x}")


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


def choose_registrar(device: torch.device | str, own_context: bool = False) -> Registrar:
    """CUDA registration when the KV cache lives on a CUDA device that is present (in a
    context of its own with ``own_context``); otherwise the recording stand-in (nothing to pin
    for CPU tensors)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaRegistrar(device, own_context)
    return RecordingRegistrar()

