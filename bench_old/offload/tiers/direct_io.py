"""Which I/O mode a directory allows: ``O_DIRECT`` with its alignment, or buffered.

``O_DIRECT`` moves bytes between the device and the caller's buffer with no page-cache copy, so
a pinned host row can be written to and read from disk as it is.  It has two preconditions: the
filesystem must support it (ramfs refuses the open with ``EINVAL``; some FUSE filesystems do
too) and every buffer address, file offset and length must be aligned to what the filesystem
asks.  Linux 6.1+ reports that alignment through ``statx(STATX_DIOALIGN)`` on a regular file;
on older kernels (or filesystems that do not report it) an ``O_DIRECT`` open plus one aligned
write of a page is the probe, and the page is then taken as the alignment (512-byte and 4 KiB
logical blocks both divide it).  Whatever the check says, a file tier whose header and rows are
page multiples only needs alignment <= the page size.

`transfer_all` moves a list of buffers with ``pwritev``/``preadv`` straight from/to them (in
O_DIRECT mode the kernel DMAs into the caller's memory: no bounce buffer).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass

STATX_DIOALIGN = 0x2000
AT_EMPTY_PATH = 0x1000
_STATX_SIZE = 256  # struct statx is 256 bytes on every Linux architecture
_STX_MASK = 0  # u32 stx_mask
_STX_DIO_MEM_ALIGN = 152  # u32 stx_dio_mem_align
_STX_DIO_OFFSET_ALIGN = 156  # u32 stx_dio_offset_align
PROBE_PREFIX = ".dio-probe-"  # the probe file's name; a crash can leave one behind

_libc = ctypes.CDLL(None, use_errno=True)
_statx = getattr(_libc, "statx", None)  # glibc >= 2.28
if _statx is not None:
    _statx.restype = ctypes.c_int
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                       ctypes.c_void_p]


@dataclass(frozen=True)
class IoMode:
    """The I/O mode of one directory.

    ``o_direct``: files are opened with ``O_DIRECT``.  ``mem_align`` / ``offset_align``: the
    alignment buffers and offsets/lengths must have then (1 when buffered).  ``source`` says how
    it was found (``statx``, ``probe``); ``reason`` why I/O is buffered (empty when direct).
    """

    o_direct: bool
    mem_align: int
    offset_align: int
    source: str
    reason: str = ""

    @property
    def name(self) -> str:
        return "o_direct" if self.o_direct else "buffered"

    @property
    def open_flags(self) -> int:
        return os.O_DIRECT if self.o_direct else 0


def statx_dio_align(fd: int) -> tuple[int, int] | None:
    """``(mem_align, offset_align)`` from ``statx(STATX_DIOALIGN)`` on an open regular file;
    ``(0, 0)`` when the filesystem says the file does not support direct I/O; None when libc or
    the kernel (before 6.1) or the filesystem do not report it."""
    if _statx is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _statx(fd, b"", AT_EMPTY_PATH, STATX_DIOALIGN, buf) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL):
            return None
        raise OSError(err, os.strerror(err))
    raw = buf.raw
    mask = int.from_bytes(raw[_STX_MASK:_STX_MASK + 4], "little")
    if not mask & STATX_DIOALIGN:
        return None
    mem = int.from_bytes(raw[_STX_DIO_MEM_ALIGN:_STX_DIO_MEM_ALIGN + 4], "little")
    offset = int.from_bytes(raw[_STX_DIO_OFFSET_ALIGN:_STX_DIO_OFFSET_ALIGN + 4], "little")
    return mem, offset


def detect_io_mode(dir_fd: int, page_size: int) -> IoMode:
    """Find how files in the directory open at ``dir_fd`` can be written, with a throw-away
    probe file.

    The probe is created ``O_EXCL | O_NOFOLLOW`` under a random name (a file or symlink planted
    in advance is never opened, let alone truncated) and removed before returning.  Raises
    OSError when the probe file cannot be created at all (the caller turns that into a "not
    writable" error); everything else decides between direct and buffered I/O.
    """
    name = f"{PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    try:
        reported = statx_dio_align(fd)
        if reported is not None:
            mem, offset = reported
            if mem == 0 or offset == 0:
                return IoMode(False, 1, 1, "statx", "the filesystem reports no direct I/O")
            if max(mem, offset) > page_size:
                return IoMode(False, 1, 1, "statx",
                              f"direct I/O needs {max(mem, offset)}-byte alignment, more than "
                              f"the {page_size}-byte page the rows are aligned to")
            return IoMode(True, mem, offset, "statx")
        return _probe(dir_fd, name, page_size)
    finally:
        os.close(fd)
        os.unlink(name, dir_fd=dir_fd)


def _probe(dir_fd: int, name: str, page_size: int) -> IoMode:
    """Open our probe file ``name`` again with ``O_DIRECT`` and write one aligned page."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return IoMode(False, 1, 1, "probe", "the filesystem refuses O_DIRECT opens (EINVAL)")
    try:
        with mmap.mmap(-1, page_size) as page:
            os.pwritev(fd, [page], 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return IoMode(False, 1, 1, "probe",
                      f"an aligned {page_size}-byte O_DIRECT write failed (EINVAL)")
    finally:
        os.close(fd)
    return IoMode(True, page_size, page_size, "probe")


def transfer_all(op: Callable[[int, list[memoryview], int], int], fd: int,
                 views: Iterable[memoryview]) -> None:
    """``pwritev``/``preadv`` all of ``views`` from file offset 0, resuming after short
    transfers (one syscall moves at most ~2 GiB); running out of file is an error."""
    pending = [v for v in views if len(v)]
    offset = 0
    while pending:
        moved = op(fd, pending, offset)
        if moved <= 0:
            raise OSError(errno.EIO, "the file ended early" if moved == 0 else "I/O error")
        offset += moved
        while moved:
            if moved >= len(pending[0]):
                moved -= len(pending.pop(0))
            else:
                pending[0] = pending[0][moved:]
                moved = 0
