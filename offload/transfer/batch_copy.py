"""The copy-engine backend: one ``cuMemcpyBatchAsync`` call per job.

The DMA engines move a job's pages without occupying a single SM, so a copy costs concurrent
compute nothing (a kernel-driven copy took 30% of a bf16 matmul's rate even on 4 SMs).  The
driver takes raw arrays of destination, source and size, which numpy builds without a Python
object per page (DESIGN.md section 7: building per-pointer Python lists through
``cuda-bindings`` cost 67 ms for 262,144 blocks).  Copies that continue each other are
coalesced first (`layout.coalesce`), so a chunk of consecutive blocks is one descriptor.

Needs a driver with the CUDA 13 entry point ``cuMemcpyBatchAsync_v2`` and host memory
registered with CUDA (the engine is only chosen for a pinned region).
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Sequence
from functools import cache

import numpy as np
import torch

from offload.transfer.base import CopySide, Direction, job_runs
from offload.transfer.cuda import StreamEngine
from offload.transfer.layout import SlotLayout

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1


class _Attributes(ctypes.Structure):
    """``CUmemcpyAttributes``: source access order, two location hints, flags."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int),
                ("src_loc_id", ctypes.c_int), ("dst_loc_type", ctypes.c_int),
                ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


@cache
def _driver() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuMemcpyBatchAsync_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.POINTER(_Attributes), ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return lib


def batch_copy_available() -> bool:
    """Whether this host's CUDA driver exports ``cuMemcpyBatchAsync_v2`` (CUDA 13+)."""
    return torch.cuda.is_available() and _driver() is not None


class BatchCopyEngine(StreamEngine):
    """Each job is one driver call on the engine's stream; the index arrays stay referenced
    until the job's event completes."""

    name = "copy_engine"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count)
        lib = _driver()
        if lib is None:
            raise RuntimeError("this CUDA driver has no cuMemcpyBatchAsync_v2 (needs CUDA 13)")
        self._lib = lib
        self._attrs = _Attributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, 0, 0, 0, 0, 0)
        self._attr_index = np.zeros(1, dtype=np.uint64)
        self._keep: deque[tuple[np.ndarray, ...]] = deque()

    def _launch(self, direction: Direction, sides: list[CopySide]) -> None:
        self._launch_runs(job_runs(sides, self._region, self._layout.row_stride))

    def _launch_runs(self, runs: tuple[np.ndarray, ...]) -> None:
        """One driver call for the job's merged copies (source, destination, bytes)."""
        if not runs[0].size:
            self._keep.append(())
            return
        srcs, dsts, sizes = (a.astype(np.uint64) for a in runs)
        stream = torch.cuda.current_stream().cuda_stream
        result = self._lib.cuMemcpyBatchAsync_v2(
            dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, srcs.size,
            ctypes.byref(self._attrs), self._attr_index.ctypes.data, 1, stream)
        if result != 0:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorString(result, ctypes.byref(text))
            message = text.value.decode() if text.value else "unknown error"
            raise RuntimeError(f"cuMemcpyBatchAsync of {srcs.size} copies failed: CUDA error "
                               f"{result} ({message})")
        self._keep.append((srcs, dsts, sizes))

    def poll(self) -> list[int]:
        finished = super().poll()
        self._release(len(finished))
        return finished

    def wait_all(self) -> list[int]:
        finished = super().wait_all()
        self._keep.clear()
        return finished

    def _release(self, jobs: int) -> None:
        for _ in range(min(jobs, len(self._keep))):
            self._keep.popleft()
