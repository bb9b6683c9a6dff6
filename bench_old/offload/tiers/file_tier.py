"""A node-local file tier behind host memory: one file per chunk key, O_DIRECT from the host row.

What it guarantees (DESIGN.md section 6, "File tier"):

* **Never wrong bytes.**  A file becomes visible only by ``rename`` after its bytes are on disk
  (written under a temporary name, ``fdatasync``, rename, ``fsync`` of the directory).  Every
  file carries a header (format version, geometry fingerprint, key, payload length) and two
  crc32c checksums (payload and header); a read verifies all of them, so a damaged, short,
  truncated, renamed or foreign file is a *miss* (counted in ``corrupt``, the file removed).
* **Geometry isolation.**  Files live in a subdirectory named by the geometry fingerprint and
  the header repeats the whole fingerprint: a restart with the same geometry finds its files
  (the index is rebuilt from the headers), any other geometry never reads them.
* **Off the copy path.**  Every read and write runs on a bounded pool of I/O threads and the
  API returns futures.  Bytes go straight between the caller's page-aligned host row and the
  disk (``pwritev``/``preadv`` on a memoryview, one syscall for header + row, no bounce
  buffer).  Filesystems without O_DIRECT get buffered I/O and one warning.
* **Its own budget.**  ``budget_bytes // file_bytes`` files at most, evicted least recently
  used first (``evicted``).  A write that fails (disk full, quota, I/O error) leaves that chunk a
  miss, logs one warning per kind of error and the job goes on.
* **Faults are misses.**  A read that fails (EIO, EACCES, EMFILE...) is a miss counted in
  ``read_errors``, never an exception.  Every read and write has a deadline (``io_timeout_s``):
  a caller that waits past it (`wait_read`, `release`) takes the key as a miss and goes on; the
  host row of a read that timed out stays busy until the read returns (the caller's
  quarantine), a spill that timed out is never made visible.  Opening (the header reads),
  `flush` and the restart's `keep_only` wait while operations keep finishing and give up once
  none finished for one deadline.
* **Trust.**  The fingerprint subdirectory is used only when this user owns it and no one else
  can write it (`tier_dir`); every open is ``O_NOFOLLOW`` relative to its descriptor; a file is
  written unnamed (``O_TMPFILE``, or a random ``O_EXCL`` temporary name where the filesystem
  lacks it) and linked into place, so a killed writer leaves no partial file behind.
* **One I/O seam.**  Every system call on the files goes through one `FileIO` object
  (``io=``), which the fault-injection tests replace.

Determinism across ranks: every rank keeps its own tier with its own slot's bytes.  All index
decisions (what is stored, what is evicted, the LRU order) are taken by one class (`Lru`, the
same the chunk manager's `DiskIndex` replays them with) when `put`, `touch`, `get` and
`discard` are *called*, never when I/O completes, so ranks that make the same calls in the same
order with the same capacity evict the same keys, and the manager knows which.

Dead keys.  A spill whose write failed (EIO, ENOSPC...) or passed its deadline, and a file a
read found damaged, missing or unreadable, leave their key *dead*: a miss, never read.  A dead
key keeps its slot and its place in the LRU exactly as a live one -- `touch`, `get` and `put`
make it most recently used, it is evicted in its turn -- until `discard` or the LRU removes it.
Two reasons: a key becomes dead on one rank only, at a moment set by its disk, so a rule that
looked at it (skip it, free its slot) would make this rank's decisions differ from the other
ranks' and from the manager's replay, which sees no I/O; and its slot still covers the bytes
of an abandoned write that may still be running (its unnamed file cannot be removed before the
write returns): the eviction's or discard's unlink is queued behind that write (the I/O of one
key is serialised: a read waits for the key's write, an eviction for the key's read) and
removes whatever it left.  Until it runs, the evicted file still takes disk space while the
new key's file is written: a stalled disk can hold up to one file per I/O thread beyond the
budget (``io_threads``).  No decision waits for a disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Collection, Hashable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from offload.errors import OffloadError
from offload.sizes import format_size
from offload.tiers.direct_io import PROBE_PREFIX, IoMode, detect_io_mode, transfer_all
from offload.tiers.file_format import (
    FORMAT_VERSION,
    SUFFIX,
    Crc,
    FormatError,
    Header,
    chunk_file_bytes,
    file_name,
    geometry_fingerprint,
    key_bytes,
    max_key_bytes,
    pack_header,
    unpack_header,
)
from offload.tiers.fs_io import FileIO
from offload.tiers.keyed_pool import KeyedPool, all_done, done
from offload.tiers.lru import Lru
from offload.tiers.tier_dir import check_directory, open_locked_subdir

log = logging.getLogger(__name__)

_WRITING, _STORED, _DEAD = "writing", "stored", "dead"
_TMP_SUFFIX = ".tmp"
DEFAULT_IO_TIMEOUT_S = 5.0
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)  # O_TMPFILE unsupported here
_buffered_warned: set[str] = set()  # directories whose buffered fallback was already logged
_warn_lock = threading.Lock()


def host_view(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of host memory at ``address`` (e.g. one chunk row of
    a region: ``base + chunk * row_stride``); the caller keeps the memory mapped while in use."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


@dataclass(frozen=True)
class Spill:
    """The two moments of one `FileTier.put`.

    ``released`` completes (with None) once the tier no longer reads the host row, whether the
    write succeeded or not: only then may the row be overwritten.  ``stored`` completes later
    with True when the file is durable and readable, False when the chunk stays a miss.
    """

    released: Future[None]
    stored: Future[bool]
    entry: _Entry | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class FileTierStats:
    """Counters of one tier since it was opened.

    ``hits``/``misses``: `get` calls that returned verified bytes / that did not (a miss includes
    keys never stored and corrupt files).  ``corrupt``: files found damaged, short or foreign
    (at open or on read), each removed.  ``evicted``: files removed by the LRU budget.
    ``write_errors``: writes that failed (disk full...).  ``read_errors``: reads that failed
    with an I/O error (EIO, EACCES, EMFILE...; a miss, the file is kept until discarded).
    ``timeouts``: reads and spills a caller stopped waiting for at the deadline, and header
    reads at open that made no progress for one deadline (each a miss; such a file is removed
    once the disk answers).
    ``write_s``/``read_s``: wall time
    during which at least one write/read was in flight, so the GB/s figures are the tier's
    aggregate throughput, not one thread's.
    """

    directory: str
    mode: IoMode
    budget_bytes: int
    file_bytes: int
    capacity_files: int
    files: int
    written_bytes: int
    read_bytes: int
    hits: int
    misses: int
    corrupt: int
    evicted: int
    write_errors: int
    write_s: float
    read_s: float
    read_errors: int = 0
    timeouts: int = 0

    def to_json(self) -> dict[str, Any]:
        """The ``fs_tier`` object of the main job's report (DESIGN.md section 10)."""
        return {
            "dir": self.directory, "o_direct": self.mode.o_direct, "mode": self.mode.name,
            "dio_align": self.mode.offset_align, "budget_bytes": self.budget_bytes,
            "file_bytes": self.file_bytes, "capacity_files": self.capacity_files,
            "files": self.files, "written_bytes": self.written_bytes,
            "read_bytes": self.read_bytes, "hits": self.hits, "misses": self.misses,
            "corrupt": self.corrupt, "evicted": self.evicted, "write_errors": self.write_errors,
            "read_errors": self.read_errors, "timeouts": self.timeouts,
            "write_s": round(self.write_s, 6), "read_s": round(self.read_s, 6),
            "write_GBps": _gbps(self.written_bytes, self.write_s),
            "read_GBps": _gbps(self.read_bytes, self.read_s),
        }


