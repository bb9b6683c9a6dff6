"""The library API across real gloo ranks: SPMD round trips in every layout with hybrid KV
tensors, the quorum, audit mode and set-up errors."""

from __future__ import annotations

import time

import pytest

from offload.config import TierConfig
from tests.harness import run_group, store_drop_load

MiB = 1 << 20


def _hybrid_kv(rank: int, num_blocks: int, same_on_all_ranks: bool = False) -> list:
    """Two KV tensors with different page sizes (8000 B of fp16 and 4096 B of bytes)."""
    import torch

    gen = torch.Generator().manual_seed(0 if same_on_all_ranks else rank + 1)
    k = torch.randn((num_blocks, 2, 2000), generator=gen).to(torch.float16)
    v = torch.randint(0, 256, (num_blocks, 4096), generator=gen, dtype=torch.uint8)
    return [k, v]


@pytest.mark.parametrize("layout", ["private", "shared", "replicated"])
def test_spmd_store_poison_load_restores_every_byte(layout: str, shm_dir: str) -> None:
    def body(rank: int) -> object:
        import torch

        from offload import HostTier

        kv = _hybrid_kv(rank, 24, same_on_all_ranks=layout == "replicated")
        original = [t.clone() for t in kv]
        config = TierConfig(cpu_bytes_per_node=4 * MiB, layout=layout, blocks_per_chunk=4,
                            tp=2, timeout_s=20, shm_dir=shm_dir)
        tier = HostTier.create(kv, config)
        blocks = tuple(range(24))
        chunks = tuple(5 - b // 4 for b in blocks)  # scattered: reversed chunk order
        positions = tuple(b % 4 for b in blocks)
        store_drop_load(tier, kv, blocks, chunks, positions)
        same = all(torch.equal(a, b) for a, b in zip(kv, original, strict=True))
        view = tier.actor.region.tensor_view(1)  # tensor 1 of chunk 5, position 0 = block 0
        raw_ok = torch.equal(view[5, 0], original[1][0])
        chunk_count = tier.plan.chunk_count
        tier.close()
        return same, raw_ok, chunk_count

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]
    assert all(o.value[0] and o.value[1] for o in out)


# KV page sizes of pipeline stages 0-3: unequal payloads and tensor counts across stages
STAGE_PAGES = ((8000, 4096), (2048,), (6000, 1000), (4096, 4096, 512))


def stage_kv(stage: int, num_blocks: int, pages: tuple[int, ...], device: str = "cpu"
             ) -> list:
    """KV tensors of one pipeline stage: identical on the stage's TP ranks (as MLA latent KV
    is), different from every other stage's."""
    import torch

    gen = torch.Generator(device=device).manual_seed(100 + stage)
    return [torch.randint(0, 256, (num_blocks, page), generator=gen, dtype=torch.uint8,
                          device=device) for page in pages]


