"""The process-wide closer registry and its signal handlers, in real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

from offload.region import cleanup
from tests.harness import shm_entries


def test_run_all_runs_each_closer_once_newest_first_and_survives_failures() -> None:
    order: list[str] = []

    def bad() -> None:
        order.append("bad")
        raise RuntimeError("closer failed")

    cleanup.register(lambda: order.append("first"))
    cleanup.register(bad)
    cleanup.register(lambda: order.append("last"))
    cleanup.run_all()
    cleanup.run_all()
    assert order == ["last", "bad", "first"]


def test_unregistered_closers_do_not_run() -> None:
    ran: list[int] = []

    def closer() -> None:
        ran.append(1)

    cleanup.register(closer)
    cleanup.unregister(closer)
    cleanup.unregister(closer)  # harmless twice
    cleanup.run_all()
    assert ran == []


_SIGTERM_CHILD = """
import os, sys, threading, time
from offload.region import cleanup
from offload.region import host_region as hr
from offload.region.prefault import madvise_populate
from tests.region.test_region_host import single_rank_region

TIER, SHM_DIR, STEP = sys.argv[1], sys.argv[2] or None, 256 << 10
populated, started = [0], threading.Event()

def slow_populate(address, length):
    # the real populate, 256 KiB at a time, slowly: pre-fault of 64 MiB takes seconds
    for offset in range(0, length, STEP):
        err = madvise_populate(address + offset, min(STEP, length - offset))
        if err:
            return err
        populated[0] += min(STEP, length - offset)
        if not started.is_set():
            started.set()
            print("prefaulting", flush=True)
        time.sleep(0.02)
    return 0

real_prefault = hr.prefault
hr.prefault = lambda *args, **kwargs: real_prefault(*args, populate=slow_populate, **kwargs)
assert cleanup.install_signal_handlers()
try:
    region = single_rank_region("private", 64 << 20, job_id=TIER, shm_dir=SHM_DIR,
                                segment_threshold=16 << 20, min_segment_bytes=8 << 20)
    print("set up", flush=True)
finally:  # runs while SystemExit(143) unwinds: what does this process still hold?
    with open("/proc/self/maps") as f:
        mapped = sum(TIER in line for line in f)
    fds = sum(TIER in os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{fd}"))
    print(f"populated {populated[0]} mapped {mapped} fds {fds}", flush=True)
"""


@pytest.fixture(params=["nameless", "named"])
def shm_dir_or_none(request: pytest.FixtureRequest, shm_dir: str) -> str:
    return "" if request.param == "nameless" else shm_dir


def test_sigterm_mid_prefault_closes_the_real_region_and_exits_143(shm_dir_or_none: str
                                                                    ) -> None:
    """A process building a real 64 MiB region (8 files, nameless or in a private shm dir) is
    SIGTERMed while its pre-fault threads run: the handler's SystemExit unwinds the pre-fault
    (running pieces finish, the rest are cancelled), the region is unmapped and its files
    closed before the process exits 143, and no file is left (the ``shm_dir`` fixture checks
    the named case)."""
    tier = uuid.uuid4().hex[:12]
    before = shm_entries()
    child = subprocess.Popen([sys.executable, "-c", _SIGTERM_CHILD, tier, shm_dir_or_none],
                             stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "prefaulting"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    last = child.stdout.read().split()
    populated, mapped, fds = int(last[1]), int(last[3]), int(last[5])
    assert 0 < populated < 64 << 20  # interrupted mid-pre-fault
    assert (mapped, fds) == (0, 0)  # unmapped and closed by the cleanup, not by exit
    assert {n for n in shm_entries() - before if tier in n} == set()


_EXIT_CHILD = """
import atexit, logging, sys
from offload.region import cleanup
atexit.register(lambda: print("finalized", flush=True))
cleanup.register(lambda: print("closed"))
logging.basicConfig(stream=sys.stderr, format="%(message)s")

def main():
    print("result", end=" ")  # buffered in a pipe: exit_after must flush it
    logging.getLogger("child").warning("logged")
    how = sys.argv[1]
    if how == "return":
        return 3
    if how == "none":
        return None
    if how == "raise":
        raise RuntimeError("boom")
    raise SystemExit(int(how) if how.isdigit() else how)

cleanup.exit_after(main)
"""


@pytest.mark.parametrize(("how", "status", "stderr"), [
    ("return", 3, "logged\n"), ("none", 0, "logged\n"), ("143", 143, "logged\n"),
    ("bad input", 1, "logged\nbad input\n"), ("raise", 1, "logged\nTraceback")])
def test_exit_after_runs_the_closers_flushes_and_skips_finalization(
        how: str, status: int, stderr: str) -> None:
    """The entry points' exit: main's status (returned or through SystemExit, as Python would
    give it), closers run, buffered output and logs flushed, and no interpreter finalization
    (an atexit callback of someone else's never runs: nothing can race gloo's threads)."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_CHILD, how], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == status
    assert proc.stdout == "result closed\n"
    assert proc.stderr.startswith(stderr)
    if how == "raise":
        assert proc.stderr.endswith("RuntimeError: boom\n")
    else:
        assert proc.stderr == stderr
