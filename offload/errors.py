"""Error types.

`OffloadError` is a *user* error: its message is one line that names the bad value, the limit
and the fix.  The main job prints it without a traceback and exits non-zero.  Anything else
escaping is a bug and keeps its traceback.
"""

from __future__ import annotations


class OffloadError(Exception):
    """A user-facing error whose message is a single self-explanatory line."""


class PeerError(OffloadError):
    """Another rank failed or stopped answering; the message names the rank(s)."""


def one_line(exc: BaseException) -> str:
    """The first line of an error; non-user errors keep their type, which says what broke."""
    lines = str(exc).strip().splitlines()
    if isinstance(exc, OffloadError) and lines:
        return lines[0]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
