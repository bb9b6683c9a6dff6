# SPDX-License-Identifier: Apache-2.0
"""The limits settings and flags are checked against (`offload.bounds`): every `TierConfig`
field is checked for its type, finiteness and range with one line naming the value, the limit
and the fix; the longest wait accepted is one every wait of the platform takes (Python's locks,
futures and sockets, torch's store); a file-tier wait computed from it stays within it."""

from __future__ import annotations

import datetime
import mmap
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from offload.bounds import MAX_WAIT_S, check_seconds
from offload.config import TierConfig
from offload.control.plan import RankDescriptor, compute_plan
from offload.control.topology import NodeInfo, Topology
from offload.errors import OffloadError
from offload.tiers.fs_io import FileIO
from offload.tiers.rank_files import RankFiles

MiB = 1 << 20
NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------- TierConfig


@pytest.mark.parametrize(("field", "value", "needle"), [
    # timeouts: past what the platform can wait, or not a positive number
    ("timeout_s", 1e10, "timeout_s (--timeout) = 1e+10 is past the longest wait the platform "
                        "allows, 1e+09 s (32 years); give the seconds a rank may wait for a "
                        "peer, such as 300"),
    ("timeout_s", INF, "timeout_s (--timeout) = inf is past the longest wait"),
    ("timeout_s", NAN, "timeout_s (--timeout) = nan must be positive"),
    ("timeout_s", True, "timeout_s (--timeout) = True is a bool, not a number; give the seconds"),
    ("timeout_s", "300", "timeout_s (--timeout) = '300' is a str, not a number"),
    ("fs_io_timeout_s", INF, "fs_io_timeout_s (--fs-io-timeout) = inf is past the longest wait"),
    ("fs_io_timeout_s", 1e10, "fs_io_timeout_s (--fs-io-timeout) = 1e+10 is past"),
    # whole numbers given as something else
    ("cpu_bytes_per_node", "1GiB", "cpu_bytes_per_node (--cpu-bytes) = '1GiB' is a str, not an "
                                   "int; give a size such as 1GiB"),
    ("page_size", 4096.0, "page_size = 4096.0 is a float, not an int; give an int"),
    ("blocks_per_chunk", None, "blocks_per_chunk (--blocks-per-chunk) = None is None, not an "
                               "int"),
    ("staging_bytes", NAN, "staging_bytes (--staging-bytes) = nan is a float, not an int"),
    ("prefault_threads", True, "prefault_threads (--prefault-threads) = True is a bool, not an "
                               "int"),
    ("cpu_bytes_per_node", 1 << 64, "cpu_bytes_per_node (--cpu-bytes) = 18446744073709551616 is "
                                    "above its maximum 9223372036854775807"),
    # the other types
    ("integrity", 1, "integrity (--no-integrity) = 1 is an int, not True or False"),
    ("layout", 3, "layout (--layout) = 3 is an int, not one of private, shared, replicated"),
    ("layout", "ring", "layout (--layout) = 'ring' is unknown; choose one of private, shared, "
                       "replicated"),
    ("shm_dir", b"/dev/shm", "shm_dir (--shm-dir) = b'/dev/shm' is a bytes, not a str or None"),
    ("metrics_addr", None, "metrics_addr (--metrics-addr) = None is None, not a str"),
])
def test_every_field_is_checked_for_type_finiteness_and_range(field: str, value: Any,
                                                              needle: str) -> None:
    """Each value used to pass the checks and then fail somewhere else (an OverflowError in a
    peer, a TypeError in a comparison, a NaN budget); now construction refuses it with one
    line."""
    with pytest.raises(OffloadError) as info:
        TierConfig(**{"cpu_bytes_per_node": MiB, field: value})
    message = str(info.value)
    assert message.startswith(needle), message
    assert "\n" not in message


def test_the_longest_wait_and_whole_numbers_within_range_pass() -> None:
    config = TierConfig(cpu_bytes_per_node=MiB, timeout_s=MAX_WAIT_S, fs_io_timeout_s=1,
                        staging_bytes=0)
    assert config.timeout_s == MAX_WAIT_S
    assert check_seconds(2, "x", "") == 2.0 and isinstance(check_seconds(2, "x", ""), float)


# ---------------------------------------------------------------------- the bound itself


def _after(seconds: float, action: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


def test_every_wait_of_the_platform_takes_the_longest_wait() -> None:
    """Python's condition (locks), futures and sockets and torch's store each take
    `MAX_WAIT_S` as a timeout and return once the awaited thing happens (1e10 s fails the
    first two with OverflowError and the store with DistNetworkError)."""
    import torch.distributed as dist

    cond = threading.Condition()
    with cond:
        _after(0.05, lambda: [cond.acquire(), cond.notify(), cond.release()])
        assert cond.wait(MAX_WAIT_S)
    future: Future[int] = Future()
    _after(0.05, lambda: future.set_result(1))
    assert future.result(MAX_WAIT_S) == 1
    left, right = socket.socketpair()
    with left, right:
        left.settimeout(MAX_WAIT_S)
        _after(0.05, lambda: right.send(b"x"))
        assert left.recv(1) == b"x"
    timeout = datetime.timedelta(seconds=MAX_WAIT_S)
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=timeout)
    _after(0.05, lambda: server.set("key", "1"))
    client.wait(["key"], timeout)
    assert client.get("key") == b"1"


# ---------------------------------------------------------------------- a computed wait

PAGE = 16 << 10
CHUNKS = 12  # more than TIMEOUT_MAX / MAX_WAIT_S rows behind one I/O thread


class _SlowWrites(FileIO):
    """Every write takes a while, so a spill is still running when its row is waited for."""

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        time.sleep(0.01)
        return super().pwritev(fd, buffers, offset)


@pytest.fixture
def fs_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="pytest-bounds-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_wait_for_many_spills_behind_one_thread_stays_within_the_bound(fs_dir: str) -> None:
    """`RankFiles.wait_rows` gives the spills of one call one deadline: the I/O deadline times
    the spills per I/O thread.  With the longest I/O deadline and 12 spills on one thread that
    product (1.2e10 s) is past what a future can wait; the wait is cut to the bound and the
    rows come back once the writes are done."""
    config = TierConfig(cpu_bytes_per_node=2 * CHUNKS * 16 * PAGE, tp=1)
    plan = compute_plan([RankDescriptor(0, "n0", 0, 1, 0, 0, (PAGE,), config)])
    assert plan.chunk_count >= CHUNKS
    region = mmap.mmap(-1, plan.region_bytes(0))
    address = np.frombuffer(region, dtype=np.uint8).ctypes.data
    generations = np.zeros(plan.chunk_count * plan.blocks_per_chunk, dtype=np.int64)
    topology = Topology(0, 1, 1, 1, (NodeInfo("n0", (0,)),))
    files = RankFiles.open(plan, topology, fs_dir, 64 * MiB, address, {"dtype": "uint8"},
                           generations, io_threads=1, io_timeout_s=MAX_WAIT_S, io=_SlowWrites())
    try:
        files.spill([((f"k{c}",), c) for c in range(CHUNKS)])
        files.wait_rows(range(CHUNKS))
        report = files.to_json()
        assert report is not None and report["timeouts"] == 0
    finally:
        files.close()
        del address
        region.close()
