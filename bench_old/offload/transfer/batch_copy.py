"""The copy-engine path: one ``cuMemcpyBatchAsync`` call per job.

The DMA engines move a job's pages without occupying a single SM, so a copy costs concurrent
compute nothing, where even a kernel-driven copy on a few SMs slows a concurrent matmul
(docs/BENCHMARKS.md, "Transfers").  The driver takes raw arrays of destination, source and size,
which numpy builds without a Python object per page: per-pointer Python lists through
``cuda-bindings`` cost tens of milliseconds for a large job (docs/BENCHMARKS.md, "Figures moved
from code comments").  Copies that continue each other are
coalesced first (`layout.coalesce`), so a chunk of consecutive blocks is one descriptor --
but never across two host registrations or two device allocations (`copy_runs`): the driver
refuses a copy that spans either ("invalid argument"), and small KV tensors from the caching
allocator often lie in neighbouring segments, so a run can continue from one into the next.

Needs a driver with the CUDA 13 entry point ``cuMemcpyBatchAsync_v2`` and host memory
registered with CUDA (the engine is only chosen for a pinned region).  With integrity on, the
Triton kernel in sum-only mode writes (store, before the DMA) or checks (load, after it) the
pages' checksums over the GPU pages (`offload.transfer.kernel`); without Triton the engine runs
without checksums and says so once.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from offload.cuda_driver import allocation_ranges, driver_call, has_entry_point
from offload.errors import OffloadError
from offload.transfer.base import Direction
from offload.transfer.cuda import StreamEngine
from offload.transfer.layout import IndexArray, Job, SlotLayout, coalesce, page_addresses
from offload.transfer.tensors import KVGeometry

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from offload.transfer.kernel import KernelCopier

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
BATCH_ENTRY = "cuMemcpyBatchAsync_v2"


class _Attributes(ctypes.Structure):
    """``CUmemcpyAttributes``: source access order, two location hints, flags."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int),
                ("src_loc_id", ctypes.c_int), ("dst_loc_type", ctypes.c_int),
                ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


def batch_copy_available() -> bool:
    """Whether this host's CUDA driver exports ``cuMemcpyBatchAsync_v2`` (CUDA 13+)."""
    return torch.cuda.is_available() and has_entry_point(BATCH_ENTRY)


