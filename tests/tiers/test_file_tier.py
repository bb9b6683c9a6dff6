"""The file tier on real files: /tmp (ext4 here: O_DIRECT) and /dev/shm (tmpfs).

Mounts that this host cannot offer as they are (a filesystem refusing O_DIRECT, a full disk, a
read-only one) are in tests/tiers/test_file_tier_mounts.py.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator

import pytest

from offload.errors import OffloadError
from offload.tiers import FileTier, chunk_file_bytes, geometry_fingerprint, host_view
from offload.tiers.file_format import file_name, key_bytes

KiB, MiB = 1 << 10, 1 << 20
ROW = 256 * KiB
FILE = ROW + 4096
GEOMETRY = {"slot_bytes": ROW, "blocks_per_chunk": 16, "layout": "private", "rank": 0}
REPORT_KEYS = {"dir", "o_direct", "written_bytes", "read_bytes", "hits", "misses", "corrupt",
               "evicted", "write_GBps", "read_GBps"}


@pytest.fixture(params=["/tmp", "/dev/shm"])
def tier_dir(request: pytest.FixtureRequest) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="pytest-fstier-", dir=request.param)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def warnings_seen() -> Iterator[list[str]]:
    """Warnings of the file tier's logger, whatever the propagation setup of this process."""
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("offload.tiers.file_tier")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


def _row(fill: bytes | int = 0) -> mmap.mmap:
    """A page-aligned host row (anonymous mappings are page-aligned, like region rows)."""
    row = mmap.mmap(-1, ROW)
    row[:] = os.urandom(ROW) if fill == b"random" else bytes([int(fill)]) * ROW
    return row


def _tier(directory: str, files: int = 8, geometry: dict[str, object] | None = None,
          **kw: int) -> FileTier:
    return FileTier(directory, files * FILE, geometry or GEOMETRY, ROW, **kw)


def _files(tier: FileTier) -> list[str]:
    return sorted(os.listdir(tier.directory))


def test_mode_matches_what_the_filesystem_does(tier_dir: str) -> None:
    """O_DIRECT is used exactly when the filesystem accepts it; on ext4 the alignment comes
    from statx(STATX_DIOALIGN) and is at most a page."""
    probe = os.path.join(tier_dir, "raw")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600))
        accepts = True
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        accepts = False
    os.unlink(probe)
    with _tier(tier_dir) as tier:
        assert tier.mode.o_direct is accepts
        assert tier.to_json()["o_direct"] is accepts
        if tier_dir.startswith("/tmp"):  # ext4 on this host reports its DIO alignment
            assert tier.mode.source == "statx"
            assert 1 < tier.mode.mem_align <= 4096 and 1 < tier.mode.offset_align <= 4096


def test_put_get_round_trip_and_report(tier_dir: str, warnings_seen: list[str]) -> None:
    with _tier(tier_dir) as tier:
        rows = [_row(b"random") for _ in range(5)]
        spills = [tier.put(("seq", i), row) for i, row in enumerate(rows)]
        assert all(s.stored.result(30) for s in spills)
        assert all(s.released.done() for s in spills)
        out = _row()
        for i, row in enumerate(rows):
            assert tier.get(("seq", i), out).result(30) is True
            assert out[:] == row[:]
        assert tier.get(("seq", 99), out).result(30) is False
        report = tier.to_json()
        assert set(report) >= REPORT_KEYS
        assert report["dir"] == tier.directory
        assert (report["written_bytes"], report["read_bytes"]) == (5 * FILE, 5 * FILE)
        assert (report["hits"], report["misses"], report["corrupt"]) == (5, 1, 0)
        assert report["files"] == 5 and report["write_GBps"] > 0 and report["read_GBps"] > 0
        assert report["file_bytes"] == chunk_file_bytes(ROW, 4096) == FILE
        assert all(os.path.getsize(os.path.join(tier.directory, n)) == FILE
                   for n in _files(tier))
        json.dumps(report)
        assert _files(tier) == sorted(file_name(key_bytes(("seq", i))) for i in range(5))
    assert warnings_seen == []


