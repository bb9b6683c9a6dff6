# SPDX-License-Identifier: Apache-2.0
"""Decisions across (simulated) nodes: every rank learns the same results from the decider's
mark, wherever the decider sits and whenever the node leaders poll; and failure records do not
pile up however many jobs fail.

A rank on another node sees the decider's node only through the key its leader refreshes when it
polls, so these tests hold completions back (a rank's engine hides its finished copies until its
turn) and order every completion and poll with barriers: the checks are exact.  Several tiers
run one after another in each group, to start the processes once.
"""

from __future__ import annotations

import random

import pytest

from offload.config import TierConfig
from tests.harness import run_group

MiB = 1 << 20
PAGE = 4096
NODES = ["a", "a", "b"]  # node a: ranks 0 (its leader) and 1; node b: rank 2
LEADERS = (0, 2)


def _kv(rank: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(7 + rank)
    return [torch.randint(1, 256, (16, PAGE), generator=gen, dtype=torch.uint8)]


def _tier(rank: int, decider: int, tp: int) -> object:
    from offload import HostTier

    return HostTier.create(_kv(rank), TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                                 tp=tp, timeout_s=20), decider=decider)


class _Held:
    """This rank's finished copies, hidden from its tier until `release` (which polls,
    publishing its watermark and, on a leader, its node's keys); ``failing`` maps a job's
    sequence number to the error this rank's engine gives it."""

    def __init__(self, tier: object) -> None:
        self.tier = tier
        self.engine = tier.actor.engine  # type: ignore[attr-defined]
        self.real_poll, real_error = self.engine.poll, self.engine.job_error
        self.failing: dict[int, str] = {}
        self.engine.poll = lambda: []
        self.engine.job_error = lambda seq: real_error(seq) or self.failing.pop(seq, None)

    def release(self) -> None:
        self.engine.poll = self.real_poll
        self.tier.poll()  # type: ignore[attr-defined]
        self.engine.poll = lambda: []


def _learn(tier: object, rank: int, decider: int, order: list[int]) -> list[tuple]:
    """The decider decides (whatever it can see), then the others learn its mark one at a
    time in ``order``.  Rank 2 (node b) first offers a mark with a wrong failure count: the
    check refuses it and moves nothing, so the right mark then gives every result."""
    import torch.distributed as dist

    from offload.tier import DecisionMark

    results = tier.finished() if rank == decider else []  # type: ignore[attr-defined]
    box = [tier.mark if rank == decider else None]  # type: ignore[attr-defined]
    dist.broadcast_object_list(box, src=decider)
    mark = box[0]
    for turn in order:
        if rank == turn != decider:
            if rank == 2 and mark.failed:
                forged = DecisionMark(mark.through, mark.failed + 1, mark.records)
                try:
                    tier.finished(forged)  # type: ignore[attr-defined]
                    raise AssertionError("a mark with a wrong failure count was accepted")
                except RuntimeError as exc:
                    assert "where the decider counted" in str(exc), exc
            results = tier.finished(mark)  # type: ignore[attr-defined]
        dist.barrier()
    return [(r.job_id, r.success, r.failed_rank, r.error) for r in results]


def _damaged_loads(rank: int) -> object:
    """For each decider and each order of node a's polls: rank 1's load fails its checksum
    (a byte of its host row rots); node a's leader polls before or after rank 1's copy
    completes; node b learns the decision first, while node a's key may be stale."""
    import torch.distributed as dist

    from offload import CopyJob

    decided = {}
    for decider in (0, 1, 2):
        for leader_first in (True, False):
            tier = _tier(rank, decider, 3)
            job = ((0, 1, 2, 3), (0, 0, 0, 0), (0, 1, 2, 3))
            tier.submit(CopyJob(1, "store", *job))  # type: ignore[attr-defined]
            tier.wait([1])  # type: ignore[attr-defined]
            if rank == 1:  # one byte of rank 1's host copy of block 2 rots
                tier.actor.region.tensor_view(0)[0, 2, 100] ^= 0x10  # type: ignore[attr-defined]
            held = _Held(tier)
            tier.submit(CopyJob(2, "load", *job))  # type: ignore[attr-defined]
            dist.barrier()
            for turn in [2, 0, 1] if leader_first else [2, 1, 0]:
                if rank == turn:
                    held.release()
                dist.barrier()
            if decider == 2 and leader_first and rank == 0:  # node b decides from node a's key
                tier.poll()  # type: ignore[attr-defined]
            dist.barrier()
            decided[decider, leader_first] = _learn(tier, rank, decider, [2, 1, 0])
            tier.close()  # type: ignore[attr-defined]
    return decided


