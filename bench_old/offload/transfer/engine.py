"""Choosing a backend for a rank's KV tensors and region."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from offload.config import DEFAULT_STAGING_BYTES
from offload.errors import OffloadError
from offload.transfer.base import TransferEngine
from offload.transfer.layout import SlotLayout

BACKENDS = ("auto", "host", "hybrid", "triton", "copy_engine", "per_block")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_backend(on_cuda: bool, pinned: bool, has_triton: bool, has_batch_copy: bool
                   ) -> str:
    """``host`` for CPU KV tensors; for CUDA ones with a pinned region ``hybrid`` (copy engines
    for long runs, the kernel for short ones) when both halves exist, else whichever exists;
    ``per_block`` for an unpinned region, the only path that needs no pinning."""
    if not on_cuda:
        return "host"
    if not pinned:
        return "per_block"
    if has_triton and has_batch_copy:
        return "hybrid"
    if has_triton:
        return "triton"
    return "copy_engine" if has_batch_copy else "per_block"


def make_engine(kv_tensors: Sequence[torch.Tensor], region_tensor: torch.Tensor,
                region_address: int | None, layout: SlotLayout, chunk_count: int, pinned: bool,
                backend: str = "auto", priority: int = 0,
                staging_bytes: int = DEFAULT_STAGING_BYTES) -> TransferEngine:
    """Build this rank's engine.

    ``auto`` picks by `choose_backend`.  ``region_address`` is the
    mapping's virtual address (the address CUDA kernels use for registered memory); it must be
    where ``region_tensor`` starts.  ``priority`` is the CUDA backends' stream priority (lower
    is higher, as in ``torch.cuda.Stream``).  ``staging_bytes`` bounds the GPU memory of
    ``hybrid``'s staged path for whole chunks (`offload.transfer.staging`; 0: none).
    """
    if backend not in BACKENDS:
        raise OffloadError(
            f"unknown transfer backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if region_address is not None and region_address != region_tensor.data_ptr():
        raise OffloadError(
            f"region address {region_address:#x} is not where the region tensor starts "
            f"({region_tensor.data_ptr():#x}); pass a tensor over the whole mapping"
        )
    if backend in ("hybrid", "triton", "copy_engine") and not pinned:
        raise OffloadError(
            f"backend {backend!r} moves host memory asynchronously and needs a region "
            "registered with CUDA; pin the region or use backend 'per_block'"
        )
    on_cuda = bool(kv_tensors) and kv_tensors[0].is_cuda
    if backend == "auto":
        from offload.transfer.batch_copy import batch_copy_available
        backend = choose_backend(on_cuda, pinned, triton_available(), batch_copy_available())
    if backend == "host" and on_cuda:
        raise OffloadError("backend 'host' needs CPU KV tensors; use 'triton' or 'per_block'")
    if backend in ("hybrid", "triton", "copy_engine", "per_block") and not on_cuda:
        raise OffloadError(f"backend {backend!r} needs CUDA KV tensors; use 'host' or 'auto'")
    if backend == "host":
        from offload.transfer.host import HostEngine
        return HostEngine(kv_tensors, region_tensor, layout, chunk_count)
    if backend == "per_block":
        from offload.transfer.cuda import PerBlockEngine
        return PerBlockEngine(kv_tensors, region_tensor, layout, chunk_count, priority)
    if backend == "hybrid":
        from offload.transfer.batch_copy import batch_copy_available
        if not (triton_available() and batch_copy_available()):
            raise OffloadError("backend 'hybrid' needs triton and a CUDA 13 driver "
                               "(cuMemcpyBatchAsync_v2); use 'triton' or 'per_block'")
        from offload.transfer.hybrid import HybridEngine
        return HybridEngine(kv_tensors, region_tensor, layout, chunk_count, priority=priority,
                            staging_bytes=staging_bytes)
    if backend == "copy_engine":
        from offload.transfer.batch_copy import BatchCopyEngine, batch_copy_available
        if not batch_copy_available():
            raise OffloadError("backend 'copy_engine' needs a CUDA 13 driver "
                               "(cuMemcpyBatchAsync_v2); use 'triton' or 'per_block'")
        return BatchCopyEngine(kv_tensors, region_tensor, layout, chunk_count, priority)
    if not triton_available():
        raise OffloadError("backend 'triton' needs the triton package; install offload[gpu] "
                           "or use backend 'per_block'")
    from offload.transfer.kernel import TritonEngine
    return TritonEngine(kv_tensors, region_tensor, layout, chunk_count, priority=priority)
