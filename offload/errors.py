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