def replicated_stages_body(rank: int, tp: int, stage_pages: tuple[tuple[int, ...], ...],
                           shm_dir: str, device: str = "cpu") -> object:
    """Every rank stores its stage's blocks (the stage's writer only), drops them, loads them
    back and reports whether it got its own stage's bytes, with its slot."""
    import torch

    from offload import HostTier

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    stage = rank // tp
    kv = stage_kv(stage, 12, stage_pages[stage], device)
    original = [t.clone() for t in kv]
    config = TierConfig(cpu_bytes_per_node=4 * MiB, layout="replicated", blocks_per_chunk=4,
                        tp=tp, pp=len(stage_pages), timeout_s=60, shm_dir=shm_dir)
    tier = HostTier.create(kv, config)
    blocks = tuple(range(12))
    chunks = tuple(5 - b // 4 for b in blocks)
    positions = tuple(b % 4 for b in blocks)
    store_drop_load(tier, kv, blocks, chunks, positions)
    if device == "cuda":
        torch.cuda.synchronize()
    own = all(torch.equal(a, b) for a, b in zip(kv, original, strict=True))
    view = tier.actor.region.tensor_view(0)  # tensor 0 of chunk 5, position 0 = block 0
    raw_ok = torch.equal(view[5, 0].cpu(), original[0][0].cpu())
    row = tier.actor.report()
    own_slot_bytes = tier.plan.chunk_count * tier.plan.slots[rank].slot_bytes
    tier.close()
    return (own, raw_ok, row["pin_plan_bytes"] == own_slot_bytes, row["slot"],
            row["pinned_bytes"], own_slot_bytes)


@pytest.mark.parametrize(("tp", "stages", "nodes"), [
    (1, 2, None),                          # TP1 x PP2: rank 1 used to load rank 0's bytes
    (2, 2, None),                          # TP2 x PP2: a stage's two ranks share one slot
    (1, 4, None),                          # TP1 x PP4 on one node
    (1, 4, ["n0", "n0", "n1", "n1"]),      # TP1 x PP4 on two nodes: two stages each
])
@pytest.mark.parametrize("equal", [False, True], ids=["unequal", "equal"])
def test_replicated_pipeline_stages_load_their_own_stage_bytes(
        tp: int, stages: int, nodes: list[str] | None, equal: bool, shm_dir: str) -> None:
    pages = (STAGE_PAGES[0],) * stages if equal else STAGE_PAGES[:stages]
    out = run_group(replicated_stages_body, tp * stages, args=(tp, pages, shm_dir),
                    nodes=nodes, timeout=120, pg_timeout=60)
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value[:3] for o in out] == [(True, True, True)] * len(out)
    per_node = len(out) if nodes is None else 2  # the slot: the stage's index on its node
    assert [o.value[3] for o in out] == [(r % per_node) // tp for r in range(len(out))]

def test_a_job_is_decided_only_when_the_last_rank_completed_it() -> None:
    def body(rank: int) -> object:
        import torch.distributed as dist

        from offload import CopyJob, HostTier

        tier = HostTier.create(_hybrid_kv(rank, 8), TierConfig(
            cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=3, timeout_s=20))
        job = CopyJob(7, "store", (0, 1), (0, 0), (0, 1))
        seen = []
        if rank != 2:
            tier.submit(job)
        dist.barrier()  # ranks 0 and 1 have copied; rank 2 has not
        if rank == 0:
            seen.append(tier.finished())
        dist.barrier()
        if rank == 2:
            tier.submit(job)
        dist.barrier()
        if rank == 0:
            seen.append([(r.job_id, r.success, r.transfer_size) for r in tier.finished()])
            seen.append(tier.mark)
        tier.close()
        return seen

    out = run_group(body, 3)
    assert all(o.ok for o in out), [o.error for o in out]
    from offload.tier import DecisionMark
    assert out[0].value == [[], [(7, True, 2 * (8000 + 4096))], DecisionMark(1, 0)]


def _race(rank: int, decider: int, steps: int, seed: int) -> object:
    """An engine loop with random pauses between submit, poll and finished on every rank: the
    decider decides, the others learn its mark from the step broadcast.  Rank 1 has fewer
    blocks, so every job naming block 7 fails there (and only there)."""
    import random

    import torch
    import torch.distributed as dist

    from offload import CopyJob, HostTier

    rng = random.Random(seed * 10 + rank)
    kv = [torch.zeros((6 if rank == 1 else 8, 1024), dtype=torch.uint8)]
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                          tp=3, timeout_s=30), decider=decider)
    batches: list[list[tuple[int, bool]]] = []
    submitted, step, finished = 0, 0, False
    while not finished:
        box = [(tier.mark, step >= steps and not tier.actor.jobs.live) if rank == decider else None]
        dist.broadcast_object_list(box, src=decider)  # the engine's own step broadcast
        mark, finished = box[0]
        if rank != decider:
            batches.append([(r.job_id, r.success) for r in tier.finished(mark)])
        for j in range(step % 3 if step < steps else 0):
            block = 7 if submitted % 5 == 3 else submitted % 6
            tier.submit(CopyJob(submitted, "store", (block,), (j,), (0,)))  # rank 1: refused
            submitted += 1
            time.sleep(rng.random() * 0.004)
            tier.poll()
        time.sleep(rng.random() * 0.004)
        if rank == decider:
            batches.append([(r.job_id, r.success) for r in tier.finished()])
        step += 1
    tier.close()
    return batches[:-1] if rank == decider else batches[1:], submitted


