"""The chunk manager: which chunk holds which key, and which chunks may be reused.

It runs on the scheduling rank only and is pure bookkeeping (no torch, no I/O); the copies
themselves run on every rank and are counted done by the quorum (`offload.quorum`).  Its rules
(DESIGN.md section 6):

* a chunk is ``free``, ``storing`` (a store job is writing it: not readable, not evictable) or
  ``readable``;
* a readable chunk may carry *holds*, one per pending load that reads it; a held chunk is never
  evicted nor reused, so a load never reads bytes a later store overwrote;
* stores take free chunks first, then evict the least recently used readable chunk without
  holds; a failed store frees its chunks, so a half-written chunk is never readable.

Every ``prepare_*`` returns a job that must be finished by exactly one ``complete_*`` call, even
when the job has no chunks, so the caller's bookkeeping needs no special case.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from offload.errors import OffloadError

ChunkKey = Hashable


class NotReadableError(LookupError):
    """A load named a key that is not readable (never stored, still being stored, or evicted);
    call `ChunkManager.lookup_prefix` first and load only the keys it reports."""


class UnknownJobError(KeyError):
    """A ``complete_*`` call named a job id that is not an outstanding job of that kind."""


@dataclass(frozen=True)
class StoreJob:
    """Chunks a store writes.  ``chunks`` pairs each key to store with its chunk id, in request
    order; ``skipped`` keys were already readable or being stored (or repeated in the request);
    ``dropped`` keys found no chunk.  Once one key is dropped every later new key is too, so
    the stored keys are always the request's new keys up to the first dropped one."""

    job_id: int
    chunks: tuple[tuple[ChunkKey, int], ...]
    skipped: tuple[ChunkKey, ...]
    dropped: tuple[ChunkKey, ...]

    @property
    def truncated(self) -> bool:
        """True when the tier could not hold every new key of the request."""
        return bool(self.dropped)


@dataclass(frozen=True)
class LoadJob:
    """Chunks a load reads, in request order; each pair holds its chunk until completion."""

    job_id: int
    chunks: tuple[tuple[ChunkKey, int], ...]


@dataclass(frozen=True)
class ManagerStats:
    """Chunk counts: ``free + storing + readable == chunk_count``; ``held`` counts readable
    chunks with at least one hold; ``evictions`` counts readable chunks reused by stores."""

    chunk_count: int
    free: int
    storing: int
    readable: int
    held: int
    evictions: int


JobT = TypeVar("JobT", StoreJob, LoadJob)


