"""Faults injected into a serving tier across real gloo ranks: a rank SIGKILLed in the middle of
a store, a rank that stops polling.  Each case checks that nothing acknowledged is lost, that no
job is reported a success it was not, that every survivor fails (or recovers) within a bounded
time, and -- through the ``shm_dir`` fixture's emptiness check -- that nothing is left behind.

(Whole-node SIGKILLs during set-up are in test_region_kill.py; ids reused at random steps in
test_tier_jobs.py; the file tier's faults in test_fs_faults.py.)
"""

from __future__ import annotations

import time

from offload.config import TierConfig
from tests.harness import run_group

MiB = 1 << 20
PAGE = 4096
TIMEOUT_S = 2.0


def _kv(rank: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(7 + rank)
    return [torch.randint(1, 256, (16, PAGE), generator=gen, dtype=torch.uint8)]


def _killed_mid_store(rank: int, shm_dir: str) -> object:
    import os
    import signal

    import torch

    from offload import CopyJob, HostTier, PeerError
    from offload.transfer.host import HostEngine

    kv = _kv(rank)
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=3,
                                          timeout_s=TIMEOUT_S, shm_dir=shm_dir))
    tier.submit(CopyJob(1, "store", (0, 1, 2, 3), (0, 0, 0, 0), (0, 1, 2, 3)))
    tier.wait([1])  # acknowledged on every rank
    if rank == 2:
        original = HostEngine._issue

        def die_halfway(self, job_id, direction, job, after):  # type: ignore[no-untyped-def]
            half = type(job)(job.blocks[:2], job.host_pages[:2])
            original(self, job_id, direction, half, after)
            os.kill(os.getpid(), signal.SIGKILL)

        HostEngine._issue = die_halfway  # type: ignore[method-assign]
    # job 2 overwrites chunk 1 (not chunk 0, which holds the acknowledged job 1)
    tier.submit(CopyJob(2, "store", (4, 5, 6, 7), (1, 1, 1, 1), (0, 1, 2, 3)))
    began = time.monotonic()
    outcome = "decided"
    try:
        if rank == 0:
            while not tier.finished():
                time.sleep(0.001)
        else:
            tier.wait([2])
    except PeerError as exc:
        outcome = str(exc)
    waited = time.monotonic() - began
    view = tier.actor.region.tensor_view(0)
    kept = all(torch.equal(view[0, p], kv[0][p]) for p in range(4))
    tier.actor.close()  # the group is broken: no collective close; this rank's share only
    return outcome, waited, kept


def test_a_rank_killed_mid_store_fails_every_survivor_in_bounded_time(shm_dir: str) -> None:
    out = run_group(_killed_mid_store, 3, args=(shm_dir,), pg_timeout=10, timeout=90)
    assert out[2].exitcode == -9  # SIGKILL, in the middle of its copy
    for o in out[:2]:
        assert o.ok, o.error
        outcome, waited, kept = o.value
        assert outcome.startswith("job 2: ranks [2] have not completed it"), outcome
        assert waited < TIMEOUT_S + 3, waited  # the decider and the waiter alike
        assert kept  # the acknowledged job's bytes are untouched


