"""Checks of user-given directories, shared by the settings that name one (``--shm-dir``,
``--fs-tier``): each failure is one line naming the setting, the path and the fix.

The tier creates its files in such a directory and finds them again by name (a peer opens a
named region's segments, a restarted file tier its fingerprint folder).  Whoever may rename
entries there could swap two of them -- two segments of one region, or two ranks' file tier
folders -- and every check on the file itself (owner, mode, size) would still pass.  So the
directory must belong to this user or to root, and a directory that others may write must be
sticky (as ``/dev/shm`` and ``/tmp`` are): there only an entry's owner may rename or remove it.
"""

from __future__ import annotations

import os
import stat

from offload.errors import OffloadError


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