def test_get_right_after_put_waits_for_the_spill(tier_dir: str) -> None:
    """A read of a key whose spill is still running is served after it, not missed."""
    with _tier(tier_dir) as tier:
        row, out = _row(b"random"), _row()
        spill = tier.put("k", row)
        assert tier.contains("k")
        assert tier.get("k", out).result(30) and out[:] == row[:]
        assert spill.stored.done()


def test_a_stored_key_is_not_written_again(tier_dir: str) -> None:
    with _tier(tier_dir) as tier:
        row = _row(3)
        first = tier.put("k", row)
        again = tier.put("k", row)
        assert again.released.done()  # nothing to read: the row is free at once
        assert first.stored.result(30) and again.stored.result(30)
        assert tier.stats().written_bytes == FILE


def test_host_view_rows_and_misaligned_rows(tier_dir: str) -> None:
    """Rows may be given as raw host addresses; O_DIRECT refuses a misaligned or read-only
    row with a clear error instead of an EINVAL from the kernel."""
    with _tier(tier_dir) as tier:
        backing = _row(9)
        address = ctypes.addressof(ctypes.c_char.from_buffer(backing))
        assert tier.put("h", host_view(address, ROW)).stored.result(30)
        with pytest.raises(ValueError, match="row of 100 bytes"):
            tier.put("x", bytearray(100))
        if tier.mode.o_direct:
            big = mmap.mmap(-1, ROW + 4096)
            with pytest.raises(ValueError, match="not aligned"):
                tier.put("x", memoryview(big)[1:ROW + 1])
            with pytest.raises(ValueError, match="writable"):
                tier.put("x", bytes(ROW))
        with pytest.raises(ValueError, match="writable"):
            tier.get("h", bytes(ROW))


def test_restart_with_the_same_geometry_finds_the_files(tier_dir: str) -> None:
    rows = {i: _row(b"random") for i in range(4)}
    with _tier(tier_dir, files=4) as tier:
        for i, row in rows.items():
            assert tier.put(i, row).stored.result(30)
        assert tier.get(0, _row()).result(30)  # touched: in memory only, not persisted
    with _tier(tier_dir, files=4) as again:
        assert again.stored_names() == {file_name(key_bytes(i)) for i in rows}
        out = _row()
        for i, row in rows.items():
            assert again.get(i, out).result(30) and out[:] == row[:]
        assert again.stats().corrupt == 0
    with _tier(tier_dir, files=4) as third:
        # the LRU order after a restart is the write order: key 0 goes first
        assert third.put(10, _row(1)).stored.result(30)
        assert not third.contains(0) and third.contains(1) and third.stats().evicted == 1


def test_restart_with_a_smaller_budget_keeps_the_newest(tier_dir: str) -> None:
    with _tier(tier_dir, files=4) as tier:
        for i in range(4):
            tier.put(i, _row(i)).stored.result(30)
    with _tier(tier_dir, files=2) as smaller:
        assert [smaller.contains(i) for i in range(4)] == [False, False, True, True]
        assert smaller.stats().evicted == 2 and len(_files(smaller)) == 2


def test_another_geometry_never_reads_the_files(tier_dir: str) -> None:
    with _tier(tier_dir) as tier:
        tier.put("k", _row(5)).stored.result(30)
        name = file_name(key_bytes("k"))
        source = os.path.join(tier.directory, name)
    other = {**GEOMETRY, "rank": 1}
    with _tier(tier_dir, geometry=other) as foreign:
        assert foreign.directory != tier.directory
        assert not foreign.contains("k") and foreign.get("k", _row()).result(30) is False
        planted = os.path.join(foreign.directory, name)
    # a foreign file copied (or colliding) into this geometry's directory is found by its
    # header at open, counted and removed, never read
    shutil.copyfile(source, planted)
    with _tier(tier_dir, geometry=other) as foreign:
        assert not foreign.contains("k")
        assert foreign.stats().corrupt == 1 and not os.path.exists(planted)
    assert geometry_fingerprint(GEOMETRY) != geometry_fingerprint(other)


