"""The real-model prefix reload (launch/prefix_reload.py): its paging math, the transformers
cache round trip, and the job end to end under torchrun, including a run whose reloaded page is
corrupted on purpose (the check must catch it) and its user errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.prefix_reload import (
    blocks_for,
    build_cache,
    first_difference,
    from_pages,
    head_range,
    layer_kv,
    reload_table,
    to_pages,
)
from offload.errors import OffloadError
from tests.harness import run_on_free_port, tail

ROOT = Path(__file__).resolve().parents[2]
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs transformers (pip install -e .[test])")
SMALL = ("--prompt-tokens", "21,40", "--layers", "2", "--decode-tokens", "5",
         "--cpu-bytes", "8MiB", "--num-gpu-blocks", "24", "--timeout", "60")


def torchrun(nproc: int, *args: str, shm_dir: str, env: dict[str, str] | None = None,
             device: str = "cpu") -> subprocess.CompletedProcess[str]:
    return run_on_free_port(
        lambda port: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                      "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                      "--master-port", port, str(ROOT / "launch" / "prefix_reload.py"),
                      "--device", device, "--shm-dir", shm_dir, *args],
        cwd=ROOT, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def our_errors(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("offload: error:")]


# ---------------------------------------------------------------------- pure parts
def test_heads_split_evenly_or_are_all_held_when_replicated() -> None:
    assert [head_range(4, 2, r, False) for r in range(2)] == [(0, 2), (2, 4)]
    assert [head_range(8, 4, r, False) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert head_range(1, 2, 1, True) == (0, 1)
    with pytest.raises(OffloadError, match="--kv-heads 3 does not split over 2 ranks"):
        head_range(3, 2, 0, False)


def test_pages_round_trip_with_a_partial_last_block_zero_padded() -> None:
    x = torch.randn(3, 37, 8)  # [heads, tokens, dim]
    pages = to_pages(x, 16)
    assert pages.shape == (blocks_for(37, 16), 16, 3, 8) == (3, 16, 3, 8)
    assert torch.equal(pages[1, 4, 2], x[2, 20])  # token 20 = block 1, offset 4
    assert not pages[2, 5:].any()  # tokens 37.. of the last block
    assert torch.equal(from_pages(pages, 37), x) and from_pages(pages, 37).is_contiguous()


def test_first_difference_is_byte_exact_and_names_the_element() -> None:
    a = torch.zeros(2, 3, 4)
    b = a.clone()
    assert first_difference(a, b) is None
    b[1, 2, 3] = -0.0  # equal as numbers, different bytes
    assert first_difference(a, b) == (1, 2, 3)
    b[0, 1, 0] = 1.0
    assert first_difference(a, b) == (0, 1, 0)


def test_reload_tables_avoid_old_blocks_and_agree_across_ranks() -> None:
    tables = [reload_table(torch.Generator().manual_seed(5), 24, {0, 1, 2, 3}, 6)
              for _ in range(2)]
    assert tables[0] == tables[1] and len(set(tables[0])) == 6
    assert not set(tables[0]) & {0, 1, 2, 3}
    with pytest.raises(OffloadError, match="--num-gpu-blocks 8 leaves 4 blocks outside"):
        reload_table(torch.Generator(), 8, {0, 1, 2, 3}, 5)


@needs_transformers
def test_cache_built_from_tensors_reads_back_the_same_tensors() -> None:
    import transformers

    kv = [torch.randn(2, 5, 4) for _ in range(6)]
    cache = build_cache(transformers, kv)
    for layer in range(3):
        k, v = layer_kv(cache, layer)
        assert torch.equal(k[0], kv[2 * layer]) and torch.equal(v[0], kv[2 * layer + 1])


# ---------------------------------------------------------------------- end to end
@needs_transformers
@pytest.mark.parametrize("layout", ["private", "replicated", "shared"])
def test_every_reload_continues_exactly_like_the_never_offloaded_cache(
        layout: str, tmp_path: Path, shm_dir: str) -> None:
    report_path = tmp_path / "r.json"
    proc = torchrun(2, "--layout", layout, *SMALL, "--report-json", str(report_path),
                    shm_dir=shm_dir)
    assert proc.returncode == 0, tail(proc)
    report = json.loads(report_path.read_text())
    assert report["reloads"] == report["matched"] == 6 and report["mismatched"] == 0
    assert report["restored_tokens"] == 3 * (21 + 40)
    assert report["first_difference"] is None and report["shm_files_left"] == 0
    assert report["kv_heads_per_rank"] == (1 if layout == "replicated" else 2)
    for prompt in report["prompts"]:
        original, *reloads = prompt["tables"]
        assert len(reloads) == 3 and len(prompt["reference_tokens"]) == 6
        for previous, table in zip([original, *reloads], reloads, strict=False):
            # always into other blocks than it was stored from and than the previous reload
            assert not set(table) & (set(original) | set(previous))
    assert report["time_s"]["prefill_median"] > 0 and report["time_s"]["reload_median"] > 0
    assert "6/6 reloads matched" in proc.stdout


@needs_transformers
def test_a_corrupted_reloaded_page_is_caught_with_its_position(tmp_path: Path,
                                                                shm_dir: str) -> None:
    report_path = tmp_path / "r.json"
    proc = torchrun(2, *SMALL, "--corrupt-after-load", "--report-json", str(report_path),
                    shm_dir=shm_dir)
    assert proc.returncode != 0
    report = json.loads(report_path.read_text())
    assert report["mismatched"] == 1 and report["matched"] == report["reloads"] - 1 == 5
    diff = report["first_difference"]
    assert {k: diff[k] for k in ("rank", "prompt", "reload", "what", "layer", "tensor",
                                 "position", "head", "dim")} == {
        "rank": 0, "prompt": 0, "reload": 0, "what": "page", "layer": 0, "tensor": "K",
        "position": 0, "head": 0, "dim": 0}
    assert report["restored_tokens"] == 3 * (21 + 40) - 21
    assert "prefix reload failed: 1 of 6 reloads mismatched" in proc.stderr
    assert report["shm_files_left"] == 0


@needs_transformers
def test_kv_as_views_of_one_tensor_per_layer(tmp_path: Path, shm_dir: str) -> None:
    report_path = tmp_path / "r.json"
    proc = torchrun(2, *SMALL, "--kv-views", "--report-json", str(report_path),
                    shm_dir=shm_dir)
    assert proc.returncode == 0, tail(proc)
    report = json.loads(report_path.read_text())
    assert report["matched"] == report["reloads"] == 6 and report["kv_views"]


def test_kv_heads_that_do_not_split_are_one_line(shm_dir: str) -> None:
    proc = torchrun(2, "--kv-heads", "3", shm_dir=shm_dir)
    assert proc.returncode != 0
    errors = our_errors(proc)
    assert len(errors) == 1 and "--kv-heads 3 does not split over 2 ranks" in errors[0], \
        proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr


def test_missing_transformers_is_one_line(tmp_path: Path, shm_dir: str) -> None:
    # a module that fails to import stands in for an absent install
    (tmp_path / "transformers.py").write_text("raise ImportError('not installed')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = torchrun(1, shm_dir=shm_dir, env=env)
    assert proc.returncode != 0
    errors = our_errors(proc)
    assert len(errors) == 1 and "pip install 'offload[model]'" in errors[0], proc.stderr[-3000:]


@needs_transformers
@pytest.mark.parametrize(("nproc", "layout"), [(1, "private"), (2, "replicated")])
def test_a_layer_wise_reload_continues_exactly_too(nproc: int, layout: str, tmp_path: Path,
                                                   shm_dir: str) -> None:
    """Each reload also runs layer-wise (the load in groups, the first decode step started at
    once, each layer waiting for its group): every one of those reloads matches as well, and
    the report times the first token both ways."""
    report_path = tmp_path / "r.json"
    proc = torchrun(nproc, "--layout", layout, *SMALL, "--layerwise", "3", "--report-json",
                    str(report_path), shm_dir=shm_dir)
    assert proc.returncode == 0, tail(proc)
    report = json.loads(report_path.read_text())
    assert report["reloads"] == report["matched"] == 12 and report["mismatched"] == 0
    assert report["layerwise_groups"] == 3 and report["restored_tokens"] == 6 * (21 + 40)
    first = report["time_s"]["ttft_median"]
    assert set(first) == {"whole", "forward", "layerwise", "layerwise_load",
                          "layerwise_load_alone", "paged_forward",
                          "layerwise_over_longer", "layerwise_submit"}
    assert all(v > 0 for v in first.values())
    assert "layer-wise (3 groups)" in proc.stdout


@needs_transformers
def test_a_corrupted_page_of_the_layer_wise_load_alone_is_caught(tmp_path: Path,
                                                                  shm_dir: str) -> None:
    """The layer-wise load timed alone is checked as well: a byte flipped after it fails
    that reload, though the load with the decode step brings clean pages back."""
    report_path = tmp_path / "r.json"
    proc = torchrun(1, *SMALL, "--layerwise", "3", "--corrupt-after-load", "--report-json",
                    str(report_path), shm_dir=shm_dir)
    assert proc.returncode != 0
    report = json.loads(report_path.read_text())
    assert report["mismatched"] == 2 and report["matched"] == report["reloads"] - 2 == 10
    assert report["first_difference"]["what"] == "page"


def test_layer_wise_reloads_of_split_heads_are_one_line(shm_dir: str) -> None:
    proc = torchrun(2, "--layerwise", "2", shm_dir=shm_dir)
    assert proc.returncode != 0
    errors = our_errors(proc)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "--layerwise needs every rank to hold all KV heads" in errors[0]
