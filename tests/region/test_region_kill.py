"""A node-wide SIGKILL during set-up: nameless regions leave nothing, named files stay.

A 2-rank ``--layout shared`` main job (real torchrun) builds a 1 GiB node region with one
pre-fault thread, so set-up takes a moment; every process of the job is SIGKILLed at once while
the region is being reserved (or, second case, pre-faulted), as the OOM killer, a container stop
or ``kill -9`` of the whole job would.  Nobody runs any cleanup.  Then the memory must be gone
(``Shmem`` in /proc/meminfo back near where it started: other tests run in parallel, so the
tolerance is a quarter of the budget) and no file of the job may be left in /dev/shm.  The same
kill with ``--shm-dir`` documents why regions are nameless: the files and their memory stay
until someone removes them.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offload.region.space import meminfo
from tests.harness import has_our_traceback

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 1 << 30
REGION_FILE = re.compile(r"offload-([0-9a-f]+)-L0-s\d+")


def shmem() -> int:
    return meminfo()["Shmem"]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun starts its workers in sessions of their
    own, so a process-group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:  # a name may not be UTF-8
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def region_tier(pids: list[int], shm_dir: str | None, where: str
                ) -> tuple[str | None, set[int]]:
    """The tier id of the job's region once the moment ``where`` is reached: ``reserving``
    (the leader holds a region file) or ``mapped`` (every worker maps one); and the processes
    that hold it."""
    holders = set()
    tier = None
    for pid in pids:
        try:
            if where == "mapped":
                with open(f"/proc/{pid}/maps") as f:
                    names = f.read().splitlines()
            else:  # "/memfd:offload-<tier>-L0-s0 (deleted)" or the named file's path
                names = [os.readlink(f"/proc/{pid}/fd/{fd}")
                         for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for name in names:
            if found := REGION_FILE.search(name):
                tier = found.group(1)
                holders.add(pid)
    if shm_dir is not None and where == "reserving" and tier is None:
        tier = next((m.group(1) for n in os.listdir(shm_dir)
                     if (m := REGION_FILE.search(n))), None)
    enough = len(holders) >= 2 if where == "mapped" else tier is not None
    return (tier if enough else None), holders


def alive(pid: int) -> bool:
    """Not yet dead: a zombie has already released its memory."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:  # a name may not be UTF-8
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def kill_job_during_setup(shm_dir: str | None, where: str, log: Path,
                          sigterm_leader: bool = False) -> tuple[str, int]:
    """Start the job and SIGKILL all of it at ``where`` (or SIGTERM only the rank that holds
    the region then and let torchrun stop the rest); return the tier id and how much memory the
    region held by then."""
    start = shmem()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "launch" / "run.py"), "--device", "cpu", "--layout", "shared",
           "--cpu-bytes", str(BUDGET), "--segment-bytes", "256MiB", "--prefault-threads", "1",
           "--rounds", "100000", "--timeout", "60",
           "--no-integrity",  # rows of exactly 2 MiB: segments of whole 256 MiB files
           *(("--shm-dir", shm_dir) if shm_dir else ())]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"},
                                start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        tier = None
        while time.monotonic() < deadline and proc.poll() is None:
            pids = [proc.pid, *descendants(proc.pid)]
            tier, holders = region_tier(pids, shm_dir, where)
            if tier and (where == "mapped" or reserved(shm_dir, tier, start) >= BUDGET // 2):
                break
            time.sleep(0.005)
        # what the region held then: its files' blocks when named (exact, whatever parallel
        # tests do to the host's Shmem meanwhile), else the growth of Shmem
        grown = reserved(shm_dir, tier, start) if tier else shmem() - start
        if sigterm_leader and tier is not None:
            assert len(holders) == 1
            os.kill(holders.pop(), signal.SIGTERM)
            proc.wait(90)
    finally:
        for pid in [proc.pid, *descendants(proc.pid)]:  # the whole job, at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(30)
    assert tier is not None, f"the job never reached {where!r}: {log.read_text()[-2000:]}"
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)
    return tier, grown


def reserved(shm_dir: str | None, tier: str, baseline: int) -> int:
    """Bytes the job's region holds: its named files' allocated blocks (exact, whatever other
    tests running in parallel do to the host's Shmem), or, for nameless regions, the growth
    of Shmem since ``baseline``."""
    if shm_dir is None:
        return shmem() - baseline
    total = 0
    for name in os.listdir(shm_dir):
        if tier in name:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(shm_dir, name)).st_blocks * 512
    return total


def settle(baseline: int, limit: int) -> int:
    """Shmem above ``baseline`` once it dropped under ``limit`` (or after 30 s)."""
    deadline = time.monotonic() + 30
    while (extra := shmem() - baseline) >= limit and time.monotonic() < deadline:
        time.sleep(0.1)
    return extra


@pytest.mark.parametrize("where", ["reserving", "mapped"])
def test_a_node_wide_sigkill_during_setup_leaves_nothing(where: str, tmp_path: Path) -> None:
    baseline = shmem()
    tier, grown = kill_job_during_setup(None, where, tmp_path / "job.log")
    assert grown >= BUDGET // 2  # the kill really caught the region in memory
    extra = settle(baseline, BUDGET // 4)
    assert extra < BUDGET // 4, f"{extra} B of shared memory still held after the kill"
    assert [n for n in os.listdir("/dev/shm") if tier in n] == []


@pytest.mark.parametrize("named", [False, True])
def test_sigterm_of_the_leader_mid_reservation_leaves_nothing(named: bool, shm_dir: str,
                                                             tmp_path: Path) -> None:
    """SIGTERM (what torchrun and container stops send) runs the handlers: named files are
    unlinked at once, the reservation unwinds, the job fails; nothing stays.  (The rank's own
    exit status, 143, is checked in test_region_cleanup: torchrun reports the SIGTERM it sends
    the unwinding rank once its peer has failed, not the rank's status.)"""
    baseline = shmem()
    log = tmp_path / "job.log"
    tier, grown = kill_job_during_setup(shm_dir if named else None, "reserving", log,
                                        sigterm_leader=True)
    assert grown >= BUDGET // 2
    assert "ChildFailedError" in log.read_text()
    assert not has_our_traceback(log.read_text())  # no traceback of ours: a clean unwind
    assert settle(baseline, BUDGET // 4) < BUDGET // 4
    assert os.listdir(shm_dir) == [] and [n for n in os.listdir("/dev/shm") if tier in n] == []


def test_named_files_outlive_a_node_wide_sigkill(shm_dir: str, tmp_path: Path) -> None:
    """Why regions are nameless: with ``--shm-dir`` the same kill leaves the files and their
    memory behind until someone removes them (done here, so the ``shm_dir`` fixture's own
    emptiness check passes)."""
    baseline = shmem()
    tier, grown = kill_job_during_setup(shm_dir, "reserving", tmp_path / "job.log")
    left = [n for n in os.listdir(shm_dir) if tier in n]
    try:
        assert left, "the named region files vanished with the job"
        assert reserved(shm_dir, tier, baseline) >= BUDGET // 2 - BUDGET // 8
    finally:
        for name in left:
            os.unlink(os.path.join(shm_dir, name))
    assert settle(baseline, BUDGET // 4) < BUDGET // 4