def test_leftovers_of_an_interrupted_write_are_ignored_and_removed(tier_dir: str) -> None:
    with _tier(tier_dir) as tier:
        tier.put("k", _row(1)).stored.result(30)
        directory = tier.directory
    name = file_name(key_bytes("lost"))
    leftovers = [f".{name}.0123456789ab.tmp", ".dio-probe-4242"]
    for leftover in leftovers:
        with open(os.path.join(directory, leftover), "wb") as f:
            f.write(b"half a chunk")
    with _tier(tier_dir) as tier:
        assert _files(tier) == [file_name(key_bytes("k"))]
        assert not tier.contains("lost") and tier.stats().corrupt == 0


_CRASH_CHILD = textwrap.dedent("""
    import mmap, signal, sys
    from offload.tiers import FileTier
    signal.alarm(120)  # never outlive the test, whatever happens to it
    row_bytes, named = int(sys.argv[2]), sys.argv[3] == "named"
    tier = FileTier(sys.argv[1], 8 * (row_bytes + 4096), {"crash": 1}, row_bytes, io_threads=2)
    tier._tmpfile = tier._tmpfile and not named  # the fallback for filesystems without it
    print(tier.directory, flush=True)
    rows = [mmap.mmap(-1, row_bytes) for _ in range(4)]
    for i in range(0, 4000, 4):  # bounded: at most 8 files on disk, a bounded run
        spills = []
        for j, row in enumerate(rows):
            row[:] = bytes([(i + j) % 251]) * row_bytes
            spills.append(tier.put(("crash", i + j), row))
        for spill in spills:
            spill.released.result()
""")


def _writing(pid: int, subdir: str) -> bool:
    """The child holds a file of ``subdir`` open that has no final name yet (an unnamed
    O_TMPFILE shows as ``#inode (deleted)``, the fallback as ``.*.tmp``)."""
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    return any(link.startswith(subdir + "/") and ("#" in link or link.endswith(".tmp"))
               for link in links)


@pytest.mark.parametrize("create", ["tmpfile", "named"])
def test_a_crash_mid_write_leaves_no_visible_partial_file(create: str) -> None:
    """SIGKILL a writer while a chunk file is being written.  Unnamed files (O_TMPFILE)
    leave nothing at all; the named fallback leaves a temp file that the next open removes.
    Either way every visible file verifies with its own key's bytes."""
    directory = tempfile.mkdtemp(prefix="pytest-fstier-crash-", dir="/tmp")
    row_bytes = 8 * MiB
    child = subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, directory, str(row_bytes),
                              create], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        subdir = child.stdout.readline().strip()
        deadline = time.monotonic() + 60
        while True:  # freeze the writer at a moment a file is half written, then kill it
            assert child.poll() is None and time.monotonic() < deadline
            if _writing(child.pid, subdir):
                os.kill(child.pid, signal.SIGSTOP)
                if _writing(child.pid, subdir):
                    break
                os.kill(child.pid, signal.SIGCONT)
            time.sleep(0.005)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        before = os.listdir(subdir)
        temps = [n for n in before if n.endswith(".tmp")]
        assert bool(temps) == (create == "named")  # (an unnamed file vanishes with its writer)
        with FileTier(directory, 8 * (row_bytes + 4096), {"crash": 1}, row_bytes) as tier:
            assert not any(n.endswith(".tmp") for n in os.listdir(subdir))
            names = tier.stored_names()
            out = mmap.mmap(-1, row_bytes)
            keys = [i for i in range(4000) if file_name(key_bytes(("crash", i))) in names]
            assert len(keys) == len(names) == len([n for n in before if n.endswith(".kv")])
            for i in keys:
                assert tier.get(("crash", i), out).result(30)
                assert out[:4096] == bytes([i % 251]) * 4096 and out[-1] == i % 251
            assert tier.stats().corrupt == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        shutil.rmtree(directory, ignore_errors=True)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("where", ["payload", "last payload byte", "header key", "header pad"])
