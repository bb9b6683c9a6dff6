"""`scripts/bench_tier.py` end to end on CPU tensors (the host backend): two ranks, every job
size verified byte-exact after a load into other blocks, the JSON complete.  The figures
themselves are the device's business (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import tail

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("barrier", "integrity"), [("gloo", "on"), ("spin", "both")])
def test_bench_tier_runs_and_verifies_on_cpu(tmp_path: Path, barrier: str,
                                             integrity: str) -> None:
    """With ``--integrity both`` two tiers run side by side, their jobs alternating: a row per
    tier, each verified, and the on/off ratios printed."""
    out = tmp_path / "tier.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_tier.py"), "--ranks", "2", "--layers", "2",
         "--page-bytes", "4KiB", "--blocks", "1,16", "--reps", "3", "--device", "cpu",
         "--timeout", "60", "--barrier", barrier, "--integrity", integrity, "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, tail(proc, 2000)
    report = json.loads(out.read_text())
    rows = report["rows"]
    tiers = ["on", "off"] if integrity == "both" else ["on"]
    assert [(r["blocks"], r["direction"], r["integrity"]) for r in rows] == [
        (n, d, i) for n in (1, 16) for d in ("store", "load") for i in tiers]
    assert all(r["verified"] and r["GBps"] > 0 and r["submit_us"] > 0 for r in rows)
    assert report["engine"] == "host" and f"host engine on cpu, {barrier} barrier" in proc.stdout
    assert report["args"]["barrier"] == barrier
    if integrity == "both":
        assert "integrity on vs off, job by job" in proc.stdout
        assert len(re.findall(r"^\s+(1|16)\s+(store|load)\s+\d+\.\d{3}\s+[+-]", proc.stdout,
                              re.M)) == 4, proc.stdout
