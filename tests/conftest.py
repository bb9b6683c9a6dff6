"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

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
