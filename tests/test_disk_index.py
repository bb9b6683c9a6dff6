"""The chunk manager's disk picture replays a real FileTier's LRU decisions exactly."""

from __future__ import annotations

import mmap
import shutil
import tempfile

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from offload.disk_index import DiskIndex
from offload.errors import OffloadError
from offload.tiers import FileTier

ROW = 4096
KEYS = st.sampled_from([("k", i) for i in range(6)])


def test_put_get_discard_in_lru_order() -> None:
    index = DiskIndex(2)
    assert index.put("a") and index.put("b") and not index.put("a")  # a is now MRU
    assert index.put("c") and index.lru() == [b"'a'", b"'c'"] and index.evicted == 1
    assert index.touch("a") and not index.touch("b") and index.lru() == [b"'c'", b"'a'"]
    index.discard("a")
    assert "a" not in index and "c" in index and len(index) == 1
    index.seed([b"'x'", b"'y'", b"'z'"])
    assert index.lru() == [b"'y'", b"'z'"]
    with pytest.raises(OffloadError, match="capacity = 0 files"):
        DiskIndex(0)


class MirrorMatchesFileTier(RuleBasedStateMachine):
    """Random put/get/discard on a real FileTier (tmpfs) and on the index, same order."""

    @initialize()
    def start(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="pytest-diskindex-", dir="/dev/shm")
        self.tier = FileTier(self.dir, 3 * (ROW + 4096), {"t": 1}, ROW, io_threads=2)
        self.index = DiskIndex(self.tier.capacity)
        self.row = mmap.mmap(-1, ROW)

    @rule(key=KEYS)
    def put(self, key: tuple[str, int]) -> None:
        self.tier.put(key, self.row).released.result()
        self.index.put(key)

    @rule(key=KEYS)
    def get(self, key: tuple[str, int]) -> None:
        assert self.tier.get(key, self.row).result() == self.index.touch(key)

    @rule(key=KEYS)
    def touch(self, key: tuple[str, int]) -> None:
        assert self.tier.touch(key) == self.index.touch(key)

    @rule(key=KEYS)
    def discard(self, key: tuple[str, int]) -> None:
        self.tier.discard(key)
        self.index.discard(key)

    @invariant()
    def same_keys_same_order(self) -> None:
        assert self.tier.stored_keys() == self.index.lru()
        assert self.tier.stats().evicted == self.index.evicted

    def teardown(self) -> None:
        if hasattr(self, "tier"):  # the row is unmapped by the garbage collector, after the views
            self.tier.close()
            shutil.rmtree(self.dir, ignore_errors=True)


MirrorMatchesFileTier.TestCase.settings = settings(max_examples=25, stateful_step_count=25,
                                                   deadline=None)
test_mirror_matches_file_tier = MirrorMatchesFileTier.TestCase
