# SPDX-License-Identifier: Apache-2.0
"""The vLLM integration's core without vLLM (`offload.vllm.core`).

* ``kv_connector_extra_config`` becomes a `TierConfig` once; each bad key is one line.
* vLLM's transfers (GPU block ids, the first block's index in the request, chunk ids) become
  `CopyJob`s, a load that starts in the middle of its first chunk included.
* `TierIndex` walks vLLM's manager calls through the chunk manager: nothing is cached before
  the tier reports its plan; a store becomes readable only when the decider says every worker
  finished it; a failed store never does; a damaged load drops its keys; eviction reports its
  victims; rows not set up yet are never handed out; a cache reset forgets every key while
  jobs in flight still end; disk-only keys are promoted before they hit.
* `TierWorker` on two real gloo ranks: the decider speaks for both, the other rank learns
  the same decisions from the mark, and a load whose host bytes were damaged on one rank comes
  back failed, damaged, with its GPU blocks.
"""

from __future__ import annotations

import pytest

from offload.config import TierConfig
from offload.errors import OffloadError
from offload.tier import DecisionMark
from offload.vllm import core
from tests.harness import run_group

MiB = 1 << 20


# ---------------------------------------------------------------------- configuration


def parse(extra: dict, **kw: object) -> TierConfig:
    args: dict = {"blocks_per_chunk": 2, "tp": 1, "pp": 1, "model": "m:float16"}
    args.update(kw)
    return core.parse_extra_config(extra, **args)


def test_extra_config_becomes_a_tier_config() -> None:
    """Sizes take suffixes, vLLM's own keys pass, blocks per chunk and the grid come from
    vLLM, and the file tier's namespace defaults to the model."""
    config = parse({"spec_name": "HostTierSpec", "spec_module_path": "offload.vllm",
                    "blocks_per_chunk": 2, "cpu_bytes_per_node": "64MiB", "layout": "shared",
                    "integrity": False, "background": True, "staging_bytes": "16MiB",
                    "metrics_port": 9400}, tp=2, pp=2)
    assert (config.cpu_bytes_per_node, config.layout, config.integrity, config.background) == \
        (64 * MiB, "shared", False, True)
    assert (config.staging_bytes, config.metrics_port) == (16 * MiB, 9400)
    assert (config.blocks_per_chunk, config.tp, config.pp) == (2, 2, 2)


def test_the_file_tier_defaults_its_namespace_to_the_model(tmp_path) -> None:
    config = parse({"cpu_bytes_per_node": 4 * MiB, "fs_tier": str(tmp_path),
                    "fs_bytes": "8MiB"})
    assert (config.fs_dir, config.fs_bytes, config.fs_namespace) == \
        (str(tmp_path), 8 * MiB, "m:float16")


def test_keep_s_keeps_the_tier_under_the_models_name() -> None:
    """``keep_s``: the kept tier is found again by the model (docs/KEEP.md), as files are."""
    config = parse({"cpu_bytes_per_node": 4 * MiB, "keep_s": 60})
    assert (config.keep_s, config.fs_namespace) == (60.0, "m:float16")
    assert parse({"cpu_bytes_per_node": 4 * MiB, "keep_s": 5,
                  "fs_namespace": "llama@abc"}).fs_namespace == "llama@abc"
    assert parse({"cpu_bytes_per_node": 4 * MiB}).fs_namespace is None


def test_each_bad_key_is_one_line() -> None:
    """Three bad keys, three lines, each naming its key and a fix."""
    with pytest.raises(OffloadError) as err:
        parse({"cpu_bytes_per_node": "lots", "layuot": "shared", "integrity": "yes"})
    lines = str(err.value).splitlines()
    assert len(lines) == 3
    assert any("'cpu_bytes_per_node'" in line and "not a size" in line for line in lines)
    assert any("'layuot' is unknown" in line and "layout" in line for line in lines)
    assert any("'integrity'" in line and "true or false" in line for line in lines)


@pytest.mark.parametrize("extra, words", [
    ({}, "has no 'cpu_bytes_per_node'"),
    ({"cpu_bytes_per_node": "1MiB", "layout": "mirrored"}, "not a layout"),
    ({"cpu_bytes_per_node": True}, "not a size"),
    ({"cpu_bytes_per_node": "1MiB", "metrics_port": "9400"}, "not an integer"),
    ({"cpu_bytes_per_node": "1MiB", "canonical_layout": True}, "canonical_layout"),
    ({"cpu_bytes_per_node": "1MiB", "metrics_port": 70000}, "not a TCP port"),
    ({"cpu_bytes_per_node": "1MiB", "keep_s": "60"}, "not a number"),
    ({"cpu_bytes_per_node": "1MiB", "keep_s": 60, "integrity": False}, "needs page checksums"),
])
def test_bad_extra_config_is_refused(extra: dict, words: str) -> None:
    with pytest.raises(OffloadError, match=words):
        parse(extra)


