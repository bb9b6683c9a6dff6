"""The chunk manager: which chunk holds which key, and which chunks may be reused.

It runs on the scheduling rank only and is pure bookkeeping (no torch, no I/O); the copies
themselves run on every rank and are counted done by the quorum (`offload.control.quorum`).  Its
rules (DESIGN.md section 6):

* a chunk is ``free``, ``storing`` (a store job is writing it: not readable, not evictable) or
  ``readable``;
* a readable chunk may carry *holds*, one per pending load that reads it; a held chunk is never
  evicted nor reused, so a load never reads bytes a later store overwrote;
* stores take free chunks first, then evict the least recently used readable chunk without
  holds; a failed store's chunks are never readable (their bytes may be half written);
* a failed job's chunks are *quarantined* when the caller gives a ``fence``: a rank that missed
  the deadline may still be copying them, and an engine may run a later job's copies before a
  late earlier one lands (several streams), so reusing them early lets the late copy corrupt
  the next owner's bytes.  A failed store's chunks stay out of use, a failed load keeps its
  holds, until `drained` reports every rank completed the jobs below the fence (the tier's
  watermarks tell; `HostTier.submitted` after the failure is the fence).  Without a fence
  (the job never reached any rank) they are released at once.

With a file tier behind host memory (``disk_capacity`` > 0) a key is in one of three states:
in host memory, on disk, or both.

* the longest-prefix lookup spans both tiers;
* a readable host chunk evicted for reuse is *spilled* to disk unless it is there already:
  the job that takes the chunk lists it in ``spills``, which every rank executes (writing its
  slot of the row) before anything is copied into the chunk;
* a key on disk only is *promoted* before it is loaded (`prepare_promote`): it gets a host
  chunk as a store would, every rank reads its file into its slot of the row, and the key
  becomes readable in host memory (and stays on disk) when every rank verified its bytes
  (`complete_promote`); a key whose read failed anywhere is dropped from both tiers, and its
  chunk is quarantined while some rank's read of it may still be running (a read past its
  deadline still writes into the row when it returns): the caller reports those rows
  (``busy``) with every promotion, and a row comes back once no report lists it;
* stores skip keys that are on disk (they are cached).

The disk side is a replay (`DiskIndex`) of the calls every writer's `FileTier` receives, in
the same order, so it needs no I/O and no reply to know what the disk holds.

Every ``prepare_*`` returns a job that must be finished by exactly one ``complete_*`` call, even
when the job has no chunks, so the caller's bookkeeping needs no special case.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from offload.errors import OffloadError
from offload.tiers.disk_index import DiskIndex

ChunkKey = Hashable
Pairs = tuple[tuple[ChunkKey, int], ...]


class NotReadableError(LookupError):
    """A load named a key that is not readable in host memory (never stored, still being
    stored, evicted, or on disk only), or a promotion a key that is on no tier; call
    `ChunkManager.lookup_prefix` first, promote what `residence` says is on disk only, and load
    only readable keys."""


class UnknownJobError(KeyError):
    """A ``complete_*`` call named a job id that is not an outstanding job of that kind."""


@dataclass(frozen=True)
class StoreJob:
    """Chunks a store writes.  ``chunks`` pairs each key to store with its chunk id, in request
    order; ``skipped`` keys were already cached (readable in host memory, or on disk) or being
    stored (or repeated in the request);
    ``dropped`` keys found no chunk.  Once one key is dropped every later new key is too, so
    the stored keys are always the request's new keys up to the first dropped one.
    ``spills`` are evicted readable keys to write to disk first, with the chunk they leave
    (each rank writes its slot of the row out before the store copies into it); ``evicted``
    lists every key this job evicted from host memory (spilled or not), oldest first, for
    an engine that announces removals."""

    job_id: int
    chunks: tuple[tuple[ChunkKey, int], ...]
    skipped: tuple[ChunkKey, ...]
    dropped: tuple[ChunkKey, ...]
    spills: tuple[tuple[ChunkKey, int], ...] = ()
    evicted: tuple[ChunkKey, ...] = ()

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
class PromoteJob(StoreJob):
    """Disk hits brought back into host memory: ``chunks`` pairs each key to read with its new
    chunk; ``skipped`` keys were readable in host memory or on their way there; ``dropped``
    found no chunk; ``spills`` as for a store.  Every rank runs `RankFiles.promote`."""


@dataclass(frozen=True)
class ManagerStats:
    """Chunk counts: ``free + storing + readable + quarantined + not_ready == chunk_count``
    (``not_ready``: rows background set-up has not made usable on every rank yet); ``held``
    counts readable chunks with at least one hold (a failed load's quarantined holds
    included); ``evictions`` counts readable chunks reused by stores (and promotions).  With a
    file tier: ``on_disk`` keys on disk, ``spilled`` chunks written out on eviction,
    ``promoted`` keys read back into host memory."""

    chunk_count: int
    free: int
    storing: int
    readable: int
    held: int
    evictions: int
    quarantined: int = 0
    not_ready: int = 0
    on_disk: int = 0
    spilled: int = 0
    promoted: int = 0


JobT = TypeVar("JobT", StoreJob, LoadJob, PromoteJob)


class ChunkManager:
    """Maps chunk keys to chunk ids ``0 .. chunk_count - 1`` with LRU eviction and load holds.

    Recency: a key becomes most recently used when its store completes and again when a load
    that read it completes (a held chunk is not evictable, so its position only matters once
    the last hold is released).  `lookup_prefix` is a pure query and does not touch.
    """

    def __init__(self, chunk_count: int, disk_capacity: int = 0, ready: int | None = None
                 ) -> None:
        if chunk_count < 1:
            raise OffloadError(f"chunk_count = {chunk_count} must be at least 1")
        # chunks below this are usable on every rank (background set-up raises it)
        self._ready = chunk_count if ready is None else max(0, min(ready, chunk_count))
        # the writers' file tiers, replayed (None: no file tier)
        self._disk = DiskIndex(disk_capacity) if disk_capacity else None
        self._promote_jobs: dict[int, PromoteJob] = {}
        self._io_busy: set[int] = set()  # failed promotions' chunks a read may still fill
        self._spilled = self._promoted = 0
        self._chunk_count = chunk_count
        self._free = list(range(self._ready))  # a heap: lowest free id first, deterministic
        self._chunk_of: dict[ChunkKey, int] = {}  # storing and readable keys
        self._storing: set[ChunkKey] = set()
        self._holds: dict[ChunkKey, int] = {}  # readable keys with holds > 0
        self._evictable: OrderedDict[ChunkKey, None] = OrderedDict()  # readable, unheld; LRU
        self._store_jobs: dict[int, StoreJob] = {}
        self._load_jobs: dict[int, LoadJob] = {}
        self._job_ids = itertools.count()
        self._evictions = 0
        self._evicted: list[ChunkKey] = []  # victims of the current `prepare_store`
        # failed jobs' chunks (stores) and holds (loads) by fence, until `drained` passes it
        self._quarantine: list[tuple[int, list[int], Pairs]] = []
        # chunks whose bytes a load found damaged: their key is gone; chunk -> holds left
        self._condemned: dict[int, int] = {}
        self._seeded: set[int] = set()  # chunks `seed` gave a key (never free on set_ready)

    @property
    def chunk_count(self) -> int:
        return self._chunk_count

    @property
    def ready(self) -> int:
        """Chunks ``0 .. ready - 1`` may be handed out; the others wait for set-up."""
        return self._ready

    def set_ready(self, rows: int) -> int:
        """Rows below ``rows`` are now usable on every rank (the tier's ready watermark,
        which only rises): their chunks join the free chunks.  Returns how many joined."""
        rows = min(rows, self._chunk_count)
        added = max(0, rows - self._ready)
        for chunk in range(self._ready, rows):
            if chunk not in self._seeded:
                heapq.heappush(self._free, chunk)
        self._ready = max(self._ready, rows)
        return added

    def prepare_store(self, keys: Sequence[ChunkKey]) -> StoreJob:
        """Allocate chunks for the keys that are neither readable, being stored, nor on disk.

        Free chunks go first (lowest id first), then LRU readable chunks without holds (spilled
        to disk first where there is a file tier, see ``spills``).  Keys named in this request
        are never evicted for it (a prefix that is already cached must stay cached while its
        continuation is stored).  When chunks run out, the new keys before the first key
        without a chunk are stored and every later new key is reported in ``dropped``: a
        stored sequence never has holes.
        """
        evicted_before = len(self._evicted)
        chunks, skipped, dropped, spills = self._allocate(
            keys, lambda key: key in self._chunk_of or self._on_disk(key))
        evicted = tuple(self._evicted[evicted_before:])
        del self._evicted[evicted_before:]
        job = StoreJob(next(self._job_ids), chunks, skipped, dropped, spills, evicted)
        self._store_jobs[job.job_id] = job
        return job

    def prepare_promote(self, keys: Sequence[ChunkKey]) -> PromoteJob:
        """Allocate host chunks for the ``keys`` that are on disk only, as `prepare_store`
        does (same order, protection, spills and ``dropped`` rule); until `complete_promote`
        they are not readable.  Keys readable in host memory or on their way there are
        ``skipped``; a key on no tier raises `NotReadableError` and nothing changes.

        The disk picture replays what every rank then does: make the keys to read most
        recently used, write out the spills, read the keys."""
        for key in keys:
            if key not in self._chunk_of and not self._on_disk(key):
                raise NotReadableError(f"chunk key {key!r} is not cached; it cannot be "
                                       "promoted")
        protected = set(keys)
        new = [k for k in dict.fromkeys(keys) if k not in self._chunk_of]
        room = len(self._free) + sum(1 for k in self._evictable if k not in protected)
        reads = new[:room]  # the keys that will get a chunk
        for key in reads:  # are touched before the spills are written (in _allocate) ...
            self._touch(key)
        chunks, skipped, dropped, spills = self._allocate(
            keys, lambda key: key in self._chunk_of)
        assert [key for key, _ in chunks] == reads
        for key in reads:  # ... and read after them
            self._touch(key)
        job = PromoteJob(next(self._job_ids), chunks, skipped, dropped, spills)
        self._promote_jobs[job.job_id] = job
        return job

    def complete_promote(self, job_id: int, failed: Collection[ChunkKey],
                         busy: Collection[int] = ()) -> None:
        """Finish a promotion: its keys become readable in host memory (most recently used)
        and stay on disk, except the ``failed`` ones (some rank could not read verified bytes):
        those are forgotten on disk too (the caller discards them on every rank) and their
        chunks freed, or quarantined when listed in ``busy``.

        Args:
            job_id: the `PromoteJob`'s id.
            failed: keys of the job some rank could not read back.
            busy: every chunk whose row some rank's file read may still write into, as the
                ranks report it now (`RankFiles.busy_rows`, all ranks' union; pass all the
                job's chunks when a rank failed without reporting).  Chunks quarantined by an
                earlier promotion and no longer listed are freed.
        """
        job = self._pop_job(self._promote_jobs, job_id, "promote")
        busy = set(busy)
        for chunk in sorted(self._io_busy - busy):  # every rank's read of it has returned
            self._io_busy.discard(chunk)
            heapq.heappush(self._free, chunk)
        for key, chunk in job.chunks:
            self._storing.discard(key)
            if key in failed:
                del self._chunk_of[key]
                if chunk in busy:
                    self._io_busy.add(chunk)
                else:
                    heapq.heappush(self._free, chunk)
                if self._disk is not None:
                    self._disk.discard(key)
            else:
                self._evictable[key] = None
                self._promoted += 1

    def storing(self, key: ChunkKey) -> bool:
        """Whether ``key`` is being stored or promoted (readable once its job completes)."""
        return key in self._storing

    def residence(self, key: ChunkKey) -> str | None:
        """Where ``key`` can be read from: ``host``, ``disk``, ``both`` or None (not cached;
        a key being stored or promoted is not readable in host memory yet)."""
        host, disk = self._readable(key), self._on_disk(key)
        return ("both" if disk else "host") if host else ("disk" if disk else None)

    def seed_disk(self, stored: Sequence[bytes]) -> None:
        """Adopt what the writers' file tiers found at start (`FileTier.stored_keys` after
        every writer agreed, least recently used first)."""
        if self._disk is not None:
            self._disk.seed(stored)

    def seed(self, pairs: Sequence[tuple[ChunkKey, int]]) -> None:
        """Adopt keys that are readable in given chunks (a kept tier's index, docs/KEEP.md),
        least recently used first; a key or chunk already taken, or a chunk out of range, is
        skipped.  Call it before any job."""
        taken: set[int] = set()
        for key, chunk in pairs:
            if (key in self._chunk_of or chunk in taken or chunk in self._seeded
                    or not 0 <= chunk < self._chunk_count):
                continue
            self._chunk_of[key] = chunk
            self._evictable[key] = None
            taken.add(chunk)
        self._seeded |= taken
        self._free = [c for c in self._free if c not in taken]
        heapq.heapify(self._free)

    def disk_keys(self) -> list[bytes]:
        """The keys on disk in their stored form, least recently used first: what
        `seed_disk` takes (a manager elsewhere adopts this one's disk picture)."""
        return self._disk.lru() if self._disk is not None else []

    def _allocate(self, keys: Sequence[ChunkKey], cached: Callable[[ChunkKey], bool]
                  ) -> tuple[Pairs, tuple[ChunkKey, ...], tuple[ChunkKey, ...], Pairs]:
        """Take chunks for the keys not ``cached`` (chunks, skipped, dropped, spills)."""
        protected = set(keys)
        chunks: list[tuple[ChunkKey, int]] = []
        spills: list[tuple[ChunkKey, int]] = []
        skipped: list[ChunkKey] = []
        dropped: list[ChunkKey] = []
        seen: set[ChunkKey] = set()  # new keys of this request handled so far
        for key in keys:
            if key in seen or cached(key):
                skipped.append(key)
                continue
            seen.add(key)
            # after one key found no chunk, later keys are dropped too: no holes in a sequence
            chunk = None if dropped else self._take_chunk(protected, spills)
            if chunk is None:
                dropped.append(key)
                continue
            self._chunk_of[key] = chunk
            self._storing.add(key)
            chunks.append((key, chunk))
        return tuple(chunks), tuple(skipped), tuple(dropped), tuple(spills)

    def complete_store(self, job_id: int, ok: bool, fence: int | None = None) -> None:
        """Finish a store: on success its chunks become readable (most recently used); on
        failure they are never readable (their bytes may be partly written on some ranks) and
        are quarantined until `drained` passes ``fence``, or freed at once without one."""
        job = self._pop_job(self._store_jobs, job_id, "store")
        failed = []
        for key, chunk in job.chunks:
            self._storing.discard(key)
            if ok:
                self._evictable[key] = None
            else:
                del self._chunk_of[key]
                failed.append(chunk)
        if fence is None:
            for chunk in failed:
                heapq.heappush(self._free, chunk)
        elif failed:
            self._quarantine.append((fence, failed, ()))

    def prepare_load(self, keys: Sequence[ChunkKey]) -> LoadJob:
        """Hold the chunks of ``keys`` (one hold per occurrence) until `complete_load`.

        Every key must be readable in host memory; otherwise nothing is held and
        `NotReadableError` names the first key that is not.
        """
        for key in keys:
            if not self._readable(key):
                state = ("still being stored" if key in self._storing else
                         "on disk only; promote it first" if self._on_disk(key) else
                         "not cached")
                raise NotReadableError(f"chunk key {key!r} is {state}; it cannot be loaded")
        for key in keys:
            self._holds[key] = self._holds.get(key, 0) + 1
            self._evictable.pop(key, None)
        job = LoadJob(next(self._job_ids), tuple((k, self._chunk_of[k]) for k in keys))
        self._load_jobs[job.job_id] = job
        return job

    def complete_load(self, job_id: int, fence: int | None = None,
                      damaged: Collection[ChunkKey] = ()) -> None:
        """Release a load's holds; a chunk without holds becomes the most recently used.  With
        a ``fence`` (the load failed) the holds stay until `drained` passes it.

        ``damaged`` keys (the load found their host bytes did not match their checksums) are
        dropped at once: no lookup finds them and a later store of the key takes a new chunk;
        their chunk is reused once no load holds it any more (and past the fence)."""
        job = self._pop_job(self._load_jobs, job_id, "load")
        for key in dict.fromkeys(damaged):
            self._condemn(key)
        if fence is not None:
            self._quarantine.append((fence, [], job.chunks))
            return
        self._release_holds(job.chunks)

    def _condemn(self, key: ChunkKey) -> None:
        """Forget ``key``'s host copy: its chunk waits for its holds, then is free."""
        if not self._readable(key):
            return
        chunk = self._chunk_of.pop(key)
        self._evictable.pop(key, None)
        holds = self._holds.pop(key, 0)
        if holds:
            self._condemned[chunk] = holds
        else:
            heapq.heappush(self._free, chunk)

    def drop(self, keys: Collection[ChunkKey] | None = None) -> None:
        """Forget ``keys`` (None: every cached key) on both tiers, as an engine's cache reset
        does: no lookup finds them and a later store of one takes a new chunk.  A chunk that
        pending loads hold is reused once they are completed; keys being stored are left to
        their store.

        The disk side forgets only in this replay: the writers' files stay where they are
        and are never read again (no lookup names them), and their file tiers evict them
        first, being the least recently used."""
        if keys is None:
            keys = [k for k in self._chunk_of if k not in self._storing]
            if self._disk is not None:  # the replay holds keys' stored form: start it anew
                self._disk = DiskIndex(self._disk.capacity)
        for key in dict.fromkeys(keys):
            self._condemn(key)
            if self._disk is not None:
                self._disk.discard(key)

    def drained(self, through: int) -> int:
        """Every rank has completed every job below ``through``: end the quarantines whose
        fence that reaches.  Returns how many chunks and holds were released."""
        released = 0
        keep = []
        for fence, chunks, holds in self._quarantine:
            if fence > through:
                keep.append((fence, chunks, holds))
                continue
            for chunk in chunks:
                heapq.heappush(self._free, chunk)
            self._release_holds(holds)
            released += len(chunks) + len(holds)
        self._quarantine = keep
        return released

    def _release_holds(self, pairs: Pairs) -> None:
        """Release one hold per (key, chunk) pair; holds are counted by key, except on a
        condemned chunk, whose key may already name another chunk."""
        for key, chunk in pairs:
            if chunk in self._condemned:
                self._condemned[chunk] -= 1
                if not self._condemned[chunk]:
                    del self._condemned[chunk]
                    heapq.heappush(self._free, chunk)
                continue
            remaining = self._holds[key] - 1
            if remaining:
                self._holds[key] = remaining
            else:
                del self._holds[key]
                self._evictable[key] = None

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` are readable in host memory or on disk: the longest
        cached prefix (`residence` says which keys need a promotion before their load)."""
        for count, key in enumerate(keys):
            if not (self._readable(key) or self._on_disk(key)):
                return count
        return len(keys)

    def stats(self) -> ManagerStats:
        storing = len(self._storing)
        readable = len(self._chunk_of) - storing
        quarantined = (sum(len(chunks) for _, chunks, _ in self._quarantine)
                       + len(self._condemned)
                       + len(self._io_busy))
        return ManagerStats(self._chunk_count, len(self._free), storing, readable,
                            len(self._holds), self._evictions, quarantined,
                            self._chunk_count - self._ready,
                            len(self._disk) if self._disk is not None else 0, self._spilled,
                            self._promoted)

    def _readable(self, key: ChunkKey) -> bool:
        return key in self._chunk_of and key not in self._storing

    def _touch(self, key: ChunkKey) -> None:
        if self._disk is not None:
            self._disk.touch(key)

    def _on_disk(self, key: ChunkKey) -> bool:
        return self._disk is not None and key in self._disk

    def _take_chunk(self, protected: set[ChunkKey], spills: list[tuple[ChunkKey, int]]
                    ) -> int | None:
        """A free chunk, else the chunk of the LRU unheld readable key not in ``protected``;
        an evicted key that is not on disk yet is spilled (appended to ``spills``)."""
        if self._free:
            return heapq.heappop(self._free)
        victim = next((k for k in self._evictable if k not in protected), None)
        if victim is None:
            return None
        del self._evictable[victim]
        self._evictions += 1
        self._evicted.append(victim)
        chunk = self._chunk_of.pop(victim)
        if self._disk is not None and victim not in self._disk:  # (a put would touch it)
            self._disk.put(victim)
            spills.append((victim, chunk))
            self._spilled += 1
        return chunk

    @staticmethod
    def _pop_job(jobs: dict[int, JobT], job_id: int, kind: str) -> JobT:
        try:
            return jobs.pop(job_id)
        except KeyError:
            raise UnknownJobError(f"no outstanding {kind} job {job_id}") from None