@pytest.mark.parametrize("nodes,decider", [(None, 0), (["a", "a", "b"], 2)],
                         ids=["one-node", "two-nodes-decider-2"])
def test_racing_ranks_learn_the_same_decisions_in_the_same_steps(
        nodes: list[str] | None, decider: int) -> None:
    out = run_group(_race, 3, args=(decider, 30, 1), nodes=nodes, timeout=180)
    assert all(o.ok for o in out), [o.error for o in out]
    batches, submitted = out[0].value
    assert [o.value for o in out] == [out[0].value] * 3  # same batches at the same steps
    decided = [job for batch in batches for job in batch]
    assert [job_id for job_id, _ in decided] == list(range(submitted))
    assert all(ok == (job_id % 5 != 3) for job_id, ok in decided)
    assert sum(1 for batch in batches if len(batch) > 1) > 0  # batches really vary


def test_a_killed_rank_is_named_by_the_decider_within_the_timeout() -> None:
    def body(rank: int) -> object:
        import os

        import torch.distributed as dist

        from offload import CopyJob, HostTier, PeerError

        tier = HostTier.create(_hybrid_kv(rank, 8), TierConfig(
            cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=3, timeout_s=2))
        tier.submit(CopyJob(0, "store", (0,), (0,), (0,)))
        tier.wait([0])
        dist.barrier()
        if rank == 2:
            os._exit(0)  # dies before job 1
        tier.submit(CopyJob(1, "store", (1,), (0,), (1,)))
        if rank == 1:
            return None
        began = time.monotonic()
        try:
            while time.monotonic() - began < 20:
                assert tier.finished() == []
                time.sleep(0.001)
        except PeerError as exc:
            return time.monotonic() - began, str(exc)
        return None

    out = run_group(body, 3, pg_timeout=10)
    waited, message = out[0].value
    assert 1.5 < waited < 4.0, message
    assert message.startswith("job 1: ranks [2] have not completed it")


def test_a_store_host_dying_before_the_tier_id_is_named_at_once() -> None:
    """Rank 0 (which hosts the job's store) dies between discovery and publishing the tier
    id: rank 1 says so as soon as the store goes, not after the 60 s timeout."""
    def body(rank: int) -> object:
        import os

        import offload.tier as tier_module
        from offload import HostTier, PeerError

        if rank == 0:
            tier_module._tier_store = lambda *args: os._exit(3)  # type: ignore[assignment]
        began = time.monotonic()
        try:
            HostTier.create(_hybrid_kv(rank, 8), TierConfig(
                cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=2, timeout_s=60))
        except PeerError as exc:
            return time.monotonic() - began, str(exc)
        return None

    out = run_group(body, 2, pg_timeout=10)
    waited, message = out[1].value
    assert waited < 20 and "lost the store while waiting for rank 0's tier id" in message


def test_a_rank_whose_engine_raised_reports_the_job_failed_on_every_rank() -> None:
    def body(rank: int) -> object:
        from offload import CopyJob, HostTier, OffloadError

        tier = HostTier.create(_hybrid_kv(rank, 8), TierConfig(
            cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=2, timeout_s=20))
        if rank == 1:
            tier.actor.engine = _RaisesOnce(tier.actor.engine)
        tier.submit(CopyJob(1, "store", (0,), (0,), (0,)))
        began = time.monotonic()
        try:
            tier.wait([1])
        except OffloadError as exc:
            failed = (str(exc), time.monotonic() - began)
        tier.submit(CopyJob(2, "store", (1,), (0,), (1,)))
        tier.wait([2])  # the next job is fine again
        tier.close()
        return failed

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]
    for o in out:
        message, waited = o.value
        assert message == ("job 1 failed on rank 1: the transfer engine failed: RuntimeError: "
                           "device lost (test)")
        assert waited < 5


