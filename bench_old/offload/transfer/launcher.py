"""A compiled Triton kernel launched with one driver call and an argument block built once.

Triton's Python launch path (binding and specialising arguments, launch metadata, its C
launcher parsing ~20 Python arguments) costs more host time per call than the rest of a small
job's submit (docs/BENCHMARKS.md, "Host time in `submit`").  An engine launches one kernel with
the same pointers job after job; only a few integers change.  `BoundKernel` keeps the kernel's
parameters in ctypes cells behind one ``void *[]`` array and launches with ``cuLaunchKernel``
directly, after updating the cells that changed -- the approach of PyTorch Inductor's static
CUDA launcher, without a C extension.

The parameter block must match what Triton compiled, so nothing is assumed: the driver reports
every parameter's size (``cuFuncGetParamInfo``, CUDA 12.4+), the caller's values fill the first
ones in order (8-byte pointers, 4- or 8-byte integers as Triton typed them), and the rest must
be the hidden 8-byte scratch pointers Triton appends (global and profile scratch), which are
NULL when the compiled kernel asks for no scratch.  Anything else -- an older driver or Triton,
cooperative or cluster launches, scratch memory, launch hooks installed by a profiler -- and
`bind` returns None: the caller keeps Triton's own launcher.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from offload.cuda_driver import bound_function, check, libcuda

_CELL = {4: ctypes.c_int32, 8: ctypes.c_int64}
CUDA_ERROR_INVALID_VALUE = 1


def param_sizes(function: int) -> list[int] | None:
    """Byte size of each parameter of the ``CUfunction``, or None where the driver cannot say."""
    lib = libcuda()
    if lib is None or not hasattr(lib, "cuFuncGetParamInfo"):
        return None
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    sizes: list[int] = []
    while True:
        result = lib.cuFuncGetParamInfo(ctypes.c_void_p(function), ctypes.c_size_t(len(sizes)),
                                        ctypes.byref(offset), ctypes.byref(size))
        if result == CUDA_ERROR_INVALID_VALUE:  # past the last parameter
            return sizes
        if result != 0 or len(sizes) > 256:
            return None
        sizes.append(size.value)


def plain_launch(metadata: Any) -> bool:
    """Whether Triton would launch this kernel with a plain ``cuLaunchKernel``: one CTA per
    cluster, not cooperative, no programmatic dependent launch, no scratch memory."""
    return (getattr(metadata, "num_ctas", 1) == 1
            and tuple(getattr(metadata, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) in
            ((1, 1, 1), (0, 0, 0))
            and not getattr(metadata, "launch_cooperative_grid", False)
            and not getattr(metadata, "launch_pdl", False)
            and not getattr(metadata, "global_scratch_size", 0)
            and not getattr(metadata, "profile_scratch_size", 0))


class BoundKernel:
    """``cuLaunchKernel`` of one function with a parameter block of ctypes cells; `set`
    changes a cell, `launch` issues the kernel on a raw stream handle."""

    def __init__(self, function: int, threads: int, shared: int, sizes: Sequence[int],
                 values: Sequence[int]) -> None:
        self._cells = [_CELL[s](v) for s, v in zip(sizes, values, strict=False)]
        self._cells += [ctypes.c_int64(0) for _ in sizes[len(values):]]  # hidden scratch: NULL
        self._limits = [1 << (8 * s - 1) for s in sizes]
        self._params = (ctypes.c_void_p * len(sizes))(
            *[ctypes.cast(ctypes.byref(c), ctypes.c_void_p) for c in self._cells])
        self._function = ctypes.c_void_p(function)
        self.function, self.threads, self.shared = function, threads, shared
        self.params_address = ctypes.addressof(self._params)
        self._launch = bound_function("cuLaunchKernel", ctypes.c_void_p, *[ctypes.c_uint] * 7,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

    def fits(self, index: int, value: int) -> bool:
        """Whether ``value`` fits parameter ``index`` as compiled (an int32 parameter cannot
        take a value Triton would have compiled as int64)."""
        return -self._limits[index] <= value < self._limits[index]

    def cell(self, index: int) -> tuple[int, int]:
        """Address and byte size of parameter ``index``'s cell (for a native launcher that
        writes it in place, `offload.transfer.native`)."""
        return ctypes.addressof(self._cells[index]), ctypes.sizeof(self._cells[index])

    def set(self, index: int, value: int) -> None:
        self._cells[index].value = value

    def launch(self, grid: int, stream: int) -> None:
        check(self._launch(self._function, grid, 1, 1, self.threads, 1, 1, self.shared,
                           stream, self._params, None), "cuLaunchKernel")


def hooks_active(hooks: Sequence[object]) -> bool:
    """Whether any of Triton's launch hooks would run: a callable (older Triton) or a
    ``HookChain`` holding calls (Triton 3.5+, where the knob is a chain, empty by default)."""
    return any(hook is not None and bool(getattr(hook, "calls", True)) for hook in hooks)


def bind(compiled: Any, values: Sequence[int], hooks: Sequence[object] = ()) -> BoundKernel | None:
    """A `BoundKernel` for Triton's ``compiled`` kernel whose leading parameters take
    ``values`` (pointers and integers, in signature order, constexprs left out), or None
    where the launch cannot be reproduced exactly (module docstring)."""
    if hooks_active(hooks):
        return None  # a profiler is watching Triton's launches: keep them visible to it
    metadata = getattr(compiled, "metadata", None)
    init = getattr(compiled, "_init_handles", None)
    if metadata is None or not plain_launch(metadata):
        return None
    if init is not None:
        init()
    function = getattr(compiled, "function", None)
    if not isinstance(function, int) or not function:
        return None
    return bind_function(function, int(metadata.num_warps), int(metadata.shared), values)


def bind_function(function: int, num_warps: int, shared: int, values: Sequence[int]
                  ) -> BoundKernel | None:
    """A `BoundKernel` for a loaded Triton ``CUfunction`` (compiled for a plain launch with
    ``num_warps`` warps and ``shared`` bytes of shared memory) whose leading parameters take
    ``values``, or None where its parameters are not those values plus Triton's NULL scratch
    pointers, or where the driver cannot say."""
    sizes = param_sizes(function)
    if (sizes is None or len(sizes) < len(values) or len(sizes) > len(values) + 2
            or any(s not in _CELL for s in sizes) or any(s != 8 for s in sizes[len(values):])):
        return None
    kernel = BoundKernel(function, 32 * num_warps, shared, sizes, values)
    if not all(kernel.fits(i, v) for i, v in enumerate(values)):
        return None
    return kernel
