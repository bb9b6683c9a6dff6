# SPDX-License-Identifier: Apache-2.0
"""After a restart the writers agree on one LRU order, not only on one set of files.

The scenario (found by review): two writers hold K and A; at the next start rank 1 cannot read
K's header (kept, not indexed); J is stored, K re-stored (rank 1's write fails, its old file
stays) and A touched; at the following start both hold {K, J, A}, but rank 1's K carries its
old sequence number, so its write order differs.  Agreeing on the set alone leaves the two LRUs
(and the manager's replay, seeded from one of them) evicting different keys.  Adopting one
writer's order -- what `offload.fs_actions.setup` does -- makes them evict alike."""

from __future__ import annotations

import errno
import mmap
from pathlib import Path

import pytest

from offload.tiers.file_tier import FileTier
from offload.tiers.fs_io import FileIO
from offload.tiers.lru import Lru

ROW = 4096


class _FailOnce(FileIO):
    """A file system that fails the next read or write once (``fail``: "r", "w")."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: set[str] = set()

    def pwritev(self, fd, buffers, offset):  # type: ignore[no-untyped-def]
        if "w" in self.fail:
            self.fail.discard("w")
            raise OSError(errno.EIO, "injected EIO")
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd, buffers, offset):  # type: ignore[no-untyped-def]
        if "r" in self.fail:
            self.fail.discard("r")
            raise OSError(errno.EIO, "injected EIO")
        return super().preadv(fd, buffers, offset)


def _restart_scenario(tmp_path: Path) -> list[FileTier]:
    dirs = [tmp_path / "r0", tmp_path / "r1"]
    ios = [_FailOnce(), _FailOnce()]
    for d in dirs:
        d.mkdir()

    def open_all() -> list[FileTier]:
        return [FileTier(str(d), 4 * (ROW + 4096), {"g": 1}, ROW, io_threads=1, io=io)
                for d, io in zip(dirs, ios, strict=True)]

    def agree(tiers: list[FileTier]) -> None:
        names = frozenset.intersection(*[t.stored_names() for t in tiers])
        for t in tiers:
            t.keep_only(names).result()

    row = memoryview(mmap.mmap(-1, ROW))
    tiers = open_all()
    for t in tiers:
        t.put("K", row).stored.result()
        t.put("A", row).stored.result()
        t.close()
    ios[1].fail = {"r"}  # rank 1 cannot read K's header at the next start
    tiers = open_all()
    agree(tiers)
    for t in tiers:
        t.put("J", row).stored.result()
    ios[1].fail = {"w"}  # K stored again: rank 1's write fails, its old file stays
    for t in tiers:
        t.put("K", row).stored.result()
        t.put("A", row).stored.result()
        t.close()
    tiers = open_all()
    agree(tiers)
    return tiers


def test_one_writers_order_makes_every_writer_evict_alike(tmp_path: Path) -> None:
    tiers = _restart_scenario(tmp_path)
    try:
        assert {frozenset(t.ordered_names()) for t in tiers} == {frozenset(tiers[0]
                                                                           .ordered_names())}
        assert tiers[0].ordered_names() != tiers[1].ordered_names()  # the set alone is not enough
        tiers[1].adopt_order(tiers[0].ordered_names())
        assert tiers[0].lru_keys() == tiers[1].lru_keys()
        row = memoryview(mmap.mmap(-1, ROW))
        for key in ("X", "Y"):  # past the capacity: both evict the same keys
            for t in tiers:
                t.put(key, row).stored.result()
            assert tiers[0].lru_keys() == tiers[1].lru_keys()
    finally:
        for t in tiers:
            t.close()


def test_an_order_must_name_exactly_the_held_keys() -> None:
    lru: Lru[str] = Lru(3)
    for key in "abc":
        lru.put(key)
    lru.reorder(["c", "a", "b"])
    assert list(lru) == ["c", "a", "b"] and lru.put("d") == ["c"]
    with pytest.raises(ValueError, match="exactly the held keys"):
        lru.reorder(["a", "b"])


def test_set_up_gives_every_writer_and_the_manager_one_order(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """`fs_actions.setup` (rank 0's side, here over a stand-in RPC that runs each step on both
    writers in this process): after it, both writers' LRUs and the keys the chunk manager is
    seeded with are in one order."""
    from offload import fs_actions
    from offload.tiers.rank_files import RankFiles

    tiers = _restart_scenario(tmp_path)

    class Actor:
        def __init__(self, tier: FileTier) -> None:
            self.files = RankFiles(tier, 0, ROW, 0, ROW)

    class Rpc:
        def __init__(self, actors: list[Actor]) -> None:
            self.actors = actors

        def call(self, fn, *args, actor):  # type: ignore[no-untyped-def]
            # the tiers are open already, and their budget and the disk's old folders are
            # `tests/tiers/test_file_tier_room.py`'s subject: those steps do nothing here
            if fn in (fs_actions.open_files, fs_actions.evict_old_folders):
                return [None] * len(self.actors)
            if fn is fs_actions.held_bytes:
                return [("n0", 0)] * len(self.actors)
            return [fn(a, *args) for a in self.actors]

    actors = [Actor(t) for t in tiers]
    monkeypatch.setattr(fs_actions, "agree_budget", lambda actor, rpc: None)
    try:
        seeded = fs_actions.setup(actors[0], Rpc(actors))  # type: ignore[arg-type]
        assert tiers[0].lru_keys() == tiers[1].lru_keys() == seeded
    finally:
        for t in tiers:
            t.close()
