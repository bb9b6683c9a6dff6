"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory on /dev/shm for one test's regions, so leak checks see only that
    test's files while other tests run in parallel; it must be empty again at the end."""
    path = tempfile.mkdtemp(prefix="pytest-shm-", dir="/dev/shm")
    try:
        yield path
        left = os.listdir(path)
        assert left == [], f"files left in the shm dir: {left}"
    finally:
        shutil.rmtree(path, ignore_errors=True)
