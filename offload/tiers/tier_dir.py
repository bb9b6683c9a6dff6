# SPDX-License-Identifier: Apache-2.0
"""The directory of a file tier: checked, created without following links, owned, locked.

The user's directory must exist and be a directory (one-line errors otherwise); the tier works
in its fingerprint subdirectory, created mode 0700, opened with ``O_NOFOLLOW`` (a symlink
planted there is refused, not followed) and locked with ``flock`` so two processes with the same
geometry never share files.  The lock dies with the process, whatever kills it.

NOTE: the fingerprint is predictable, so another local user can create ``fp-<fingerprint>``
before us in a shared directory (``/tmp``) and fill it with files of their choosing.  The
subdirectory is therefore used only when this user owns it and no one else may write it
(checked on the opened descriptor, so a swap after the check changes nothing); otherwise the
tier refuses to start with a one-line error naming the folder.  The user's directory itself
must keep others from renaming our folders (`offload.system.paths`): in a shared directory without
the sticky bit, another user could rename one rank's folder to another's fingerprint, and the
tier would take that rank's files for damaged ones and delete them.  It is checked on its open
descriptor too, and the subdirectory is made and opened relative to that descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time

from offload.errors import OffloadError
from offload.system.paths import check_entries_are_ours

FOLDER_PREFIX = "fp-"  # a tier's folder in DIR: fp-<fingerprint>
# How long a tier retries the lock of its folder before it takes the folder for another
# process's: `offload.tiers.disk_room` holds a folder's lock for a moment to see whether a live
# tier holds it, and for a removal.
LOCK_RETRY_S = 2.0


def check_directory(directory: str) -> str:
    """The absolute path of an existing directory, or a one-line OffloadError."""
    root = os.path.abspath(directory)
    try:
        mode = os.stat(root).st_mode
    except FileNotFoundError:
        raise OffloadError(f"file tier directory {root} does not exist; create it or pass an "
                           "existing directory") from None
    except OSError as exc:
        raise OffloadError(f"file tier directory {root} cannot be used ({exc.strerror}); pass "
                           "another directory") from None
    if not stat.S_ISDIR(mode):
        raise OffloadError(f"file tier path {root} is not a directory; pass a directory")
    return root


def open_locked_subdir(root: str, path: str) -> int:
    """Create (0700) and open the fingerprint subdirectory ``path`` (an entry of ``root``)
    without following a planted symlink, check that it is ours and that no one else can write
    it, and lock it so a second process with the same geometry cannot share it.  A folder
    removed while this waited for its lock (an eviction of old folders) is made anew.  Returns
    the directory's descriptor."""
    deadline = time.monotonic() + LOCK_RETRY_S
    while True:
        fd = _open_subdir(root, path)
        try:
            _lock(fd, path, deadline)
        except BaseException:
            os.close(fd)
            raise
        if os.fstat(fd).st_nlink > 0:
            return fd
        os.close(fd)  # removed before we got the lock: make it again


def _lock(fd: int, path: str, deadline: float) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OffloadError(f"file tier directory {path} is in use by another process "
                                   "with the same geometry; give each job its own "
                                   "directory") from None
            time.sleep(0.01)


def _open_subdir(root: str, path: str) -> int:
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise OffloadError(f"file tier directory {root} cannot be opened ({exc.strerror}); "
                           "pass another directory") from None
    try:
        check_entries_are_ours(os.fstat(root_fd), root, "file tier directory")
        fd = _make_and_open(root_fd, os.path.relpath(path, root))
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise OffloadError(f"file tier directory {root} is not writable ({exc.strerror}); "
                               "pass a writable directory") from None
        raise OffloadError(f"file tier directory {path} cannot be opened ({exc.strerror}); "
                           "remove it or pass another directory") from None
    finally:
        os.close(root_fd)
    try:
        check_owned(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_and_open(root_fd: int, name: str) -> int:
    """Create folder ``name`` (0700) unless it exists, and open it; a removal between the two
    (an eviction of old folders) makes it again."""
    for _ in range(3):
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=root_fd)
        try:
            return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                           dir_fd=root_fd)
        except FileNotFoundError:
            continue
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                   dir_fd=root_fd)


def check_owned(fd: int, path: str) -> None:
    """A one-line OffloadError unless the directory open at ``fd`` belongs to this user and
    neither its group nor others may write it."""
    st = os.fstat(fd)
    uid = os.geteuid()
    if st.st_uid != uid:
        raise OffloadError(f"file tier directory {path} belongs to uid {st.st_uid}, not to this "
                           f"user (uid {uid}), so its files cannot be trusted; remove it or pass "
                           "a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OffloadError(f"file tier directory {path} is writable by others (mode "
                           f"{stat.S_IMODE(st.st_mode):o}), so its files cannot be trusted; "
                           f"run chmod 700 {path} or remove it")