class _RaisesOnce:
    """A test engine whose first poll raises, as a CUDA error at event query would."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.raised = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def poll(self) -> list[int]:
        if not self.raised:
            self.raised = True
            raise RuntimeError("device lost (test)")
        return self.inner.poll()  # type: ignore[attr-defined, no-any-return]


def test_wait_with_timeout_zero_checks_once() -> None:
    def body(rank: int) -> object:
        import torch.distributed as dist

        from offload import CopyJob, HostTier, PeerError

        tier = HostTier.create(_hybrid_kv(rank, 8), TierConfig(
            cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=2, timeout_s=20))
        job = CopyJob(1, "store", (0,), (0,), (0,))
        waited = None
        if rank == 0:
            tier.submit(job)
            began = time.monotonic()
            with pytest.raises(PeerError, match=r"ranks \[1\] have not completed it"):
                tier.wait([1], timeout_s=0)
            waited = time.monotonic() - began
            assert not tier.actor.jobs.is_live(1)  # a wait returns its ids however it ends
        dist.barrier()
        if rank == 1:
            tier.submit(job)
            tier.wait([1], timeout_s=0)  # done on every rank: one look suffices
        dist.barrier()
        tier.close()
        return waited

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]
    assert out[0].value < 1.0


class _LateFirstCopy:
    """A test engine that lands its first job's copy ``delay_s`` late while later jobs copy at
    once -- as an engine with several streams may -- still reporting in submission order."""

    def __init__(self, inner: object, delay_s: float) -> None:
        self.inner = inner
        self.late: tuple[float, tuple] | None = None
        self.delay_s = delay_s
        self.order: list[int] = []
        self.copied: set[int] = set()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def issue(self, local_id: int, *args: object, after: object = None) -> None:
        self.order.append(local_id)
        if local_id == 0:
            self.late = (time.monotonic() + self.delay_s, (local_id, *args))
        else:
            self.inner.issue(local_id, *args, after=after)  # type: ignore[attr-defined]

    def poll(self) -> list[int]:
        if self.late is not None and time.monotonic() >= self.late[0]:
            self.inner.issue(*self.late[1])  # type: ignore[attr-defined]
            self.late = None
        self.copied.update(self.inner.poll())  # type: ignore[attr-defined]
        done = []
        while self.order and self.order[0] in self.copied:
            done.append(self.order.pop(0))
        return done

    def wait_all(self) -> list[int]:
        if self.late is not None:
            time.sleep(max(0.0, self.late[0] - time.monotonic()))
        return self.poll()


def test_poll_counts_this_ranks_copies_still_in_flight() -> None:
    def body(rank: int) -> object:
        import torch

        from offload import CopyJob, HostTier

        kv = [torch.zeros((8, 4096), dtype=torch.uint8)]
        tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                              tp=1, timeout_s=30))
        tier.actor.engine = _LateFirstCopy(tier.actor.engine, 0.5)
        tier.submit(CopyJob(0, "store", (0,), (0,), (0,)))
        tier.submit(CopyJob(1, "store", (1,), (0,), (1,)))  # copies at once, behind job 0
        early = tier.poll()
        time.sleep(0.6)
        later = [tier.poll() for _ in range(2)]  # the first lands job 0, the second sees it
        tier.wait([0, 1], timeout_s=0)
        tier.close()
        return early, later[-1]

    out = run_group(body, 1)
    assert all(o.ok for o in out), [o.error for o in out]
    assert out[0].value == (2, 0)


def test_a_failed_store_quarantines_its_chunk_while_a_late_rank_still_writes_it() -> None:
    """Rank 1 writes job A's chunk after the timeout failed A; a store reusing the chunk at
    once would be overwritten by that late copy (the load of B would return A's bytes)."""

    def body(rank: int) -> object:
        import torch

        from offload import CopyJob, HostTier, PeerError

        kv = [torch.zeros((8, 4096), dtype=torch.uint8)]
        tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                              tp=2, timeout_s=3))
        if rank == 1:
            tier.actor.engine = _LateFirstCopy(tier.actor.engine, 4.5)
            tier.serve()
            tier.close()
            return None
        manager = tier.manager

        def fill(actor: object) -> None:  # block 0 holds A's bytes (1s), block 1 B's (2s)
            actor.kv_tensors[0][0].fill_(1)  # type: ignore[attr-defined]
            actor.kv_tensors[0][1].fill_(2)  # type: ignore[attr-defined]

        tier.call(fill)
        a = manager.prepare_store(["a"])
        with pytest.raises(PeerError, match=r"ranks \[1\] have not completed it"):
            tier.run(CopyJob(a.job_id, "store", (0,), (a.chunks[0][1],), (0,)))
        manager.complete_store(a.job_id, ok=False, fence=tier.submitted)
        quarantined = manager.stats().quarantined
        b = manager.prepare_store(["b"])
        tier.run(CopyJob(b.job_id, "store", (1,), (b.chunks[0][1],), (0,)))
        manager.complete_store(b.job_id, ok=True)
        load = manager.prepare_load(["b"])
        tier.run(CopyJob(load.job_id, "load", (2,), (load.chunks[0][1],), (0,)))
        manager.complete_load(load.job_id)
        loaded = tier.call(lambda actor: sorted(set(actor.kv_tensors[0][2].tolist())))
        result = (a.chunks[0][1], b.chunks[0][1], quarantined, manager.stats().quarantined,
                  loaded)
        tier.release()
        tier.close()
        return result

    out = run_group(body, 2, timeout=120)
    assert all(o.ok for o in out), [o.error for o in out]
    chunk_a, chunk_b, quarantined, after, loaded = out[0].value
    assert loaded == [[2], [2]]  # the old release-at-once returned [1] from rank 1
    assert chunk_b != chunk_a and quarantined == 1 and after == 0


