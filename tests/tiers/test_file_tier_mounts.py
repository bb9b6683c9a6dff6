"""The file tier on filesystems this host does not offer as they are: one that refuses O_DIRECT
(ramfs), a full one (a 1 MiB tmpfs) and a read-only one.

Each scenario runs in a child process inside its own mount namespace (``unshare --mount``), so
its mounts are real and vanish with the child whatever happens.  Skipped where this process may
not create mount namespaces (not root / no CAP_SYS_ADMIN).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

import pytest

from offload.errors import OffloadError
from offload.tiers import FileTier

ROW = 256 << 10
FILE = ROW + 4096
GEOMETRY = {"slot_bytes": ROW}
Scenario = Callable[[str, list[str]], dict[str, object]]


def _warnings() -> list[str]:
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("offload.tiers.file_tier").addHandler(handler)
    return seen


def _row(fill: int) -> mmap.mmap:
    row = mmap.mmap(-1, ROW)
    row[:] = bytes([fill]) * ROW
    return row


def scenario_no_o_direct(directory: str, warnings: list[str]) -> dict[str, object]:
    """ramfs refuses O_DIRECT: buffered I/O, one warning for the whole life of the process,
    bytes still verified, and any buffer (aligned or not) accepted."""
    rows = [_row(i) for i in range(6)]
    with FileTier(directory, 4 * FILE, GEOMETRY, ROW) as tier:
        stored = [tier.put(i, row).stored.result(30) for i, row in enumerate(rows)]
        unaligned = bytearray(bytes([77]) * ROW)
        stored.append(tier.put("unaligned", unaligned).stored.result(30))
        out = bytearray(ROW)
        read = [tier.get(i, out).result(30) and out == bytes([i]) * ROW for i in range(3, 6)]
        mode = tier.mode
        report = tier.to_json()
    with FileTier(directory, 4 * FILE, GEOMETRY, ROW) as again:  # a restart: no second warning
        read.append(again.get(5, out).result(30))
    return {"o_direct": mode.o_direct, "reason": mode.reason, "stored": stored, "read": read,
            "report": report, "warnings": warnings}


def scenario_disk_full(directory: str, warnings: list[str]) -> dict[str, object]:
    """A 1 MiB filesystem holds three 260 KiB files: the fourth and later spills fail with
    ENOSPC, stay misses, warn once, leave no temp file; freeing space lets the job go on."""
    with FileTier(directory, 16 * FILE, GEOMETRY, ROW, io_threads=1) as tier:
        stored = [tier.put(i, _row(i)).stored.result(30) for i in range(6)]
        contains = [tier.contains(i) for i in range(6)]
        missed = [tier.get(i, _row(0)).result(30) for i in range(3, 6)]
        leftovers = sorted(os.listdir(tier.directory))
        tier.discard(0).result(30)
        tier.discard(1).result(30)
        after = tier.put("later", _row(9)).stored.result(30)
        out = _row(0)
        later_read = tier.get("later", out).result(30) and out[:] == bytes([9]) * ROW
        report = tier.to_json()
    return {"stored": stored, "contains": contains, "missed": missed, "leftovers": leftovers,
            "after": after, "later_read": later_read, "report": report, "warnings": warnings}


def scenario_read_only(directory: str, warnings: list[str]) -> dict[str, object]:
    try:
        FileTier(directory, 16 * FILE, GEOMETRY, ROW)
    except OffloadError as exc:
        return {"error": str(exc)}
    return {"error": None}


_CHILD = """
import json, subprocess, sys
directory, fstype, options, name = sys.argv[1:5]
subprocess.run(["mount", "-t", fstype, "-o", options, fstype, directory], check=True)
from tests.tiers import test_file_tier_mounts as t
print("RESULT " + json.dumps(getattr(t, name)(directory, t._warnings())))
"""


def _run(scenario: Scenario, fstype: str, options: str) -> dict[str, object]:
    directory = tempfile.mkdtemp(prefix="pytest-fstier-mnt-", dir="/tmp")
    try:
        if shutil.which("unshare") is None or shutil.which("mount") is None:
            pytest.skip("util-linux unshare/mount are not installed")
        probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot create a mount namespace here: {probe.stderr.strip()}")
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _CHILD,
             directory, fstype, options, scenario.__name__],
            capture_output=True, text=True, timeout=120, cwd=os.path.dirname(
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stderr
        assert os.listdir(directory) == []  # the mount went away with the child
        result: dict[str, object] = json.loads(lines[0][len("RESULT "):])
        return result
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_filesystem_without_o_direct_gets_buffered_io_and_one_warning() -> None:
    r = _run(scenario_no_o_direct, "ramfs", "mode=0755")
    assert r["o_direct"] is False and "EINVAL" in str(r["reason"])
    assert r["stored"] == [True] * 7 and r["read"] == [True] * 4
    report = r["report"]
    assert isinstance(report, dict) and report["o_direct"] is False
    assert report["mode"] == "buffered" and report["evicted"] == 3
    warnings = r["warnings"]
    assert isinstance(warnings, list) and len(warnings) == 1
    assert "buffered I/O" in warnings[0] and "refuses O_DIRECT" in warnings[0]


def test_disk_full_leaves_that_chunk_a_miss_and_the_job_goes_on() -> None:
    r = _run(scenario_disk_full, "tmpfs", "size=1m")
    assert r["stored"] == [True, True, True, False, False, False]
    assert r["contains"] == [True, True, True, False, False, False]
    assert r["missed"] == [False, False, False]
    leftovers = r["leftovers"]
    assert isinstance(leftovers, list) and len(leftovers) == 3
    assert all(str(n).endswith(".kv") for n in leftovers)
    assert r["after"] is True and r["later_read"] is True
    report = r["report"]
    assert isinstance(report, dict)
    assert report["write_errors"] == 3 and report["misses"] == 3 and report["corrupt"] == 0
    warnings = r["warnings"]
    assert isinstance(warnings, list) and len(warnings) == 1
    assert "disk is full" in warnings[0] and "job goes on" in warnings[0]


def test_a_read_only_directory_is_a_one_line_error() -> None:
    r = _run(scenario_read_only, "tmpfs", "ro,size=1m")
    error = str(r["error"])
    assert "is not writable (Read-only file system); pass a writable directory" in error
    assert "\n" not in error
