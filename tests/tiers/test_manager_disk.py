"""ChunkManager with a file tier behind it: three states per key (host, disk, both), spills of
evicted host chunks, promotions of disk hits, and a stateful model of all of it."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
from collections.abc import Hashable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from offload.manager import ChunkManager, NotReadableError
from offload.tiers import FileTier
from offload.tiers.file_format import file_name, key_bytes
from offload.tiers.fs_io import FileIO

ROW = 4096
KEYS = st.integers(0, 9)


def stored(m: ChunkManager, keys: list[Hashable]) -> tuple[tuple[Hashable, int], ...]:
    """Store ``keys``; return the spills the caller had to run first."""
    job = m.prepare_store(keys)
    m.complete_store(job.job_id, ok=True)
    return job.spills


def test_eviction_spills_then_a_disk_hit_is_promoted_and_is_in_both_tiers() -> None:
    m = ChunkManager(2, disk_capacity=4)
    assert stored(m, ["a", "b"]) == ()
    assert [m.residence(k) for k in ("a", "b", "z")] == ["host", "host", None]
    assert stored(m, ["c"]) == (("a", 0),)  # a is written out before c reuses its row
    assert (m.residence("a"), m.residence("c")) == ("disk", "host")
    assert m.lookup_prefix(["a", "b", "c", "z"]) == 3  # the prefix spans both tiers
    with pytest.raises(NotReadableError, match="'a' is on disk only; promote it"):
        m.prepare_load(["a"])
    promote = m.prepare_promote(["a", "c"])
    assert promote.chunks == (("a", 1),) and promote.spills == (("b", 1),)
    assert promote.skipped == ("c",) and not promote.dropped
    assert m.residence("a") == "disk"  # not readable in host memory until complete
    m.complete_promote(promote.job_id, failed=())
    assert [m.residence(k) for k in ("a", "b", "c")] == ["both", "disk", "host"]
    load = m.prepare_load(["a"])
    assert load.chunks == (("a", 1),)
    m.complete_load(load.job_id)
    # c is least recently used and on no disk: spilled; a is on disk already: no spill
    assert stored(m, ["d", "e"]) == (("c", 0),)
    assert [m.residence(k) for k in "abcde"] == ["disk", "disk", "disk", "host", "host"]
    s = m.stats()
    assert (s.on_disk, s.spilled, s.promoted, s.evictions) == (3, 3, 1, 4)


def test_a_failed_promotion_frees_its_chunk_and_forgets_the_disk_copy() -> None:
    m = ChunkManager(1, disk_capacity=4)
    stored(m, ["a"])
    stored(m, ["b"])
    promote = m.prepare_promote(["a"])
    assert promote.chunks == (("a", 0),) and promote.spills == (("b", 0),)
    m.complete_promote(promote.job_id, failed=["a"])
    assert (m.residence("a"), m.residence("b")) == (None, "disk")
    assert m.lookup_prefix(["a"]) == 0 and m.stats().free == 1
    with pytest.raises(NotReadableError, match="'a' is not cached"):
        m.prepare_promote(["a"])


def test_a_promotions_own_spills_never_evict_the_keys_it_reads() -> None:
    m = ChunkManager(1, disk_capacity=2)
    for key in "abc":
        stored(m, [key])  # disk: a, b (LRU first); host: c
    promote = m.prepare_promote(["a"])
    assert promote.spills == (("c", 0),)  # its write evicts b, not a (a was touched first)
    m.complete_promote(promote.job_id, failed=())
    assert [m.residence(k) for k in "abc"] == ["both", None, "disk"]


def test_evicting_a_key_already_on_disk_leaves_the_disk_lru_alone() -> None:
    """No rank writes it again, so the picture must not make it most recently used either
    (found by the model below: the picture and the disks then disagreed)."""
    m = ChunkManager(2, disk_capacity=2)
    stored(m, ["a", "x"])
    stored(m, ["b"])  # a spilled; disk: a
    promote = m.prepare_promote(["a"])  # x spilled; disk: x, a
    m.complete_promote(promote.job_id, failed=())
    assert stored(m, ["y"]) == (("b", 0),)  # b's file evicts x; disk: a, b
    # a leaves host memory (on disk: no write, no touch), then y's file evicts the LRU: a
    assert stored(m, ["x", "z"]) == (("y", 0),)
    assert [m.residence(k) for k in "abxyz"] == [None, "disk", "host", "disk", "host"]


def test_stores_skip_keys_on_disk_and_no_disk_means_no_spills() -> None:
    m = ChunkManager(1, disk_capacity=2)
    stored(m, ["a"])
    stored(m, ["b"])
    job = m.prepare_store(["a", "c"])
    assert job.skipped == ("a",) and job.chunks == (("c", 0),) and job.spills == (("b", 0),)
    plain = ChunkManager(1)
    stored(plain, ["a"])
    assert stored(plain, ["b"]) == () and plain.residence("a") is None
    with pytest.raises(NotReadableError, match="'a' is not cached"):
        plain.prepare_promote(["a"])


def test_the_disk_picture_keeps_its_capacity_and_a_restart_seeds_it() -> None:
    m = ChunkManager(1, disk_capacity=2)
    for key in "abcd":
        stored(m, [key])
    assert [m.residence(k) for k in "abcd"] == [None, "disk", "disk", "host"]
    fresh = ChunkManager(4, disk_capacity=2)
    fresh.seed_disk([b"'x'", b"'y'", b"'z'"])  # a restarted tier's keys, LRU first
    assert [fresh.residence(k) for k in "xyz"] == [None, "disk", "disk"]
    assert fresh.lookup_prefix(["y", "z", "x"]) == 2


class DiskModel(RuleBasedStateMachine):
    """Stores, loads and promotions completing at once, against plain sets and an LRU list
    replaying the file tier's calls in the documented order (a store's spills; a promotion's
    touches of the keys it reads, its spills, then its reads)."""

    @initialize(chunk_count=st.integers(1, 4), disk=st.integers(1, 6))
    def start(self, chunk_count: int, disk: int) -> None:
        self.m = ChunkManager(chunk_count, disk_capacity=disk)
        self.capacity = disk
        self.host: set[Hashable] = set()
        self.disk: list[Hashable] = []  # LRU first

    def _put(self, key: Hashable) -> None:
        assert key not in self.disk  # a key already on disk is never spilled again
        if len(self.disk) >= self.capacity:
            self.disk.pop(0)
        self.disk.append(key)

    def _leave_host(self, before: set[Hashable], spills: tuple[tuple[Hashable, int], ...],
                    disk_before: list[Hashable]) -> None:
        """Every key that left host memory was on disk already or was spilled."""
        gone = before - self.host
        spilled = [k for k, _ in spills]
        assert gone == set(spilled) | (gone & set(disk_before))

    @rule(keys=st.lists(KEYS, max_size=5))
    def store(self, keys: list[int]) -> None:
        before, disk_before = set(self.host), list(self.disk)
        job = self.m.prepare_store(keys)
        for key, _ in job.spills:
            self._put(key)
        self.m.complete_store(job.job_id, ok=True)
        # stored keys are new to both tiers (a key this job's spills pushed off the disk is new)
        assert not {k for k, _ in job.chunks} & (before | set(self.disk))
        self.host = {k for k in before | {c for c, _ in job.chunks}
                     if self.m.residence(k) in ("host", "both")}
        assert len(self.host) <= self.m.chunk_count
        self._leave_host(before, job.spills, disk_before)

    @rule(keys=st.lists(KEYS, max_size=4), data=st.data())
    def promote(self, keys: list[int], data: st.DataObject) -> None:
        wanted = [k for k in keys if k in self.disk or k in self.host]
        before, disk_before = set(self.host), list(self.disk)
        job = self.m.prepare_promote(wanted)
        assert {k for k, _ in job.chunks} <= set(disk_before) - before
        for key, _ in job.chunks:  # the reads are made most recently used first
            if key in self.disk:
                self.disk.remove(key)
                self.disk.append(key)
        for key, _ in job.spills:
            self._put(key)
        failed = set()
        for key, _ in job.chunks:  # reads after the spills; evicted meanwhile = a miss
            if key in self.disk and data.draw(st.booleans(), label=f"read {key} ok"):
                self.disk.remove(key)
                self.disk.append(key)
            else:
                failed.add(key)
        for key in failed:
            if key in self.disk:
                self.disk.remove(key)
        self.m.complete_promote(job.job_id, failed=sorted(failed))
        self.host = {k for k in before | {c for c, _ in job.chunks}
                     if self.m.residence(k) in ("host", "both")}
        assert {k for k, _ in job.chunks} - failed <= self.host
        self._leave_host(before, job.spills, disk_before)

    @rule(keys=st.lists(KEYS, max_size=4))
    def load(self, keys: list[int]) -> None:
        readable = [k for k in keys if k in self.host]
        job = self.m.prepare_load(readable)
        self.m.complete_load(job.job_id)

    @rule(keys=st.lists(KEYS, max_size=6))
    def lookup(self, keys: list[int]) -> None:
        cached = self.host | set(self.disk)
        expected = next((i for i, k in enumerate(keys) if k not in cached), len(keys))
        assert self.m.lookup_prefix(keys) == expected

    @invariant()
    def states_match(self) -> None:
        for key in range(10):
            where = {(True, True): "both", (True, False): "host", (False, True): "disk",
                     (False, False): None}[(key in self.host, key in self.disk)]
            assert self.m.residence(key) == where
        s = self.m.stats()
        assert s.readable == len(self.host) and s.on_disk == len(self.disk)


TestDiskModel = DiskModel.TestCase
TestDiskModel.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)


class FailingWrites(FileIO):
    """The tier's I/O seam, whose writes fail with ``code`` while it is set."""

    code: int | None = None

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if self.code is not None:
            raise OSError(self.code, os.strerror(self.code))
        return super().pwritev(fd, buffers, offset)


