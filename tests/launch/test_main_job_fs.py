"""The main job with the file tier (issue 11's "Show" list) under real torchrun: rounds larger
than host memory spill and verify, a restart with the same directory and geometry finds its
files, a flipped byte is detected and skipped, another geometry reads nothing."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import tail
from tests.launch.test_main_job import our_errors, our_tracebacks, torchrun

# 2 ranks x 256 KiB slots: a 512 KiB row, 8 chunks of host memory; 16 chunks per round
GEOMETRY = ("--cpu-bytes", "4MiB", "--num-gpu-blocks", "256", "--blocks-per-chunk", "16",
            "--kv-bytes-per-block", "16KiB", "--fs-bytes", "16MiB")  # a bounded disk budget


@pytest.fixture
def fs_dir() -> Iterator[Path]:
    path = tempfile.mkdtemp(prefix="pytest-fsjob-", dir="/tmp")  # ext4 here: O_DIRECT
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run(fs_dir: Path, tmp_path: Path, *args: str, name: str = "r.json"
         ) -> tuple[dict[str, object], str]:
    report_path = tmp_path / name
    proc = torchrun(2, *GEOMETRY, "--fs-tier", str(fs_dir), "--report-json", str(report_path),
                    *args, timeout=240)
    assert proc.returncode == 0, tail(proc, 4000)
    return json.loads(report_path.read_text()), proc.stdout


def _chunk_files(fs_dir: Path) -> list[Path]:
    return sorted(p for p in fs_dir.glob("fp-*/*") if not p.name.startswith("."))


def test_spill_restart_corruption_and_geometry_isolation(fs_dir: Path, tmp_path: Path
                                                         ) -> None:
    first, out = _run(fs_dir, tmp_path, name="1.json")
    transfer, fs = first["transfer"], first["fs_tier"]
    assert transfer["verified"] and transfer["mismatched_blocks"] == 0
    for r in transfer["per_round"]:  # every round spills, and every chunk of it is loaded
        assert r["spilled_chunks"] > 0 and r["loaded_chunks"] == 16
        assert r["promoted_chunks"] > 0 and r["missed_chunks"] == 0
    assert transfer["checked_blocks"] == 2 * 2 * 256
    assert fs["o_direct"] is True and fs["dir"] == str(fs_dir) and fs["writers"] == 2
    assert fs["written_bytes"] > 0 and fs["hits"] > 0 and fs["corrupt"] == 0
    slot = first["plan"]["slot_bytes"]["0"]  # the pages, then their checksums' trailer
    assert slot == 256 * 1024 + 4096
    assert fs["read_bytes"] == fs["hits"] * (slot + 4096)  # a file: one header page + the slot
    assert "fs tier: " + str(fs_dir) in out and "O_DIRECT" in out
    files = _chunk_files(fs_dir)
    assert len({p.parent for p in files}) == 2  # one fingerprint directory per rank

    second, _ = _run(fs_dir, tmp_path, name="2.json")
    assert second["transfer"]["verified"] and second["fs_tier"]["hits"] > 0
    # round 0's keys were found on disk at start: stored from the GPU only where missing
    assert second["transfer"]["per_round"][0]["stored_chunks"] < 16

    _flip_a_byte_of_the_newest_round0_file(fs_dir)
    third, _ = _run(fs_dir, tmp_path, name="3.json")
    assert third["fs_tier"]["corrupt"] >= 1
    assert third["transfer"]["verified"] and third["transfer"]["mismatched_blocks"] == 0
    assert sum(r["missed_chunks"] for r in third["transfer"]["per_round"]) >= 1

    before = {p.name for p in _chunk_files(fs_dir)}
    # another geometry, with room for a whole round in host memory: it reads no file at all
    other, _ = _run(fs_dir, tmp_path, "--kv-bytes-per-block", "8KiB", "--cpu-bytes", "8MiB",
                    name="4.json")
    fs = other["fs_tier"]
    assert other["transfer"]["verified"]
    assert (fs["hits"], fs["read_bytes"], fs["corrupt"]) == (0, 0, 0)
    assert before <= {p.name for p in _chunk_files(fs_dir)}  # the other geometry's files stay

    # the same geometry and keys, computed by another model: no file of the first is found
    # (every round-0 chunk is stored from the GPU) and they stay, in folders of their own
    folders = {p.parent for p in _chunk_files(fs_dir)}
    model, _ = _run(fs_dir, tmp_path, "--fs-namespace", "another-model@rev2", name="5.json")
    assert model["transfer"]["verified"] and model["fs_tier"]["corrupt"] == 0
    assert model["transfer"]["per_round"][0]["stored_chunks"] == 16
    assert len({p.parent for p in _chunk_files(fs_dir)} - folders) == 2
    assert before <= {p.name for p in _chunk_files(fs_dir)}


def _flip_a_byte_of_the_newest_round0_file(fs_dir: Path) -> None:
    """Damage one payload byte of the most recently written file of a round-0 key (the one
    the next run's disk LRU keeps longest)."""
    round0 = [p for p in _chunk_files(fs_dir) if b"(0, " in p.read_bytes()[:4096]]
    assert round0
    victim = max(round0, key=lambda p: p.stat().st_mtime_ns)
    with open(victim, "r+b") as f:
        f.seek(4096 + 1000)
        byte = f.read(1)
        f.seek(4096 + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_tmpfs_spills_and_verifies_in_the_mode_it_supports(tmp_path: Path) -> None:
    """tmpfs takes O_DIRECT on recent kernels and refuses it on older ones (buffered I/O with
    one warning): the report says which, and the job verifies either way."""
    fs_dir = Path(tempfile.mkdtemp(prefix="pytest-fsjob-", dir="/dev/shm"))
    try:
        report, out = _run(fs_dir, tmp_path, "--rounds", "1", "--layout", "shared")
        fs = report["fs_tier"]
        assert report["transfer"]["verified"] and fs["o_direct"] is _takes_o_direct(fs_dir)
        assert fs["written_bytes"] > 0 and fs["hits"] > 0
        assert ("O_DIRECT" if fs["o_direct"] else "buffered") in out
    finally:
        shutil.rmtree(fs_dir, ignore_errors=True)


def _takes_o_direct(directory: Path) -> bool:
    probe = directory / "probe"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def test_replicated_writes_one_copy_per_stage(fs_dir: Path, tmp_path: Path) -> None:
    # one 256 KiB slot per row: 16 chunks of host memory, 32 per round
    report, _ = _run(fs_dir, tmp_path, "--rounds", "1", "--layout", "replicated",
                     "--num-gpu-blocks", "512")
    assert report["transfer"]["verified"] and report["fs_tier"]["writers"] == 1
    assert len({p.parent for p in _chunk_files(fs_dir)}) == 1


def test_dp_replicas_on_one_host_get_their_own_folders(fs_dir: Path, tmp_path: Path) -> None:
    """Two DP replicas of equal geometry on one host: each keeps its own fingerprint folder
    (before, both took the same one and the second failed with "in use by another
    process")."""
    report, _ = _run(fs_dir, tmp_path, "--dp", "2", "--rounds", "1",
                     "--cpu-bytes", "2MiB")  # one rank per replica: half the rows spill
    assert report["dp"] == 2 and report["transfer"]["verified"]
    for replica in report["replicas"]:
        fs = replica["fs_tier"]
        assert replica["transfer"]["verified"] and fs["written_bytes"] > 0 and fs["hits"] > 0
    assert len({p.parent for p in _chunk_files(fs_dir)}) == 2


@pytest.mark.parametrize("problem", ["missing", "file", "small", "timeout"])
def test_an_unusable_fs_tier_is_one_line(problem: str, fs_dir: Path, tmp_path: Path) -> None:
    path = {"missing": fs_dir / "nope", "file": fs_dir / "f", "small": fs_dir,
            "timeout": fs_dir}[problem]
    if problem == "file":
        path.write_text("")
    extra = {"small": ("--fs-bytes", "300KiB"),
             "timeout": ("--fs-io-timeout", "0")}.get(problem, ())
    proc = torchrun(2, *GEOMETRY, "--fs-tier", str(path), *extra)
    assert proc.returncode == 1
    errors = our_errors(proc)
    assert len(errors) == 1, proc.stderr[-3000:]
    needle = {"missing": f"fs_dir (--fs-tier) {path} does not exist",
              "file": f"fs_dir (--fs-tier) {path} is not a directory",
              "small": "file tier budget fs_bytes = 307200 B (300.00 KiB) per node holds no "
                       "chunk: one chunk needs ",  # (its size depends on --no-integrity)
              "timeout": "--fs-io-timeout 0 must be positive"}[problem]
    assert needle in errors[0], errors[0]
    assert not our_tracebacks(proc), proc.stderr[-3000:]
    assert [p for p in os.listdir(fs_dir) if p != "f"] == []


def test_background_set_up_spills_and_promotes_into_ready_rows(fs_dir: Path, tmp_path: Path
                                                                ) -> None:
    """The file tier behind a tier set up in the background: rounds larger than host memory
    spill and promote (into rows the manager handed out as they came online), verified."""
    report, out = _run(fs_dir, tmp_path, "--rounds", "2", "--layout", "shared",
                       "--background-setup")
    fs, transfer = report["fs_tier"], report["transfer"]
    assert transfer["verified"] and transfer["spilled_chunks"] > 0
    assert transfer["promoted_chunks"] > 0 and fs["hits"] > 0
    assert report["readiness"]["background"] and report["readiness"]["full_s"] is not None
    assert "readiness (background set-up)" in out
