"""ChunkManager: examples of each rule, then a stateful model check of all of them together."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from offload.errors import OffloadError
from offload.manager import ChunkManager, NotReadableError, UnknownJobError


def stored(manager: ChunkManager, keys: Sequence[Hashable]) -> dict[Hashable, int]:
    job = manager.prepare_store(keys)
    manager.complete_store(job.job_id, ok=True)
    return dict(job.chunks)


def test_free_chunks_first_then_least_recently_used() -> None:
    m = ChunkManager(3)
    assert stored(m, ["a", "b", "c"]) == {"a": 0, "b": 1, "c": 2}
    load = m.prepare_load(["a"])  # a is used after b and c
    m.complete_load(load.job_id)
    assert stored(m, ["d", "e"]) == {"d": 1, "e": 2}  # b and c evicted, oldest first
    assert m.lookup_prefix(["a", "d", "e", "b"]) == 3
    assert m.stats().evictions == 2


def test_a_key_whose_bytes_a_load_found_damaged_is_dropped_once_unheld() -> None:
    """Two loads hold "a"; the first finds its bytes damaged (an integrity mismatch): "a" is
    gone at once (no lookup finds it, a new store of it takes another chunk), while its old
    chunk stays out of use until the second load lets go of it."""
    m = ChunkManager(3)
    assert stored(m, ["a", "b"]) == {"a": 0, "b": 1}
    first, second = m.prepare_load(["a"]), m.prepare_load(["a", "b"])
    m.complete_load(first.job_id, fence=5, damaged=["a"])
    assert m.lookup_prefix(["a"]) == 0
    with pytest.raises(NotReadableError):
        m.prepare_load(["a"])
    assert stored(m, ["a"]) == {"a": 2}  # chunk 0 is still held by the second load
    assert m.stats().quarantined == 1
    m.drained(5)  # the first load's hold ends at its fence
    assert m.stats().quarantined == 1
    m.complete_load(second.job_id)
    s = m.stats()
    assert (s.quarantined, s.free, s.readable) == (0, 1, 2)
    assert stored(m, ["c"]) == {"c": 0}  # the damaged chunk is free again
    load = m.prepare_load(["a"])  # the new "a" is held and released as usual
    m.complete_load(load.job_id)
    assert m.lookup_prefix(["a", "b", "c"]) == 3


def test_held_chunks_are_not_evicted() -> None:
    m = ChunkManager(2)
    stored(m, ["a", "b"])
    hold = m.prepare_load(["a"])
    job = m.prepare_store(["c", "d"])
    assert job.chunks == (("c", 1),) and job.dropped == ("d",) and job.truncated
    assert m.lookup_prefix(["a"]) == 1
    m.complete_load(hold.job_id)
    m.complete_store(job.job_id, ok=True)
    assert stored(m, ["d"]) == {"d": 0}  # a is reusable once its hold is gone


def test_several_loads_hold_one_chunk() -> None:
    m = ChunkManager(1)
    stored(m, ["a"])
    first, second = m.prepare_load(["a"]), m.prepare_load(["a", "a"])
    assert m.stats().held == 1
    m.complete_load(first.job_id)
    assert m.prepare_store(["b"]).truncated
    m.complete_load(second.job_id)
    assert m.stats().held == 0
    assert stored(m, ["c"]) == {"c": 0}


def test_store_skips_cached_and_in_flight_keys_and_never_evicts_its_own_prefix() -> None:
    m = ChunkManager(3)
    stored(m, ["a"])
    in_flight = m.prepare_store(["b"])
    job = m.prepare_store(["a", "b", "c", "c", "d", "e"])
    assert job.chunks == (("c", 2),)
    assert job.skipped == ("a", "b", "c") and job.dropped == ("d", "e")
    assert m.lookup_prefix(["a"]) == 1  # not evicted to make room for its own continuation
    m.complete_store(in_flight.job_id, ok=True)
    m.complete_store(job.job_id, ok=True)
    assert m.lookup_prefix(["a", "b", "c", "d"]) == 3


def test_stored_keys_are_a_prefix_once_chunks_run_out() -> None:
    m = ChunkManager(2)
    job = m.prepare_store(["a", "b", "c", "d"])
    assert [k for k, _ in job.chunks] == ["a", "b"] and job.dropped == ("c", "d")


def test_storing_chunks_are_not_readable_and_failed_stores_free_them() -> None:
    m = ChunkManager(2)
    job = m.prepare_store(["a", "b"])
    assert m.lookup_prefix(["a"]) == 0
    with pytest.raises(NotReadableError, match="'a' is still being stored"):
        m.prepare_load(["a"])
    m.complete_store(job.job_id, ok=False)
    assert m.stats().free == 2 and m.lookup_prefix(["a"]) == 0
    with pytest.raises(NotReadableError, match="'a' is not cached"):
        m.prepare_load(["a"])


def test_a_failed_load_request_holds_nothing() -> None:
    m = ChunkManager(2)
    stored(m, ["a"])
    with pytest.raises(NotReadableError, match="'zz'"):
        m.prepare_load(["a", "zz"])
    assert m.stats().held == 0


def test_jobs_are_numbered_in_order_and_completed_once() -> None:
    m = ChunkManager(2)
    ids = [m.prepare_store(["a"]).job_id, m.prepare_store([]).job_id,
           m.prepare_load([]).job_id, m.prepare_store(["a"]).job_id]
    assert ids == sorted(ids) and len(set(ids)) == 4
    m.complete_store(ids[0], ok=True)
    with pytest.raises(UnknownJobError, match=f"no outstanding store job {ids[0]}"):
        m.complete_store(ids[0], ok=True)
    with pytest.raises(UnknownJobError, match="no outstanding load job"):
        m.complete_load(ids[1])  # a store id is not a load id
    m.complete_store(ids[1], ok=True)  # empty jobs complete like any other
    m.complete_load(ids[2])


def test_keys_may_be_any_hashable() -> None:
    m = ChunkManager(2)
    keys: list[Hashable] = [("seq", 0, b"\x00"), frozenset({1})]
    assert list(stored(m, keys).values()) == [0, 1]
    assert m.lookup_prefix(keys) == 2


def test_a_failed_store_with_a_fence_keeps_its_chunks_out_of_use_until_drained() -> None:
    m = ChunkManager(2)
    job = m.prepare_store(["a"])
    m.complete_store(job.job_id, ok=False, fence=5)  # some rank may still write chunk 0
    assert m.lookup_prefix(["a"]) == 0
    assert m.stats().quarantined == 1 and m.stats().free == 1
    assert stored(m, ["b"]) == {"b": 1}
    m.prepare_load(["b"])  # b held: nothing is evictable
    assert m.prepare_store(["c"]).dropped == ("c",)  # chunk 0 is not reused
    assert m.drained(4) == 0 and m.stats().quarantined == 1  # one job still behind the fence
    assert m.drained(5) == 1
    assert m.stats().quarantined == 0 and m.stats().free == 1
    assert stored(m, ["d"]) == {"d": 0}


def test_a_failed_load_with_a_fence_keeps_its_holds_until_drained() -> None:
    m = ChunkManager(1)
    stored(m, ["a"])
    load = m.prepare_load(["a"])
    m.complete_load(load.job_id, fence=3)  # a late rank may still read chunk 0
    assert m.lookup_prefix(["a"]) == 1 and m.stats().held == 1
    assert m.prepare_store(["b"]).dropped == ("b",)  # held: not evicted
    m.drained(3)
    assert m.stats().held == 0
    assert stored(m, ["c"]) == {"c": 0}


def test_without_a_fence_a_failed_job_releases_at_once() -> None:
    m = ChunkManager(1)
    m.complete_store(m.prepare_store(["a"]).job_id, ok=False)
    assert m.stats().free == 1 and m.stats().quarantined == 0


def test_chunk_count_must_be_positive() -> None:
    with pytest.raises(OffloadError, match="chunk_count = 0"):
        ChunkManager(0)


KEYS = st.integers(0, 9)


class ManagerModel(RuleBasedStateMachine):
    """Drives a ChunkManager against a plain model of the rules in DESIGN.md section 6."""

    @initialize(chunk_count=st.integers(1, 6), ready=st.none() | st.integers(0, 6))
    def start(self, chunk_count: int, ready: int | None) -> None:
        self.m = ChunkManager(chunk_count, ready=ready)
        self.n = chunk_count
        self.ready = chunk_count if ready is None else min(ready, chunk_count)
        self.readable: dict[Hashable, int] = {}  # key -> chunk
        self.storing: dict[Hashable, int] = {}
        self.holds: Counter[Hashable] = Counter()
        self.used: dict[Hashable, int] = {}  # key -> logical time of last use (LRU order)
        self.clock = 0
        self.stores: dict[int, list[tuple[Hashable, int]]] = {}
        self.loads: dict[int, list[tuple[Hashable, int]]] = {}
        self.evictions = 0
        self.last_job = -1
        self.quarantine: list[tuple[int, list[int], list[Hashable]]] = []

    def _tick(self, key: Hashable) -> None:
        self.clock += 1
        self.used[key] = self.clock

    def _quarantined(self) -> int:
        return sum(len(chunks) for _, chunks, _ in self.quarantine)

    def _new_job(self, job_id: int) -> None:
        assert job_id > self.last_job
        self.last_job = job_id

    @rule(keys=st.lists(KEYS, max_size=6))
    def store(self, keys: list[int]) -> None:
        free_before = (self.ready - len(self.readable) - len(self.storing)
                       - self._quarantined())
        job = self.m.prepare_store(keys)
        self._new_job(job.job_id)
        new = list(dict.fromkeys(k for k in keys
                                 if k not in self.readable and k not in self.storing))
        taken = [k for k, _ in job.chunks]
        assert taken + list(job.dropped) == new  # stored keys: a prefix of the new ones
        assert len(job.skipped) == len(keys) - len(new)
        evicted_count = max(0, len(taken) - free_before)
        eligible = sorted((k for k in self.readable if not self.holds[k] and k not in keys),
                          key=self.used.__getitem__)
        victims = eligible[:evicted_count]
        if job.dropped:  # truncated only when nothing more could be evicted
            assert len(eligible) == evicted_count
        free = sorted(set(range(self.ready)) - {*self.readable.values(), *self.storing.values()}
                      - {c for _, chunks, _ in self.quarantine for c in chunks})
        assert [c for _, c in job.chunks] == (free[:len(taken) - evicted_count]
                                               + [self.readable[v] for v in victims])
        for v in victims:
            del self.readable[v]
        self.evictions += len(victims)
        self.storing.update(job.chunks)
        self.stores[job.job_id] = list(job.chunks)

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), ok=st.booleans(), fence=st.none() | st.integers(0, 5))
    def finish_store(self, data: st.DataObject, ok: bool, fence: int | None) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.stores)))
        self.m.complete_store(job_id, ok, fence)
        failed = []
        for key, chunk in self.stores.pop(job_id):
            del self.storing[key]
            if ok:
                self.readable[key] = chunk
                self._tick(key)
            else:
                failed.append(chunk)
        if failed and fence is not None:
            self.quarantine.append((fence, failed, []))

    @rule(through=st.integers(0, 5))
    def drained(self, through: int) -> None:
        self.m.drained(through)
        for _, _, holds in [q for q in self.quarantine if q[0] <= through]:
            self._release(holds)
        self.quarantine = [q for q in self.quarantine if q[0] > through]

    def _release(self, keys: list[Hashable]) -> None:
        for key in keys:
            self.holds[key] -= 1
            if not self.holds[key]:
                self._tick(key)

    @precondition(lambda self: self.readable)
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(list(self.readable)), max_size=4))
        job = self.m.prepare_load(keys)
        self._new_job(job.job_id)
        assert list(job.chunks) == [(k, self.readable[k]) for k in keys]
        self.holds.update(keys)
        self.loads[job.job_id] = list(job.chunks)

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4))
    def load_unreadable(self, keys: list[int]) -> None:
        if all(k in self.readable for k in keys):
            return
        before = self.m.stats()
        with pytest.raises(NotReadableError):
            self.m.prepare_load(keys)
        assert self.m.stats() == before

    @precondition(lambda self: self.loads)
    @rule(data=st.data(), fence=st.none() | st.integers(0, 5))
    def finish_load(self, data: st.DataObject, fence: int | None) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.loads)))
        self.m.complete_load(job_id, fence)
        keys = [key for key, _ in self.loads.pop(job_id)]
        if fence is None:
            self._release(keys)
        else:
            self.quarantine.append((fence, [], keys))

    @rule(job_id=st.integers(-2, 200))
    def finish_unknown(self, job_id: int) -> None:
        if job_id not in self.stores:
            with pytest.raises(UnknownJobError):
                self.m.complete_store(job_id, ok=True)
        if job_id not in self.loads:
            with pytest.raises(UnknownJobError):
                self.m.complete_load(job_id)

    @rule(rows=st.integers(0, 8))
    def rows_come_online(self, rows: int) -> None:
        added = self.m.set_ready(rows)
        assert added == max(0, min(rows, self.n) - self.ready)
        self.ready = max(self.ready, min(rows, self.n))
        assert self.m.ready == self.ready

    @rule(keys=st.lists(KEYS, max_size=6))
    def lookup(self, keys: list[int]) -> None:
        expected = next((i for i, k in enumerate(keys) if k not in self.readable), len(keys))
        assert self.m.lookup_prefix(keys) == expected

    @invariant()
    def counts_add_up(self) -> None:
        s = self.m.stats()
        assert (s.chunk_count, s.storing, s.readable) == (
            self.n, len(self.storing), len(self.readable))
        assert s.quarantined == self._quarantined()
        assert s.not_ready == self.n - self.ready
        assert s.free + s.storing + s.readable + s.quarantined + s.not_ready == self.n
        assert s.held == sum(1 for k in self.readable if self.holds[k])
        assert s.evictions == self.evictions

    @invariant()
    def one_key_per_chunk(self) -> None:
        chunks = [*self.readable.values(), *self.storing.values(),
                  *(c for _, q, _ in self.quarantine for c in q)]
        # only chunks of ready rows are ever handed out
        assert len(chunks) == len(set(chunks)) and all(0 <= c < self.ready for c in chunks)
        assert not set(self.readable) & set(self.storing)
        assert all(k in self.readable for k, held in self.holds.items() if held)


TestManagerModel = ManagerModel.TestCase
TestManagerModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
