# SPDX-License-Identifier: Apache-2.0
"""How a tier refuses jobs, across real gloo ranks: every index is checked before anything of a
job runs, every refusal behaves the same on every rank, and a job's spills run in sequence
whatever its fate.

* **No write outside the region.**  Arbitrary integers in every field of a job (blocks, chunks,
  positions, spills, the id, the direction, writer_only, layer_groups) and of a promotion
  (its reads, spills and id), on the host backend: `submit` raises nothing but `MalformedJob`,
  no failure reason is a raw exception, no file-tier view reaches outside the region, and no row
  a job does not name changes, in its bytes or its pages' generations.  The GPU backends run
  the same checks (`EngineBase.prepare`, the actor's and the file tier's, which every backend
  shares); only the copy after them differs.
* **One behaviour on every rank.**  A malformed job (every rank has the same plan, so every rank
  refuses it) raises `MalformedJob` on every rank at once; a refusal of one rank's own (an
  engine error) returns normally there, as on the others.  Either way the job takes its
  sequence place and comes back failed from `finished` on every rank, and the next job runs.
* **Spills whatever the job's fate.**  A rank that refuses a store (a reused id still in flight
  there) still writes out its spills, so the ranks' file tiers hold the same keys in the same
  order.
"""

from __future__ import annotations

import re
import time

import pytest

from offload.config import TierConfig
from tests.harness import decide_all, run_group

KiB = 1 << 10
MiB = 1 << 20
BPC = 4
PAGE = 4 * KiB
BLOCKS = 8


def _kv(rank: int, blocks: int = BLOCKS) -> list:
    import torch

    gen = torch.Generator().manual_seed(11 + rank)
    return [torch.randint(1, 256, (blocks, PAGE), generator=gen, dtype=torch.uint8)]


