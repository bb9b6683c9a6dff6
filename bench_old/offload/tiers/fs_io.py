# SPDX-License-Identifier: Apache-2.0
"""The file tier's I/O seam: every system call the tier makes on its files goes through one
`FileIO` object, so a test can replace it to inject faults (EIO, ENOSPC, a stalled file
system) into real files without touching anything else.

Runs in every rank process that keeps a file tier, on its I/O threads.  Primitives:

* `open` -- open a name relative to the tier's directory (the tier adds ``O_NOFOLLOW``);
* `pwritev` / `preadv` -- move a list of buffers at a file offset;
* `fdatasync` / `fsync` -- make a file's bytes / a directory's entries durable;
* `link_fd` / `rename` / `unlink` -- make a written file visible, remove one;
* `fstat` / `close`.

`FileTier(io=...)` takes another object with the same methods (`FaultyIO` in the tests derives
from this class and overrides the calls it breaks).
"""

from __future__ import annotations

import os
from collections.abc import Sequence


class FileIO:
    """Plain Linux system calls (`os` functions), relative to a directory descriptor."""

    def open(self, name: str, flags: int, mode: int, dir_fd: int) -> int:
        """Args: ``name`` inside the directory ``dir_fd``; ``flags`` and ``mode`` as
        `os.open`.  Returns the descriptor.  Raises OSError."""
        return os.open(name, flags, mode, dir_fd=dir_fd)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """Returns the bytes written (maybe fewer than asked).  Raises OSError."""
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """Returns the bytes read (0 at the end of the file).  Raises OSError."""
        return os.preadv(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def link_fd(self, fd: int, name: str, dir_fd: int) -> None:
        """Give the unnamed (``O_TMPFILE``) file ``fd`` the name ``name`` in ``dir_fd``.
        Raises FileExistsError when the name is taken."""
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)

    def rename(self, src: str, dst: str, dir_fd: int) -> None:
        os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def unlink(self, name: str, dir_fd: int) -> None:
        os.unlink(name, dir_fd=dir_fd)

    def close(self, fd: int) -> None:
        os.close(fd)
