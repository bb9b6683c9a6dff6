"""Shared fixtures, and the rule that no test leaves a process behind.

Every test process is made a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): a
grandchild whose parent died -- a torchrun worker, a writer a rank forked -- is re-parented to
the test process instead of to init, so it stays visible.  After each test, any process that
the test started and that is still running fails the test and is killed (one such writer,
left running after a failure, once filled a machine's disk).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator

import pytest

PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_GRACE_S = 3.0  # a child that is exiting (closing its sockets) gets this long
# multiprocessing's helpers live as long as the test process, by design
_LONG_LIVED_HELPERS = ("resource_tracker", "forkserver", "semaphore_tracker")


def pytest_configure(config: pytest.Config) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children() -> dict[int, str]:
    """This process's running children (pid -> command line); zombies are reaped."""
    me = str(os.getpid())
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            # Bytes: a process name is cut at 15 bytes, possibly inside a UTF-8 character.
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].decode("ascii").split()
            if fields[1] != me:  # fields[0] is the state, fields[1] the parent pid
                continue
            if fields[0] == "Z":
                os.waitpid(int(pid), os.WNOHANG)
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ChildProcessError):
            continue  # it exited meanwhile
        if not any(helper in command for helper in _LONG_LIVED_HELPERS):
            found[int(pid)] = command
    return found


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    before = set(_children())
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = {p: c for p, c in _children().items() if p not in before}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p: c for p, c in _children().items() if p not in before}
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    pytest.fail(f"the test left {len(left)} process(es) running (killed now): "
                + "; ".join(f"{pid}: {cmd[:120]}" for pid, cmd in left.items()))

SHM_PREFIX = "pytest-shm-"


def remove_orphaned_shm_dirs() -> None:
    """Remove the shm directories of test processes that no longer exist: a worker killed
    mid-test (a timeout, SIGKILL) never runs the fixture's teardown.  The creator's pid is the
    name's first field after the prefix."""
    for name in os.listdir("/dev/shm"):
        pid = name[len(SHM_PREFIX):].split("-", 1)[0]
        if name.startswith(SHM_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join("/dev/shm", name), ignore_errors=True)


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory on /dev/shm for one test's regions, so leak checks see only that
    test's files while other tests run in parallel; it must be empty again at the end.  Named
    after this process, so a later test removes it if this process dies before teardown."""
    remove_orphaned_shm_dirs()
    path = tempfile.mkdtemp(prefix=f"{SHM_PREFIX}{os.getpid()}-", dir="/dev/shm")
    try:
        yield path
        left = os.listdir(path)
        assert left == [], f"files left in the shm dir: {left}"
    finally:
        shutil.rmtree(path, ignore_errors=True)
