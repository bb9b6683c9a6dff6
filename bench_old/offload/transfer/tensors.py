"""Which KV tensors a backend can move, checked before any host memory exists.

An engine's KV cache is one tensor per layer (and K/V); block ``i`` of a tensor must be one
contiguous page at ``data_ptr + i * stride(0)``.  That admits plain ``[blocks, ...]`` tensors,
views such as ``kv[:, 0]`` / ``kv[:, 1]`` of a ``[blocks, 2, ...]`` tensor (``stride(0)`` two
pages) and different page sizes per tensor; a page that is itself strided (a transposed view)
or blocks that overlap cannot be copied as pages and are refused here, by name and stride.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from offload.errors import OffloadError


@dataclass(frozen=True)
class KVGeometry:
    """Per KV tensor: page bytes and block stride in bytes (``stride(0) x element size``); one
    block count and device for all."""

    page_bytes: tuple[int, ...]
    block_strides: tuple[int, ...]
    num_blocks: int
    device: torch.device


def kv_geometry(kv_tensors: Sequence[torch.Tensor]) -> KVGeometry:
    """Check every KV tensor and describe it; raises a one-line `OffloadError` naming the
    first tensor that cannot be moved page by page and why."""
    if not kv_tensors:
        raise OffloadError("no KV tensors given; pass the rank's KV cache tensors")
    first = kv_tensors[0]
    pages, strides = [], []
    for t, kv in enumerate(kv_tensors):
        if kv.dim() < 1 or kv.shape[0] == 0:
            raise OffloadError(f"KV tensor {t} has shape {tuple(kv.shape)}; dimension 0 must "
                               "index at least one block")
        if kv.shape[0] != first.shape[0] or kv.device != first.device:
            raise OffloadError(
                f"KV tensor {t} has {kv.shape[0]} blocks on {kv.device} but tensor 0 has "
                f"{first.shape[0]} on {first.device}; all KV tensors need the same block "
                "count and one device"
            )
        page = kv[0].numel() * kv.element_size()
        stride = kv.stride(0) * kv.element_size()
        if not kv[0].is_contiguous():
            raise OffloadError(
                f"KV tensor {t} (shape {tuple(kv.shape)}, strides {kv.stride()}) does not hold "
                "each block as one contiguous page; only dimension 0 (blocks) may be strided, "
                "e.g. kv[:, 0] of a [blocks, 2, ...] tensor, not a transposed view"
            )
        if kv.shape[0] > 1 and stride < page:
            raise OffloadError(
                f"KV tensor {t} (shape {tuple(kv.shape)}, strides {kv.stride()}) has blocks "
                f"{stride} bytes apart but {page}-byte pages, so its blocks overlap; pass a "
                "tensor whose stride(0) spans at least one page"
            )
        pages.append(page)
        strides.append(stride)
    return KVGeometry(tuple(pages), tuple(strides), first.shape[0], first.device)


def page_view(kv: torch.Tensor, page: int, stride: int) -> torch.Tensor:
    """A ``[blocks, page]`` uint8 view of ``kv``'s pages (row ``i`` = block ``i``), over the
    same memory whatever the tensor's dtype and block stride."""
    flat = torch.empty(0, dtype=torch.uint8, device=kv.device)
    return flat.set_(kv.untyped_storage(), kv.storage_offset() * kv.element_size(),
                     (kv.shape[0], page), (stride, 1))


def region_pages(region: torch.Tensor, offset: int, page: int, bpc: int, row_stride: int,
                 chunk_count: int) -> torch.Tensor:
    """A ``[chunks, positions, page]`` view of one tensor's host pages in a flat uint8 region
    (its first page ``offset`` bytes into row 0)."""
    return region.as_strided((chunk_count, bpc, page), (row_stride, page, 1),
                             region.storage_offset() + offset)