def _stops_polling(rank: int) -> object:
    from offload import CopyJob, HostTier, PeerError

    kv = _kv(rank)
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=2,
                                          timeout_s=TIMEOUT_S))
    engine = tier.actor.engine
    if rank == 1:  # its copies finish, but it stops collecting them: its watermark stalls
        real_poll = engine.poll
        engine.poll = lambda: []  # type: ignore[method-assign]
    tier.submit(CopyJob(3, "store", (0,), (0,), (0,)))
    import torch.distributed as dist

    seen: list[object] = []
    if rank == 0:
        began = time.monotonic()
        try:
            while True:
                assert tier.finished() == []  # never a success before every rank is done
                time.sleep(0.001)
        except PeerError as exc:
            seen.append((str(exc), time.monotonic() - began))
    dist.barrier()
    if rank == 1:
        engine.poll = real_poll  # type: ignore[method-assign]
        tier.poll()  # it resumes: the job completes
    dist.barrier()
    if rank == 0:
        seen.append([(r.job_id, r.success) for r in tier.finished()])
    box = [tier.mark if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if rank == 1:
        seen.append([(r.job_id, r.success) for r in tier.finished(box[0])])
    tier.close()
    return seen


def test_a_rank_that_stops_polling_is_named_then_recovers() -> None:
    out = run_group(_stops_polling, 2, timeout=90)
    assert all(o.ok for o in out), [o.error for o in out]
    (message, waited), decided = out[0].value
    assert message.startswith("job 3: ranks [1] have not completed it"), message
    assert TIMEOUT_S - 0.5 <= waited < TIMEOUT_S + 3  # not before the timeout, soon after
    assert decided == [(3, True)] and out[1].value == [[(3, True)]]


def _corrupted_host_row(rank: int) -> object:
    import torch
    import torch.distributed as dist

    from offload import CopyJob, HostTier, JobFailed

    kv = _kv(rank)
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=2,
                                          timeout_s=20))
    manager = tier.manager
    keys = ("prefix-a", "prefix-b")
    box = [manager.prepare_store(list(keys)) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    store = box[0]
    blocks = list(range(8))
    chunks = [c for _, c in store.chunks for _ in range(4)]
    positions = [p for _ in store.chunks for p in range(4)]
    tier.submit(CopyJob(1, "store", blocks, chunks, positions))
    tier.wait([1])
    if rank == 0:
        manager.complete_store(store.job_id, ok=True)
    if rank == 1:  # one byte of rank 1's copy of block 6 (chunk b, position 2) rots
        tier.actor.region.tensor_view(0)[chunks[6], 2, 100] ^= 0x10
    original = kv[0].clone()
    kv[0].zero_()
    box = [manager.prepare_load(list(keys)) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    load = box[0]
    tier.submit(CopyJob(2, "load", blocks, chunks, positions))
    result = None
    if rank == 0:
        while not (decided := tier.finished()):
            time.sleep(0.001)
        (result,) = decided
    box = [tier.mark if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if rank == 1:
        (result,) = tier.finished(box[0])
    lookup = None
    if rank == 0:
        manager.complete_load(load.job_id, fence=tier.submitted,
                              damaged=list(keys) if result.damaged else ())
        lookup = manager.lookup_prefix(list(keys))
    # the driven path raises the same decision as JobFailed
    blocks_ok = torch.equal(kv[0][:6], original[:6])
    driven = None
    if rank == 0:
        try:
            tier.run(CopyJob(3, "load", [6], [chunks[6]], [2]))
        except JobFailed as exc:
            driven = (exc.rank, exc.damaged)
        tier.release()
    else:
        tier.serve()
    mismatches = tier.actor.engine.mismatches
    tier.close()
    return (result.success, result.failed_rank, result.error, result.damaged, lookup,
            blocks_ok, driven, mismatches)


def test_a_host_row_corrupted_between_store_and_load_fails_the_load_on_every_rank() -> None:
    out = run_group(_corrupted_host_row, 2, timeout=90)
    assert all(o.ok for o in out), [o.error for o in out]
    (ok, rank, error, damaged, lookup, _, driven, mismatches0), rest = (o.value for o in out)
    assert rest[:4] == (ok, rank, error, damaged)  # the same decision on both ranks
    assert (ok, rank, damaged) == (False, 1, True)
    assert error.startswith("integrity: tensor 0 chunk 1 position 2"), error
    assert lookup == 0  # the damaged keys are dropped from the manager
    assert driven == (1, True)
    assert (mismatches0, rest[7]) == (0, 2)  # counted on the rank that found it


def _lost_store_copy(rank: int) -> object:
    import torch

    from offload import CopyJob, HostTier, JobFailed

    kv = _kv(rank)
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=2,
                                          timeout_s=20))
    chunks, positions = [0] * 4 + [1] * 4, list(range(4)) * 2
    tier.submit(CopyJob(1, "store", list(range(8)), chunks, positions))
    tier.wait([1])
    engine = tier.actor.engine
    if rank == 1:  # rank 1's copy of the second store never runs, yet completes
        issue = engine._issue
        engine._issue = lambda job_id, direction, job, after: engine._done.append(job_id)
    tier.submit(CopyJob(2, "store", list(range(8, 16)), chunks, positions))
    tier.wait([2])  # every rank reports the store a success
    if rank == 1:
        engine._issue = issue
    kv[0][:8] = 0
    outcome = None
    try:
        tier.submit(CopyJob(3, "load", list(range(8)), chunks, positions))
        tier.wait([3])
    except JobFailed as exc:
        outcome = (exc.rank, exc.damaged, str(exc))
    # what this rank loaded: the second store's blocks, or (rank 1) poison instead of the first's
    first_store = _kv(rank)[0][:8]
    loaded = kv[0][:8]
    report = (outcome, bool(torch.equal(loaded, kv[0][8:16])),
              bool((loaded == first_store).all(dim=1).any()), engine.mismatches)
    tier.close()
    return report


def test_a_store_whose_copy_went_missing_on_one_rank_fails_the_next_load_everywhere() -> None:
    """Rank 1's copy of a re-store is lost though the store completes: its host rows still
    hold the first store's pages and sums, which agree.  The load after it fails on every rank
    with rank 1's integrity error (the pages carry the first store's generation); no rank
    gets the first store's bytes."""
    out = run_group(_lost_store_copy, 2, timeout=90)
    assert all(o.ok for o in out), [o.error for o in out]
    (outcome0, exact0, stale0, mismatches0), (outcome1, exact1, stale1, mismatches1) = (
        o.value for o in out)
    assert outcome0 == outcome1 and outcome0 is not None
    rank, damaged, message = outcome0
    assert (rank, damaged) == (1, True)
    assert "integrity: tensor 0 chunk 0 position 0 does not match what was stored" in message
    assert exact0 and not stale0 and mismatches0 == 0
    assert not exact1 and not stale1 and mismatches1 == 1