RAW = re.compile(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b")  # `one_line` of a non-user error


# ---------------------------------------------------------------------- arbitrary integers


def _fuzz(rank: int, fs_dir: str, examples: int, backend: str = "host") -> object:
    """One rank, ``backend`` (KV on CUDA for any but the host's): hypothesis draws jobs and
    promotions with arbitrary values in some fields (module docstring)."""
    import numpy as np
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import offload.tiers.rank_files as rank_files
    from offload import CopyJob, HostTier, JobFailed, MalformedJob, OffloadError, fs_actions

    row = BPC * PAGE
    kv = [t.to("cpu" if backend == "host" else "cuda") for t in _kv(rank)]  # type: ignore
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=6 * row, blocks_per_chunk=BPC,
                                          tp=1, timeout_s=20, fs_dir=fs_dir,
                                          fs_namespace="fuzz", fs_bytes=6 * row), backend=backend)
    actor, region = tier.actor, tier.actor.region
    engine = actor.engine.name
    chunks_total, stride = tier.plan.chunk_count, tier.plan.row_stride(0)
    low, high = region.address, region.address + region.tensor.numel()
    outside: list[tuple[int, int]] = []
    real_view = rank_files.host_view

    def guarded(address: int, length: int) -> memoryview:
        if not low <= address <= address + length <= high:
            outside.append((address - low, length))
            raise AssertionError("a file-tier view outside the region")  # never touch it
        return real_view(address, length)

    rank_files.host_view = guarded
    anything = st.integers()
    near = st.integers(-3, max(BLOCKS, chunks_total) + 2)
    number = st.one_of(near, anything)

    def arbitrary_index(length: int) -> st.SearchStrategy:
        """An index field that is anything: wrong values, lengths, types or dtypes."""
        exact = st.lists(number, min_size=length, max_size=length)
        sized = st.lists(near, min_size=length, max_size=length)
        return st.one_of(
            exact, exact.map(tuple), st.lists(number, max_size=4), number,
            sized.map(lambda v: np.array(v, dtype=np.int64)),
            sized.map(lambda v: np.array(v, dtype=np.int32)),
            st.lists(st.integers(0, 2**64 - 1), min_size=length, max_size=length).map(
                lambda v: np.array(v, dtype=np.uint64)),
            st.lists(st.integers(-2**63, 2**63 - 1), min_size=length, max_size=length).map(
                lambda v: np.array(v, dtype=np.int64)),
            sized.map(lambda v: np.array(v, dtype=np.float64)),
            sized.map(lambda v: np.array(v, dtype=bool)),
            sized.map(lambda v: np.array([v], dtype=np.int64)))  # 2-D

    def valid_items() -> st.SearchStrategy:
        return st.lists(st.tuples(st.integers(0, 5), st.integers(0, chunks_total - 1)),
                        max_size=3)

    arbitrary_items = st.lists(st.one_of(st.tuples(st.integers(0, 5), number),
                                         st.tuples(st.integers(0, 5)), number), max_size=3)

    def draw_job(data: st.DataObject) -> tuple[CopyJob, object]:
        """A valid job, then arbitrary values in a random subset of its fields."""
        direction = data.draw(st.sampled_from(["store", "load"]))
        places = data.draw(st.lists(st.tuples(st.integers(0, chunks_total - 1),
                                              st.integers(0, BPC - 1)), unique=True,
                                    max_size=4))
        blocks = data.draw(st.lists(st.integers(0, BLOCKS - 1), unique=True,
                                    min_size=len(places), max_size=len(places)))
        fields: dict[str, object] = {
            "job_id": data.draw(st.integers(0, 10**6)), "direction": direction,
            "blocks": blocks, "chunks": [c for c, _ in places],
            "positions": [p for _, p in places], "writer_only": False,
            "spills": data.draw(valid_items()),
            "layer_groups": 1 if direction == "load" and data.draw(st.booleans()) else None}
        arbitrary = {
            "job_id": anything, "direction": st.sampled_from(["copy", 5, "store", "load"]),
            "blocks": arbitrary_index(len(places)), "chunks": arbitrary_index(len(places)),
            "positions": arbitrary_index(len(places)),
            "writer_only": st.one_of(st.booleans(), anything), "spills": arbitrary_items,
            "layer_groups": st.one_of(st.none(), number)}
        for name in data.draw(st.sets(st.sampled_from(sorted(fields)), min_size=1)):
            fields[name] = data.draw(arbitrary[name], label=name)
        groups = fields.pop("layer_groups")
        return CopyJob(**fields), groups  # type: ignore[arg-type]

    def named(field: object) -> set[int]:
        """Every in-range integer a field holds: the rows its job may change."""
        try:
            flat = np.asarray(field, dtype=object).ravel().tolist()
        except Exception:
            return set()
        out = set()
        for v in flat:
            for x in (v if isinstance(v, tuple | list) else (v,)):
                if isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_) \
                        and 0 <= x < chunks_total:
                    out.add(int(x))
        return out

    def rows_changed(before: object, generations: object) -> set[int]:
        now = region.tensor[:chunks_total * stride].view(chunks_total, stride)
        changed = {int(c) for c in (now != before).any(dim=1).nonzero().flatten().tolist()}
        gens = actor.engine.generations.reshape(chunks_total, BPC)
        return changed | {int(c) for c in np.flatnonzero((gens != generations).any(axis=1))}

    seen = {"malformed": 0, "failed": 0, "ok": 0, "promote_refused": 0, "promoted": 0}
    reasons: list[str] = []

    def promotion(data: st.DataObject) -> set[int]:
        spills = data.draw(st.one_of(valid_items(), arbitrary_items))
        reads = data.draw(st.one_of(valid_items(), arbitrary_items))
        try:
            fs_actions.promote(actor, spills, reads, data.draw(st.one_of(st.integers(0, 100),
                                                                        anything)))
            seen["promoted"] += 1
        except OffloadError:
            seen["promote_refused"] += 1
        return named(spills) | named(reads)

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one_job(data: st.DataObject) -> None:
        before = region.tensor[:chunks_total * stride].view(chunks_total, stride).clone()
        generations = actor.engine.generations.reshape(chunks_total, BPC).copy()
        if data.draw(st.integers(0, 4)) == 0:
            allowed = promotion(data)
        else:
            job, groups = draw_job(data)
            try:
                tier.submit(job, layer_groups=groups)
            except MalformedJob:
                seen["malformed"] += 1
            # anything else escapes: a raw exception fails the test
            try:
                tier.wait([job.job_id])
                seen["ok"] += 1
            except JobFailed as exc:
                seen["failed"] += 1
                reasons.append(exc.reason)
                assert not RAW.match(exc.reason), exc.reason
            allowed = named(job.spills) | (named(job.chunks) if job.direction == "store"
                                           else set())
        assert not outside, outside
        changed = rows_changed(before, generations)
        assert changed <= allowed, (changed, allowed)

    try:
        one_job()
    finally:
        rank_files.host_view = real_view
        tier.close()
    return seen, sorted({r.split(":")[0][:40] for r in reasons}), engine


def test_arbitrary_integers_in_every_field_never_write_outside_the_region(tmp_path) -> None:
    out = run_group(_fuzz, 1, args=(str(tmp_path), 300), timeout=600)
    assert out[0].ok, out[0].error
    seen, _, engine = out[0].value
    assert engine == "host"
    # the draws reach every outcome: refused at once, failed through the quorum, run; a
    # promotion refused or run
    assert all(seen.values()), seen


# ---------------------------------------------------------------------- the same on every rank


