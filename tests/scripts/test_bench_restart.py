# SPDX-License-Identifier: Apache-2.0
"""`scripts/bench_restart.py` end to end on CPU tensors: three lives on fresh processes (cold,
kept, adopting), two ranks; the adopting life's first hit is an adopted chunk, and the bench's
keeper is gone at the end.  The figures are the device's business (docs/BENCHMARKS.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from offload.region import kept
from tests.harness import tail

ROOT = Path(__file__).resolve().parents[2]


def test_bench_restart_adopts_and_leaves_no_keeper() -> None:
    before = {name for name, _ in kept.keepers()}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_restart.py"), "--ranks", "2",
         "--device", "cpu", "--cpu-bytes", "8MiB", "--layers", "1", "--page-bytes", "4KiB",
         "--gpu-blocks", "64", "--bpc", "4", "--stored", "4", "--keep", "60",
         "--timeout", "60"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, tail(proc, 3000)
    rows = {m[0]: m[1:] for m in re.findall(
        r"^(cold|kept|adopt)\s+([\d.]+)\s+(\S+)\s+(\S+)", proc.stdout, re.M)}
    assert set(rows) == {"cold", "kept", "adopt"}, proc.stdout
    assert rows["cold"][2] == "-" and rows["kept"][2] == "0", proc.stdout
    assert int(rows["adopt"][2]) >= 4 and float(rows["adopt"][1]) > 0, proc.stdout
    assert "first hit, adopt / cold:" in proc.stdout
    assert {name for name, _ in kept.keepers()} <= before  # its keeper was dropped