def test_replicated_needs_kv_identical_across_tp() -> None:
    """One copy per stage is right only when every TP rank's KV is the same (MLA): a model
    whose TP ranks hold different heads would load another rank's bytes."""
    with pytest.raises(OffloadError, match="identical on every TP rank"):
        parse({"cpu_bytes_per_node": "1MiB", "layout": "replicated"}, tp=2)
    assert parse({"cpu_bytes_per_node": "1MiB", "layout": "replicated"}, tp=2,
                 kv_identical_across_tp=True).layout == "replicated"
    assert parse({"cpu_bytes_per_node": "1MiB", "layout": "replicated"}, tp=1).layout == \
        "replicated"


# ---------------------------------------------------------------------- job mapping


def test_a_store_fills_whole_chunks_in_order() -> None:
    job = core.copy_job(7, "store", [10, 11, 12, 13], 4, [5, 9], blocks_per_chunk=2)
    assert (job.job_id, job.direction) == (7, "store")
    assert job.blocks.tolist() == [10, 11, 12, 13]
    assert job.chunks.tolist() == [5, 5, 9, 9]
    assert job.positions.tolist() == [0, 1, 0, 1]


def test_a_load_may_start_inside_its_first_chunk() -> None:
    """Blocks 3..7 of a request with 4 blocks per chunk: the first chunk (blocks 0..3) gives
    only its last position."""
    job = core.copy_job(1, "load", [40, 41, 42, 43, 44], 3, [2, 8], blocks_per_chunk=4)
    assert job.chunks.tolist() == [2, 8, 8, 8, 8]
    assert job.positions.tolist() == [3, 0, 1, 2, 3]


def test_writer_only_applies_to_stores() -> None:
    store = core.copy_job(1, "store", [0, 1], 0, [0], 2, writer_only=True)
    load = core.copy_job(2, "load", [0, 1], 0, [0], 2, writer_only=True)
    assert store.writer_only and not load.writer_only


def test_blocks_that_do_not_fill_the_chunks_are_a_bug() -> None:
    with pytest.raises(ValueError, match="span 2 chunks"):
        core.copy_job(1, "store", [0, 1, 2], 0, [0], blocks_per_chunk=2)


# ---------------------------------------------------------------------- the index


def make_index(chunks: int = 4, disk: int = 0, ready: int | None = None,
               events: bool = False) -> core.TierIndex:
    index = core.TierIndex(events=events)
    index.configure(core.TierSetup(chunks, disk, ready))
    return index


_next_vllm_id = iter(range(1000, 10**6))


def store(index: core.TierIndex, keys: list, fail: bool = False) -> core.StorePlan | None:
    """vLLM's store of ``keys``, sent and decided (failed when ``fail``)."""
    plan = index.prepare_store(keys)
    if plan is None or not plan.keys:
        return plan
    job = next(_next_vllm_id)
    index.bind(job, plan.job_id)
    if fail:
        index.apply(core.StepReport(failed={job: core.Outcome(job, False, "store")}))
    index.decided(job)
    return plan


def test_nothing_is_cached_before_the_plan_arrives() -> None:
    index = core.TierIndex()
    assert index.lookup(b"a") == "miss"
    plan = index.prepare_store([b"a"])
    assert plan is not None and plan.keys == ()


def test_a_store_is_readable_once_decided() -> None:
    """prepare_store takes chunks: the keys are pending (a lookup waits) until the decider
    reports the job; then they hit and a load holds them until it is decided."""
    index = make_index()
    plan = index.prepare_store([b"a", b"b"])
    assert plan is not None and plan.keys == (b"a", b"b") and plan.chunks.tolist() == [0, 1]
    index.bind(1, plan.job_id)
    assert index.lookup(b"a") == "pending"
    index.decided(1)
    assert [index.lookup(k) for k in (b"a", b"b", b"c")] == ["hit", "hit", "miss"]
    load = index.prepare_load([b"a", b"b"])
    assert load.chunks.tolist() == [0, 1]
    index.bind(2, load.job_id)
    assert index.held() == 2
    index.decided(2)
    assert index.held() == 0
    assert (index.stats.stored_chunks, index.stats.loaded_chunks) == (2, 2)


