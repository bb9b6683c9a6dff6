"""The real-model prefix reload on CUDA (bfloat16): two ranks (sharing one GPU where there is
only one) store, reload into other blocks and decode exactly as from the never-offloaded
cache, in every layout."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.launch.test_prefix_reload import torchrun

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="needs transformers (pip install -e .[model])")]


@pytest.mark.parametrize("layout", ["private", "shared", "replicated"])
def test_every_reload_matches_on_cuda(layout: str, tmp_path: Path, shm_dir: str) -> None:
    report_path = tmp_path / "r.json"
    proc = torchrun(2, "--layout", layout, "--report-json", str(report_path), "--timeout", "120",
                    shm_dir=shm_dir, device="cuda")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert (report["device"], report["dtype"]) == ("cuda", "bfloat16")
    assert report["reloads"] == report["matched"] == 9 and report["mismatched"] == 0
    assert report["first_difference"] is None and report["shm_files_left"] == 0
