# SPDX-License-Identifier: Apache-2.0
"""The room a node's disk has for the file tier, and the folders earlier runs left in DIR.

Runs on one rank per node (its leader), at set-up.  A tier keeps its files in
``DIR/fp-<fingerprint>``; a run with another geometry or namespace gets another folder and
never reads the old one, which would stay on the disk for ever.  So:

* **Room.**  What the tier may fill on a node is the disk's free space plus what the folders
  no live tier holds take (this job's own from an earlier run among them): `scan`.  The budget
  per node is bounded by it (`bound_budget`): the default (`FS_BYTES_FACTOR` x the host budget)
  takes at most half of it, an explicit ``fs_bytes`` past it is refused with one line.
* **Eviction.**  Once this job's tiers have opened (and locked) their folders, the folders
  of earlier runs are removed oldest first until what remains fits what the budget leaves
  (`evict`): next to this job's files, and never into the room the budget needs.

Only folders of this user that no one else may write are counted or removed, each opened
``O_NOFOLLOW`` relative to DIR's descriptor and locked (``flock``) as the tier locks its own:
a folder a live tier holds is left alone.  A removal unlinks the regular files and links in the
folder (never following one) and then the folder; anything else in it (a subfolder) keeps the
folder.  A tier that opens a folder while it is being removed waits for the lock and starts
over in a new one (`offload.tiers.tier_dir.open_locked_subdir`).

Primitives:

* `Folder` -- one unlocked folder: its name, bytes on disk and last change;
* `scan` -- free bytes of DIR's filesystem and its unlocked folders;
* `bound_budget` -- the node budget the ranks agree on, from every node's room;
* `evict` -- remove unlocked folders oldest first down to a limit.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from offload.errors import OffloadError
from offload.sizes import format_size
from offload.tiers.tier_dir import FOLDER_PREFIX

log = logging.getLogger(__name__)

DEFAULT_ROOM_SHARE = 2  # the default budget takes at most 1/this of the room


@dataclass(frozen=True)
class Folder:
    """An ``fp-*`` folder of this user that no live tier holds."""

    name: str
    bytes: int  # allocated on disk by its files
    mtime: float  # its last change (an entry added or removed)


@dataclass(frozen=True)
class Room:
    """What `scan` found: the filesystem's free bytes (for this user) and the folders."""

    free: int
    folders: tuple[Folder, ...]

    @property
    def total(self) -> int:
        """Bytes the file tier may fill: free space and the unlocked folders."""
        return self.free + sum(f.bytes for f in self.folders)


def scan(root: str) -> Room:
    """The room under the existing directory ``root`` (DIR).

    Raises:
        OSError: DIR cannot be opened or its filesystem read.
    """
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstatvfs(root_fd)
        folders = []
        for name in _folder_names(root_fd):
            with _locked(root_fd, name) as fd:
                if fd is not None:
                    folders.append(Folder(name, _bytes(fd), os.fstat(fd).st_mtime))
        return Room(st.f_bavail * st.f_frsize, tuple(folders))
    finally:
        os.close(root_fd)


def bound_budget(explicit: int | None, default: int, rooms: Mapping[str, int],
                 directory: str) -> int:
    """The budget per node every rank uses: ``explicit`` (``fs_bytes``) when every node's
    room holds it, else ``default`` cut to the smallest room / `DEFAULT_ROOM_SHARE`.

    Raises:
        OffloadError: ``explicit`` is more than a node's room (naming the node, both sizes and
            the fix).
    """
    node, room = min(rooms.items(), key=lambda item: item[1])
    if explicit is None:
        return min(default, room // DEFAULT_ROOM_SHARE)
    if explicit > room:
        raise OffloadError(
            f"fs_bytes (--fs-bytes) = {explicit} B ({format_size(explicit)}) per node is more "
            f"than the disk of {directory} has room for on node {node}: {room} B "
            f"({format_size(room)}, its free space and the folders of earlier runs); give at "
            "most that, or free space")
    return explicit


def evict(root: str, limit: int) -> list[Folder]:
    """Remove the unlocked folders under ``root``, oldest first, until the bytes of those
    left are at most ``limit``; return the removed ones.  A folder that cannot be removed
    whole is logged and counts as left."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    removed: list[Folder] = []
    try:
        found = []
        for name in _folder_names(root_fd):
            with _locked(root_fd, name) as fd:
                if fd is not None:
                    found.append(Folder(name, _bytes(fd), os.fstat(fd).st_mtime))
        left = sum(f.bytes for f in found)
        for folder in sorted(found, key=lambda f: (f.mtime, f.name)):
            if left <= limit:
                break
            if _remove(root_fd, folder.name):
                removed.append(folder)
                left -= folder.bytes
    finally:
        os.close(root_fd)
    return removed


# ---------------------------------------------------------------------- helpers


def _folder_names(root_fd: int) -> list[str]:
    with os.scandir(root_fd) as entries:
        return sorted(e.name for e in entries
                      if e.name.startswith(FOLDER_PREFIX) and e.is_dir(follow_symlinks=False))


@contextlib.contextmanager
def _locked(root_fd: int, name: str) -> Iterator[int | None]:
    """The descriptor of folder ``name``, locked, while it is ours alone and no live tier
    holds it; None otherwise (a link, another user's, writable by others, in use, gone)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=root_fd)
    except OSError:
        yield None
        return
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            yield None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None  # a live tier's
            return
        yield fd
    finally:
        os.close(fd)  # releases the lock


def _bytes(fd: int) -> int:
    """Bytes the folder's entries take on disk (allocated blocks; links count nothing)."""
    total = 0
    with os.scandir(fd) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                total += st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0
    return total


def _remove(root_fd: int, name: str) -> bool:
    """Remove folder ``name`` while holding its lock: its files and links, then itself."""
    with _locked(root_fd, name) as fd:
        if fd is None:
            return False
        try:
            with os.scandir(fd) as entries:
                for entry in list(entries):
                    if not entry.is_dir(follow_symlinks=False):
                        os.unlink(entry.name, dir_fd=fd)
            os.rmdir(name, dir_fd=root_fd)  # under the lock: a tier opening it waits
            return True
        except OSError as exc:
            log.warning("file tier: could not remove the folder %s of an earlier run (%s); "
                        "it stays", name, exc.strerror or exc)
            return False
