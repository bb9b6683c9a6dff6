"""Job ids and sequence places across real gloo ranks: a refusal on one rank never shifts the
ranks' sequences, and no job is reported a success unless every rank's bytes are right.

The scenario the rules exist for: job 1 is decided; the next step reuses id 1; one rank handles
the step's job before it has learned the decision (``finished(mark)``), so the id is still in
flight there and that rank refuses the job.  The job still takes its sequence place on that
rank, its `submit` returns normally as on every other rank (no control flow diverges), the
quorum learns the refusal, and every rank returns the reused job as failed -- naming the refusing
rank and its reason -- while the next job succeeds everywhere.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from offload.config import TierConfig
from tests.harness import decide_all, run_group

MiB = 1 << 20
PAGE = 1024


def _kv(rank: int, blocks: int = 8) -> list:
    """One KV tensor whose every block holds bytes unique to (rank, block)."""
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(1, 256, (blocks, PAGE), generator=gen, dtype=torch.uint8)]


def _stored_right(tier, kv, block: int, chunk: int, position: int = 0) -> bool:
    import torch

    return bool(torch.equal(tier.actor.region.tensor_view(0)[chunk, position], kv[0][block]))


def _reuse_before_learning(rank: int, learn_first: bool) -> object:
    import torch.distributed as dist

    from offload import CopyJob, HostTier, OffloadError

    kv = _kv(rank)
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                          tp=2, timeout_s=20))
    tier.submit(CopyJob(1, "store", (0,), (0,), (0,)))
    first: list = []
    while rank == 0 and not first:
        first = [(r.job_id, r.success, r.failed_rank, r.error) for r in tier.finished()]
    box = [tier.mark if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # the engine's step broadcast carries the mark
    mark = box[0]
    refused = None
    if rank == 1 and learn_first:
        first = [(r.job_id, r.success, r.failed_rank, r.error) for r in tier.finished(mark)]
    try:
        tier.submit(CopyJob(1, "store", (1,), (1,), (0,)))  # the reused id
    except OffloadError as exc:
        refused = str(exc)
    if rank == 1 and not learn_first:
        first = [(r.job_id, r.success, r.failed_rank, r.error) for r in tier.finished(mark)]
    tier.submit(CopyJob(2, "store", (2,), (2,), (0,)))
    rest = decide_all(tier, rank)
    right = {1: _stored_right(tier, kv, 1, 1), 2: _stored_right(tier, kv, 2, 2)}
    tier.close()
    return first, rest, refused, right


@pytest.mark.parametrize("learn_first", [False, True], ids=["submit-first", "learn-first"])
def test_a_reused_id_still_in_flight_on_one_rank_fails_on_every_rank(learn_first: bool) -> None:
    out = run_group(_reuse_before_learning, 2, args=(learn_first,), timeout=120)
    assert all(o.ok for o in out), [o.error for o in out]
    (first0, rest0, refused0, right0), (first1, rest1, refused1, right1) = (o.value for o in out)
    assert first0 == first1 == [(1, True, None, None)]
    assert rest0 == rest1  # the same results for the same mark on every rank
    assert refused0 is None
    if learn_first:  # rank 1 had returned job 1 before the reuse: nothing to refuse
        assert refused1 is None
        assert rest0 == [(1, True, None, None), (2, True, None, None)]
        assert right0 == right1 == {1: True, 2: True}
    else:
        assert refused1 is None  # a refusal of its own: submit returned, as on rank 0
        (job, success, rank, error), job2 = rest0
        assert "reused while a job with that id" in error
        assert (job, success, rank) == (1, False, 1) and "still in flight on rank 1" in error
        assert job2 == (2, True, None, None)
        assert right1 == {1: False, 2: True}  # rank 1 never copied the refused job...
        assert right0[2]  # ...and job 2, the next in sequence, is right on both ranks


def _wait_times_out_on_one_rank(rank: int) -> object:
    import torch.distributed as dist

    from offload import CopyJob, HostTier, PeerError

    kv = _kv(rank)
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                          tp=2, timeout_s=20))
    timed_out = False
    if rank == 1:
        dist.barrier()  # rank 0's wait has timed out
    tier.submit(CopyJob(5, "store", (0,), (0,), (0,)))
    try:
        tier.wait([5], timeout_s=0.3 if rank == 0 else None)
    except PeerError:
        timed_out = True
    if rank == 0:
        dist.barrier()
    dist.barrier()
    tier.submit(CopyJob(5, "store", (3,), (3,), (0,)))  # the id is free on both ranks again
    tier.wait([5])
    right = _stored_right(tier, kv, 3, 3)
    tier.close()
    return timed_out, right


def test_a_wait_that_times_out_on_one_rank_leaves_the_ranks_in_step() -> None:
    out = run_group(_wait_times_out_on_one_rank, 2, timeout=120)
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value for o in out] == [(True, True), (False, True)]


def _reuse_at_random(rank: int, steps: int, seed: int) -> object:
    """An engine loop in which ids come from a pool of two and each rank learns the step's
    mark at a random point among its submits, so any rank may still hold a reused id."""
    import random

    import torch.distributed as dist

    from offload import CopyJob, HostTier, OffloadError

    rng = random.Random(seed * 10 + rank)
    kv = _kv(rank)
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                          tp=3, timeout_s=30))
    batches: list[list[tuple[int, bool, int | None]]] = []
    placed: list[tuple[int, int]] = []  # per job in sequence: (block, chunk)
    for step in range(steps + 1):
        box = [tier.mark if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        count = step % 3 if step < steps else 0
        learn_at = rng.randrange(count + 1)
        for j in range(count + 1):
            if j == learn_at and rank != 0:
                batches.append([(r.job_id, r.success, r.failed_rank)
                                for r in tier.finished(box[0])])
            if j == count:
                break
            seq = len(placed)
            block, chunk = seq % 8, seq
            placed.append((block, chunk))
            with contextlib.suppress(OffloadError):  # a refusal still takes its place
                tier.submit(CopyJob(seq % 2, "store", (block,), (chunk,), (0,)))
            time.sleep(rng.random() * 0.003)
            tier.poll()
        time.sleep(rng.random() * 0.003)
        if rank == 0:
            batches.append([(r.job_id, r.success, r.failed_rank) for r in tier.finished()])
    final = decide_all(tier, rank)
    decided = [job for batch in batches for job in batch] + [f[:3] for f in final]
    wrong = [seq for seq, (job, ok, _) in enumerate(decided)
             if ok and not _stored_right(tier, kv, *placed[seq])]
    tier.close()
    return (batches[:-1] if rank == 0 else batches[1:]), decided, wrong


def test_ranks_reusing_ids_at_random_steps_agree_on_every_result() -> None:
    out = run_group(_reuse_at_random, 3, args=(40, 3), timeout=180)
    assert all(o.ok for o in out), [o.error for o in out]
    batches, decided, _ = out[0].value
    assert [o.value[0] for o in out] == [batches] * 3  # same results at the same steps
    assert [o.value[1] for o in out] == [decided] * 3
    assert [o.value[2] for o in out] == [[], [], []]  # no success with a wrong byte anywhere
    refused = [job for job in decided if not job[1]]
    assert refused and all(rank is not None for _, _, rank in refused)
    assert len(refused) < len(decided)


def _wait_on_an_id_live_twice(rank: int) -> object:
    """Job 5 is decided and returned by the decider's `finished`; both ranks reuse id 5 before
    rank 1 learned that (so rank 1 refuses it) and `wait` for it: `wait` takes the newest job
    of the id on both ranks, and rank 1 still gets the old job from `finished(mark)`."""
    import torch.distributed as dist

    from offload import CopyJob, HostTier, JobFailed, OffloadError

    tier = HostTier.create(_kv(rank), TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                                 tp=2, timeout_s=20))
    tier.submit(CopyJob(5, "store", (0,), (0,), (0,)))
    first: list = []
    while rank == 0 and not first:
        first = [(r.job_id, r.success) for r in tier.finished()]
    box = [tier.mark if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    with contextlib.suppress(OffloadError):
        tier.submit(CopyJob(5, "store", (1,), (1,), (0,)))
    waited = None
    try:
        tier.wait([5])
    except JobFailed as exc:
        waited = (exc.rank, exc.job_id)
    if rank == 1:
        first = [(r.job_id, r.success) for r in tier.finished(box[0])]
    live = tier.actor.jobs.live
    tier.close()
    return first, waited, live


def test_wait_takes_the_newest_job_of_an_id_live_twice() -> None:
    out = run_group(_wait_on_an_id_live_twice, 2, timeout=90)
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value for o in out] == [([(5, True)], (1, 5), 0)] * 2


def _layer_wise(rank: int) -> object:
    import torch

    from offload import CopyJob, HostTier, OffloadError

    kv = [torch.randint(1, 256, (8, 256), generator=torch.Generator().manual_seed(rank + t),
                        dtype=torch.uint8) for t in range(4)]
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                          tp=2, timeout_s=20))
    tier.submit(CopyJob(1, "store", (0, 1), (1, 1), (0, 1)))
    events = tier.submit(CopyJob(2, "load", (5, 6), (1, 1), (0, 1)), layer_groups=2)
    refused = None
    try:
        tier.submit(CopyJob(3, "store", (2,), (2,), (0,)), layer_groups=2)
    except OffloadError as exc:
        refused = str(exc)
    results = decide_all(tier, rank)
    loaded = all(torch.equal(t[5:7], t[0:2]) for t in kv)
    tier.close()
    return events, refused, results, loaded


def test_a_layer_wise_load_through_the_tier_is_one_job_with_an_event_per_group() -> None:
    """Host KV: one None per group; the job is decided once, like any other; layer_groups on a
    store is refused on every rank alike (its place in the sequence kept)."""
    out = run_group(_layer_wise, 2, timeout=120)
    assert all(o.ok for o in out), [o.error for o in out]
    for events, refused, results, loaded in (o.value for o in out):
        assert events == [None, None] and loaded
        assert refused is not None and "layer_groups applies to loads, not a store" in refused
        assert results[:2] == [(1, True, None, None), (2, True, None, None)]
        job, success, failed_rank, error = results[2]
        assert (job, success, failed_rank) == (3, False, 0) and "layer_groups" in error
