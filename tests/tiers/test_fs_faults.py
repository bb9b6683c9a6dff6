# SPDX-License-Identifier: Apache-2.0
"""The file tier against a hostile or failing file system, on real files.

Trust: a fingerprint folder another user made (or may write) is refused with one line; the
O_DIRECT probe never follows or truncates a planted link; a chunk file that is a symlink or
cannot be opened is a counted miss, never a crash nor another file's bytes.

Faults, injected through the tier's I/O seam (`FileIO`, the only thing replaced): EIO and
ENOSPC on a spill's write, EIO / EACCES / EMFILE on a promotion's read, and a stalled file
system.  Each case checks that nothing acknowledged is lost (a key reported stored reads back
byte-exact or is a miss), no wrong byte is returned, every wait ends within the deadline, the
row a late read may still fill is kept out of use until that read returns, and nothing is left
behind (no temporary files, no I/O threads once the stall ends).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from offload.errors import OffloadError
from offload.manager import ChunkManager
from offload.tiers import FileTier, direct_io
from offload.tiers.file_format import SUFFIX, file_name, key_bytes
from offload.tiers.fs_io import FileIO
from offload.tiers.rank_files import RankFiles

KiB = 1 << 10
ROW = 64 * KiB
FILE = ROW + 4096
GEOMETRY = {"slot_bytes": ROW, "test": "faults"}
NOBODY = 65534
TIMEOUT = 0.5  # the I/O deadline of these tests (seconds)


@pytest.fixture
def fs_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="pytest-fsfaults-", dir="/tmp")  # ext4 here: O_DIRECT
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class FaultyIO(FileIO):
    """The seam with faults: ``fail[op]`` is the errno that ``op`` (``open``, ``pwritev``,
    ``preadv``...) raises; ``stall[op]`` an Event that ``op`` waits for first.  ``only`` limits
    the faults to files whose name (or, for descriptors, whose path) contains it."""

    def __init__(self, only: str = "") -> None:
        self.fail: dict[str, int] = {}
        self.stall: dict[str, threading.Event] = {}
        self.only = only
        self.stalled = threading.Event()  # set once some call is waiting in a stall

    def _fault(self, op: str, target: str | int) -> None:
        if self.only:
            name = target if isinstance(target, str) else _fd_path(target)
            if self.only not in name:
                return
        gate = self.stall.get(op)
        if gate is not None:
            self.stalled.set()
            gate.wait(60)  # (a bound, so a broken test cannot hang forever)
        code = self.fail.get(op)
        if code is not None:
            raise OSError(code, os.strerror(code))

    def open(self, name: str, flags: int, mode: int, dir_fd: int) -> int:
        self._fault("open", name)
        return super().open(name, flags, mode, dir_fd)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self._fault("pwritev", fd)
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self._fault("preadv", fd)
        return super().preadv(fd, buffers, offset)


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _row(fill: int) -> mmap.mmap:
    row = mmap.mmap(-1, ROW)
    row[:] = bytes([fill]) * ROW
    return row


def _tier(directory: str, io: FileIO | None = None, files: int = 8) -> FileTier:
    return FileTier(directory, files * FILE, GEOMETRY, ROW, io_threads=2,
                    io_timeout_s=TIMEOUT, io=io)


def _leftovers(tier: FileTier) -> list[str]:
    """Files in the tier's folder that are not chunk files (temporary or probe files)."""
    return [n for n in os.listdir(tier.directory) if not n.endswith(SUFFIX)]


def _io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("offload-fs")]