def test_a_failed_store_is_never_readable() -> None:
    index = make_index()
    store(index, [b"a"], fail=True)
    assert index.lookup(b"a") == "miss"
    assert index.stats.failed_stores == 1
    assert index.manager is not None and index.manager.stats().free == 4


def test_a_damaged_load_drops_its_keys_and_a_refused_one_keeps_them() -> None:
    index = make_index()
    store(index, [b"a", b"b"])
    for damaged in (False, True):
        load = index.prepare_load([b"a", b"b"])
        index.bind(50 + damaged, load.job_id)
        outcome = core.Outcome(50 + damaged, False, "load", damaged=damaged, blocks=(3, 4))
        index.apply(core.StepReport(failed={50 + damaged: outcome}))
        index.decided(50 + damaged)
        expected = "miss" if damaged else "hit"
        assert index.lookup(b"a") == index.lookup(b"b") == expected
    assert (index.stats.failed_loads, index.stats.damaged_loads, index.held()) == (2, 1, 0)


def test_pressure_evicts_the_least_recently_used_and_says_so() -> None:
    """Four chunks, three stores of two keys: the third evicts the first store's keys (the
    oldest), which the plan and the events name; keys of the same request are kept."""
    index = make_index(events=True)
    store(index, [b"a", b"b"])
    store(index, [b"c", b"d"])
    plan = store(index, [b"c", b"e", b"f"])
    assert plan is not None and plan.keys == (b"e", b"f") and plan.evicted == (b"a", b"b")
    assert [index.lookup(k) for k in (b"a", b"b", b"c", b"e", b"f")] == \
        ["miss", "miss", "hit", "hit", "hit"]
    events = index.take_events()
    assert ((b"a", b"b"), True) in events and ((b"e", b"f"), False) in events


def test_a_full_tier_of_held_chunks_stores_nothing() -> None:
    """Every chunk held by a pending load: a store finds no room (vLLM tries again later)."""
    index = make_index(chunks=2)
    store(index, [b"a", b"b"])
    load = index.prepare_load([b"a", b"b"])
    index.bind(9, load.job_id)
    assert index.prepare_store([b"c"]) is None
    index.decided(9)
    assert store(index, [b"c"]) is not None and index.lookup(b"c") == "hit"


def test_rows_not_ready_are_never_handed_out() -> None:
    """Background set-up: one ready row of four; a store of two keys gets one chunk, the
    rest are dropped (misses); once the decider reports every row ready, they fit."""
    index = make_index(chunks=4, ready=1)
    plan = store(index, [b"a", b"b"])
    assert plan is not None and plan.keys == (b"a",) and plan.chunks.tolist() == [0]
    assert index.lookup(b"b") == "miss"
    index.apply(core.StepReport(ready_rows=4))
    plan = store(index, [b"a", b"b", b"c"])
    assert plan is not None and plan.keys == (b"b", b"c")


def test_a_reset_forgets_every_key_and_jobs_in_flight_still_end() -> None:
    index = make_index()
    store(index, [b"a"])
    load = index.prepare_load([b"a"])
    index.bind(1, load.job_id)
    pending = index.prepare_store([b"b"])
    assert pending is not None
    index.bind(2, pending.job_id)
    index.reset()
    assert index.lookup(b"a") == "miss"
    index.decided(1)
    index.decided(2)
    assert index.held() == 0
    stats = index.manager.stats() if index.manager else None
    assert stats is not None and stats.storing == 0 and stats.free + stats.readable == 4


def test_disk_only_keys_are_promoted_before_they_hit() -> None:
    """Two host chunks and a file tier: storing four keys spills the first two to disk; a
    lookup of a spilled key waits (pending) and queues a promotion; once every worker read
    it back the key hits; a key whose read failed is a miss."""
    index = make_index(chunks=2, disk=8)
    store(index, [b"a", b"b"])
    plan = store(index, [b"c", b"d"])
    assert plan is not None and plan.spills and {k for k, _ in plan.spills} == {b"a", b"b"}
    assert index.lookup(b"a") == "pending" and index.lookup(b"b") == "pending"
    assert index.pending_work
    promote = index.flush_promotions()
    assert promote is not None and [k for k, _ in promote.job.chunks] == [b"a", b"b"]
    assert index.lookup(b"a") == "pending" and index.flush_promotions() is None  # once
    index.apply(core.StepReport(promoted={promote.job.job_id: (b"b",)}))
    assert not index.pending_work
    assert (index.lookup(b"a"), index.lookup(b"b")) == ("hit", "miss")
    assert (index.stats.promoted_chunks, index.stats.failed_promotions) == (1, 1)


