# SPDX-License-Identifier: Apache-2.0
"""The room a node's disk has for the file tier and the folders earlier runs left in DIR
(`offload.tiers.disk_room`, `offload.fs_actions.agree_budget`): the default budget is bounded
by the disk's room, an explicit one past it is one line, and folders of earlier runs (another
geometry or namespace) are removed oldest first to fit the budget -- only our own, unlocked,
never through a link.  The main job runs on a real 8 MiB tmpfs in a mount namespace of its
own."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from offload.errors import OffloadError
from offload.tiers import disk_room
from tests.harness import free_port, has_our_traceback, tail
from tests.other_user import NOBODY, as_root

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fs_dir() -> Iterator[Path]:
    path = tempfile.mkdtemp(prefix="pytest-fsroom-", dir="/tmp")
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def make_folder(root: Path, name: str, nbytes: int, age_s: float) -> Path:
    """A folder of an earlier run: 0700, one file of ``nbytes``, last changed ``age_s`` ago."""
    folder = root / name
    folder.mkdir(0o700)
    (folder / "0123456789abcdef.kv").write_bytes(os.urandom(nbytes))
    when = time.time() - age_s
    os.utime(folder, (when, when))
    return folder


# ---------------------------------------------------------------------- scan and evict


def test_the_room_is_free_space_and_the_folders_no_live_tier_holds(fs_dir: Path) -> None:
    """Counted: our unlocked folder.  Not counted: one a live tier holds (locked), a link
    named like a folder, a folder others may write."""
    make_folder(fs_dir, "fp-old", MiB, 100)
    live = make_folder(fs_dir, "fp-live", MiB, 100)
    elsewhere = make_folder(fs_dir, "elsewhere", MiB, 100)
    (fs_dir / "fp-link").symlink_to(elsewhere)
    os.chmod(make_folder(fs_dir, "fp-open", MiB, 100), 0o777)
    held = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        room = disk_room.scan(str(fs_dir))
    finally:
        os.close(held)
    assert [f.name for f in room.folders] == ["fp-old"]
    assert room.folders[0].bytes == MiB
    statvfs = os.statvfs(fs_dir)
    assert abs(room.free - statvfs.f_bavail * statvfs.f_frsize) < 64 * MiB
    assert room.total == room.free + MiB


@as_root
def test_another_users_folder_is_neither_counted_nor_removed(fs_dir: Path) -> None:
    theirs = make_folder(fs_dir, "fp-theirs", MiB, 1000)
    os.chown(theirs, NOBODY, NOBODY)
    assert disk_room.scan(str(fs_dir)).folders == ()
    assert disk_room.evict(str(fs_dir), 0) == [] and theirs.exists()


def test_folders_are_removed_oldest_first_down_to_the_limit(fs_dir: Path) -> None:
    """Three old folders of 1 MiB and a live one, the oldest of all: a limit of 1.5 MiB
    removes the two oldest unlocked ones and keeps the newest and the live one."""
    for name, age in (("fp-b-old", 300), ("fp-a-mid", 200), ("fp-c-new", 100)):
        make_folder(fs_dir, name, MiB, age)
    live = make_folder(fs_dir, "fp-live", MiB, 400)
    held = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = disk_room.evict(str(fs_dir), int(1.5 * MiB))
    finally:
        os.close(held)
    assert [f.name for f in removed] == ["fp-b-old", "fp-a-mid"]
    assert sorted(p.name for p in fs_dir.iterdir()) == ["fp-c-new", "fp-live"]


def test_a_removal_never_follows_a_link_and_keeps_what_it_does_not_know(fs_dir: Path,
                                                                        tmp_path: Path) -> None:
    """A link inside an old folder is removed itself, its target stays; a folder holding a
    subfolder is left as it is."""
    victim = tmp_path / "precious"
    victim.write_bytes(b"ours")
    linked = make_folder(fs_dir, "fp-linked", MiB, 300)
    (linked / "ffffffffffffffff.kv").symlink_to(victim)
    nested = make_folder(fs_dir, "fp-nested", MiB, 200)
    (nested / "sub").mkdir()
    removed = disk_room.evict(str(fs_dir), 0)
    assert [f.name for f in removed] == ["fp-linked"]
    assert victim.read_bytes() == b"ours" and sorted(os.listdir(fs_dir)) == ["fp-nested"]


@pytest.mark.parametrize(("explicit", "default", "expected"), [
    (None, 16 * MiB, 4 * MiB),  # the default: at most half the smallest node's room
    (None, 2 * MiB, 2 * MiB),
    (6 * MiB, 16 * MiB, 6 * MiB),  # an explicit budget the room holds
])
def test_the_budget_is_bounded_by_every_nodes_room(explicit: int | None, default: int,
                                                   expected: int) -> None:
    rooms = {"n0": 100 * MiB, "n1": 8 * MiB}
    assert disk_room.bound_budget(explicit, default, rooms, "/data") == expected


def test_an_explicit_budget_past_a_nodes_room_is_one_line() -> None:
    with pytest.raises(OffloadError) as info:
        disk_room.bound_budget(12 * MiB, 16 * MiB, {"n0": 100 * MiB, "n1": 8 * MiB}, "/data")
    assert str(info.value) == (
        "fs_bytes (--fs-bytes) = 12582912 B (12.00 MiB) per node is more than the disk of /data "
        "has room for on node n1: 8388608 B (8.00 MiB, its free space and the folders of "
        "earlier runs); give at most that, or free space")


# ---------------------------------------------------------------------- behind a tier


def _tier_with_old_folders(rank: int, fs_dir: str) -> object:
    import torch

    from offload import HostTier, TierConfig

    tier = HostTier.create([torch.ones((64, 16384), dtype=torch.uint8)],
                           TierConfig(cpu_bytes_per_node=2 * MiB, blocks_per_chunk=16,
                                      timeout_s=30, fs_dir=fs_dir, fs_namespace="model@1",
                                      fs_bytes=8 * MiB))
    own = os.path.basename(tier.actor.files.tier.directory)  # type: ignore[union-attr]
    tier.close()
    return own


def test_a_tier_removes_the_oldest_folders_of_earlier_runs_to_fit_its_budget(fs_dir: Path
                                                                             ) -> None:
    """Three folders of 3 MiB left by runs of other models beside an 8 MiB budget: the tier
    removes the oldest, so the 6 MiB left fit in the budget next to its own (empty) files."""
    from tests.harness import run_group

    for name, age in (("fp-1111111111111111", 300), ("fp-2222222222222222", 200),
                      ("fp-3333333333333333", 100)):
        make_folder(fs_dir, name, 3 * MiB, age)
    (out,) = run_group(_tier_with_old_folders, 1, args=(str(fs_dir),), timeout=120)
    assert out.ok, out.error
    assert sorted(os.listdir(fs_dir)) == sorted(
        ["fp-2222222222222222", "fp-3333333333333333", out.value])


# ---------------------------------------------------------------------- the main job

_CHILD = """
import os, subprocess, sys
directory = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", directory],
               check=True)
