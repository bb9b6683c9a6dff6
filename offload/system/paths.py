"""Checks of user-given directories, run with the other settings before anything exists
(``--shm-dir``, ``--fs-tier``): each failure is one line naming the setting, the path and the
fix; and the one way the package writes a whole file (`write_atomic`).

A ``--shm-dir`` must also be memory-backed (tmpfs, hugetlbfs, ramfs): region files on a disk
filesystem would be written back to the disk.

The tier creates its files in such a directory and finds them again by name (a peer opens a
named region's segments, a restarted file tier its fingerprint folder).  Whoever may rename
entries there could swap two of them -- two segments of one region, or two ranks' file tier
folders -- and every check on the file itself (owner, mode, size) would still pass.  So the
directory must belong to this user or to root, and a directory that others may write must be
sticky (as ``/dev/shm`` and ``/tmp`` are): there only an entry's owner may rename or remove it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat

from offload.errors import OffloadError

TMPFS_MAGIC = 0x01021994
RAMFS_MAGIC = 0x858458F6
HUGETLBFS_MAGIC = 0x958458F6
MEMORY_FILESYSTEMS = {TMPFS_MAGIC: "tmpfs", RAMFS_MAGIC: "ramfs", HUGETLBFS_MAGIC: "hugetlbfs"}
_KNOWN_FILESYSTEMS = {0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs",
                      0x794C7630: "overlay", 0x9FA0: "proc", 0x62656572: "sysfs",
                      0x6969: "nfs", 0x01021997: "9p", 0x65735546: "fuse"}

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
_libc.statfs.restype = ctypes.c_int


def check_writable_dir(path: str, name: str, fix: str) -> None:
    """``path`` must exist, be a directory and be writable by this user (which also catches a
    read-only mount); ``name`` is the setting as the user knows it, e.g. ``fs_dir
    (--fs-tier)``."""
    if not os.path.lexists(path):
        raise OffloadError(f"{name} {path} does not exist; {fix}")
    if not os.path.isdir(path):
        raise OffloadError(f"{name} {path} is not a directory; {fix}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise OffloadError(f"{name} {path} is not writable by uid {os.geteuid()} (read-only "
                           f"mount or permissions); {fix}")
    check_entries_are_ours(os.stat(path), path, name)


def check_shm_dir(path: str) -> None:
    """One clear error when ``path`` cannot hold region files: missing, not a directory, not
    writable by this user, or not memory-backed."""
    flag = f"shm_dir (--shm-dir) {path}"
    fix = "give a tmpfs directory such as /dev/shm, or leave it unset for nameless regions"
    check_writable_dir(path, "shm_dir (--shm-dir)", fix)
    magic = filesystem_magic(path)
    if magic not in MEMORY_FILESYSTEMS:
        kind = _KNOWN_FILESYSTEMS.get(magic, f"type {magic:#x}")
        raise OffloadError(f"{flag} is on a {kind} filesystem, not a memory-backed one (tmpfs, "
                           f"hugetlbfs, ramfs); {fix}")


def check_fs_dir(directory: str, name: str) -> None:
    """The check of ``--fs-tier``: ``directory`` must be an existing directory this user may
    create files in.  ``name`` is how the user knows the setting (e.g. ``fs_dir
    (--fs-tier)``)."""
    check_writable_dir(os.path.abspath(directory), name,
                       "pass an existing, writable directory on a local disk")


def filesystem_magic(path: str) -> int:
    """``statfs(path).f_type`` (the first field of ``struct statfs`` on 64-bit Linux; Python's
    ``os.statvfs`` does not expose it)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"statfs {path}: {os.strerror(err)}")
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def check_entries_are_ours(st: os.stat_result, path: str, name: str) -> None:
    """No one but this user (and root) may rename or remove entries of the directory ``st``
    describes (module docstring); one-line OffloadError naming ``name`` and ``path``."""
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        raise OffloadError(f"{name} {path} belongs to uid {st.st_uid}, who may rename or "
                           f"replace the tier's files in it; pass a directory of this user "
                           f"(uid {uid}) or a root-owned sticky one such as /dev/shm or /tmp")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise OffloadError(f"{name} {path} is writable by other users and not sticky (mode "
                           f"{stat.S_IMODE(st.st_mode):o}), so they may rename or replace the "
                           f"tier's files in it; run chmod +t {path}, or pass a directory of "
                           f"your own inside it (mkdir -m 700 {os.path.join(path, 'offload')}: "
                           "a Kubernetes emptyDir is mode 777 and not sticky)")


def write_atomic(path: str, data: bytes | str, dir_fd: int | None = None) -> None:
    """Write ``data`` as the file ``path`` (relative to ``dir_fd`` when given) so that a reader
    sees the old file or the whole new one, and nothing planted in the directory is followed.

    NOTE: a fixed temporary name (``<path>.tmp``) opened with a plain ``open`` follows a
    symlink another user planted there, in a directory others can write, and overwrites
    whatever file of ours it points to.  The bytes go instead to a new file under a random
    name in the same directory, created ``O_CREAT|O_EXCL|O_NOFOLLOW`` mode 0600 (as
    ``tempfile.mkstemp`` does: a planted name fails it, never redirects it), flushed to disk,
    then renamed over ``path`` (a rename replaces a symlink at ``path``, never follows it).  The
    directory is opened once and both names are resolved in it.

    Raises:
        OSError: the directory cannot be opened or written, or ``path`` belongs to another
            user in a sticky directory; the temporary file is removed.
    """
    folder, name = os.path.split(path)
    if not name:
        raise IsADirectoryError(errno.EISDIR, "names a directory, not a file", path)
    if dir_fd is not None:
        if folder:
            raise ValueError(f"{path}: with dir_fd, give a name inside that directory")
        _write_in(dir_fd, name, data.encode() if isinstance(data, str) else data)
        return
    own_fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _write_in(own_fd, name, data.encode() if isinstance(data, str) else data)
    finally:
        os.close(own_fd)


def _write_in(dir_fd: int, name: str, data: bytes) -> None:
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
