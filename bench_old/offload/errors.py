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


class JobFailed(OffloadError):
    """A job was decided failed: ``rank`` (the lowest failing rank) refused or failed it for
    ``reason``.  ``damaged`` says the reason was an integrity mismatch: the host bytes of the
    job's chunks are not what was stored, so their keys must be dropped (``ChunkManager.
    complete_load(..., damaged=keys)``)."""

    def __init__(self, job_id: int, rank: int, reason: str) -> None:
        super().__init__(f"job {job_id} failed on rank {rank}: {reason}")
        self.job_id, self.rank, self.reason = job_id, rank, reason

    @property
    def damaged(self) -> bool:
        return is_damage(self.reason)


def is_damage(reason: str | None) -> bool:
    """Whether a job's failure reason is an integrity mismatch (engines word them so)."""
    return reason is not None and reason.startswith("integrity")


def one_line(exc: BaseException) -> str:
    """The first line of an error; non-user errors keep their type, which says what broke."""
    lines = str(exc).strip().splitlines()
    if isinstance(exc, OffloadError) and lines:
        return lines[0]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