def test_one_flipped_byte_is_a_counted_miss_and_the_file_goes(tier_dir: str, where: str,
                                                              warnings_seen: list[str]) -> None:
    with _tier(tier_dir) as tier:
        tier.put("k", _row(b"random")).stored.result(30)
        tier.put("other", _row(7)).stored.result(30)
        path = os.path.join(tier.directory, file_name(key_bytes("k")))
        offset = {"payload": 4096 + 1000, "last payload byte": FILE - 1, "header key": 80,
                  "header pad": 4000}[where]
        _flip(path, offset)
        out = _row()
        assert tier.get("k", out).result(30) is False
        stats = tier.stats()
        assert (stats.corrupt, stats.misses, stats.hits) == (1, 1, 0)
        assert not os.path.exists(path) and not tier.contains("k")
        assert tier.get("k", out).result(30) is False  # now simply absent
        assert tier.get("other", out).result(30) and out[:] == bytes([7]) * ROW
        assert tier.stats().corrupt == 1
        assert len(warnings_seen) == 1 and "damaged" in warnings_seen[0]
        # the key can be stored again
        assert tier.put("k", _row(2)).stored.result(30) and tier.get("k", out).result(30)


@pytest.mark.parametrize("damage", ["truncate", "extend", "header"])
def test_damage_found_at_open_is_counted_and_removed(tier_dir: str, damage: str) -> None:
    with _tier(tier_dir) as tier:
        tier.put("k", _row(1)).stored.result(30)
        tier.put("ok", _row(2)).stored.result(30)
        path = os.path.join(tier.directory, file_name(key_bytes("k")))
    if damage == "truncate":
        os.truncate(path, FILE - 4096)
    elif damage == "extend":
        os.truncate(path, FILE + 4096)
    else:
        _flip(path, 20)
    with _tier(tier_dir) as tier:
        assert not tier.contains("k") and tier.contains("ok")
        assert tier.stats().corrupt == 1 and not os.path.exists(path)


def test_a_file_damaged_after_open_is_caught_on_read(tier_dir: str) -> None:
    with _tier(tier_dir) as tier:
        tier.put("k", _row(1)).stored.result(30)
        path = os.path.join(tier.directory, file_name(key_bytes("k")))
        os.truncate(path, FILE - 4096)
        assert tier.get("k", _row()).result(30) is False
        assert not os.path.exists(path) and tier.stats().corrupt == 1
        tier.put("j", _row(1)).stored.result(30)
        # a file removed behind the tier's back is a counted miss as well
        os.unlink(os.path.join(tier.directory, file_name(key_bytes("j"))))
        assert tier.get("j", _row()).result(30) is False
        assert tier.stats().corrupt == 2 and not tier.contains("j")


def test_lru_eviction_within_the_budget(tier_dir: str) -> None:
    with _tier(tier_dir, files=3) as tier:
        for key in "abc":
            tier.put(key, _row(ord(key))).stored.result(30)
        assert tier.get("a", _row()).result(30)  # a becomes the most recently used
        tier.put("d", _row(4)).stored.result(30)
        assert [tier.contains(k) for k in "abcd"] == [True, False, True, True]
        tier.flush()
        assert len(_files(tier)) == 3 and tier.stats().evicted == 1
        assert tier.get("b", _row()).result(30) is False
        assert tier.stats().capacity_files == 3


def test_eviction_and_rewrite_of_keys_still_in_flight(tier_dir: str) -> None:
    """With room for one file, every put evicts the previous key while it may still be
    written; the I/O of one key runs in call order, so the last write of a key wins and no
    eviction removes a newer file."""
    rows = {k: _row(b"random") for k in "ab"}
    with _tier(tier_dir, files=1, io_threads=4) as tier:
        for _ in range(20):
            for key in "ab":
                tier.put(key, rows[key])
        tier.flush()
        assert [tier.contains(k) for k in "ab"] == [False, True]
        out = _row()
        assert tier.get("b", out).result(30) and out[:] == rows["b"][:]
        assert _files(tier) == [file_name(key_bytes("b"))]
        assert tier.stats().evicted == 39


def test_discard_and_keep_only(tier_dir: str) -> None:
    with _tier(tier_dir) as tier:
        for i in range(4):
            tier.put(i, _row(i))
        tier.discard(0).result(30)
        assert not tier.contains(0)
        names = {file_name(key_bytes(i)) for i in (1, 3)}
        tier.keep_only(names).result(30)
        assert tier.stored_names() == names
        tier.flush()  # the kept keys' spills may still be running
        assert set(_files(tier)) == names
        assert tier.stats().evicted == 0
        tier.discard("never stored").result(30)