class _Entry:
    """One key in the index: its write order and the state of its file.  ``row_done``: its
    spill no longer reads the host row; ``abandoned``: the caller stopped waiting for that
    (`FileTier.release`), so the write must never be made visible."""

    __slots__ = ("abandoned", "key", "row_done", "seq", "state", "stored")

    def __init__(self, key: bytes, seq: int, state: str, stored: Future[bool]) -> None:
        self.key = key
        self.seq = seq
        self.state = state
        self.stored = stored
        self.row_done = False
        self.abandoned = False


class _Busy:
    """Wall time during which at least one operation of a kind was in flight."""

    def __init__(self) -> None:
        self.active = 0
        self.since = 0.0
        self.seconds = 0.0
        self.bytes = 0


class FileTier:
    """Chunk rows on local disk, keyed by chunk key, under one geometry fingerprint.

    ``directory`` must exist and be writable; the tier uses its subdirectory
    ``fp-<fingerprint>`` (created, locked against a second process).  ``geometry`` is every
    value the bytes of a row depend on (slot bytes, blocks per chunk, page bytes and offsets
    per tensor, layout, tp/pp, this rank's tp/pp rank or slot, dtype): equal geometry = same
    files.  ``row_bytes`` (a page multiple) is the size of every payload; ``budget_bytes``
    bounds the files (header page + row each).  ``io_threads`` is the number of row transfers
    in flight (the queue depth seen by the disk; the block layer splits each row further).
    ``io_timeout_s`` is the deadline of one read or write (`wait_read`, `release`, `close`);
    ``io`` the I/O seam (`FileIO`, replaced by fault-injection tests).
    Thread-safety: the methods may be called from any thread; the order of calls is the order
    of decisions.
    """

    def __init__(self, directory: str, budget_bytes: int, geometry: Mapping[str, object],
                 row_bytes: int, *, io_threads: int = 8, page_size: int = 4096,
                 io_timeout_s: float = DEFAULT_IO_TIMEOUT_S, io: FileIO | None = None) -> None:
        self._crc = _load_crc32c()
        _check_geometry(budget_bytes, row_bytes, io_threads, page_size)
        if not io_timeout_s > 0:
            raise OffloadError(f"fs_io_timeout_s = {io_timeout_s} must be positive; give the "
                               "seconds one file-tier read or write may take, such as 5")
        self.io_timeout_s = io_timeout_s
        self.io_threads = io_threads
        self._io = io if io is not None else FileIO()
        self._tmpfile = hasattr(os, "O_TMPFILE")  # until the filesystem refuses it
        self.row_bytes = row_bytes
        self.page_size = page_size
        self.file_bytes = chunk_file_bytes(row_bytes, page_size)
        self.capacity = budget_bytes // self.file_bytes
        self.budget_bytes = budget_bytes
        if self.capacity < 1:
            raise OffloadError(
                f"file tier budget fs_bytes = {budget_bytes} B ({format_size(budget_bytes)}) is "
                f"smaller than one chunk file of {self.file_bytes} B; give at least "
                f"{self.file_bytes} B")
        self.fingerprint = geometry_fingerprint(
            {"geometry": dict(geometry), "row_bytes": row_bytes, "header_bytes": page_size,
             "format": FORMAT_VERSION})
        root = check_directory(directory)
        self.directory = os.path.join(root, "fp-" + self.fingerprint.hex()[:16])
        self._dir_fd = open_locked_subdir(root, self.directory)
        try:
            self.mode = detect_io_mode(self._dir_fd, page_size)
        except OSError as exc:
            os.close(self._dir_fd)
            raise OffloadError(f"file tier directory {root} is not writable ({exc.strerror}); "
                               "pass a writable directory") from None
        if not self.mode.o_direct:
            _warn_buffered(root, self.mode.reason)
        self._lock = threading.Lock()
        # the budget's decisions (file names, LRU first) and each name's file state
        self._lru: Lru[str] = Lru(self.capacity)
        self._entries: dict[str, _Entry] = {}
        self._local = threading.local()
        self._pool = KeyedPool(io_threads, "offload-fs")  # I/O of one file in call order
        self._write_busy, self._read_busy = _Busy(), _Busy()
        self._counts = dict.fromkeys(("hits", "misses", "corrupt", "evicted", "write_errors",
                                      "read_errors", "timeouts"), 0)
        self._warned_errors: set[int] = set()
        self._closed = False
        try:
            self._seq = itertools.count(self._rebuild())
        except BaseException:
            self._pool.shutdown()
            os.close(self._dir_fd)
            raise

    # ------------------------------------------------------------------ public API

    def put(self, key: Hashable, row: Any) -> Spill:
        """Spill ``row`` (the chunk's host row: any contiguous buffer of ``row_bytes``,
        page-aligned in O_DIRECT mode) under ``key``.

        Returns at once.  The row must not be written until ``released`` is done (the same
        quarantine as a failed job's chunks); ``stored`` says whether the key is now on disk.
        A key already stored (or being stored) is not written again: it only becomes most
        recently used.  A dead key (failed write, damaged file) is written again in its own
        slot: it becomes most recently used and nothing is evicted, as for any held key.  When
        the budget is full the least recently used keys are evicted.
        """
        view = self._view(row, writable=False)
        key_b = self._key(key)
        name = file_name(key_b)
        done: Future[None] = Future()
        with self._lock:
            self._check_open()
            self._evict(self._lru.put(name))
            entry = self._entries.get(name)
            if entry is not None and entry.state != _DEAD:
                done.set_result(None)
                return Spill(done, entry.stored)
            entry = self._entries[name] = _Entry(key_b, next(self._seq), _WRITING, Future())
            entry.stored = self._pool.submit(
                name, lambda: self._write(name, entry, key_b, view, done))
        return Spill(done, entry.stored, entry)

    def release(self, spill: Spill, timeout_s: float | None = None) -> bool:
        """Wait until ``spill`` no longer reads its host row, at most ``timeout_s`` (default
        `io_timeout_s`).  Past the deadline the spill is abandoned: its key becomes a miss
        (dead, counted in ``timeouts``) and its file is never made visible, however late the
        write ends, so the row may be overwritten at once either way.  Returns True when the
        write released the row in time."""
        try:
            spill.released.result(self.io_timeout_s if timeout_s is None else timeout_s)
            return True
        except FutureTimeout:
            pass
        entry = spill.entry
        assert entry is not None  # a spill without an entry is released at once
        with self._lock:
            if entry.row_done:
                return True
            entry.abandoned = True
            entry.state = _DEAD
            self._counts["timeouts"] += 1
        self._warn_once(errno.ETIMEDOUT, "spilling a chunk took longer than the "
                        f"{self.io_timeout_s:g} s deadline (fs_io_timeout_s); that chunk is a "
                        "miss and the job goes on")
        return False

    def wait_read(self, read: Future[bool], deadline: float) -> bool:
        """The result of a `get`, waiting at most until ``deadline`` (`time.monotonic`); past
        it the key is a miss (counted in ``timeouts``).  The read may still be writing into
        its row: the caller keeps the row out of use until ``read`` is done."""
        try:
            return read.result(max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            with self._lock:
                self._counts["timeouts"] += 1
            self._warn_once(-errno.ETIMEDOUT, "reading a chunk took longer than the "
                            f"{self.io_timeout_s:g} s deadline (fs_io_timeout_s); that chunk "
                            "is a miss and its host row stays out of use until the read ends")
            return False
        except Exception:  # noqa: BLE001 -- a bug in a read is a miss, not a crashed promotion
            log.exception("file tier %s: a read raised", self.directory)
            return False

    def get(self, key: Hashable, row: Any) -> Future[bool]:
        """Read ``key``'s bytes into ``row`` (a writable host row of ``row_bytes``).

        The future is True when the row now holds the verified bytes; False is a miss (never
        stored, evicted, failed write, or a damaged file, which is then removed) and the row's
        contents are undefined.  A key whose spill is still running is read after it.  A held
        key becomes most recently used, a dead one too (see the module docstring).
        """
        view = self._view(row, writable=True)
        key_b = self._key(key)
        name = file_name(key_b)
        with self._lock:
            self._check_open()
            entry = self._entries.get(name)
            self._lru.touch(name)  # a dead key too: the replay cannot tell (module docstring)
            if entry is None or entry.state == _DEAD:
                self._counts["misses"] += 1
                return done(False)
            return self._pool.submit(name, lambda: self._read(name, entry, key_b, view))

    def touch(self, key: Hashable) -> bool:
        """Make a held ``key`` (dead or not) most recently used, as `get` does when it is
        called, without reading it; False when the tier does not hold it.  A promotion touches
        the keys it is about to read before it spills the rows it needs, so the spills'
        evictions never pick them."""
        with self._lock:
            self._check_open()
            return self._lru.touch(file_name(self._key(key)))

    def contains(self, key: Hashable) -> bool:
        """True when ``key`` is stored or being stored (a `get` would wait for it); a pure
        query for the longest-prefix lookup: it does not change the LRU order."""
        with self._lock:
            entry = self._entries.get(file_name(self._key(key)))
            return entry is not None and entry.state != _DEAD

    def discard(self, key: Hashable) -> Future[None]:
        """Forget ``key`` and remove its file (after any I/O of it still running)."""
        with self._lock:
            self._check_open()
            return self._drop(file_name(self._key(key)))

    def stored_names(self) -> frozenset[str]:
        """File names of the readable keys: what ranks exchange after a restart to agree on
        the keys every rank has (then `keep_only` their intersection)."""
        with self._lock:
            return frozenset(n for n, e in self._entries.items() if e.state != _DEAD)

    def stored_keys(self) -> list[bytes]:
        """The stored form (`key_bytes`) of the readable keys, least recently used first: what
        a chunk manager mirroring this tier's LRU is seeded with after a restart."""
        with self._lock:
            return [e.key for e in map(self._entries.__getitem__, self._lru)
                    if e.state != _DEAD]

    def ordered_names(self) -> list[str]:
        """The held file names, least recently used first."""
        with self._lock:
            return list(self._lru)

    def adopt_order(self, names: Sequence[str]) -> None:
        """Take another writer's LRU order for the same held names (after a restart, file
        sequence numbers may order them differently on different ranks)."""
        with self._lock:
            self._lru.reorder(names)

    def lru_keys(self) -> list[bytes]:
        """The stored form of every key that holds a slot of the budget, dead ones included,
        least recently used first: what `DiskIndex.lru` replays (for tests and checks)."""
        with self._lock:
            return [self._entries[n].key for n in self._lru]

    def keep_only(self, names: Collection[str]) -> Future[None]:
        """Discard every key whose file name is not in ``names``; done when the files are gone."""
        with self._lock:
            self._check_open()
            doomed = [self._drop(n) for n in list(self._lru) if n not in names]
        return all_done(doomed)

    def flush(self) -> bool:
        """Wait until every operation scheduled so far has finished, or until none finished
        for one I/O deadline (a stalled file system: False, with a warning)."""
        if self._pool.drain(stall_s=self.io_timeout_s):
            return True
        log.warning("file tier %s: %d file operations made no progress for %g s "
                    "(fs_io_timeout_s); going on without them", self.directory,
                    self._pool.pending(), self.io_timeout_s)
        return False

    def stats(self) -> FileTierStats:
        with self._lock:
            c = self._counts
            return FileTierStats(
                self.directory, self.mode, self.budget_bytes, self.file_bytes, self.capacity,
                sum(e.state != _DEAD for e in self._entries.values()), self._write_busy.bytes,
                self._read_busy.bytes, c["hits"], c["misses"], c["corrupt"], c["evicted"],
                c["write_errors"], _busy_seconds(self._write_busy),
                _busy_seconds(self._read_busy), c["read_errors"], c["timeouts"])

    def to_json(self) -> dict[str, Any]:
        return self.stats().to_json()

    def close(self, timeout_s: float | None = None) -> bool:
        """Finish all I/O (waiting at most ``timeout_s``, default `io_timeout_s`), stop the
        threads and release the directory.  Returns False when some I/O was still stalled at
        the deadline: its thread is left to end with it (a daemon thread) and the directory
        stays locked until then.  Idempotent."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
        finished = self._pool.shutdown(self.io_timeout_s if timeout_s is None else timeout_s)
        if finished:
            os.close(self._dir_fd)
        else:  # the stalled operations still use the descriptor: it is closed after them
            log.warning("file tier %s: %d file operations still stalled at close after %g s; "
                        "left to their threads", self.directory, self._pool.pending(),
                        self.io_timeout_s if timeout_s is None else timeout_s)
            threading.Thread(target=self._close_when_drained, name="offload-fs-closer",
                             daemon=True).start()
        return finished

    def _close_when_drained(self) -> None:
        self._pool.drain()
        os.close(self._dir_fd)

    def wait_idle(self) -> None:
        """Block until every file operation has returned, stalled ones included (after a
        `close` that gave up on them, before the rows they read into may be unmapped)."""
        self._pool.drain()

    def __enter__(self) -> FileTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ decisions (locked)

    def _evict(self, victims: list[str]) -> None:
        """Remove the files of the keys the LRU evicted (each after its own I/O)."""
        for victim in victims:
            self._counts["evicted"] += 1
            self._remove(victim)

    def _drop(self, name: str) -> Future[None]:
        if not self._lru.discard(name):
            return done(None)
        return self._remove(name)

    def _remove(self, name: str) -> Future[None]:
        """Forget a key the LRU no longer holds and unlink its file, queued behind the key's
        I/O (a write still running, even an abandoned one, ends first)."""
        del self._entries[name]
        return self._pool.submit(name, lambda: self._unlink(name))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"file tier {self.directory} is closed")

    # ------------------------------------------------------------------ I/O (pool threads)

    def _write(self, name: str, entry: _Entry, key_b: bytes, row: memoryview,
               released: Future[None]) -> bool:
        fd = -1
        tmp: str | None = None
        ok = intact = False
        self._begin(self._write_busy)
        try:
            try:
                with self._lock:
                    if entry.abandoned:  # the row may hold another chunk's bytes by now
                        return False
                page = self._header_page()
                pack_header(page, Header(self.page_size, self.row_bytes, self._crc(row, 0, 1),
                                         entry.seq, self.fingerprint, key_b), self._crc)
                fd, tmp = self._create(name)
                transfer_all(self._io.pwritev, fd, [page, row])
            finally:
                with self._lock:  # from here on `release` can no longer abandon this write
                    intact = not entry.abandoned
                    entry.row_done = True
                released.set_result(None)
            if intact:
                self._io.fdatasync(fd)
                self._publish(fd, tmp, name)
                ok = True
        except OSError as exc:
            self._write_failed(name, exc)
        finally:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    self._io.close(fd)
            if not ok and tmp is not None:
                with contextlib.suppress(OSError):
                    self._io.unlink(tmp, self._dir_fd)
            self._end(self._write_busy, self.file_bytes if ok else 0)
            with self._lock:
                entry.state = _STORED if ok else _DEAD
        return ok

    def _create(self, name: str) -> tuple[int, str | None]:
        """A new file to write ``name``'s bytes into: unnamed (``O_TMPFILE``: a process killed
        mid-write leaves nothing) where the filesystem allows it, else under a random
        temporary name (removed at the next start if the process dies).  Returns the
        descriptor and the temporary name (None when unnamed)."""
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | self.mode.open_flags
        if self._tmpfile:
            try:
                return self._io.open(".", flags | os.O_TMPFILE, 0o600, self._dir_fd), None
            except OSError as exc:
                if exc.errno not in _NO_TMPFILE:
                    raise
                self._tmpfile = False
        tmp = f".{name}.{uuid.uuid4().hex[:12]}{_TMP_SUFFIX}"
        fd = self._io.open(tmp, flags | os.O_CREAT | os.O_EXCL, 0o600, self._dir_fd)
        return fd, tmp

    def _publish(self, fd: int, tmp: str | None, name: str) -> None:
        """Give the written file its name, replacing an older file of the key, and make the
        directory entry durable."""
        if tmp is not None:
            self._io.rename(tmp, name, self._dir_fd)
        else:
            try:
                self._io.link_fd(fd, name, self._dir_fd)
            except FileExistsError:  # a dead file of the key (failed write, damage): replace
                self._io.unlink(name, self._dir_fd)
                self._io.link_fd(fd, name, self._dir_fd)
        self._io.fsync(self._dir_fd)

    def _read(self, name: str, entry: _Entry, key_b: bytes, row: memoryview) -> bool:
        with self._lock:
            if entry.state == _DEAD:  # its write failed after get() was called
                self._counts["misses"] += 1
                return False
        self._begin(self._read_busy)
        problem = error = ""
        header: Header | None = None
        try:
            page = self._header_page()
            problem, error = self._read_file(name, [page, row])
            if not problem:
                header = unpack_header(page, self._crc)
                problem = self._mismatch(header, name, key_b)
            if not problem and header is not None and \
                    self._crc(row, 0, 1) != header.payload_crc:
                problem = "payload checksum mismatch"
        except FormatError as exc:
            problem = str(exc)
        finally:
            self._end(self._read_busy, 0 if problem else self.file_bytes)
        with self._lock:
            if problem:
                entry.state = _DEAD
                self._counts["misses"] += 1
            else:
                self._counts["hits"] += 1
        if error:
            self._read_failed(name, error)
        elif problem:
            self._corrupt(name, problem)
        return not problem

    def _read_file(self, name: str, views: list[memoryview]) -> tuple[str, str]:
        """Fill ``views`` from the start of a file of the right size.  Returns ``(problem,
        error)``: ``problem`` non-empty says why the file is not valid (missing, wrong size,
        unreadable); ``error`` is set too when the cause is an I/O error rather than the
        file's contents (the file may be fine: it is not counted as damaged)."""
        try:
            fd = self._io.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                               | self.mode.open_flags, 0, self._dir_fd)
        except FileNotFoundError:
            return "the file is missing", ""
        except OSError as exc:
            return "open failed", _errno_text(exc)
        try:
            size = self._io.fstat(fd).st_size
            if size != self.file_bytes:
                return f"{size} bytes instead of {self.file_bytes}", ""
            transfer_all(self._io.preadv, fd, views)
            return "", ""
        except OSError as exc:
            return "read failed", _errno_text(exc)
        finally:
            with contextlib.suppress(OSError):
                self._io.close(fd)

    def _mismatch(self, header: Header, name: str, key_b: bytes | None) -> str:
        """Why a verified header does not belong to this tier (or to ``key_b``); "" if it does."""
        if header.fingerprint != self.fingerprint:
            return "written under another geometry (fingerprint differs)"
        if header.payload_bytes != self.row_bytes:
            return f"payload of {header.payload_bytes} bytes instead of {self.row_bytes}"
        if file_name(header.key) != name:
            return "its key does not hash to its name"
        if key_b is not None and header.key != key_b:
            return "it holds another key"
        return ""

    def _unlink(self, name: str) -> None:
        try:
            self._io.unlink(name, self._dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:  # the file stays; a later write of the key replaces it
            log.warning("file tier %s: removing %s failed (%s)", self.directory, name,
                        _errno_text(exc))

    def _corrupt(self, name: str, problem: str) -> None:
        with self._lock:
            self._counts["corrupt"] += 1
        log.warning("file tier %s: %s is damaged (%s); removed, counted as a miss",
                    self.directory, name, problem)
        self._unlink(name)

    def _read_failed(self, name: str, error: str) -> None:
        with self._lock:
            self._counts["read_errors"] += 1
        self._warn_once(-1, f"reading {name} failed ({error}); that chunk is a miss and the "
                        "job goes on (later read errors are only counted in read_errors)")

    def _write_failed(self, name: str, exc: OSError) -> None:
        code = exc.errno or 0
        with self._lock:
            self._counts["write_errors"] += 1
        what = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is spent",
                errno.EFBIG: "the file size limit is reached"}.get(code, "it failed")
        self._warn_once(code, f"writing {name} failed because {what} ({_errno_text(exc)}); "
                        "that chunk stays a miss and the job goes on (later "
                        f"{errno.errorcode.get(code, code)} errors are only counted in "
                        "write_errors)")

    def _warn_once(self, kind: int, message: str) -> None:
        """Log ``message`` the first time a kind of fault happens (a failing disk must not
        flood the log)."""
        with self._lock:
            first = kind not in self._warned_errors
            self._warned_errors.add(kind)
        if first:
            log.warning("file tier %s: %s", self.directory, message)

    def _header_page(self) -> memoryview:
        """This thread's page-aligned header buffer (an anonymous mapping is page-aligned, as
        O_DIRECT needs)."""
        page = getattr(self._local, "page", None)
        if page is None:
            page = self._local.page = memoryview(mmap.mmap(-1, self.page_size))
        return page

    def _begin(self, busy: _Busy) -> None:
        with self._lock:
            if busy.active == 0:
                busy.since = time.perf_counter()
            busy.active += 1

    def _end(self, busy: _Busy, nbytes: int) -> None:
        with self._lock:
            busy.active -= 1
            busy.bytes += nbytes
            if busy.active == 0:
                busy.seconds += time.perf_counter() - busy.since

    # ------------------------------------------------------------------ opening

    def _rebuild(self) -> int:
        """Index the files of a previous run from their headers (LRU = write order), remove
        leftovers of interrupted writes, and return the next sequence number."""
        found: list[tuple[int, str, bytes]] = []
        names = os.listdir(self._dir_fd)
        for name in names:
            if name.endswith(_TMP_SUFFIX) or name.startswith(PROBE_PREFIX):
                self._unlink(name)  # a write or probe interrupted by a crash
        chunk_files = [n for n in names if n.endswith(SUFFIX)]
        headers = self._pool.map(self._header_of, chunk_files, self.io_timeout_s)
        for name, read in zip(chunk_files, headers, strict=True):
            if read is None:  # stalled past the deadline: a miss; the other ranks drop the key
                self._counts["timeouts"] += 1  # too (restart agreement), and its file goes
                self._pool.submit(name, functools.partial(self._unlink, name))  # (budget)
                continue
            header, problem = read
            if problem:
                self._corrupt(name, problem)
            elif header is not None:  # (None: unreadable, counted in read_errors, kept)
                found.append((header.seq, name, header.key))
        found.sort()
        for seq, name, key_b in found:  # in write order: the oldest beyond the budget go
            self._entries[name] = _Entry(key_b, seq, _STORED, done(True))
            for victim in self._lru.put(name):  # removed before the tier opens (no I/O yet)
                self._counts["evicted"] += 1
                del self._entries[victim]
                self._unlink(victim)
        return found[-1][0] + 1 if found else 0

    def _header_of(self, name: str) -> tuple[Header | None, str]:
        """Read and check only the header page of one file."""
        page = self._header_page()
        problem, error = self._read_file(name, [page])
        if error:
            self._read_failed(name, error)
            return None, ""
        if problem:
            return None, problem
        try:
            header = unpack_header(page, self._crc)
        except FormatError as exc:
            return None, str(exc)
        return header, self._mismatch(header, name, None)

    # ------------------------------------------------------------------ argument checks

    def _view(self, row: Any, writable: bool) -> memoryview:
        view = memoryview(row)
        if not view.c_contiguous:
            raise ValueError("a file tier row must be one contiguous buffer")
        view = view.cast("B")
        if len(view) != self.row_bytes:
            raise ValueError(f"row of {len(view)} bytes, the file tier stores rows of "
                             f"{self.row_bytes}")
        if view.readonly and (writable or self.mode.o_direct):
            raise ValueError("the file tier needs a writable row here (get() fills it; O_DIRECT "
                             "needs its address); pass the host row itself")
        if self.mode.o_direct and _address(view) % self.mode.mem_align:
            raise ValueError(f"row at {_address(view):#x} is not aligned to "
                             f"{self.mode.mem_align} bytes, as O_DIRECT needs; pass the "
                             "page-aligned host row (or host_view of it)")
        return view

    def _key(self, key: Hashable) -> bytes:
        key_b = key_bytes(key)
        if len(key_b) > max_key_bytes(self.page_size):
            raise ValueError(f"chunk key repr of {len(key_b)} bytes is longer than the "
                             f"{max_key_bytes(self.page_size)} a file header holds")
        return key_b