def test_a_damaged_load_is_the_same_failure_on_every_node() -> None:
    out = run_group(_damaged_loads, 3, nodes=NODES, timeout=240)
    assert all(o.ok for o in out), [o.error for o in out]
    for case, decided in out[0].value.items():
        assert [o.value[case] for o in out[1:]] == [decided] * 2, case
        ((job_id, success, failed_rank, error),) = decided
        assert (job_id, success, failed_rank) == (2, False, 1), case
        assert error.startswith("integrity: tensor 0 chunk 0 position 2"), (case, error)


Event = tuple[str, object]  # ("complete" | "poll", rank) or ("decide", learning order)


def _schedule(seed: int, steps: int) -> list[tuple[list[int], list[Event]]]:
    """A random schedule: for each step, the ranks that fail its job and the events after
    every rank submitted it -- each rank completes it once, in a random order; leaders poll
    and the decider decides at random moments between; a decision ends the step.  Each
    decision gives the order in which the other ranks learn its mark."""
    rng = random.Random(seed)
    schedule = []
    for _ in range(steps):
        failing = sorted(rng.sample(range(3), rng.choice([0, 1, 1, 2])))
        events: list[Event] = [("complete", r) for r in rng.sample(range(3), 3)]
        for _ in range(rng.randint(0, 2)):
            extra = ("poll", rng.choice(LEADERS)) if rng.random() < 0.5 else ("decide", 0)
            events.insert(rng.randint(0, len(events)), extra)
        events.append(("decide", 0))
        schedule.append((failing, [(e, rng.sample(range(3), 3)) if e == "decide" else (e, r)
                                   for e, r in events]))
    return schedule


def _stale_hazards(schedule: list[tuple[list[int], list[Event]]]) -> int:
    """How often, with rank 1 deciding, node b learns a failure of rank 1 alone while node
    a's key (refreshed by rank 0's polls) does not show it yet: the case a follower reading
    its own view gets wrong."""
    hazards = 0
    for failing, events in schedule:  # rank 0's submit of the step refreshed the key
        done, shown = set(), False
        for event, arg in events:
            if event in ("complete", "poll") and arg == 0:
                shown = 1 in done
            if event == "complete":
                done.add(arg)
            if event == "decide" and len(done) == 3 and failing == [1] and not shown:
                order = list(arg)  # type: ignore[call-overload]
                hazards += order.index(2) < order.index(0)
            if event == "decide":  # rank 0 decides or learns the mark: it polls
                shown = 1 in done
    return hazards


def _random_schedule(rank: int, schedule: list[tuple[list[int], list[Event]]]) -> object:
    """For each decider, run ``schedule`` (`_schedule`): every step, every rank submits a
    store and the failing ranks' engines fail it.  Returns every rank's results."""
    import torch.distributed as dist

    from offload import CopyJob

    outcome = {}
    for decider in (0, 1, 2):
        tier = _tier(rank, decider, 3)
        held = _Held(tier)
        results = []
        for step, (failing, events) in enumerate(schedule):
            if rank in failing:
                held.failing[step] = f"rank {rank} failed job {step}"
            tier.submit(CopyJob(step, "store", (step % 16,), (0,), (step % 4,)))  # type: ignore
            for event, arg in events:
                if event == "decide":
                    results += _learn(tier, rank, decider, arg)  # type: ignore[arg-type]
                    continue
                if rank == arg:
                    held.release() if event == "complete" else tier.poll()  # type: ignore
                dist.barrier()
        tier.close()  # type: ignore[attr-defined]
        outcome[decider] = results
    return outcome