def test_the_directory_is_locked_against_a_second_process(tier_dir: str) -> None:
    with _tier(tier_dir) as tier, pytest.raises(OffloadError, match="in use by another"):
        _tier(tier_dir)
    assert tier.to_json()["files"] == 0
    _tier(tier_dir).close()  # released on close


def test_a_root_where_others_may_rename_our_folders_is_refused(tier_dir: str) -> None:
    """In a root others can write without the sticky bit, another user could rename rank 1's
    folder to rank 0's fingerprint, and rank 0 would delete rank 1's files as damaged: such a
    root is refused, a sticky one (as /tmp) is used, and rank 1's files stay."""
    other = {**GEOMETRY, "rank": 1}
    os.chmod(tier_dir, 0o777)
    with pytest.raises(OffloadError) as info:
        _tier(tier_dir)
    assert str(info.value).startswith(f"file tier directory {tier_dir} is writable by other "
                                      "users and not sticky (mode 777)")
    os.chmod(tier_dir, 0o1777)
    with _tier(tier_dir, geometry=other) as tier:
        tier.put(("k", 0), memoryview(mmap.mmap(-1, ROW))).stored.result()
        theirs = tier.directory
    _tier(tier_dir).close()
    assert len(os.listdir(theirs)) == 1


def test_bad_settings_are_one_line_errors(tier_dir: str) -> None:
    missing = os.path.join(tier_dir, "missing")
    with pytest.raises(OffloadError, match=f"{missing} does not exist; create it"):
        _tier(missing)
    a_file = os.path.join(tier_dir, "file")
    open(a_file, "w").close()
    with pytest.raises(OffloadError, match=f"{a_file} is not a directory"):
        _tier(a_file)
    with pytest.raises(OffloadError, match=f"smaller than one chunk file of {FILE} B"):
        FileTier(tier_dir, FILE - 1, GEOMETRY, ROW)
    with pytest.raises(OffloadError, match="not a positive multiple of the 4096-byte page"):
        FileTier(tier_dir, 1 << 30, GEOMETRY, ROW + 1)
    with pytest.raises(OffloadError, match="io_threads = 0"):
        _tier(tier_dir, io_threads=0)
    planted = os.path.join(tier_dir, "planted")
    os.mkdir(planted)
    probe = FileTier(planted, 8 * FILE, GEOMETRY, ROW)
    probe.close()
    os.rmdir(probe.directory)
    os.symlink("/", probe.directory)  # a symlink where the fingerprint subdirectory goes
    with pytest.raises(OffloadError, match="cannot be opened") as raised:
        FileTier(planted, 8 * FILE, GEOMETRY, ROW)
    assert "\n" not in str(raised.value)


def test_a_closed_tier_refuses_work(tier_dir: str) -> None:
    tier = _tier(tier_dir)
    tier.put("k", _row(1))
    tier.close()
    tier.close()
    assert tier.stats().written_bytes == FILE  # close waited for the spill
    with pytest.raises(RuntimeError, match="closed"):
        tier.put("j", _row(1))


def test_parallel_callers_get_their_own_bytes(tier_dir: str) -> None:
    """Several threads putting and reading back distinct keys through 4 I/O threads."""
    from concurrent.futures import ThreadPoolExecutor

    with _tier(tier_dir, files=64, io_threads=4) as tier:
        def worker(t: int) -> bool:
            out = _row()
            for i in range(6):
                row = _row(b"random")
                tier.put((t, i), row).released.result(30)
                if not tier.get((t, i), out).result(30) or out[:] != row[:]:
                    return False
            return True

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(worker, range(4)))
        assert tier.stats().hits == 24


def test_the_documented_example_runs(tier_dir: str) -> None:
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "FILE_TIER.md")) as f:
        readme = f.read()
    example = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                   if "FileTier(" in b)
    assert example.count("tempfile.mkdtemp()") == 1
    exec(example.replace("tempfile.mkdtemp()", repr(tier_dir)), {})
    assert len(os.listdir(tier_dir)) == 1  # its fingerprint subdirectory