class ChunkManager:
    """Maps chunk keys to chunk ids ``0 .. chunk_count - 1`` with LRU eviction and load holds.

    Recency: a key becomes most recently used when its store completes and again when a load
    that read it completes (a held chunk is not evictable, so its position only matters once
    the last hold is released).  `lookup_prefix` is a pure query and does not touch.
    """

    def __init__(self, chunk_count: int) -> None:
        if chunk_count < 1:
            raise OffloadError(f"chunk_count = {chunk_count} must be at least 1")
        self._chunk_count = chunk_count
        self._free = list(range(chunk_count))  # a heap: lowest free id first, deterministic
        self._chunk_of: dict[ChunkKey, int] = {}  # storing and readable keys
        self._storing: set[ChunkKey] = set()
        self._holds: dict[ChunkKey, int] = {}  # readable keys with holds > 0
        self._evictable: OrderedDict[ChunkKey, None] = OrderedDict()  # readable, unheld; LRU
        self._store_jobs: dict[int, StoreJob] = {}
        self._load_jobs: dict[int, LoadJob] = {}
        self._job_ids = itertools.count()
        self._evictions = 0

    @property
    def chunk_count(self) -> int:
        return self._chunk_count

    def prepare_store(self, keys: Sequence[ChunkKey]) -> StoreJob:
        """Allocate chunks for the keys that are neither readable nor being stored.

        Free chunks go first (lowest id first), then LRU readable chunks without holds.  Keys
        named in this request are never evicted for it (a prefix that is already cached must
        stay cached while its continuation is stored).  When chunks run out, the new keys
        before the first key without a chunk are stored and every later new key is reported
        in ``dropped``: a stored sequence never has holes.
        """
        protected = set(keys)
        chunks: list[tuple[ChunkKey, int]] = []
        skipped: list[ChunkKey] = []
        dropped: list[ChunkKey] = []
        seen: set[ChunkKey] = set()  # new keys of this request handled so far
        for key in keys:
            if key in self._chunk_of or key in seen:
                skipped.append(key)
                continue
            seen.add(key)
            # after one key found no chunk, later keys are dropped too: no holes in a sequence
            chunk = None if dropped else self._take_chunk(protected)
            if chunk is None:
                dropped.append(key)
                continue
            self._chunk_of[key] = chunk
            self._storing.add(key)
            chunks.append((key, chunk))
        job = StoreJob(next(self._job_ids), tuple(chunks), tuple(skipped), tuple(dropped))
        self._store_jobs[job.job_id] = job
        return job

    def complete_store(self, job_id: int, ok: bool) -> None:
        """Finish a store: on success its chunks become readable (most recently used); on
        failure they are freed, because their bytes may be partly written on some ranks."""
        job = self._pop_job(self._store_jobs, job_id, "store")
        for key, chunk in job.chunks:
            self._storing.discard(key)
            if ok:
                self._evictable[key] = None
            else:
                del self._chunk_of[key]
                heapq.heappush(self._free, chunk)

    def prepare_load(self, keys: Sequence[ChunkKey]) -> LoadJob:
        """Hold the chunks of ``keys`` (one hold per occurrence) until `complete_load`.

        Every key must be readable; otherwise nothing is held and `NotReadableError` names the
        first key that is not.
        """
        for key in keys:
            if not self._readable(key):
                state = "still being stored" if key in self._storing else "not cached"
                raise NotReadableError(f"chunk key {key!r} is {state}; it cannot be loaded")
        for key in keys:
            self._holds[key] = self._holds.get(key, 0) + 1
            self._evictable.pop(key, None)
        job = LoadJob(next(self._job_ids), tuple((k, self._chunk_of[k]) for k in keys))
        self._load_jobs[job.job_id] = job
        return job

    def complete_load(self, job_id: int) -> None:
        """Release a load's holds; a chunk without holds becomes the most recently used."""
        job = self._pop_job(self._load_jobs, job_id, "load")
        for key, _ in job.chunks:
            remaining = self._holds[key] - 1
            if remaining:
                self._holds[key] = remaining
            else:
                del self._holds[key]
                self._evictable[key] = None

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` are readable: the longest cached prefix."""
        for count, key in enumerate(keys):
            if not self._readable(key):
                return count
        return len(keys)

    def stats(self) -> ManagerStats:
        storing = len(self._storing)
        readable = len(self._chunk_of) - storing
        return ManagerStats(self._chunk_count, len(self._free), storing, readable,
                            len(self._holds), self._evictions)

    def _readable(self, key: ChunkKey) -> bool:
        return key in self._chunk_of and key not in self._storing

    def _take_chunk(self, protected: set[ChunkKey]) -> int | None:
        """A free chunk, else the chunk of the LRU unheld readable key not in ``protected``."""
        if self._free:
            return heapq.heappop(self._free)
        victim = next((k for k in self._evictable if k not in protected), None)
        if victim is None:
            return None
        del self._evictable[victim]
        self._evictions += 1
        return self._chunk_of.pop(victim)

    @staticmethod
    def _pop_job(jobs: dict[int, JobT], job_id: int, kind: str) -> JobT:
        try:
            return jobs.pop(job_id)
        except KeyError:
            raise UnknownJobError(f"no outstanding {kind} job {job_id}") from None
