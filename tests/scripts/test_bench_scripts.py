"""`scripts/bench_fs.py` and `scripts/bench_completion.py` end to end on this machine: the file
tier's `dd` baseline writes the tier's own rows (not zeros), and the completion benchmark's
spinning barrier runs real ranks to a result.  The figures are the device's business
(docs/BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

from tests.harness import tail

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_fs  # noqa: E402  (the scripts folder is not a package)


def test_each_dd_stream_writes_its_share_of_the_rows(tmp_path: Path) -> None:
    """The baseline moves the bytes the tier moves: stream ``i`` writes rows ``first_i ..``
    of the rows' memfd, so the streams' files put together are the rows, not zeros."""
    rows, row_bytes = 5, 64 << 10
    source = os.memfd_create("rows", os.MFD_CLOEXEC)
    try:
        os.ftruncate(source, rows * row_bytes)
        with mmap.mmap(source, rows * row_bytes) as host:
            host[:] = os.urandom(rows * row_bytes)
            args = argparse.Namespace(threads=2, row_bytes=row_bytes)
            assert bench_fs._dd(str(tmp_path), rows, args, source=source) > 0
            written = b"".join((tmp_path / f"stream{i}").read_bytes() for i in range(2))
            assert written == host[:]
    finally:
        os.close(source)


def test_bench_fs_runs_and_verifies(tmp_path: Path) -> None:
    out = tmp_path / "fs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_fs.py"), "--dir", str(tmp_path),
         "--bytes", "8MiB", "--row-bytes", "1MiB", "--threads", "2", "--reps", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, tail(proc, 2000)
    report = json.loads(out.read_text())
    assert report["verified"] and report["rows"] == 8
    assert report["write_ratio"] > 0 and report["read_ratio"] > 0
    assert sorted(os.listdir(tmp_path)) == ["fs.json"]  # its work directory is gone


def test_bench_completion_with_a_spinning_barrier(tmp_path: Path) -> None:
    out = tmp_path / "completion.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_completion.py"), "--ranks", "2",
         "--jobs", "60", "--device", "cpu", "--barrier", "spin", "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, tail(proc, 2000)
    (row,) = json.loads(out.read_text())
    assert row["barrier"] == "spin" and row["ranks"] == 2 and row["path"] == "finished"
    assert row["median_us"] > 0 and row["from_last_us"] > 0


def test_bench_startup_times_background_set_up_beside_the_blocking_create(tmp_path: Path
                                                                         ) -> None:
    out = tmp_path / "startup.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_startup.py"), "--nproc", "2",
         "--cpu-bytes", "64MiB", "--kv-bytes-per-block", "128KiB", "--variants",
         "ours,background", "--layouts", "shared", "--warm", "0", "--threads", "2",
         "--json", str(out), "--stack-samples", str(tmp_path / "stacks"), "--backend", "host",
         "--no-integrity"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, tail(proc, 2000)
    rows = json.loads(out.read_text())["variants"]
    background, blocking = rows["background/shared"], rows["ours/shared"]
    for row in (background, blocking):  # the tier's backend and integrity as asked
        assert row["ranks"][0]["row"]["engine"] == "host"
        assert row["ranks"][0]["row"]["integrity"]["enabled"] is False
    assert 0 < background["created"] <= background["first"] <= background["seconds"]
    assert background["ranks"][0]["row"]["background"] is True
    assert blocking["ranks"][0]["row"]["background"] is False
    assert "background/shared" in proc.stdout and "full/blocking" in proc.stdout
    for rank in range(2):  # every thread's stacks, per variant and rank
        stacks = (tmp_path / f"stacks-background-shared-rank{rank}.txt").read_text()
        assert "== MainThread" in stacks and "offload-bg-pin" in stacks