def _odd_shapes(rank: int, fs_dir: str) -> object:
    """A store and a load whose index fields are tuples of numpy ints, and a store whose chunks
    are an empty 2-D array, on a tier with a file tier and the block audit: the file tier's
    wait and the audit read the checked job, never the caller's fields."""
    import numpy as np

    from offload import CopyJob, HostTier, MalformedJob

    kv = _kv(rank)
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=6 * BPC * PAGE, blocks_per_chunk=BPC,
                                          tp=1, timeout_s=20, fs_dir=fs_dir,
                                          fs_namespace="shapes", fs_bytes=6 * BPC * PAGE),
                           audit=True)
    try:
        two = (np.int64(1), np.int32(2))
        tier.submit(CopyJob(1, "store", blocks=two, chunks=(np.int64(0), np.uint8(0)),
                            positions=two))
        tier.wait([1])
        kv[0][1:3] = 0
        tier.submit(CopyJob(2, "load", blocks=two, chunks=[0, 0], positions=two))
        tier.wait([2])
        refused = None
        try:
            tier.submit(CopyJob(3, "store", blocks=[], chunks=np.zeros((1, 0), np.int64),
                                positions=[]))
        except MalformedJob as exc:
            refused = str(exc)
        return refused, tier.actor.auditor.to_json(), kv[0][1:3].eq(_kv(rank)[0][1:3]).all().item()
    finally:
        tier.close()


def test_index_fields_of_any_accepted_shape_reach_the_file_tier_and_audit_checked(
        tmp_path) -> None:
    out = run_group(_odd_shapes, 1, args=(str(tmp_path),), timeout=120)
    assert out[0].ok, out[0].error
    refused, audit, restored = out[0].value
    assert refused is not None and "chunk_ids must be a 1-D array of integers, got shape (1, 0)" \
        in refused, refused
    assert audit == {"checked_blocks": 2, "mismatched_blocks": 0} and restored


def _refusals_alike(rank: int, fs_dir: str) -> object:
    import torch

    import offload.transfer.host as host
    from offload import CopyJob, HostTier, MalformedJob

    row = 2 * BPC * PAGE
    kv = _kv(rank)
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * row, blocks_per_chunk=BPC,
                                          tp=2, timeout_s=20, fs_dir=fs_dir,
                                          fs_namespace="alike", fs_bytes=8 * row))
    region = tier.actor.region.tensor.clone()
    raised = []
    for job in (CopyJob(1, "store", (0,), (-1,), (0,)),  # a chunk before the region
                CopyJob(2, "store", (0,), (0,), (0,), spills=(("k", -2),)),  # a spill too
                CopyJob(3, "load", (0,), (0,), (2**70,))):  # a position past any index
        try:
            tier.submit(job)
            raised.append(None)
        except MalformedJob as exc:
            raised.append(str(exc))
    untouched = bool(torch.equal(region, tier.actor.region.tensor))
    files = tier.actor.files.tier.stored_keys()
    issue = host.HostEngine._issue
    if rank == 1:  # an engine error of rank 1's own: its submit returns, as rank 0's does
        def broken(self, job_id, direction, job, after):  # type: ignore[no-untyped-def]
            raise RuntimeError("the copy engine went away")

        host.HostEngine._issue = broken  # type: ignore[method-assign]
    returned = tier.submit(CopyJob(4, "store", (1,), (1,), (0,))) is None
    host.HostEngine._issue = issue  # type: ignore[method-assign]
    results = decide_all(tier, rank)
    tier.submit(CopyJob(5, "store", (2,), (2,), (1,)))  # the next place: it runs everywhere
    results += decide_all(tier, rank)
    chunks = tier.plan.chunk_count
    tier.close()
    return raised, untouched, files, returned, results, chunks


def test_a_malformed_job_raises_on_every_rank_and_a_refusal_of_one_rank_returns(
        tmp_path) -> None:
    out = run_group(_refusals_alike, 2, args=(str(tmp_path),), timeout=120)
    assert all(o.ok for o in out), [o.error for o in out]
    (raised0, untouched0, files0, returned0, results0, chunks), rest = (o.value for o in out)
    assert rest[0] == raised0 and rest[3] == returned0 and rest[4] == results0  # alike
    assert raised0 == [
        f"chunk id -1 (entry 0 of the job) is out of range: the region has {chunks} chunks, "
        f"valid ids are 0..{chunks - 1}",
        f"job 2: spills[0] has chunk -2, out of range: the region has {chunks} chunks, valid "
        f"chunks are 0..{chunks - 1}",
        f"positions entry 0 is {2**70}, out of range: valid ids are 0..{BPC - 1}"]
    assert untouched0 and rest[1] and files0 == rest[2] == []  # nothing ran: no row, no file
    assert returned0  # rank 1's submit returned (no event on the host)
    ids = [(job, ok, failed) for job, ok, failed, _ in results0]
    assert ids == [(1, False, 0), (2, False, 0), (3, False, 0), (4, False, 1), (5, True, None)]
    assert results0[3][3] == "RuntimeError: the copy engine went away"