def _wait_threads_gone(limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while _io_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _io_threads()


# ---------------------------------------------------------------------- trust


@pytest.mark.parametrize("how", ["owner", "mode"])
def test_a_fingerprint_folder_someone_else_controls_is_refused(fs_dir: str, how: str) -> None:
    """An attacker predicts the fingerprint and plants ``fp-<fingerprint>`` with a chunk file
    of the victim's key holding the attacker's bytes.  The victim must not start on it (before
    the fix its `get` returned the attacker's bytes as a verified hit)."""
    with _tier(fs_dir) as attacker:
        assert attacker.put("victim-key", _row(0x66)).stored.result(30)
        folder = attacker.directory
    if how == "owner":
        for path in [folder, *(os.path.join(folder, n) for n in os.listdir(folder))]:
            os.chown(path, NOBODY, NOBODY)
        needle = f"belongs to uid {NOBODY}, not to this user"
    else:
        os.chmod(folder, 0o777)
        needle = "is writable by others (mode 777)"
    with pytest.raises(OffloadError) as error:
        _tier(fs_dir)
    message = str(error.value)
    assert "\n" not in message and folder in message and needle in message
    assert "remove it" in message


def test_the_folder_we_create_is_0700_and_ours(fs_dir: str) -> None:
    with _tier(fs_dir) as tier:
        st = os.stat(tier.directory)
        assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o700)