def test_bad_jobs_are_clear_errors_before_anything_moves() -> None:
    """A malformed job (writer_only outside the replicated layout) raises `MalformedJob` on
    every rank; a block past a rank's KV cache is that rank's own refusal (ranks may hold
    caches of different sizes), so `submit` returns and the job comes back failed."""
    def body(rank: int) -> object:
        import pytest

        from offload import CopyJob, HostTier, MalformedJob, OffloadError

        tier = HostTier.create(_hybrid_kv(rank, 8), TierConfig(
            cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=2, timeout_s=20), audit=True)
        messages = []
        tier.submit(CopyJob(1, "store", (99,), (0,), (0,)))
        for job in (CopyJob(2, "store", (0,), (0,), (0,), writer_only=True),
                    CopyJob(3, "load", (0,), (0,), (0,), writer_only=True)):
            with pytest.raises(MalformedJob) as info:
                tier.submit(job)
            messages.append(str(info.value))
        with pytest.raises(OffloadError, match="job id 5 is not in flight"):
            tier.wait([5])
        # a refused job still took its place in the sequence and comes back failed everywhere
        with pytest.raises(OffloadError) as info:
            tier.wait([1, 2, 3])
        messages.append(str(info.value))
        tier.close()
        return messages

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]
    writer_private, writer_load, first_failed = out[0].value
    assert first_failed.startswith("job 1 failed on rank 0: gpu block 99 (entry 0 of the job) "
                                   "is out of range")
    assert "\n" not in first_failed
    assert out[1].value == out[0].value
    assert "writer_only applies to stores in the replicated layout" in writer_private
    assert "not a load" in writer_load


def test_audit_counts_blocks_corrupted_in_host_memory() -> None:
    def body(rank: int) -> object:
        from offload import CopyJob, HostTier

        kv = _hybrid_kv(rank, 8)
        # integrity off: the page checksums would fail the load before the audit counts it
        tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                              tp=2, timeout_s=20, integrity=False), audit=True)
        blocks, chunks, positions = (0, 1, 2, 3), (2, 2, 2, 2), (0, 1, 2, 3)
        tier.submit(CopyJob(1, "store", blocks, chunks, positions))
        tier.wait([1])
        if rank == 1:
            tier.actor.region.tensor_view(0)[2, 3, 17] ^= 0xFF  # flip a byte of block 3
        tier.submit(CopyJob(2, "load", blocks, chunks, positions))
        tier.wait([2])
        audit = tier.actor.auditor.to_json()
        tier.close()
        return audit

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]
    assert out[0].value == {"checked_blocks": 4, "mismatched_blocks": 0}
    assert out[1].value == {"checked_blocks": 4, "mismatched_blocks": 1}