# ---------------------------------------------------------------------- spills whatever the fate


def _spills_on_refusal(rank: int, fs_dir: str) -> object:
    import torch.distributed as dist

    from offload import CopyJob, HostTier

    row = 2 * BPC * PAGE  # both ranks' slots: a chunk in host memory, the rest on disk
    tier = HostTier.create(_kv(rank, 4 * BPC), TierConfig(cpu_bytes_per_node=2 * row,
                                                 blocks_per_chunk=BPC, tp=2, timeout_s=20,
                                                 fs_dir=fs_dir, fs_namespace="fate",
                                                 fs_bytes=8 * row))
    manager = tier.manager

    def decided(make):  # type: ignore[no-untyped-def]
        box = [make() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def job(job_id: int, store) -> CopyJob:  # type: ignore[no-untyped-def]
        (key, chunk), = store.chunks
        return CopyJob(job_id, "store", [key * BPC + p for p in range(BPC)], [chunk] * BPC,
                       list(range(BPC)), spills=store.spills)

    for key in range(2):  # key 0, then key 1 (which spills key 0)
        store = decided(lambda k=key: manager.prepare_store([k]))
        tier.submit(job(7 + key, store))
        tier.wait([7 + key])
        if rank == 0:
            manager.complete_store(store.job_id, ok=True)
    store = decided(lambda: manager.prepare_store([2]))  # spills key 1
    tier.submit(job(5, store))  # decided, and returned by the decider only
    if rank == 0:
        while not tier.finished():
            time.sleep(0.001)
    mark = decided(lambda: tier.mark)
    if rank == 0:
        manager.complete_store(store.job_id, ok=True)
    third = decided(lambda: manager.prepare_store([3]))  # evicts a key: spilled first
    tier.submit(job(5, third))  # id 5 is still live on rank 1: it refuses, after its spills
    first = tier.finished(mark) if rank == 1 else []
    results = decide_all(tier, rank)
    files = tier.actor.files.tier
    files.flush()
    keys = files.stored_keys()
    tier.close()
    return third.spills, [(r.job_id, r.success) for r in first], results, keys


def test_a_rank_that_refuses_a_store_still_writes_its_spills(tmp_path) -> None:
    out = run_group(_spills_on_refusal, 2, args=(str(tmp_path),), timeout=120)
    assert all(o.ok for o in out), [o.error for o in out]
    (spills0, _, results0, keys0), (spills1, first1, results1, keys1) = (o.value for o in out)
    assert spills0 == spills1 == ((2, 0),)
    assert first1 == [(5, True)]
    assert results0 == results1
    (job, ok, failed, reason), = results0
    assert (job, ok, failed) == (5, False, 1) and "reused while a job" in reason
    # the same files in the same order on both ranks, the refused store's spill (key 2) too
    assert keys0 == keys1 == [b"0", b"1", b"2"]


@pytest.mark.parametrize("field", ["reads", "spills"])
@pytest.mark.parametrize("chunk", [-1, -2, 8, 2**64])
def test_a_promotion_item_outside_the_region_is_refused_before_anything_runs(
        field: str, chunk: int) -> None:
    from types import SimpleNamespace

    from offload import MalformedJob, fs_actions

    class Untouched:
        def promote(self, reads, generation, spills):  # pragma: no cover - never reached
            raise AssertionError("a promotion ran with a chunk outside the region")

    plan = SimpleNamespace(chunk_count=8, page_size=4096)
    actor = SimpleNamespace(files=Untouched(), ready_rows=8, topology=SimpleNamespace(rank=0),
                            _installed=lambda: plan)
    items = {"reads": [("a", 3)], "spills": []}
    items[field].append(("b", chunk))
    with pytest.raises(MalformedJob, match=rf"promotion 7: {field}\[\d\] has chunk {chunk}, out "
                                           r"of range: the region has 8 chunks, valid chunks "
                                           r"are 0..7"):
        fs_actions.promote(actor, items["spills"], items["reads"], 7)


def test_the_file_tier_checks_every_row_before_its_first_spill() -> None:
    from offload.tiers.rank_files import RankFiles

    class Tier:
        io_timeout_s, io_threads = 1.0, 1

        def put(self, key, row):  # pragma: no cover - never reached
            raise AssertionError("spilled before every row was checked")

    files = RankFiles(Tier(), 1 << 40, 4096, 0, 4096, rows=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk -2 is not a row of this 4-row region"):
        files.spill([("a", 1), ("b", -2)])