class BatchCopier:
    """Issues copies given as (source, destination, bytes) address arrays; returns the arrays
    the driver was given, to be kept until the job's event completes."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        if not has_entry_point(BATCH_ENTRY):
            raise RuntimeError("this CUDA driver has no cuMemcpyBatchAsync_v2 (needs CUDA 13)")
        self._stream = stream
        self._attrs = _Attributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, 0, 0, 0, 0, 0)
        self._attr_index = np.zeros(1, dtype=np.uint64)

    @property
    def attributes(self) -> tuple[int, int]:
        """Addresses of the one attribute set every copy uses and of its index array."""
        return ctypes.addressof(self._attrs), self._attr_index.ctypes.data

    def launch_runs(self, src: np.ndarray, dst: np.ndarray, size: np.ndarray
                    ) -> tuple[np.ndarray, ...]:
        srcs, dsts, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (src, dst, size))
        self.launch_part(srcs, dsts, sizes, 0, srcs.size)
        return srcs, dsts, sizes

    def launch_part(self, srcs: np.ndarray, dsts: np.ndarray, sizes: np.ndarray, first: int,
                    count: int) -> None:
        """Copies ``first`` .. ``first + count - 1`` of contiguous uint64 address arrays (a
        staged job's DMAs, issued slice by slice without copying the arrays)."""
        at = 8 * first
        driver_call(BATCH_ENTRY, ctypes.c_void_p(dsts.ctypes.data + at),
                    ctypes.c_void_p(srcs.ctypes.data + at), ctypes.c_void_p(sizes.ctypes.data + at),
                    ctypes.c_size_t(count), ctypes.byref(self._attrs),
                    ctypes.c_void_p(self._attr_index.ctypes.data), ctypes.c_size_t(1),
                    ctypes.c_void_p(self._stream.cuda_stream))


def allocation_starts(kv_bases: Sequence[int], block_strides: Sequence[int],
                      page_bytes: Sequence[int], num_blocks: int,
                      ranges: Sequence[Sequence[tuple[int, int]]]) -> IndexArray:
    """The sorted starts of the device allocations the KV tensors lie in, given each tensor's
    allocations (``ranges[t]``, `offload.cuda_driver.allocation_ranges` over its bytes): a
    page's allocation is then the last start at or below it (`copy_runs`).

    A page must lie in one allocation, since the copy engines move it in one piece; tensors
    in memory mapped piecewise (expandable segments) can break that where a page straddles a
    piece's end, and such tensors are refused with the way out."""
    starts: set[int] = set()
    for t, (base, stride, page, pieces) in enumerate(
            zip(kv_bases, block_strides, page_bytes, ranges, strict=True)):
        for start, size in pieces:
            starts.add(start)
            end = start + size
            block = straddled_block(end, base, stride, page, num_blocks)
            if block is not None:
                raise OffloadError(
                    f"KV tensor {t}'s block {block} spans two CUDA allocations (one ends at "
                    f"{end:#x}), which the copy engines cannot copy in one piece; allocate "
                    "each KV tensor in one piece (no expandable segments) or use backend "
                    "'triton'")
    return np.array(sorted(starts), dtype=np.int64)


def straddled_block(end: int, base: int, stride: int, page: int, num_blocks: int
                    ) -> int | None:
    """The block of a tensor (pages of ``page`` bytes every ``stride`` from ``base``) whose
    page ``end`` falls strictly inside, or None."""
    if num_blocks == 1 or stride == 0:  # one page: any stride is allowed
        return 0 if base < end < base + page else None
    block, within = divmod(end - base, stride)  # stride >= page (`kv_geometry`)
    return block if 0 <= block < num_blocks and 0 < within < page else None


def kv_allocations(kv_tensors: Sequence[torch.Tensor], geometry: KVGeometry) -> IndexArray:
    """`allocation_starts` of ``kv_tensors`` (described by ``geometry``), asking the driver
    for each one's allocations.

    Where the driver cannot say (a pointer it does not know), each tensor's own start stands
    in: runs then never join two tensors -- the case seen to fail -- at the price of a few more
    descriptors where tensors share an allocation."""
    bases = [t.data_ptr() for t in kv_tensors]
    strides, pages, num_blocks = geometry.block_strides, geometry.page_bytes, geometry.num_blocks
    try:
        ranges = [allocation_ranges(base, (num_blocks - 1) * stride + page)
                  for base, stride, page in zip(bases, strides, pages, strict=True)]
    except RuntimeError as exc:
        log.warning("the KV tensors' device allocations are unknown (%s): the copy engines' "
                    "runs stop at every tensor", exc)
        return np.array(sorted(set(bases)), dtype=np.int64)
    return allocation_starts(bases, strides, pages, num_blocks, ranges)


def copy_runs(layout: SlotLayout, region_base: int, kv_bases: IndexArray,
              block_strides: IndexArray, allocations: IndexArray, direction: Direction,
              job: Job) -> tuple[IndexArray, IndexArray, IndexArray]:
    """``job`` as one (source, destination, bytes) copy per page of every tensor (whole-array
    numpy operations), merged where pages continue each other on both sides (`coalesce`)
    within one host registration -- one host row, or one piece of it where the row is
    registered in pieces (`SlotLayout.cuts`; a page never spans a cut) -- and within one
    device allocation (``allocations``, `allocation_starts`): a batched copy may span
    neither, and separate KV tensors are often neighbours in the address space."""
    kv, host = page_addresses(kv_bases, block_strides, region_base, layout, job)
    sizes = np.broadcast_to(np.asarray(layout.page_bytes, dtype=np.int64)[:, None], kv.shape)
    rows = np.broadcast_to(job.host_pages // layout.blocks_per_chunk, kv.shape)
    if layout.cuts:
        within = host - region_base - rows * layout.row_stride
        rows = rows * (len(layout.cuts) + 1) + layout.piece_of(within)
    key = rows if allocations.size <= 1 else rows * (allocations.size + 1) + page_allocations(
        allocations, kv_bases, block_strides, job.blocks, kv)
    src, dst = (kv, host) if direction == "store" else (host, kv)
    return coalesce(src.ravel(), dst.ravel(), sizes.ravel(), key.ravel())


def page_allocations(allocations: IndexArray, kv_bases: IndexArray, block_strides: IndexArray,
                     blocks: IndexArray, kv: IndexArray) -> IndexArray:
    """Which of ``allocations`` each page (``kv``: [tensors, entries] addresses) lies in, as
    the count of starts at or below it: one number per tensor where the job's lowest and
    highest blocks of every tensor lie in one allocation (the common case, a KV tensor
    allocated whole: no per-page search), else one per page."""
    if blocks.size == 0:
        return np.zeros((1, 1), dtype=np.int64)
    low = np.searchsorted(allocations, kv_bases + blocks.min() * block_strides, side="right")
    high = np.searchsorted(allocations, kv_bases + blocks.max() * block_strides, side="right")
    if (low == high).all():
        return low[:, None]
    return np.searchsorted(allocations, kv, side="right")


def page_copies(engine: StreamEngine, allocations: IndexArray, direction: Direction, job: Job
                ) -> tuple[IndexArray, IndexArray, IndexArray]:
    """`copy_runs` of a job on ``engine``, whose KV tensors lie in ``allocations``."""
    return copy_runs(engine.layout, engine._region.data_ptr(), engine._kv_bases,
                     engine._block_strides, allocations, direction, job)


class BatchCopyEngine(StreamEngine):
    """Every job as per-page descriptors (`page_copies`) in one driver call."""

    name = "copy_engine"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int, priority: int = 0) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count, priority)
        self.batch = BatchCopier(self._stream)
        self.allocations = kv_allocations(kv_tensors, self._geometry)
        self.kernel: KernelCopier | None = None
        if layout.integrity:
            from offload.transfer.engine import triton_available
            if triton_available():
                from offload.transfer.kernel import kernel_copier
                self.kernel = kernel_copier(self)
            else:
                log.warning("transfer backend 'copy_engine' without triton cannot checksum "
                            "pages: integrity is off for this rank's jobs; install triton")
                self.integrity = False

    def _launch(self, direction: Direction, job: Job) -> object:
        sums = None
        if self.kernel is not None and direction == "store":
            sums = self.kernel.launch(direction, job, copy=False)
        copies = self.batch.launch_runs(*page_copies(self, self.allocations, direction, job))
        if self.kernel is not None and direction == "load":
            sums = self.kernel.launch(direction, job, copy=False)
        return copies if sums is None else (sums, copies)