def test_ranks_with_different_settings_fail_on_every_rank_naming_them(shm_dir: str) -> None:
    def body(rank: int) -> object:
        from offload import HostTier

        config = TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=8 if rank == 2 else 4,
                            tp=3, timeout_s=20, shm_dir=shm_dir)
        HostTier.create(_hybrid_kv(rank, 8), config)

    out = run_group(body, 3)
    assert all(not o.ok for o in out)
    assert "ranks 2 run with blocks_per_chunk = 8 but rank 0 with 4" in (out[0].error or "")
    assert all(o.error_type == "Aborted" for o in out[1:])


def test_a_rank_without_kv_tensors_is_named_by_rank_zero() -> None:
    def body(rank: int) -> object:
        from offload import HostTier

        kv = [] if rank == 1 else _hybrid_kv(rank, 8)
        HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, tp=2, timeout_s=20))

    out = run_group(body, 2)
    assert "rank 1: no KV tensors given" in (out[0].error or "")
    assert out[1].error_type == "Aborted"


def test_replicated_stage_with_unequal_payloads_fails_naming_ranks_and_stage(
        shm_dir: str) -> None:
    def body(rank: int) -> object:
        from offload import HostTier

        pages = STAGE_PAGES[0] if rank == 3 else STAGE_PAGES[rank // 2]  # rank 3 differs
        HostTier.create(stage_kv(rank // 2, 8, pages), TierConfig(
            cpu_bytes_per_node=4 * MiB, layout="replicated", tp=2, pp=2, timeout_s=20,
            shm_dir=shm_dir))

    out = run_group(body, 4)
    assert ("layout 'replicated' needs equal KV payloads within pipeline stage 1 but ranks 3 "
            "have 11.81 KiB (KV pages [8000, 4096] B) per block against rank 2's 2.00 KiB; use "
            "layout 'private'") in (out[0].error or ""), out[0].error
    assert all(o.error_type == "Aborted" for o in out[1:])


class _PinnedStandIn:
    """A registrar that counts as pinning (as CUDA's does) and can refuse, for the group's
    all-or-none decision on a machine without CUDA."""

    name = "stand-in"
    counts_as_pinned = True
    own_context = False

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.live: set[int] = set()

    def prepare(self) -> None:
        pass

    def close(self) -> None:
        pass

    def register(self, address: int, length: int) -> None:
        if self.fail:
            raise RuntimeError("cuMemHostRegister failed: out of memory (stand-in)")
        self.live.add(address)

    def unregister(self, address: int) -> None:
        self.live.remove(address)


def test_one_rank_that_cannot_pin_makes_the_whole_group_run_unpinned() -> None:
    def body(rank: int) -> object:
        from offload import HostTier

        registrars: list[_PinnedStandIn] = []

        def factory(device: object) -> _PinnedStandIn:
            registrars.append(_PinnedStandIn(fail=rank == 1))
            return registrars[-1]

        tier = HostTier.create(_hybrid_kv(rank, 8), TierConfig(
            cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4, tp=2, timeout_s=20),
            registrar_factory=factory)
        row = tier.actor.report()
        still_registered = len(registrars[0].live)
        tier.close()
        return row["pinned"], row["pinned_bytes"], still_registered

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value for o in out] == [(False, 0, 0), (False, 0, 0)]


def test_a_group_that_can_pin_reports_own_bytes_pinned() -> None:
    def body(rank: int) -> object:
        from offload import HostTier

        tier = HostTier.create(_hybrid_kv(rank, 8), TierConfig(
            cpu_bytes_per_node=4 * MiB, layout="shared", blocks_per_chunk=4, tp=2,
            timeout_s=20), registrar_factory=lambda device: _PinnedStandIn(fail=False))
        row = tier.actor.report()
        own = tier.plan.chunk_count * tier.plan.slots[rank].slot_bytes
        tier.close()
        return row["pinned"], row["pinned_bytes"] == own

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value for o in out] == [(True, True), (True, True)]


