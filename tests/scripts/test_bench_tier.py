"""`scripts/bench_tier.py` end to end on CPU tensors (the host backend): two ranks, every job
size verified byte-exact after a load into other blocks, the JSON complete.  The figures
themselves are the device's business (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import tail

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("barrier", ["gloo", "spin"])
def test_bench_tier_runs_and_verifies_on_cpu(tmp_path: Path, barrier: str) -> None:
    out = tmp_path / "tier.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_tier.py"), "--ranks", "2", "--layers", "2",
         "--page-bytes", "4KiB", "--blocks", "1,16", "--reps", "3", "--device", "cpu",
         "--timeout", "60", "--barrier", barrier, "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, tail(proc, 2000)
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["blocks"], r["direction"]) for r in rows] == [
        (1, "store"), (1, "load"), (16, "store"), (16, "load")]
    assert all(r["verified"] and r["GBps"] > 0 and r["submit_us"] > 0 for r in rows)
    assert report["engine"] == "host" and f"host engine on cpu, {barrier} barrier" in proc.stdout
    assert report["args"]["barrier"] == barrier