class ManagerDrivesARealFileTier(RuleBasedStateMachine):
    """The manager's work items executed on a real FileTier (tmpfs) in the documented order:
    the manager's picture of the disk must stay the tier's own index, spills whose write
    failed (dead keys, which keep their slot until a promotion finds them) included."""

    @initialize(chunk_count=st.integers(1, 3), disk=st.integers(1, 4))
    def start(self, chunk_count: int, disk: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="pytest-mgrfs-", dir="/dev/shm")
        self.io = FailingWrites()
        self.tier = FileTier(self.dir, disk * 2 * ROW, {"t": 2}, ROW, io_threads=2, io=self.io)
        self.m = ChunkManager(chunk_count, disk_capacity=self.tier.capacity)
        self.rows = mmap.mmap(-1, chunk_count * ROW)

    def _row(self, chunk: int) -> memoryview:
        return memoryview(self.rows)[chunk * ROW:(chunk + 1) * ROW]

    def _spill(self, spills: tuple[tuple[Hashable, int], ...]) -> None:
        for key, chunk in spills:
            self.tier.put(key, self._row(chunk)).released.result()

    @rule(keys=st.lists(KEYS, max_size=4), fail=st.booleans())
    def store(self, keys: list[int], fail: bool) -> None:
        """``fail``: the spills' writes fail (EIO), as a failing disk does on one rank."""
        job = self.m.prepare_store(keys)
        self.io.code = errno.EIO if fail else None
        self._spill(job.spills)
        self.tier.flush()  # the faults hit these writes and no later ones
        self.io.code = None
        self.m.complete_store(job.job_id, ok=True)

    @rule(keys=st.lists(KEYS, max_size=3), lose=st.booleans())
    def promote(self, keys: list[int], lose: bool) -> None:
        """``lose``: the first key's file vanishes before it is read (a failed read)."""
        wanted = [k for k in keys if self.m.residence(k) is not None]
        job = self.m.prepare_promote(wanted)
        for key, _ in job.chunks:
            self.tier.touch(key)
        self._spill(job.spills)
        if lose and job.chunks:
            self.tier.flush()
            path = os.path.join(self.tier.directory, file_name(key_bytes(job.chunks[0][0])))
            if os.path.exists(path):
                os.unlink(path)
        reads = [(key, self.tier.get(key, self._row(chunk))) for key, chunk in job.chunks]
        failed = [key for key, read in reads if not read.result()]
        for key in failed:
            self.tier.discard(key)
        self.m.complete_promote(job.job_id, failed)

    @invariant()
    def the_picture_is_the_tier(self) -> None:
        on_disk = {key_bytes(k) for k in range(10) if self.m.residence(k) in ("disk", "both")}
        assert on_disk == set(self.tier.lru_keys())  # the readable and the dead keys
        assert set(self.tier.stored_keys()) <= on_disk
        assert self.m.stats().on_disk == len(on_disk)

    def teardown(self) -> None:
        if hasattr(self, "tier"):
            self.tier.close()
            shutil.rmtree(self.dir, ignore_errors=True)


TestManagerDrivesARealFileTier = ManagerDrivesARealFileTier.TestCase
TestManagerDrivesARealFileTier.settings = settings(max_examples=300, stateful_step_count=30,
                                                   deadline=None)