old = os.path.join(directory, "fp-0000000000000000")
os.mkdir(old, 0o700)
with open(os.path.join(old, "0123456789abcdef.kv"), "wb") as f:
    f.write(os.urandom(6 << 20))
proc = subprocess.run([sys.executable, "launch/run.py", *sys.argv[2:]], capture_output=True,
                      text=True)
sys.stdout.write(proc.stdout)
sys.stderr.write(proc.stderr)
print("LEFT " + " ".join(sorted(os.listdir(directory))))
sys.exit(proc.returncode)
"""


def _job_on_a_small_disk(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """The main job (one rank) with ``--fs-tier`` on an 8 MiB tmpfs that a folder of an
    earlier run fills to 6 MiB."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("util-linux unshare/mount are not installed")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.strip()}")
    directory = tmp_path / "disk"
    directory.mkdir(mode=0o700)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        env.pop(name, None)
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _CHILD,
         str(directory), "--device", "cpu", "--fs-tier", str(directory), "--cpu-bytes", "4MiB",
         "--num-gpu-blocks", "256", "--kv-bytes-per-block", "16KiB", "--rounds", "1",
         *flags], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert os.listdir(directory) == []  # the mount went away with the child
    return proc


def test_the_default_budget_is_bounded_by_the_disk_and_old_folders_make_room(
        tmp_path: Path) -> None:
    """The default budget, 4 x 4 MiB, is more than the disk holds: it is cut to half the room
    (8 MiB: 2 MiB free and the old folder's 6 MiB) with a warning, and the old folder is
    removed so the budget's files fit; the job verifies."""
    report = tmp_path / "r.json"
    proc = _job_on_a_small_disk(tmp_path, "--report-json", str(report))
    assert proc.returncode == 0, tail(proc)
    fs = json.loads(report.read_text())["fs_tier"]
    assert [r["budget_bytes"] <= 4 * MiB for r in fs["per_rank"]] == [True]
    assert fs["written_bytes"] > 0 and fs["write_errors"] == 0
    assert "the default budget 16.00 MiB per node is cut to 4.00 MiB" in proc.stderr
    assert "removed 1 folder(s) of earlier runs" in proc.stderr
    left = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LEFT "))
    assert "fp-0000000000000000" not in left


def test_an_explicit_budget_past_the_disks_room_is_one_line(tmp_path: Path) -> None:
    proc = _job_on_a_small_disk(tmp_path, "--fs-bytes", "12MiB")
    assert proc.returncode == 1, tail(proc)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("offload: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "offload: error: fs_bytes (--fs-bytes) = 12582912 B (12.00 MiB) per node is more than "
        f"the disk of {tmp_path / 'disk'} has room for on node "), tail(proc)
    assert not has_our_traceback(proc.stderr), tail(proc)
    assert "LEFT fp-0000000000000000" in proc.stdout  # nothing removed for a job that failed
