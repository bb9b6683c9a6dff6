"""Quorum: counter semantics on an in-process c10d store, then real 3-rank gloo groups."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch.distributed as dist

from offload.errors import OffloadError, PeerError
from offload.manager import ChunkManager, NotReadableError
from offload.quorum import Quorum, default_store
from tests.harness import free_port, run_group

# ---------------------------------------------------------------- one process


def test_done_only_after_every_member_reported() -> None:
    q = Quorum(dist.HashStore(), members=3)
    for reported in range(3):
        assert q.count(7) == reported and not q.done(7)
        q.report(7)
    assert q.done(7) and not q.done(8)


def test_wait_returns_for_done_jobs_and_forget_deletes_the_counter() -> None:
    store = dist.HashStore()
    q = Quorum(store, members=1, prefix="jobs")
    q.report(1)
    q.report(2)
    q.wait([1, 2, 1], timeout_s=0.0)
    q.forget(1)
    assert store.num_keys() == 1 and not store.check(["jobs/1"])


def test_prefixes_do_not_share_counters() -> None:
    store = dist.HashStore()
    a, b = Quorum(store, 1, prefix="a"), Quorum(dist.PrefixStore("b", store), 1)
    a.report(0)
    assert a.done(0) and not b.done(0)


def test_wait_times_out_with_the_count() -> None:
    q = Quorum(dist.HashStore(), members=4)
    q.report(3)
    start = time.monotonic()
    with pytest.raises(PeerError, match=r"job 3: 1 of 4 ranks reported .* within 0.2 s"):
        q.wait([3], timeout_s=0.2)
    assert time.monotonic() - start < 1.0


def test_members_must_be_positive() -> None:
    with pytest.raises(OffloadError, match="at least 1 member"):
        Quorum(dist.HashStore(), members=0)


def test_default_store_falls_back_to_the_torchrun_address(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    assert not dist.is_initialized()
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    q = Quorum(default_store("offload", timeout_s=10), members=1)
    q.report(0)
    assert q.done(0)


def test_default_store_without_group_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(OffloadError, match="init_process_group or launch with torchrun"):
        default_store("offload")


# ---------------------------------------------------------------- real groups
# Ordering between ranks comes from gloo barriers, never from sleeps, so the checks are exact.


def _late_last_rank(rank: int) -> dict[str, object]:
    q = Quorum(default_store("test"), members=3)
    seen: dict[str, object] = {}
    if rank < 2:
        q.report(5)
    dist.barrier()
    seen["before"] = (q.done(5), q.count(5))
    dist.barrier()
    if rank == 2:
        q.report(5)
    dist.barrier()
    seen["after"] = (q.done(5), q.count(5))
    dist.barrier()
    if rank == 0:
        q.forget(5)
    dist.barrier()
    return seen


def test_a_job_is_not_done_until_the_last_rank_reports() -> None:
    out = run_group(_late_last_rank, 3)
    assert all(o.ok for o in out), [o.error for o in out]
    for o in out:
        assert o.value == {"before": (False, 2), "after": (True, 3)}


def _dead_rank(rank: int) -> float:
    q = Quorum(default_store("test"), members=3)
    q.report(0)
    q.wait([0], timeout_s=20)
    dist.barrier()
    if rank == 2:
        os._exit(0)  # dies without reporting job 1
    q.report(1)
    if rank == 1:
        return 0.0
    start = time.monotonic()
    try:
        q.wait([1], timeout_s=1.0)
    except PeerError as exc:
        assert "job 1: 2 of 3 ranks reported" in str(exc), exc
        return time.monotonic() - start
    raise AssertionError("wait returned although rank 2 never reported")


def test_survivors_fail_within_the_bound_when_a_rank_dies() -> None:
    out = run_group(_dead_rank, 3)
    assert out[0].ok and out[1].ok, [o.error for o in out]
    assert out[2].exitcode == 0 and out[2].value is None
    assert 1.0 <= out[0].value < 3.0


def _scheduler(rank: int) -> dict[str, object]:
    """Rank 0 schedules with a ChunkManager; every rank "copies" and reports; rank 2 always
    reports last, after rank 0 has checked what must not happen before the quorum."""
    q = Quorum(default_store("sched"), members=3)
    m = ChunkManager(2) if rank == 0 else None
    seen: dict[str, object] = {}

    def publish(job_id: int | None) -> int:
        box = [job_id]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None
        return box[0]

    def copy_with_rank_2_late(job_id: int, check_before: Callable[[], None]) -> None:
        if rank < 2:
            q.report(job_id)
        dist.barrier()
        if m is not None:
            check_before()
        dist.barrier()
        if rank == 2:
            q.report(job_id)
        if m is not None:  # only the scheduler waits: it forgets the counter right after
            q.wait([job_id], timeout_s=20)

    store_ab = publish(m.prepare_store(["a", "b"]).job_id if m else None)

    def store_pending() -> None:
        assert m is not None and not q.done(store_ab)
        seen["readable_before_quorum"] = m.lookup_prefix(["a", "b"])
        with pytest.raises(NotReadableError):
            m.prepare_load(["a"])

    copy_with_rank_2_late(store_ab, store_pending)
    if m is not None:
        m.complete_store(store_ab, ok=True)
        q.forget(store_ab)
        seen["readable_after_quorum"] = m.lookup_prefix(["a", "b"])

    load_a = publish(m.prepare_load(["a"]).job_id if m else None)

    def load_pending() -> None:
        assert m is not None and not q.done(load_a)
        job = m.prepare_store(["c", "d"])  # "a" is held: only "b" may go
        seen["store_while_held"] = (job.chunks, job.dropped)
        m.complete_store(job.job_id, ok=False)
        seen["a_cached_while_held"] = m.lookup_prefix(["a"])

    copy_with_rank_2_late(load_a, load_pending)
    if m is not None:
        m.complete_load(load_a)
        q.forget(load_a)
        seen["stats"] = m.stats()
    dist.barrier()
    return seen


def test_manager_with_quorum_across_ranks() -> None:
    out = run_group(_scheduler, 3)
    assert all(o.ok for o in out), [o.error for o in out]
    seen = out[0].value
    assert seen["readable_before_quorum"] == 0
    assert seen["readable_after_quorum"] == 2
    assert seen["store_while_held"] == ((("c", 1),), ("d",))
    assert seen["a_cached_while_held"] == 1
    stats = seen["stats"]
    assert (stats.readable, stats.free, stats.held, stats.evictions) == (1, 1, 0, 1)