# ---------------------------------------------------------------------- helpers


def _load_crc32c() -> Crc:
    try:
        import crc32c
    except ImportError:
        raise OffloadError("the file tier needs the crc32c package, which is not installed; "
                           "install it with pip install 'offload[fs]'") from None
    fn: Crc = crc32c.crc32c
    return fn


def _check_geometry(budget_bytes: int, row_bytes: int, io_threads: int, page_size: int) -> None:
    if page_size < 512 or page_size & (page_size - 1):
        raise OffloadError(f"page_size = {page_size} is not a power of two >= 512; use 4096")
    if row_bytes < 1 or row_bytes % page_size:
        raise OffloadError(f"row_bytes = {row_bytes} is not a positive multiple of the "
                           f"{page_size}-byte page; pass the plan's page-rounded slot or row")
    if io_threads < 1:
        raise OffloadError(f"io_threads = {io_threads} is below its minimum 1; give at least 1")
    if budget_bytes < 0:
        raise OffloadError(f"file tier budget fs_bytes = {budget_bytes} is negative; give a "
                           "byte count such as 64GiB")


def _warn_buffered(root: str, reason: str) -> None:
    with _warn_lock:
        if root in _buffered_warned:
            return
        _buffered_warned.add(root)
    log.warning("file tier %s: %s, so chunk files use buffered I/O (slower, through the page "
                "cache)", root, reason)


def _errno_text(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{code}: {text}" if code else text


def _address(view: memoryview) -> int:
    """The address of a writable buffer."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _busy_seconds(busy: _Busy) -> float:
    running = time.perf_counter() - busy.since if busy.active else 0.0
    return busy.seconds + running


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0
