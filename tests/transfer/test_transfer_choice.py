"""Backend choice by what the host offers (pure, CPU), and the host-row rule of coalescing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from offload.actor import kv_page_bytes
from offload.errors import OffloadError

NEEDS = {"host": set(), "per_block": {"cuda"}, "triton": {"cuda", "pinned", "triton"},
         "copy_engine": {"cuda", "pinned", "batch"},
         "hybrid": {"cuda", "pinned", "triton", "batch"}}
FASTEST_FIRST = ("hybrid", "triton", "copy_engine", "per_block")  # on pages: bench_engine.py


@pytest.mark.parametrize("offered", [
    {name for name, on in zip(("cuda", "pinned", "triton", "batch"), flags, strict=True) if on}
    for flags in itertools.product((False, True), repeat=4)])
def test_auto_backend_choice(offered: set[str]) -> None:
    """The pick runs with what is offered, and is the fastest such CUDA backend (CPU tensors:
    the host backend; nothing else can touch them)."""
    from offload.transfer.engine import choose_backend

    picked = choose_backend("cuda" in offered, "pinned" in offered, "triton" in offered,
                            "batch" in offered)
    if "cuda" not in offered:
        assert picked == "host"
        return
    runnable = [b for b in FASTEST_FIRST if NEEDS[b] <= offered]
    assert picked == runnable[0]


def test_coalesce_never_merges_across_a_host_row() -> None:
    from offload.transfer.layout import coalesce

    pages = np.arange(8, dtype=np.int64) * 4096
    merged = coalesce(pages, pages + 65536, np.full(8, 4096, dtype=np.int64), pages // 16384)
    assert merged[2].tolist() == [16384, 16384]


def test_descriptor_accepts_engine_views_and_refuses_strided_pages() -> None:
    """`describe` (via kv_page_bytes) checks tensors before any host memory exists."""
    kv = torch.zeros(6, 2, 4, 32, dtype=torch.bfloat16)
    assert kv_page_bytes([kv[:, 0], kv[:, 1], torch.zeros(6, 3)]) == (256, 256, 12)
    with pytest.raises(OffloadError, match=r"KV tensor 1 \(shape \(6, 32, 4\), strides "
                       r"\(256, 1, 32\)\) does not hold each block as one contiguous page"):
        kv_page_bytes([kv[:, 0], kv[:, 1].transpose(1, 2)])