def test_the_probe_never_follows_nor_truncates_a_planted_link(
        fs_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A symlink waiting at the probe's name: the probe refuses it (``O_EXCL``) instead of
    truncating its target, and a random name makes planting in advance pointless."""
    victim = os.path.join(fs_dir, "victims-own-file")
    with open(victim, "wb") as f:
        f.write(b"precious" * 100)
    monkeypatch.setattr(direct_io.secrets, "token_hex", lambda n: "f" * 2 * n)
    planted = f"{direct_io.PROBE_PREFIX}{os.getpid()}-{'f' * 16}"
    os.symlink(victim, os.path.join(fs_dir, planted))
    fd = os.open(fs_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileExistsError):
            direct_io.detect_io_mode(fd, 4096)
    finally:
        os.close(fd)
    assert os.path.getsize(victim) == 800
    monkeypatch.undo()
    names = set()
    for _ in range(2):
        fd = os.open(fs_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            direct_io.detect_io_mode(fd, 4096)
        finally:
            os.close(fd)
        names |= set(os.listdir(fs_dir))
    assert names == {"victims-own-file", planted}  # the probes were removed


def test_a_chunk_file_that_is_a_symlink_is_not_followed(fs_dir: str) -> None:
    """A chunk name that is a symlink to a valid chunk file elsewhere: opened ``O_NOFOLLOW``,
    it is a counted read error and a miss, not the other file's bytes."""
    with _tier(fs_dir) as tier:
        assert tier.put("k", _row(7)).stored.result(30)
        folder = tier.directory
    name = file_name(key_bytes("k"))
    elsewhere = os.path.join(fs_dir, "elsewhere.kv")
    os.rename(os.path.join(folder, name), elsewhere)
    os.symlink(elsewhere, os.path.join(folder, name))
    with _tier(fs_dir) as tier:
        assert not tier.contains("k")
        assert tier.get("k", _row(0)).result(30) is False
        assert tier.stats().read_errors == 1 and tier.stats().corrupt == 0


def test_a_file_that_cannot_be_opened_at_start_is_a_counted_miss(fs_dir: str) -> None:
    """EACCES on a chunk file while the index is rebuilt: start-up goes on (before the fix:
    a raw PermissionError), the key is a miss, the error is counted."""
    with _tier(fs_dir) as tier:
        for key in ("a", "b"):
            assert tier.put(key, _row(1)).stored.result(30)
    io = FaultyIO(only=file_name(key_bytes("a")))
    io.fail["open"] = errno.EACCES
    with _tier(fs_dir, io) as tier:
        assert (tier.contains("a"), tier.contains("b")) == (False, True)
        assert tier.stats().read_errors == 1


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_failing_spill_is_a_miss_and_leaves_nothing(fs_dir: str, code: int) -> None:
    io = FaultyIO(only="")
    with _tier(fs_dir, io) as tier:
        assert tier.put("good", _row(1)).stored.result(30)
        io.fail["pwritev"] = code
        spill = tier.put("bad", _row(2))
        assert spill.stored.result(30) is False and spill.released.done()
        io.fail.clear()
        out = _row(0)
        assert tier.get("bad", out).result(30) is False
        assert tier.get("good", out).result(30) and out[:] == bytes([1]) * ROW
        stats = tier.stats()
        assert (stats.write_errors, stats.hits, stats.files) == (1, 1, 1)
        assert _leftovers(tier) == []


@pytest.mark.parametrize("op,code", [("preadv", errno.EIO), ("open", errno.EACCES),
                                     ("open", errno.EMFILE)])
def test_a_failing_read_is_a_miss_and_the_other_reads_finish(fs_dir: str, op: str,
                                                             code: int) -> None:
    """One read of a promotion fails: it is a miss, the other reads complete into their
    rows, and `promote` returns (before the fix it raised while other reads still ran)."""
    io = FaultyIO(only=file_name(key_bytes("bad")))
    region = mmap.mmap(-1, 4 * ROW)
    files = RankFiles(_tier(fs_dir, io), ctypes.addressof(ctypes.c_char.from_buffer(region)),
                      ROW, 0, ROW)
    try:
        for chunk, key in enumerate(["bad", "good"]):
            region[chunk * ROW:(chunk + 1) * ROW] = bytes([chunk + 1]) * ROW
            files.spill([(key, chunk)])
        assert files.tier is not None
        files.tier.flush()
        io.fail[op] = code
        region[:] = bytes(4 * ROW)
        assert files.promote([("bad", 2), ("good", 3)], 1) == [False, True]
        assert region[3 * ROW:] == bytes([2]) * ROW and files.busy_rows() == []
        assert files.tier.stats().read_errors == 1 and files.tier.stats().corrupt == 0
    finally:
        files.close()


# ---------------------------------------------------------------------- a stalled disk


def test_a_stalled_read_is_a_miss_at_the_deadline_and_its_row_stays_busy(fs_dir: str
                                                                       ) -> None:
    io = FaultyIO(only=file_name(key_bytes("slow")))
    region = mmap.mmap(-1, 4 * ROW)
    files = RankFiles(_tier(fs_dir, io), ctypes.addressof(ctypes.c_char.from_buffer(region)),
                      ROW, 0, ROW)
    gate = threading.Event()
    try:
        for chunk, key in enumerate(["slow", "fast"]):
            region[chunk * ROW:(chunk + 1) * ROW] = bytes([chunk + 1]) * ROW
            files.spill([(key, chunk)])
        assert files.tier is not None
        files.tier.flush()
        io.stall["preadv"] = gate
        began = time.monotonic()
        assert files.promote([("slow", 2), ("fast", 3)], 1) == [False, True]
        assert time.monotonic() - began < TIMEOUT + 1.0
        assert files.busy_rows() == [2] and files.tier.stats().timeouts == 1
        with pytest.raises(OSError, match="still being filled"):
            files.wait_rows([2])  # nothing may be copied into the row yet
        began = time.monotonic()
        assert files.tier.close(timeout_s=TIMEOUT) is False  # bounded, the read stays
        assert time.monotonic() - began < TIMEOUT + 1.0
    finally:
        gate.set()
    deadline = time.monotonic() + 10
    while files.busy_rows() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert files.busy_rows() == []
    files.close()
    _wait_threads_gone()
    with _tier(fs_dir) as again:  # the folder's lock went with the last stalled operation
        assert again.contains("fast")


def test_a_stalled_spill_is_abandoned_and_never_published(fs_dir: str) -> None:
    """A spill stuck in its write: past the deadline the row is handed back (the store can
    overwrite it), the key is a miss, and when the write returns its file (now holding other
    bytes) is never made visible."""
    io = FaultyIO()
    gate = threading.Event()
    io.stall["pwritev"] = gate
    tier = _tier(fs_dir, io)
    region = mmap.mmap(-1, 2 * ROW)
    files = RankFiles(tier, ctypes.addressof(ctypes.c_char.from_buffer(region)), ROW, 0, ROW)
    try:
        region[:ROW] = bytes([9]) * ROW
        files.spill([("k", 0)])
        assert io.stalled.wait(10)
        began = time.monotonic()
        files.wait_rows([0])
        assert TIMEOUT - 0.1 < time.monotonic() - began < TIMEOUT + 1.0
        region[:ROW] = bytes([0xEE]) * ROW  # the next owner of the row writes into it
        assert not tier.contains("k") and tier.stats().timeouts == 1
    finally:
        gate.set()
    tier.flush()
    assert os.listdir(tier.directory) == []  # neither the file nor a temporary one
    assert tier.get("k", memoryview(region)[ROW:]).result(30) is False
    assert tier.stats().corrupt == 0  # (the checksum is the second line of defence)
    files.close()
    with _tier(fs_dir) as again:
        assert again.stored_names() == frozenset()
    _wait_threads_gone()


def test_a_stalled_disk_delays_neither_opening_nor_the_report_past_the_deadline(fs_dir: str
                                                                               ) -> None:
    """Opening reads every file's header, and the report waits for the spills in flight:
    with the disk stalled, each gives up after one I/O deadline without progress.  The file
    whose header never came is a miss (the other ranks drop its key too), removed once the
    disk answers, so it does not sit outside the budget."""
    with _tier(fs_dir) as first:
        first.put("k", memoryview(_row(3))).stored.result(30)
    io = FaultyIO()
    gate = threading.Event()
    io.stall["preadv"] = gate
    watchdog = threading.Timer(20, gate.set)  # a regression fails the test instead of hanging
    watchdog.start()
    try:
        began = time.monotonic()
        tier = _tier(fs_dir, io)
        assert time.monotonic() - began < TIMEOUT + 1.0
        assert tier.stored_names() == frozenset() and tier.stats().timeouts == 1
        io.stall = {"pwritev": gate}
        tier.put("j", memoryview(_row(4)))
        assert io.stalled.wait(10)
        began = time.monotonic()
        assert tier.flush() is False
        assert TIMEOUT - 0.1 < time.monotonic() - began < TIMEOUT + 1.0
    finally:
        gate.set()
        watchdog.cancel()
    assert tier.flush() is True
    assert tier.stored_names() == frozenset({file_name(key_bytes("j"))})
    tier.close()
    assert os.listdir(tier.directory) == [file_name(key_bytes("j"))]
    _wait_threads_gone()


def test_the_manager_keeps_busy_rows_quarantined_until_no_rank_reports_them() -> None:
    """A failed promotion whose row some rank's late read may still fill: the chunk stays out
    of use (counted quarantined) until a later promotion's report no longer lists it."""
    m = ChunkManager(2, disk_capacity=4)
    for key in ("a", "b", "c", "d"):  # a and b end up on disk only
        job = m.prepare_store([key])
        m.complete_store(job.job_id, ok=True)
    first = m.prepare_promote(["a"])
    chunk = first.chunks[0][1]
    m.complete_promote(first.job_id, failed=["a"], busy=[chunk])
    stats = m.stats()
    assert stats.quarantined == 1 and stats.free == 0
    assert stats.free + stats.storing + stats.readable + stats.quarantined == 2
    again = m.prepare_promote(["b"])
    assert chunk not in [c for _, c in again.chunks]  # never handed out while busy
    m.complete_promote(again.job_id, failed=[], busy=[])  # every read has returned
    assert m.stats().quarantined == 0 and m.stats().free == 1


_STALLED_EXIT_CHILD = """
import mmap, signal, sys, threading
from offload.tiers import FileTier
from offload.tiers.fs_io import FileIO
signal.alarm(60)  # never outlive the test
class Stalled(FileIO):
    def preadv(self, fd, buffers, offset):
        threading.Event().wait()  # a file system that never answers
tier = FileTier(sys.argv[1], 4 * 69632, {"t": "exit"}, 65536, io_timeout_s=0.5, io=Stalled())
row = mmap.mmap(-1, 65536)
assert tier.put("k", row).stored.result(30)
read = tier.get("k", row)
print(tier.close(), flush=True)
"""


def test_a_process_with_a_stalled_read_still_exits(fs_dir: str) -> None:
    """The I/O threads never hold the process: close gives up at the deadline and the
    interpreter exits although a read never returns (the threads are daemons)."""
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _STALLED_EXIT_CHILD, fs_dir],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
    assert time.monotonic() - began < 20