def test_the_later_mark_wins_when_reports_merge() -> None:
    a = core.StepReport(DecisionMark(3, 0), 2, {}, {})
    b = core.StepReport(DecisionMark(5, 1), None,
                        {4: core.Outcome(4, False, "store")}, {})
    merged = a.merge(b)
    assert merged.mark == DecisionMark(5, 1) and merged.ready_rows == 2 and 4 in merged.failed
    assert core.StepReport().empty() and not merged.empty()


# ---------------------------------------------------------------------- workers


def _two_workers(rank: int) -> object:
    """Rank 0 decides; after each step its mark reaches rank 1 as vLLM's metadata would.
    Step 1 stores blocks 0..3 into chunks 0, 1; then rank 1's host copy of chunk 1 is
    damaged; step 2 loads both chunks into blocks 4..7."""
    import time

    import torch
    import torch.distributed as dist

    from offload import HostTier

    kv = [torch.randint(1, 255, (8, 4096), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(rank))]
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * MiB, blocks_per_chunk=2),
                           decider=0)
    worker = core.TierWorker(tier, 2)
    seen: list = []

    def step(submit) -> None:
        submit()
        deadline = time.monotonic() + 20
        while True:  # the decider reports once the job is decided everywhere
            outcomes = worker.finished()
            seen.extend((o.job_id, o.success, o.damaged, o.blocks) for o in outcomes)
            box = [worker.report(outcomes).mark if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            learned.extend(worker.learn(box[0]))
            if box[0] is not None and box[0].through >= tier.submitted or \
                    time.monotonic() > deadline:
                return

    learned: list[int] = []
    step(lambda: worker.submit(1, "store", [0, 1, 2, 3], 0, [0, 1]))
    if rank == 1:
        tier.actor.region.tensor_view(0)[1, 0, 100] ^= 0x40
    step(lambda: worker.submit(2, "load", [4, 5, 6, 7], 0, [0, 1]))
    setup = worker.setup()
    ok = bool(torch.equal(kv[0][4:6], kv[0][0:2]))
    worker.close()
    return (seen, tier.mark, (setup.chunk_count > 0, setup.disk_capacity, setup.ready_rows),
            ok, learned, len(worker._loads))


def test_the_decider_speaks_for_every_worker_and_a_damaged_load_fails() -> None:
    out = run_group(_two_workers, 2, timeout=120)
    assert all(o.ok for o in out), [o.error for o in out]
    decider, other = out[0].value, out[1].value
    assert decider[0] == [(1, True, False, ()), (2, False, True, (4, 5, 6, 7))]
    assert other[0] == []  # the decider reported for it
    # rank 1 learned the same mark: two jobs decided, one failure, its record read of rank 1
    assert decider[1] == other[1] == DecisionMark(2, 1, records=((1, 1),))
    assert decider[2] == (True, 0, None)
    assert decider[3] and other[3]  # chunk 0 loaded right on both ranks
    assert (decider[4], other[4]) == ([], [1, 2])  # the other rank learned both jobs
    assert decider[5] == other[5] == 0  # no load is remembered past its decision


def test_the_job_stream_benchmark_runs_on_cpu(tmp_path) -> None:
    """scripts/bench_vllm_jobs.py: a short stream through the core and the raw API, the same
    jobs on both, figures for each."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_vllm_jobs.py"),
                           "--steps", "6", "--layers", "2", "--page-bytes", "1KiB",
                           "--gpu-blocks", "256", "--cpu-bytes", "4MiB", "--json", str(out)],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["path"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["core"]["jobs"] == rows["raw"]["jobs"] > 0
    assert "core vs raw" in proc.stdout


def test_the_core_imports_without_vllm() -> None:
    """``offload.vllm`` and its core never import vLLM; the shells load on first use."""
    import subprocess
    import sys

    code = ("import sys, offload.vllm, offload.vllm.core; "
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]; "
            "assert sorted(offload.vllm.__all__) == ['HostTierConnector', 'HostTierSpec']")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------------- retention


def _kept_life(rank: int, steps: str, keep_s: float, namespace: str) -> object:
    """One engine life on two gloo ranks with ``keep_s`` (docs/KEEP.md), vLLM's way: rank 0
    also plays the scheduler (`TierIndex`, configured from the decider's `TierSetup`), every
    rank a worker.  ``s<k>`` stores key k (decided); ``i<k>`` stores it, its copies done, but
    the engine ends before the decider hears of it; ``l<k>`` looks key k up and loads it:
    "hit" (loaded, bytes verified), "miss" (lookup), "failed" (the load failed its checks),
    "WRONG BYTES".  Returns rank 0's kept keys, adopted chunks and log."""
    import time

    import torch
    import torch.distributed as dist

    from offload import HostTier
    from tests.test_tier_keep import BPC, PAGE, ROW

    gen = torch.Generator().manual_seed(7 + rank)
    kv = [torch.randint(0, 256, (8 * BPC, PAGE), generator=gen, dtype=torch.uint8)]
    original = kv[0].clone()
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=2 * ROW, blocks_per_chunk=BPC,
                                          tp=2, timeout_s=30, keep_s=keep_s,
                                          fs_namespace=namespace), decider=0)
    worker = core.TierWorker(tier, BPC)
    index = core.TierIndex(keep=True)
    if rank == 0:
        index.configure(worker.setup())
    ids = iter(range(100, 1000))
    log: list[str] = []

    def scheduler(make) -> object:  # rank 0 decides, every rank learns it
        box = [make() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def run(job_id: int) -> bool:
        """Until the decider has decided ``job_id``: its success, learned by every rank."""
        deadline = time.monotonic() + 20
        ok = None
        while ok is None and time.monotonic() < deadline:
            outcomes = worker.finished()
            report = worker.report(outcomes)
            index.apply(report)
            mark, done = scheduler(lambda out=outcomes, r=report: (  # type: ignore[misc]
                r.mark, {o.job_id: o.success for o in out}))
            worker.learn(mark)
            ok = done.get(job_id)
        if rank == 0:
            index.decided(job_id)
        return bool(ok)

    for step in steps.split():
        op, key = step[0], int(step[1:])
        blocks = [key * BPC + p for p in range(BPC)]
        if op in "si":
            plan = scheduler(lambda k=key: index.prepare_store([f"k{k}".encode()]))
            job_id = next(ids)
            if rank == 0:
                index.bind(job_id, plan.job_id)  # type: ignore[union-attr]
            worker.submit(job_id, "store", blocks, 0, plan.chunks,  # type: ignore[union-attr]
                          stored=plan.stored)  # type: ignore[union-attr]
            worker.flush()
            if op == "s":
                run(job_id)
            continue
        found = scheduler(lambda k=key: index.lookup(f"k{k}".encode()))
        if found != "hit":
            log.append("miss")
            continue
        plan = scheduler(lambda k=key: index.prepare_load([f"k{k}".encode()]))
        job_id = next(ids)
        if rank == 0:
            index.bind(job_id, plan.job_id)  # type: ignore[union-attr]
        kv[0][blocks] = 0
        worker.submit(job_id, "load", blocks, 0, plan.chunks)  # type: ignore[union-attr]
        ok = run(job_id)
        same = bool(torch.equal(kv[0][blocks], original[blocks]))
        log.append("WRONG BYTES" if ok and not same else "hit" if ok else "failed")
    dist.barrier()
    kept = sorted(k for k, _ in worker.setup().kept) if rank == 0 else None
    worker.close()
    return (kept, index.stats.adopted_chunks, index.stats.adopted_loads, log) \
        if rank == 0 else None


def test_a_restarted_engine_adopts_the_kept_tier_through_the_scheduler() -> None:
    """vLLM's keys live in the scheduler, the kept index with the decider: the store plans
    bring the keys' stored form, the decider records decided stores, and the next life's
    decider hands the adopted keys to the scheduler's index, whose lookups then hit and
    whose loads are verified.  Key 3's store evicts key 1 (two chunks) and is under way when
    the engine ends: key 1's record was cleared before the copy, key 3 was never recorded,
    so both are misses -- never a load of key 3's bytes as key 1."""
    from offload.region import kept as keep
    from tests.region.test_keeper import wait_gone
    from tests.test_tier_keep import _node

    node, ns = _node(), "vllm-core-keep"
    try:
        first = run_group(_kept_life, 2, args=("s1 s2 i3", 30, ns), nodes=[node, node],
                          timeout=90)
        assert all(o.ok for o in first), [o.error for o in first]
        assert first[0].value == ([], 0, 0, [])
        second = run_group(_kept_life, 2, args=("l2 l1 l3", 1.5, ns), nodes=[node, node],
                           timeout=90)
        assert all(o.ok for o in second), [o.error for o in second]
        kept, adopted, loads, log = second[0].value
        assert kept == [b"k2"] and adopted == 1 and loads == 1
        assert log == ["hit", "miss", "miss"]
    finally:
        for _, info in keep.keepers(node):
            wait_gone(info["pid"], timeout_s=40)
