# SPDX-License-Identifier: Apache-2.0
"""File-tier faults on one rank of a real 2-rank gloo group (SPMD API), injected through the
tier's I/O seam (`FileIO`) in that rank's process only.

The scenario of every case: three stores into two host chunks (the third spills key 0 to
disk), then a promotion of key 0, which spills key 1 to make room.

* EIO on a read, ENOSPC on a spill, a read or a spill stalled past ``fs_io_timeout_s``: the
  promotion is the same miss on every rank within the deadline, the stored keys still load
  byte-exact or are reported misses, and the row of the stalled read stays quarantined on the
  chunk manager until the read returned (the next promotion's report frees it);
* SIGKILL of rank 1 inside a spill's write or a promotion's read: rank 0 fails within a bounded
  time with an error naming the failure, and nothing is left behind: no offload file in
  /dev/shm, no temporary file next to the chunk files, no process.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from tests.harness import run_group, shm_entries

KiB = 1 << 10
BPC = 4  # blocks per chunk
PAGE = 4 * KiB
ROW = 2 * BPC * PAGE  # both ranks' slots of one host row
IO_TIMEOUT = 1.0


def faulty_body(rank: int, fs_dir: str, fault: str) -> object:
    """Run the scenario with ``fault`` injected on rank 1; return what every rank saw."""
    import contextlib
    import errno
    import functools
    import signal
    import threading

    import torch
    import torch.distributed as dist

    from offload import CopyJob, HostTier
    from offload.config import TierConfig
    from offload.tiers.fs_io import FileIO

    gate, healed = threading.Event(), threading.Event()
    if rank == 1 and fault != "none":
        plain_read, plain_write = FileIO.preadv, FileIO.pwritev

        def read(self: FileIO, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
            if healed.is_set():
                return plain_read(self, fd, buffers, offset)
            if fault == "eio-read":
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            if fault == "stall-read":
                gate.wait(3 * IO_TIMEOUT)  # a stall that outlasts the deadline, then ends
            if fault == "kill-read":
                os.kill(os.getpid(), signal.SIGKILL)
            return plain_read(self, fd, buffers, offset)

        def write(self: FileIO, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
            if healed.is_set():
                return plain_write(self, fd, buffers, offset)
            if fault == "enospc-write":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if fault == "stall-write":
                gate.wait(3 * IO_TIMEOUT)
            if fault == "kill-write":
                os.kill(os.getpid(), signal.SIGKILL)
            return plain_write(self, fd, buffers, offset)

        FileIO.preadv = read  # type: ignore[method-assign]
        FileIO.pwritev = write  # type: ignore[method-assign]

    gen = torch.Generator().manual_seed(100 + rank)
    kv = [torch.randint(0, 256, (3 * BPC, PAGE), generator=gen, dtype=torch.uint8)]
    original = kv[0].clone()
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=2 * ROW, layout="private",
                                          blocks_per_chunk=BPC, tp=2, timeout_s=10,
                                          fs_dir=fs_dir, fs_namespace="test-model",
                                          fs_bytes=8 * ROW,
                                          fs_io_timeout_s=IO_TIMEOUT))
    manager: Any = tier.manager

    def decided(make: Callable[[], Any]) -> Any:  # rank 0 decides, everyone gets the decision
        box = [make() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def manager_call(method: str, *args: Any) -> Any:
        return getattr(manager, method)(*args)

    def copy(job_id: int, direction: str, pairs: Any, spills: Any = ()) -> None:
        blocks, chunks, positions = [], [], []
        for key, chunk in pairs:
            blocks += [key * BPC + p for p in range(BPC)]
            chunks += [chunk] * BPC
            positions += list(range(BPC))
        tier.submit(CopyJob(job_id, direction, blocks, chunks, positions,
                            spills=tuple(spills)))
        tier.wait([job_id])

    def load_back(key: int) -> bool:
        load = decided(lambda: manager.prepare_load([key]))
        copy(load.job_id, "load", load.chunks)
        if rank == 0:
            manager.complete_load(load.job_id)
        rows = slice(key * BPC, (key + 1) * BPC)
        return torch.equal(kv[0][rows], original[rows])

    began = time.monotonic()
    try:
        for key in range(3):  # the third store evicts key 0, which is spilled on the way
            job = decided(functools.partial(manager_call, "prepare_store", [key]))
            copy(job.job_id, "store", job.chunks, job.spills)
            if rank == 0:
                manager.complete_store(job.job_id, ok=True)
        kv[0].zero_()
        promotion = decided(lambda: manager.prepare_promote([0]))
        failed = tier.collective_promote(promotion)
    except Exception as exc:  # noqa: BLE001 -- the survivor's error is the result
        elapsed = time.monotonic() - began
        held = manager.stats().quarantined if manager is not None else None
        with contextlib.suppress(Exception):  # (its barrier fails too: the peer is gone)
            tier.close()
        return "error", type(exc).__name__, str(exc).splitlines()[0], elapsed, held
    promote_s = time.monotonic() - began
    quarantined = manager.stats().quarantined if manager is not None else None
    healed.set()  # the disk works again: what is still cached must read back exactly
    if fault == "stall-read":  # the stalled read returns; the next promotion frees its row
        files = tier.actor.files
        while files is not None and files.busy_rows():
            time.sleep(0.01)
        dist.barrier()
    report = decided(lambda: manager.prepare_promote([]))
    tier.collective_promote(report)  # (it reports busy rows)
    freed = manager.stats().quarantined if manager is not None else None
    seen = []
    for key in range(3):
        where = decided(functools.partial(manager_call, "residence", key))
        if where == "disk":  # bring it back first (one chunk may be all the host holds)
            job = decided(functools.partial(manager_call, "prepare_promote", [key]))
            if tier.collective_promote(job):
                seen.append("miss")
                continue
            where = decided(functools.partial(manager_call, "residence", key))
        if where in ("host", "both"):
            seen.append("exact" if load_back(key) else "WRONG")
        else:
            seen.append("miss" if key in failed else f"lost ({where})")
    tier.close()
    return failed, promote_s, quarantined, freed, seen


def _left_behind(fs_dir: pathlib.Path) -> list[str]:
    """Anything in the file-tier directory but fingerprint folders holding chunk files."""
    found = []
    for folder in fs_dir.iterdir():
        if not (folder.is_dir() and folder.name.startswith("fp-")):
            found.append(folder.name)
            continue
        found += [f"{folder.name}/{n}" for n in os.listdir(folder) if not n.endswith(".kv")]
    return found


@pytest.mark.parametrize("fault", ["none", "eio-read", "enospc-write", "stall-read",
                                   "stall-write"])
def test_a_faulty_disk_on_one_rank_is_the_same_miss_everywhere(fault: str,
                                                                tmp_path: pathlib.Path) -> None:
    out = run_group(faulty_body, 2, args=(str(tmp_path), fault), timeout=120)
    assert all(o.ok for o in out), [o.error for o in out]
    values = [o.value for o in out]
    assert values[0][4] == values[1][4]  # every rank saw the same keys
    failed, promote_s, quarantined, freed, seen = values[0]
    assert failed == ([] if fault == "none" else [0])
    assert promote_s < 30  # the stores, then one promotion bounded by the I/O deadline
    # nothing acknowledged is lost, no wrong byte: every stored key loads exactly or is a
    # reported miss (ENOSPC made the spills on rank 1 misses)
    assert all(v in ("exact", "miss") for v in seen), seen
    if fault not in ("enospc-write", "stall-write"):
        assert seen == ["exact" if fault == "none" else "miss", "exact", "exact"]
    assert quarantined == (1 if fault == "stall-read" else 0) and freed == 0
    assert _left_behind(tmp_path) == []


@pytest.mark.parametrize("where", ["kill-write", "kill-read"])
def test_a_rank_killed_mid_spill_or_mid_promote(where: str, tmp_path: pathlib.Path) -> None:
    before = shm_entries()
    began = time.monotonic()
    out = run_group(faulty_body, 2, args=(str(tmp_path), where), timeout=120, pg_timeout=20)
    elapsed = time.monotonic() - began
    assert out[1].exitcode == -9 and not out[1].ok
    assert out[0].ok, out[0].error
    status, kind, message, failed_after, held = out[0].value
    assert status == "error" and failed_after < 30 and elapsed < 90, out[0].value
    assert kind == "PeerError", (kind, message)
    # the dead rank's read may have been running: the promotion's row stays quarantined
    assert held == (1 if where == "kill-read" else 0)
    assert ("ranks [1] have not completed it" if where == "kill-write" else
            "the ranks could not agree on its reads") in message, message
    assert all(o.exitcode is not None for o in out)  # no process left running
    assert shm_entries() - before == set()
    assert _left_behind(tmp_path) == []
