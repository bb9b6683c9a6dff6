# SPDX-License-Identifier: Apache-2.0
"""The main job with ``--keep`` (docs/KEEP.md): a run keeps its tier, a rerun of the same
geometry adopts it and reports what it adopted; the keeper is gone soon after the last run."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from offload.region import kept
from tests.harness import tail
from tests.launch.test_main_job import ROOT, torchrun
from tests.region.test_keeper import wait_gone


def test_a_rerun_with_keep_adopts_the_kept_tier_and_reports_it(tmp_path: Path) -> None:
    node = f"keep-job-{uuid.uuid4().hex[:10]}"
    env = {"OFFLOAD_NODE_ID": node}
    reports = []
    for i, keep_s in enumerate(("30", "1")):  # the last run's claim sets the countdown
        path = tmp_path / f"r{i}.json"
        proc = torchrun(2, "--cpu-bytes", "16MiB", "--keep", keep_s, "--report-json",
                        str(path), env=env)
        assert proc.returncode == 0, tail(proc)
        reports.append(json.loads(path.read_text()))
        if i == 0:
            (info,) = dict(kept.keepers(node)).values()
    assert reports[0]["keep"]["adopted_chunks"] == 0
    assert reports[1]["keep"]["adopted_chunks"] > 0
    assert reports[1]["keep"]["adopted_bytes"] > 0
    wait_gone(info["pid"], timeout_s=15)


def test_help_names_keep() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "run.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--keep" in out and "offload.keep" in out
