"""Region files: named ones in a ``--shm-dir``, their reservation, and the contiguous mapping.

A region is one or several shmem files (one file serialises page-cache insertion, so large
regions are split): nameless memfds by default (``nameless``), or, with ``--shm-dir``, named
files created ``O_CREAT|O_EXCL|O_NOFOLLOW`` with mode 0600 so another user can neither pre-plant
nor read them; joiners verify what they open.  Either kind is reserved up front so running out
of memory is a clear error instead of a SIGBUS later.

The files are mapped ``MAP_SHARED|MAP_FIXED`` back to back into one anonymous ``PROT_NONE``
reservation so the region stays a single address range (one registration or one copy may cross
a file seam).  ``mmap`` goes through libc via ctypes because Python's ``mmap`` module cannot map
at a fixed address.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import mmap
import os
import re
import stat
from collections.abc import Sequence

import torch

from offload.errors import OffloadError
from offload.sizes import format_size

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.restype = ctypes.c_int
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

# Linux values (identical on x86-64 and aarch64) that Python's mmap module lacks.
PROT_NONE = 0
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MADV_DONTFORK = 10
MADV_HUGEPAGE = 14
MAP_FAILED = ctypes.c_void_p(-1).value
FILE_MODE = 0o600
_TIER_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_tier_id(tier_id: str) -> None:
    """Tier ids become parts of file and socket names: plain characters only."""
    if not _TIER_ID_RE.match(tier_id):
        raise OffloadError(
            f"tier id {tier_id!r} is not 1-64 characters of letters, digits, '_', '.' or '-'; "
            "pass such an id"
        )


def segment_paths(shm_dir: str, tier_id: str, tag: str, count: int) -> list[str]:
    """Deterministic segment paths: every rank that knows the tier id knows them, so any
    survivor can remove them after a peer dies."""
    check_tier_id(tier_id)
    return [os.path.join(shm_dir, f"offload-{tier_id}-{tag}-s{i}") for i in range(count)]


def create_segments(paths: Sequence[str], lengths: Sequence[int], threads: int = 1,
                    unlink: bool = False) -> list[int]:
    """Create and reserve every segment file; return their open descriptors.  The caller has
    checked the space (``space.check_space``).

    ``unlink`` removes each name right after it is created, before the (slow) reservation:
    a private region then has no name to leak for more than a few microseconds, even on
    SIGKILL.  On any failure every file this call created is closed and unlinked before the
    error propagates.
    """
    fds: list[int] = []
    try:
        for path in paths:
            fds.append(_create_one(path))
            if unlink:
                os.unlink(path)
        reserve(fds, lengths, threads)
    except BaseException:
        close_fds(fds)
        for path in paths[:len(fds)]:
            unlink_quiet(path)
        raise
    return fds


def reserve(fds: Sequence[int], lengths: Sequence[int], threads: int) -> None:
    """Allocate every file's pages up front (``posix_fallocate``), so running out of memory is
    a clear error now, not a SIGBUS at first touch.  Files are reserved in parallel: the call
    releases the GIL and each shmem file allocates its pages independently."""
    def one(fd: int, length: int) -> None:
        try:
            os.posix_fallocate(fd, 0, length)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            raise OffloadError(
                f"reserving {length} B ({format_size(length)}) of shared memory failed: "
                f"{os.strerror(exc.errno)}; lower --cpu-bytes, free memory or enlarge the mount"
            ) from None

    with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(fds)))) as pool:
        list(pool.map(one, fds, lengths))


def _create_one(path: str) -> int:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | os.O_CLOEXEC,
                     FILE_MODE)
    except FileExistsError:
        what = "a symbolic link" if os.path.islink(path) else "an existing file"
        raise OffloadError(
            f"region path {path} is already {what}; refusing to reuse it: remove it or start "
            "the job with a new id"
        ) from None
    os.fchmod(fd, FILE_MODE)  # the umask may have cleared bits; we want exactly 0600
    return fd


def open_segment(path: str, length: int) -> int:
    """Open a segment created by the node leader and check it is ours: a regular file owned
    by this user, mode 0600, of the expected size.  Symlinks are refused (``O_NOFOLLOW``)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OffloadError(
                f"region path {path} is a symbolic link; refusing to follow it: remove it and "
                "restart the job"
            ) from None
        if exc.errno == errno.ENOENT:
            raise OffloadError(
                f"region path {path} does not exist (the node leader failed or removed it "
                "early); check the leader's error"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        problem = _foreign(st, length)
        if problem:
            raise OffloadError(
                f"region path {path} is {problem}, not the job's own file; refusing to map it: "
                "remove it and restart the job"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _foreign(st: os.stat_result, length: int) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid} (we are {os.geteuid()})"
    if stat.S_IMODE(st.st_mode) != FILE_MODE:
        return f"mode {stat.S_IMODE(st.st_mode):04o} (expected 0600)"
    if st.st_size != length:
        return f"{st.st_size} B long (expected {length} B)"
    return None


def unlink_quiet(path: str) -> None:
    """Unlink, ignoring a path that is already gone."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def unlink_if_ours(path: str) -> None:
    """Error-path cleanup by a rank that may not have created ``path``: remove it only when it
    looks like one of our segments, so a planted symlink or another user's file is left alone
    (and reported by whoever tried to use it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
            and stat.S_IMODE(st.st_mode) == FILE_MODE):
        unlink_quiet(path)


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def tensor_at(address: int, length: int) -> torch.Tensor:
    """A uint8 tensor over ``length`` bytes at ``address`` (no copy, no ownership: the caller
    keeps the memory mapped for the tensor's lifetime)."""
    return torch.frombuffer((ctypes.c_uint8 * length).from_address(address), dtype=torch.uint8)


class Mapping:
    """Segment files mapped back to back into one reserved address range.

    The descriptors may be closed (and the files unlinked) right after construction: the
    mapping keeps the memory alive.  ``close`` unmaps once; using ``tensor`` afterwards is a
    use-after-free, so owners drop their views before closing.
    """

    def __init__(self, fds: Sequence[int], lengths: Sequence[int]) -> None:
        size = sum(lengths)
        if size <= 0 or any(n % mmap.PAGESIZE for n in lengths):
            raise ValueError(f"segment lengths {list(lengths)} must be positive multiples of "
                             f"the {mmap.PAGESIZE} B system page")
        base = libc.mmap(None, size, PROT_NONE,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if base in (None, MAP_FAILED):
            raise _os_error("mmap reservation")
        self.address: int = base
        self.size = size
        try:
            offset = 0
            for fd, length in zip(fds, lengths, strict=True):
                want = base + offset
                got = libc.mmap(want, length, mmap.PROT_READ | mmap.PROT_WRITE,
                                mmap.MAP_SHARED | MAP_FIXED, fd, 0)
                if got != want:
                    raise _os_error("mmap of a segment")
                offset += length
        except BaseException:
            self.close()
            raise
        self.tensor = tensor_at(base, size)

    @classmethod
    def anonymous(cls, size: int) -> Mapping:
        """``size`` bytes of this process's own memory, as one range: transparent huge pages
        requested (2 MiB pages pre-fault and register with CUDA faster: docs/BENCHMARKS.md,
        "Private regions on anonymous huge pages"; the host's THP setting decides whether it
        gets them) and left out of forked children (a fork would make pinned pages
        copy-on-write: the GPU would then write pages the parent no longer reads).  The kernel
        frees it with the process, however that ends."""
        if size <= 0 or size % mmap.PAGESIZE:
            raise ValueError(f"size {size} must be a positive multiple of the "
                             f"{mmap.PAGESIZE} B system page")
        base = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if base in (None, MAP_FAILED):
            raise _os_error(f"mmap of {format_size(size)} of anonymous memory")
        self = cls.__new__(cls)
        self.address, self.size = base, size
        if libc.madvise(base, size, MADV_DONTFORK) != 0:
            error = _os_error("madvise(MADV_DONTFORK)")
            self.close()
            raise error
        libc.madvise(base, size, MADV_HUGEPAGE)  # fails where THP is compiled out: 4 KiB pages
        self.tensor = tensor_at(base, size)
        return self

    def close(self) -> None:
        """Unmap the whole range; idempotent and reentrant (the size is cleared first, so a
        signal-handler call racing a normal one unmaps once)."""
        size, self.size = self.size, 0
        if size and libc.munmap(self.address, size) != 0:
            raise _os_error("munmap")


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what} failed: {os.strerror(err)}")
