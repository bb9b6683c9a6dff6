"""The chunk manager's disk picture (`DiskIndex`) replays a real FileTier's LRU decisions
exactly, failed and damaged files included; both take them with one class (`Lru`)."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from offload.errors import OffloadError
from offload.tiers import FileTier
from offload.tiers.disk_index import DiskIndex
from offload.tiers.file_format import SUFFIX, file_name, key_bytes
from offload.tiers.fs_io import FileIO
from offload.tiers.lru import Lru

ROW = 4096
FILE = ROW + 4096  # header page + row
KEYS = st.sampled_from([("k", i) for i in range(6)])


def test_lru_rules() -> None:
    lru: Lru[str] = Lru(2)
    assert lru.put("a") == [] and lru.put("b") == [] and lru.put("a") == []  # a is now MRU
    assert lru.put("c") == ["b"] and list(lru) == ["a", "c"] and len(lru) == 2
    assert lru.touch("a") and not lru.touch("b") and list(lru) == ["c", "a"]
    assert lru.discard("a") and not lru.discard("a") and "a" not in lru and "c" in lru
    assert lru.put("d") == [] and lru.put("e") == ["c"] and list(lru) == ["d", "e"]
    with pytest.raises(ValueError, match="capacity"):
        Lru(0)


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


class ArmedIO(FileIO):
    """The tier's I/O seam with one-shot faults: `arm` makes the next call of one primitive
    (``pwritev``, ``preadv``) raise an errno, or first wait for a gate (a stalled disk).
    The state machine waits for every spill to release its row and for every read, so the
    next such call is always the one of the operation the fault was armed for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, int | threading.Event] = {}
        self.stalled = threading.Event()  # set once a call waits at a gate

    def arm(self, op: str, fault: int | threading.Event) -> None:
        with self._lock:
            self._armed[op] = fault

    def disarm(self) -> None:
        """Drop a fault no call took (the operation needed no I/O)."""
        with self._lock:
            self._armed.clear()

    def _fault(self, op: str) -> None:
        with self._lock:
            fault = self._armed.pop(op, None)
        if isinstance(fault, threading.Event):
            self.stalled.set()
            fault.wait(30)  # (a bound, so a broken test cannot hang)
        elif fault is not None:
            raise OSError(fault, os.strerror(fault))

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self._fault("pwritev")
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self._fault("preadv")
        return super().preadv(fd, buffers, offset)


def _fill(key: tuple[str, int]) -> bytes:
    return bytes([key[1] + 1]) * ROW