def test_every_rank_learns_the_same_decisions_under_a_random_schedule() -> None:
    schedule = _schedule(seed=7, steps=20)
    assert _stale_hazards(schedule) >= 2  # the schedule holds the case that went wrong
    out = run_group(_random_schedule, 3, args=(schedule,), nodes=NODES, timeout=240)
    assert all(o.ok for o in out), [o.error for o in out]
    expected = [(step, not failing, failing[0] if failing else None,
                 f"rank {failing[0]} failed job {step}" if failing else None)
                for step, (failing, _) in enumerate(schedule)]
    for decider, results in out[0].value.items():
        assert [o.value[decider] for o in out[1:]] == [results] * 2, decider
        assert results == expected, decider


def _many_failures(rank: int, batches: int, batch: int, driven: bool) -> object:
    """Every job fails on rank 1 (node b), ``batch`` jobs at a time: SPMD, decided by rank 0
    and learned by rank 1; or driven, rank 0 running each job while rank 1 serves.  Returns,
    after half the batches and after all, the store's key count and the most records a rank
    keeps in memory and in its key (rank 0's view; none on rank 1, driven)."""
    import torch.distributed as dist

    from offload import CopyJob

    tier = _tier(rank, 0, 2)
    if rank == 1:  # its engine fails every job
        tier.actor.engine.job_error = lambda seq: "integrity: simulated"  # type: ignore
    sizes = []
    if driven and rank == 1:
        tier.serve()  # type: ignore[attr-defined]
    else:
        for b in range(batches):
            jobs = [CopyJob(i, "store", (i % 16,), (0,), (i % 4,)) for i in range(batch)]
            failed = _driven_batch(tier, jobs) if driven else _spmd_batch(tier, rank, jobs)
            assert failed == [1] * batch
            if b + 1 in (batches // 2, batches):
                kept: list = [None, None]
                if driven:  # rank 1 serves: ask it
                    kept = tier.call(_kept_records)  # type: ignore[attr-defined]
                else:
                    dist.all_gather_object(kept, _kept_records(tier.actor))  # type: ignore
                sizes.append((tier.actor.quorum.store.num_keys(), max(kept)))  # type: ignore
        if driven:
            tier.release()  # type: ignore[attr-defined]
    tier.close()  # type: ignore[attr-defined]
    return sizes


def _kept_records(actor: object) -> int:
    """Failure records a rank keeps: in memory (by sequence) and in its store key."""
    quorum = actor.quorum  # type: ignore[attr-defined]
    return len(quorum._failed) + len(quorum._kept)


def _driven_batch(tier: object, jobs: list) -> list[int | None]:
    """Rank 0 runs each job; the failing rank of each."""
    from offload import JobFailed

    failed: list[int | None] = []
    for job in jobs:
        try:
            tier.run(job)  # type: ignore[attr-defined]
            failed.append(None)
        except JobFailed as exc:
            failed.append(exc.rank)
    return failed


def _spmd_batch(tier: object, rank: int, jobs: list) -> list[int | None]:
    """Every rank submits ``jobs``; rank 0 decides them all, rank 1 learns its mark."""
    import torch.distributed as dist

    for job in jobs:
        tier.submit(job)  # type: ignore[attr-defined]
    results: list = []
    while rank == 0 and len(results) < len(jobs):
        results += tier.finished()  # type: ignore[attr-defined]
    box = [tier.mark if rank == 0 else None]  # type: ignore[attr-defined]
    dist.broadcast_object_list(box, src=0)
    if rank == 1:
        results = tier.finished(box[0])  # type: ignore[attr-defined]
    return [r.failed_rank for r in results]


@pytest.mark.parametrize("driven", [False, True], ids=["spmd", "driven"])
def test_failure_records_stay_flat_in_a_tier(driven: bool) -> None:
    from offload.control.quorum import FLOOR_STEP

    batch = 40
    out = run_group(_many_failures, 2, args=(30, batch, driven), nodes=["a", "b"], timeout=240)
    assert all(o.ok for o in out), [o.error for o in out]
    (keys, kept), (keys_after, kept_after) = out[0].value  # after 600 and 1200 failures
    assert keys_after == keys, out[0].value
    assert max(kept, kept_after) <= FLOOR_STEP + 2 * batch, out[0].value
