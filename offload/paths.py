"""Checks of user-given directories, shared by the settings that name one (``--shm-dir``,
``--fs-tier``): each failure is one line naming the setting, the path and the fix."""

from __future__ import annotations

import os

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
