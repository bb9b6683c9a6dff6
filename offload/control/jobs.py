"""One rank's job book: every job from the moment it takes its sequence place until the tier
has handed its result back.

All job bookkeeping of a rank lives here, so that no path can take a job without giving it a
place in the sequence, and no path can refuse one without recording the refusal:

* `open` gives every job -- accepted or refused -- the next sequence number.  A job the rank
  refuses (a reused id, a bad index, an engine error) is still opened and then failed with
  its reason, so every rank's sequence stays aligned and the quorum decides the job failed on
  every rank.
* A job is *in flight* on this rank from `open` until its copy is done and the watermark passed
  it (`retire`).  `retire` returns the new watermark and the failures, for the quorum.
* A *kept* job (SPMD) stays in the book after that, until `take` hands its outcome to the
  tier's `finished` or `wait`.  Its id is *live* until then: a second job with a live id is
  refused -- on the rank that still holds it, and decided failed on every rank.

Pure bookkeeping: no torch, no stores, no clocks other than the stamps given in.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass
class Entry:
    """One job on this rank.  ``error`` is this rank's reason for failing it (refusal, engine
    error, integrity mismatch); ``bytes`` and ``seconds`` are this rank's own figures."""

    seq: int
    job_id: int
    job: Any
    keep: bool
    started: float  # time.perf_counter() at open: the job's transfer time counts from here
    submitted_at: float  # time.monotonic() at open: the decider's overdue check counts from here
    done: bool = False
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    # a load's checked (blocks, host pages) when an audit compares them on completion
    audited: tuple[Any, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class JobBook:
    """This rank's jobs in sequence order (module docstring)."""

    def __init__(self) -> None:
        self._next = 0
        self._completed = 0  # watermark: every job below it is done on this rank
        self._flight: dict[int, Entry] = {}  # seq -> entry until retired, in order
        self._kept: dict[int, Entry] = {}  # seq -> kept entry until taken, in order
        self._live_ids: collections.Counter[int] = collections.Counter()

    # ------------------------------------------------------------------ sequence
    @property
    def submitted(self) -> int:
        """Jobs opened so far: the next job's sequence number."""
        return self._next

    @property
    def completed(self) -> int:
        """This rank's watermark."""
        return self._completed

    @property
    def in_flight(self) -> int:
        """Jobs opened and not yet retired."""
        return len(self._flight)

    def open(self, job_id: int, job: Any, keep: bool, started: float,
             submitted_at: float, rank: int) -> Entry:
        """Give a job its sequence place.  A kept job whose id is live on this rank is opened
        already refused (``error`` set): the caller fails it, it never runs."""
        entry = Entry(self._next, job_id, job, keep, started, submitted_at)
        self._next += 1
        self._flight[entry.seq] = entry
        if keep:
            if self._live_ids[job_id]:
                entry.error = (f"job id {job_id} was reused while a job with that id was still "
                               f"in flight on rank {rank}; reuse an id only after finished() "
                               "or wait() returned it on every rank")
            self._kept[entry.seq] = entry
            self._live_ids[job_id] += 1
        return entry

    def get(self, seq: int) -> Entry | None:
        """The in-flight entry of ``seq`` (None once retired)."""
        return self._flight.get(seq)

    def find(self, seq: int) -> Entry | None:
        """The entry of ``seq`` while the book holds it, in flight or kept."""
        return self._flight.get(seq) or self._kept.get(seq)

    def undone(self) -> list[Entry]:
        """In-flight entries whose copy is not done yet, in order."""
        return [e for e in self._flight.values() if not e.done]

    def retire(self) -> tuple[int, list[tuple[int, str]]] | None:
        """Retire the done jobs at the head of the order; return the new watermark and the
        (sequence, reason) of the retired ones that failed, or None when nothing moved."""
        start = self._completed
        failures = []
        while self._flight:
            seq, entry = next(iter(self._flight.items()))
            if not entry.done:
                break
            del self._flight[seq]
            self._completed = seq + 1
            if entry.error is not None:
                failures.append((seq, entry.error))
        if self._completed == start:
            return None
        return self._completed, failures

    # ------------------------------------------------------------------ kept jobs
    @property
    def live(self) -> int:
        """Kept jobs not yet taken."""
        return len(self._kept)

    def oldest_live(self) -> Entry | None:
        return next(iter(self._kept.values()), None)

    def live_seqs(self, job_ids: Iterable[int]) -> list[int]:
        """Sequence numbers of the newest live job of each of these ids, in order.  Only the
        newest: an id is live twice only on a rank that refused its reuse before it learned
        the decision on the older job, and that older job must still come back through
        `finished` there, as it did on the other ranks."""
        wanted = set(job_ids)
        newest = {e.job_id: seq for seq, e in self._kept.items() if e.job_id in wanted}
        return sorted(newest.values())

    def is_live(self, job_id: int) -> bool:
        return self._live_ids[job_id] > 0

    def take(self, seqs: Iterable[int]) -> list[Entry]:
        """Hand these kept jobs back to the caller (their ids become free again)."""
        taken = []
        for seq in seqs:
            entry = self._kept.pop(seq)
            self._live_ids[entry.job_id] -= 1
            if not self._live_ids[entry.job_id]:
                del self._live_ids[entry.job_id]
            taken.append(entry)
        return taken

    def kept_below(self, through: int) -> list[Entry]:
        """The kept jobs with a sequence below ``through``, in order (still kept)."""
        below = []
        for seq, entry in self._kept.items():  # in sequence order
            if seq >= through:
                break
            below.append(entry)
        return below