class ReplayMatchesFileTier(RuleBasedStateMachine):
    """The same calls, in the same order, on a real FileTier (real files on tmpfs, a budget of
    1 to 4 files) and on a DiskIndex, with the faults a writer meets: a spill whose write fails
    (EIO, ENOSPC) or passes its deadline, a read that fails (EIO), a file damaged on disk.
    After every step both hold the same keys in the same LRU order: a key whose write failed
    or whose file was found bad is dead on the tier (a miss) but, as on the index, still holds
    its slot until it is discarded or evicted."""

    @initialize(files=st.integers(1, 4))
    def start(self, files: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="pytest-diskindex-", dir="/dev/shm")
        self.io = ArmedIO()
        self.files = files
        self.tier = self._open()
        self.index = DiskIndex(self.tier.capacity)
        self.damaged: set[bytes] = set()  # keys whose file changed under the tier, not read yet
        self.row = mmap.mmap(-1, ROW)
        self.out = mmap.mmap(-1, ROW)

    def _open(self) -> FileTier:
        return FileTier(self.dir, self.files * FILE, {"t": 1}, ROW, io_threads=2,
                        io_timeout_s=5.0, io=self.io)

    @rule(key=KEYS)
    def put(self, key: tuple[str, int]) -> None:
        """A spill; its write may still be running at the next step (no decision waits)."""
        self.row[:] = _fill(key)
        assert self.tier.release(self.tier.put(key, self.row))
        if self.index.put(key):  # a new file
            self.damaged.discard(key_bytes(key))

    @rule(key=KEYS, code=st.sampled_from([errno.EIO, errno.ENOSPC]))
    def put_failing(self, key: tuple[str, int], code: int) -> None:
        self.io.arm("pwritev", code)
        self.row[:] = _fill(key)
        spill = self.tier.put(key, self.row)
        assert self.tier.release(spill)
        stored = spill.stored.result(10)
        assert stored is (spill.entry is None)  # a written key fails, a kept one stays
        self.io.disarm()
        self.index.put(key)

    @rule(key=KEYS)
    def put_past_deadline(self, key: tuple[str, int]) -> None:
        """A spill whose write stalls past the caller's deadline is abandoned (dead)."""
        gate = threading.Event()
        self.io.stalled.clear()
        self.io.arm("pwritev", gate)
        self.row[:] = _fill(key)
        spill = self.tier.put(key, self.row)
        if spill.entry is not None:  # a write started: let it reach the stall, then give up
            assert self.io.stalled.wait(10)
            assert not self.tier.release(spill, 0.0)
        gate.set()
        assert spill.stored.result(10) is (spill.entry is None)
        self.io.disarm()
        self.index.put(key)

    @rule(key=KEYS, fail=st.booleans())
    def get(self, key: tuple[str, int], fail: bool) -> None:
        """A promotion's read (``fail``: it meets EIO)."""
        if fail:
            self.io.arm("preadv", errno.EIO)
        hit = self.tier.get(key, self.out).result(10)
        self.io.disarm()
        present = self.index.touch(key)
        assert not hit or (present and not fail and self.out[:] == _fill(key))

    @rule(key=KEYS)
    def touch(self, key: tuple[str, int]) -> None:
        assert self.tier.touch(key) == self.index.touch(key)

    @rule(key=KEYS)
    def discard(self, key: tuple[str, int]) -> None:
        self.tier.discard(key)
        self.index.discard(key)
        self.damaged.discard(key_bytes(key))

    @rule(key=KEYS, how=st.sampled_from(["flip", "truncate", "remove"]))
    def damage(self, key: tuple[str, int], how: str) -> None:
        """The disk changes under the tier (no call: neither side sees it until a read)."""
        self.tier.flush()
        path = os.path.join(self.tier.directory, file_name(key_bytes(key)))
        if not os.path.exists(path):
            return
        self.damaged.add(key_bytes(key))
        if how == "flip":  # a payload byte (a header byte once the file was truncated)
            offset = 4096 + 100 if os.path.getsize(path) == FILE else 100
            with open(path, "r+b") as f:
                byte = os.pread(f.fileno(), 1, offset)
                os.pwrite(f.fileno(), bytes([byte[0] ^ 0xFF]), offset)
        elif how == "truncate":
            os.truncate(path, FILE - 4096)
        else:
            os.unlink(path)

    @rule()
    def restart(self) -> None:
        """A restarted tier indexes its files anew; the index is seeded with what it reports
        (as `fs_actions.setup` does after the writers agreed)."""
        self.tier.flush()
        assert self.tier.close()
        self.tier = self._open()
        self.index = DiskIndex(self.tier.capacity)
        self.index.seed(self.tier.stored_keys())
        self.damaged.clear()  # a removed or truncated file left its index, a flipped one is there

    @rule()
    def settle(self) -> None:
        """Once the I/O has ended, the files on disk are within the budget and the replay:
        every readable key has its file (unless it was damaged since), no other file exists."""
        self.tier.flush()
        names = os.listdir(self.tier.directory)
        assert all(n.endswith(SUFFIX) for n in names)  # no temporary file left
        readable = {file_name(k) for k in self.tier.stored_keys() if k not in self.damaged}
        assert readable <= set(names) <= {file_name(k) for k in self.index.lru()}
        assert len(names) <= self.tier.capacity

    @invariant()
    def same_keys_same_order(self) -> None:
        if not hasattr(self, "tier"):
            return
        assert self.tier.lru_keys() == self.index.lru()
        stored = self.tier.stored_keys()  # the readable ones, in the same order
        assert stored == [k for k in self.index.lru() if k in set(stored)]
        assert self.tier.stats().evicted == self.index.evicted

    def teardown(self) -> None:
        if hasattr(self, "tier"):  # the rows are unmapped by the garbage collector
            self.io.disarm()
            assert self.tier.close()  # every I/O thread has ended
            shutil.rmtree(self.dir, ignore_errors=True)


ReplayMatchesFileTier.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                                   deadline=None)
test_replay_matches_file_tier = ReplayMatchesFileTier.TestCase
