"""Choosing a backend for a rank's KV tensors and region."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from offload.errors import OffloadError
from offload.transfer.base import TransferEngine
from offload.transfer.layout import SlotLayout

BACKENDS = ("auto", "host", "triton", "copy_engine", "per_block")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def make_engine(kv_tensors: Sequence[torch.Tensor], region_tensor: torch.Tensor,
                region_address: int | None, layout: SlotLayout, chunk_count: int, pinned: bool,
                backend: str = "auto") -> TransferEngine:
    """Build this rank's engine.

    ``auto`` picks ``host`` for CPU KV tensors, ``triton`` for CUDA ones when the region is
    registered with CUDA and Triton imports, else ``per_block``.  ``region_address`` is the
    mapping's virtual address (the address CUDA kernels use for registered memory); it must be
    where ``region_tensor`` starts.
    """
    if backend not in BACKENDS:
        raise OffloadError(
            f"unknown transfer backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if region_address is not None and region_address != region_tensor.data_ptr():
        raise OffloadError(
            f"region address {region_address:#x} is not where the region tensor starts "
            f"({region_tensor.data_ptr():#x}); pass a tensor over the whole mapping"
        )
    if backend in ("triton", "copy_engine") and not pinned:
        raise OffloadError(
            f"backend {backend!r} moves host memory asynchronously and needs a region "
            "registered with CUDA; pin the region or use backend 'per_block'"
        )
    on_cuda = bool(kv_tensors) and kv_tensors[0].is_cuda
    if backend == "auto":
        backend = "host" if not on_cuda else (
            "triton" if pinned and triton_available() else "per_block")
    if backend == "host" and on_cuda:
        raise OffloadError("backend 'host' needs CPU KV tensors; use 'triton' or 'per_block'")
    if backend in ("triton", "copy_engine", "per_block") and not on_cuda:
        raise OffloadError(f"backend {backend!r} needs CUDA KV tensors; use 'host' or 'auto'")
    if backend == "host":
        from offload.transfer.host import HostEngine
        return HostEngine(kv_tensors, region_tensor, layout, chunk_count)
    if backend == "per_block":
        from offload.transfer.cuda import PerBlockEngine
        return PerBlockEngine(kv_tensors, region_tensor, layout, chunk_count)
    if backend == "copy_engine":
        from offload.transfer.batch_copy import BatchCopyEngine, batch_copy_available
        if not batch_copy_available():
            raise OffloadError("backend 'copy_engine' needs a CUDA 13 driver "
                               "(cuMemcpyBatchAsync_v2); use 'triton' or 'per_block'")
        return BatchCopyEngine(kv_tensors, region_tensor, layout, chunk_count)
    if not triton_available():
        raise OffloadError("backend 'triton' needs the triton package; install offload[gpu] "
                           "or use backend 'per_block'")
    from offload.transfer.triton_copy import TritonEngine
    return TritonEngine(kv_tensors, region_tensor, layout, chunk_count)