def test_a_killed_rank_fails_the_driver_within_the_timeout_and_leaves_nothing(
        shm_dir: str) -> None:
    """No torchrun to stop the survivors: our own bounds must end the job."""

    def body(rank: int) -> object:
        import os
        import signal
        import threading

        from offload import CopyJob, HostTier, PeerError
        from offload.control.rpc import Aborted

        tier = HostTier.create(_hybrid_kv(rank, 8), TierConfig(
            cpu_bytes_per_node=4 * MiB, layout="shared", blocks_per_chunk=4, tp=3,
            timeout_s=4, shm_dir=shm_dir))
        if rank == 2:  # dies while serving, without a chance to clean up
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if rank != 0:
            try:
                tier.serve()
            except Aborted as exc:
                return f"aborted: {exc}"
            return "released"
        began = time.monotonic()
        job_id = 0
        try:
            while time.monotonic() - began < 30:
                tier.run(CopyJob(job_id, "store", (0, 1), (0, 0), (0, 1)))
                job_id += 1
        except PeerError as exc:
            failed_after = time.monotonic() - began
            tier.abort(str(exc))
            tier.actor.close()
            return failed_after, str(exc)
        return None

    out = run_group(body, 3, timeout=60, pg_timeout=20)
    failed_after, message = out[0].value
    assert failed_after < 1.0 + 4 + 3, message  # kill at ~1 s, then the 4 s RPC timeout
    assert "ranks [2] have not completed it" in message
    assert out[1].value.startswith("aborted: job ")
    assert out[2].exitcode == -9


def test_submit_returns_no_event_for_host_kv_tensors() -> None:
    def body(rank: int) -> object:
        import torch

        from offload import CopyJob, HostTier

        kv = [torch.zeros((8, 4096), dtype=torch.uint8)]
        tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                              tp=1, timeout_s=30))
        event = tier.submit(CopyJob(0, "store", (0,), (0,), (0,)))
        tier.wait([0])
        tier.close()
        return event

    out = run_group(body, 1)
    assert all(o.ok for o in out), [o.error for o in out]
    assert out[0].value is None


def test_jobs_with_numpy_index_arrays_round_trip_and_audit() -> None:
    def body(rank: int) -> object:
        import numpy as np
        import torch

        from offload import CopyJob, HostTier

        kv = [torch.randint(0, 256, (32, 4096), dtype=torch.uint8)]
        original = kv[0].clone()
        tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                              tp=2, timeout_s=30), audit=True)
        blocks = np.arange(32, dtype=np.int32)
        chunks, positions = blocks // 4, blocks % 4
        tier.submit(CopyJob(0, "store", blocks, chunks, positions))
        tier.wait([0])
        kv[0].zero_()
        tier.submit(CopyJob(1, "load", blocks[::-1].copy(), chunks[::-1].copy(),
                            positions[::-1].copy()))
        tier.wait([1])
        audit = tier.actor.auditor.to_json() if tier.actor.auditor else None
        same = torch.equal(kv[0], original)
        tier.close()
        return same, audit

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value for o in out] == [(True, {"checked_blocks": 32, "mismatched_blocks": 0})] * 2


def test_a_dead_node_is_named_by_every_survivor_within_the_timeout() -> None:
    """Both ranks of simulated node b die after set-up (as when the host goes down); the ranks
    of node a fail their next job within the timeout, naming node b."""

    def body(rank: int) -> object:
        import os
        import time

        import torch

        from offload import CopyJob, HostTier, PeerError

        kv = [torch.zeros((8, 4096), dtype=torch.uint8)]
        tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=4,
                                              tp=4, timeout_s=3))
        if tier.topology.node_id == "b":
            os._exit(0)  # the whole node goes, no cleanup runs
        tier.submit(CopyJob(0, "store", (0,), (0,), (0,)))
        began = time.monotonic()
        try:
            tier.wait([0])
        except PeerError as exc:
            return str(exc), time.monotonic() - began
        return "no error", 0.0

    out = run_group(body, 4, nodes=["a", "a", "b", "b"], timeout=90, pg_timeout=15)
    for o in out[:2]:
        assert o.value is not None, o.error
        message, waited = o.value
        assert "ranks [2, 3] (every rank of node b: the node is down or cut off)" in message
        assert waited < 10
