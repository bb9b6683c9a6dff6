"""Backend choice and the run-length measure the hybrid engine routes by (pure, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.mark.parametrize(("on_cuda", "pinned", "triton", "batch", "expected"), [
    (False, True, True, True, "host"),
    (True, False, True, True, "per_block"),
    (True, True, True, True, "hybrid"),
    (True, True, True, False, "triton"),
    (True, True, False, True, "copy_engine"),
    (True, True, False, False, "per_block"),
])
def test_auto_backend_choice(on_cuda: bool, pinned: bool, triton: bool, batch: bool,
                             expected: str) -> None:
    from offload.transfer.engine import choose_backend

    assert choose_backend(on_cuda, pinned, triton, batch) == expected


def test_mean_run_bytes_merges_consecutive_pages_on_cpu_tensors() -> None:
    from offload.transfer.base import CopySide, job_runs

    def mean_run_bytes(sides: list[CopySide], region: torch.Tensor, stride: int) -> float:
        return float(job_runs(sides, region, stride)[2].mean())

    src, dst = torch.zeros(64 * 1024, dtype=torch.uint8), torch.zeros(64 * 1024, dtype=torch.uint8)
    chunk = CopySide(dst, np.arange(4, dtype=np.int64) * 4096, src,
                     np.arange(4, dtype=np.int64) * 4096, 4096)
    lone = CopySide(dst, np.array([40960]), src, np.array([49152]), 4096)
    assert mean_run_bytes([chunk], dst, 65536) == 16384
    assert mean_run_bytes([chunk, lone], dst, 65536) == (16384 + 4096) / 2
    assert mean_run_bytes([chunk], dst, 8192) == 8192  # rows of 8 KiB: runs stop at each row


def test_coalesce_never_merges_across_a_host_row() -> None:
    from offload.transfer.layout import coalesce

    pages = np.arange(8, dtype=np.int64) * 4096
    merged = coalesce(pages, pages + 65536, np.full(8, 4096, dtype=np.int64), pages // 16384)
    assert merged[2].tolist() == [16384, 16384]
