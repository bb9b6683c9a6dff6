"""The library API: one host tier per rank, created collectively.

Every rank of a torch.distributed job calls `HostTier.create` with its own KV tensors.  Inside,
rank 0 gathers the ranks' descriptors, computes the plan and drives set-up through the collective
RPC (install plan -> build region -> agree on pinning -> start engines) while the other ranks serve;
then every rank gets its `HostTier` back.

Two ways to move blocks afterwards:

* **SPMD** (an engine whose scheduler already sends each step's decisions to every worker): every
  rank calls `submit` with the same `CopyJob` and `poll`s; the *decider* (the scheduling rank)
  calls `finished()` and sends the resulting `mark` with its step broadcast, and every other
  rank calls `finished(mark)` and gets the very same results -- decisions are made once and
  learned at the same point of every rank's step sequence, never by racing reads.  Simple
  programs call `wait(job_ids)` on every rank instead.
* **driven** (the main job): rank 0 owns the `ChunkManager` and calls `run` (every rank's actor
  copies, rank 0 waits for the quorum) while the other ranks sit in `serve`.

Both paths complete jobs through the same watermarks (`offload.control.quorum`,
`offload.control.board`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import hashlib
import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch
import torch.distributed as dist

from offload import fs_actions
from offload.actor import CopyJob, RankActor
from offload.config import TierConfig
from offload.control.board import Board, unpack_ready
from offload.control.jobs import Entry
from offload.control.plan import Plan, RankDescriptor, compute_plan
from offload.control.quorum import Quorum, Words, default_store
from offload.control.rpc import CollectiveRPC
from offload.control.stores import await_key
from offload.control.topology import NODE_GROUP_MIN_TIMEOUT_S, Topology, discover
from offload.errors import JobFailed, OffloadError, PeerError, is_damage, one_line
from offload.keep_index import Adopted, KeptManager
from offload.manager import ChunkManager, PromoteJob
from offload.observe.metrics import JobTally, MetricsServer, serve_metrics
from offload.region import cleanup
from offload.region.pin import Registrar
from offload.region.prefault import progress_logger
from offload.tiers.rank_files import disk_capacity
from offload.transfer.audit import Auditor
from offload.transfer.base import After

log = logging.getLogger(__name__)
_tier_seq: collections.defaultdict[str, itertools.count[int]] = collections.defaultdict(
    itertools.count)  # store namespace -> the tiers created there


@dataclass(frozen=True)
class TransferResult:
    """One decided job, as `HostTier.finished` returns it (the shape of vLLM's offloading
    worker's ``get_finished``).  ``success`` is the same on every rank: False when any rank
    refused or failed the job, and then ``failed_rank`` (the lowest such rank) and ``error``
    (its reason) are the same on every rank too.  ``transfer_size`` (bytes) and
    ``transfer_time`` (seconds from `submit` to the copy found complete) are this rank's own."""

    job_id: int
    success: bool
    transfer_size: int
    transfer_time: float
    failed_rank: int | None = None
    error: str | None = None

    @property
    def damaged(self) -> bool:
        """A load whose host bytes did not match their checksums: drop its keys
        (``ChunkManager.complete_load(..., damaged=keys)``); the engine recomputes them."""
        return is_damage(self.error)


@dataclass(frozen=True)
class Readiness:
    """How much of the tier is usable (DESIGN.md section 3.9): the rows below ``rows`` are set
    up on every rank, of ``total``.  ``stopped`` lists the ranks whose background set-up ended
    on an error: the tier then stays at ``rows`` (those rows remain usable)."""

    rows: int
    total: int
    stopped: tuple[int, ...] = ()

    @property
    def full(self) -> bool:
        return self.rows >= self.total

    @property
    def fraction(self) -> float:
        return self.rows / self.total if self.total else 1.0


@dataclass(frozen=True)
class DecisionMark:
    """Where the decider's decisions stand: every job with a sequence number below
    ``through`` is decided, and ``failed`` of the results `finished` returned so far were
    failures.  ``records`` holds (rank, failures) for each rank the decider had read failures
    of: a follower fetches failure records up to these counts, so it finds every failure the
    decider found, however stale its own view of another node.  Small and picklable (empty
    until some job fails): the scheduler sends it with its step broadcast."""

    through: int = 0
    failed: int = 0
    records: tuple[tuple[int, int], ...] = ()


class HostTier:
    """One rank's handle on the host tier."""

    def __init__(self, actor: RankActor, rpc: CollectiveRPC, plan: Plan, decider: int = 0,
                 disk_keys: Sequence[bytes] = (), kept: Sequence[Adopted] = ()):
        self.actor = actor
        self.rpc = rpc
        self.plan = plan
        self.decider = decider
        self.manager: ChunkManager | None = None
        if actor.topology.rank == 0:
            config = actor.config
            files = (disk_capacity(plan, actor.topology, config.fs_bytes_per_node)
                     if config.fs_dir is not None else 0)
            ready = 0 if config.background else None
            index = actor.keep_index
            if index is not None:  # retention: the index follows the manager's decisions
                kept_manager = KeptManager(plan.chunk_count, files, ready, index,
                                           actor._engine().generations, actor.created_at)
                kept_manager.seed_kept(kept)
                self.manager = kept_manager
            else:
                self.manager = ChunkManager(plan.chunk_count, files, ready=ready)
            self.manager.seed_disk(disk_keys)  # what a restart found on every writer's disk
        total = plan.chunk_count
        # readiness as of the tier's last look (`ready` looks again)
        self.last_ready = Readiness(0 if actor.config.background else total, total)
        self._ready_words: Words = {}
        self._ready_checked = 0.0  # monotonic time of the last look (multi-node: throttled)
        self.first_success_at: float | None = None  # perf_counter of the first job decided ok
        self.mark = DecisionMark()
        self._awaiting: int | None = None  # the driven job `run` waits for
        actor.quorum.first_needed = self._first_needed
        self.tally = JobTally()  # decided jobs, for live metrics (plain ints, no lock)
        self.last_words: Words | None = None  # the decider's last look at the watermarks
        self.metrics: MetricsServer | None = None
        self._closed = False
        cleanup.register(self.actor.close)

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, kv_tensors: Sequence[torch.Tensor], config: TierConfig, *,
               backend: str = "auto", audit: bool = False,
               registrar_factory: Callable[[torch.device], Registrar] | None = None,
               decider: int = 0, group: Any = None, store: dist.Store | None = None,
               metrics: Any = None) -> HostTier:
        """Collective: every rank calls it with its own KV tensors and the same config.

        ``backend`` picks the transfer backend (``auto``: by device and pinning); ``audit``
        hashes every block before store and after load and counts mismatches
        (`offload.transfer.audit`).  ``registrar_factory`` makes the object that pins host memory
        for the KV device (default `choose_registrar`: CUDA's driver API for CUDA tensors, in a
        context of its own with ``config.background`` and ``config.setup_context``; a
        recording no-op else).
        ``decider`` is the rank whose `finished` decides (the engine's scheduling rank; the
        same on every rank).

        ``group`` puts the tier on a caller's process group (e.g. one DP replica's TP x PP
        ranks; None: the default group): the whole control plane then runs on that group's
        ranks, every rank number (``decider``, the topology's, the report's) is a rank of that
        group and its rank 0 drives.  The control plane needs gloo: a group of another backend
        (NCCL) gets a gloo twin (`control_group`), made collectively over the *default* group --
        then every process of the job must call `create` at the same point (each with its own
        group, all of non-gloo backends); pass gloo groups to create tiers independently.
        ``store`` is the key-value store for the tier's keys (default: the job's own, see
        `offload.control.quorum.default_store`); keys live under a namespace unique to the group, so
        tiers on disjoint groups never see each other's.  ``metrics`` is a
        ``prometheus_client`` registry to add the tier's ``offload_*`` metrics to (the engine's
        own); ``config.metrics_port`` serves them over HTTP instead (`offload.observe.metrics`)."""
        started = time.perf_counter()
        group = control_group(group, config.timeout_s)
        topology = discover(config.tp, config.pp, config.timeout_s, group)
        if not 0 <= decider < topology.world_size:
            raise OffloadError(f"decider = {decider} is not a rank of this {topology.world_size}"
                               f"-rank job; give the scheduling rank, 0 to "
                               f"{topology.world_size - 1}")
        config = dataclasses.replace(config, tp=topology.tp)  # None meant world // pp
        tier_id, store = _tier_store(topology, config, store)
        board = Board.open(topology, tier_id, store, config.timeout_s, topology.leader_pid())
        rpc = CollectiveRPC(dist.PrefixStore("rpc", store), topology.rank,
                            topology.world_size, config.timeout_s,
                            doorbell=board if 0 in topology.node.ranks else None)
        quorum = Quorum(dist.PrefixStore("quorum", store), topology, board)
        progress = (progress_logger(log, f"pre-fault ({config.layout})")
                    if topology.rank == 0 else None)
        actor = RankActor(topology, config, list(kv_tensors), tier_id, quorum, progress, backend,
                          auditor=Auditor() if audit else None,
                          registrar_factory=registrar_factory, created_at=started)
        served: MetricsServer | None = None
        descriptor: RankDescriptor | str
        try:  # bound before set-up: a taken port fails every rank through rank 0, at once
            if config.metrics_port is not None or metrics is not None:
                served = serve_metrics(topology, config.metrics_port, config.metrics_addr,
                                       metrics)
            descriptor = _describe(actor)
        except Exception as exc:  # whatever it is, every rank must reach the gather
            descriptor = f"rank {topology.rank}: {one_line(exc)}"
        gathered: list[Any] | None = [None] * topology.world_size if topology.rank == 0 else None
        try:
            dist.gather_object(descriptor, gathered, dst=topology.global_rank(0), group=group)
            disk_keys: list[bytes] = []
            kept: list[Adopted] = []
            if topology.rank == 0:
                assert gathered is not None
                plan, disk_keys, kept = _drive_setup(actor, rpc, gathered)
            else:
                _serve_setup(actor, rpc)
                plan = actor._installed()
            tier = cls(actor, rpc, plan, decider, disk_keys, kept)
        except BaseException:
            if served is not None:
                served.close()
            raise
        if served is not None:
            served.bind(tier)
            tier.metrics = served
        return tier

    def keep_report(self) -> dict[str, Any] | None:
        """Rank 0, with ``keep_s``: what this tier adopted from a kept one (docs/KEEP.md):
        ``adopted_chunks``, ``adopted_bytes`` (every node's rows of them) and ``first_hit_s``
        (from the start of `create` to the first load of an adopted chunk that succeeded;
        None before one).  None without retention."""
        manager = self.manager
        if not isinstance(manager, KeptManager):
            return None
        row_bytes = sum(b for _, b in self.plan.row_bytes)
        return {"keep_s": self.actor.config.keep_s, "adopted_chunks": manager.adopted_chunks,
                "adopted_bytes": manager.adopted_chunks * row_bytes,
                "first_hit_s": manager.first_hit_s}

    @property
    def topology(self) -> Topology:
        return self.actor.topology

    @property
    def submitted(self) -> int:
        """Jobs this rank has submitted (SPMD and driven).  A failed job's chunks are safe to
        reuse once every rank has completed this many: the fence for
        `ChunkManager.complete_store` / `complete_load` after a failure."""
        return self.actor.submitted

    # ------------------------------------------------------------------ readiness
    @property
    def ready(self) -> Readiness:
        """How much of the tier is usable now: with background set-up (`TierConfig.background`)
        rows come online as every rank has registered its part; otherwise every row is ready
        when `create` returns.  Reading it also lets the chunk manager (rank 0) hand out the
        new rows; `poll`, `finished`, `wait` and `run` do the same."""
        if not self.last_ready.full:
            self.actor.progress_copies()  # a poll: finished copies retire meanwhile
        return self._refresh_ready(force=True)

    def wait_ready(self, timeout_s: float | None = None, rows: int | None = None
                   ) -> Readiness:
        """Block until every row -- or the first ``rows`` rows -- is usable on every rank (for
        simple programs; engines serve meanwhile and watch `ready`).  Raises `OffloadError`
        when some rank's set-up stopped on an error short of them (the rows before stay
        usable), `PeerError` naming the ranks behind after ``timeout_s`` (default: the
        tier's)."""
        timeout = self.actor.config.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        wanted = self.plan.chunk_count if rows is None else min(rows, self.plan.chunk_count)
        while True:
            ready = self.ready
            if ready.rows >= wanted:
                return ready
            short = [r for r in ready.stopped
                     if unpack_ready(self._ready_words[r])[0] < wanted]
            if short:  # those ranks will never reach the rows wanted
                rank = self.topology.rank
                own = (f"; here: {self.actor.region.stats.pin_error}"
                       if rank in short and self.actor.region is not None else "")
                raise OffloadError(f"background set-up stopped on ranks {short} with rows "
                                   f"below {ready.rows} of {ready.total} usable{own}; their "
                                   "logs say why (no memory: lower --cpu-bytes)")
            if time.monotonic() >= deadline:
                behind = sorted(r for r, w in self._ready_words.items()
                                if unpack_ready(w)[0] == ready.rows)
                raise PeerError(f"rows below {ready.rows} of {ready.total} are ready after "
                                f"{timeout:g} s; ranks {behind} are behind (a rank died, or "
                                "its host is slow: give wait_ready a longer timeout)")
            time.sleep(0.005)

    def _refresh_ready(self, force: bool = False) -> Readiness:
        """Read every rank's ready word (until the tier is full) and let the chunk manager hand
        out the new rows.  Across nodes the read is a store round trip, so it runs at most
        every `_READY_INTERVAL_S` unless ``force``d."""
        if self.last_ready.full:
            return self.last_ready
        quorum = self.actor.quorum
        now = time.monotonic()
        if len(self.topology.nodes) > 1 and not force and \
                now - self._ready_checked < _READY_INTERVAL_S:
            return self.last_ready
        self._ready_checked = now
        words = self._ready_words = quorum.ready_words()
        # a node leader publishes what it just read (the board only rises): once this view is
        # full nothing here polls again, and the other nodes must still learn the last rows
        quorum.share()
        rows = quorum.ready_rows(words)
        stopped = tuple(sorted(r for r, w in words.items() if unpack_ready(w)[1]))
        self.last_ready = Readiness(rows, self.plan.chunk_count, stopped)
        if self.manager is not None:
            self.manager.set_ready(rows)
        return self.last_ready

    # ------------------------------------------------------------------ SPMD data path
    @overload
    def submit(self, job: CopyJob, after: After = None, layer_groups: None = None
               ) -> torch.cuda.Event | None: ...

    @overload
    def submit(self, job: CopyJob, after: After = None, *, layer_groups: int
               ) -> list[torch.cuda.Event | None]: ...

    def submit(self, job: CopyJob, after: After = None, layer_groups: int | None = None
               ) -> torch.cuda.Event | None | list[torch.cuda.Event | None]:
        """Queue this rank's share of ``job``; every rank submits the same jobs in the same
        order (a job's sequence number is its place in that order).  A job id may be reused
        once `finished` or `wait` has returned the job on this rank.

        A refused job behaves the same on every rank, so SPMD code never branches apart: it
        keeps its place in the sequence (its spills still run there) and comes back failed
        from `finished` / `wait` on every rank, naming the lowest refusing rank and its
        reason.  A refusal only some ranks make -- an id still in flight there, a row not set
        up yet ("not ready"), a block past that rank's KV cache, an engine error -- returns
        normally (no event).  Only a malformed job, which every rank refuses alike (an index
        out of the plan's range, a field of the wrong type, a repeated destination, a spill
        outside the region), raises `MalformedJob` at once, on every rank.

        The copy runs after ``after`` (a CUDA event or stream; default: the current stream)
        and the call returns the copy's completion event, which the compute stream can
        ``wait_event`` on before reading loaded blocks -- no host round trip.  The event says
        the copy is done, not that it verified (the verdict comes with the decision); a loaded
        piece that fails its checksum is overwritten with all-ones bytes (NaN in fp16 to fp64)
        before the event fires, so nothing read ahead of the verdict is a damaged byte.  None
        when this rank moves nothing (a refused job, a replicated store's non-writer) or its
        KV lives in host memory.

        ``layer_groups=G`` (loads): the copy runs group by group over ``G`` runs of
        consecutive KV tensors, in the order given to `create` (G = layers: each layer's K
        and V), and the call returns ``G`` events, one per group in that order, so the
        forward pass can wait for each layer's KV just before that layer (the completion
        and the verdict stay per job; a refused job's G events are None)."""
        self.actor.submit(job, keep=True, after=after, layer_groups=layer_groups)
        if layer_groups is not None:
            return list(self.actor.layer_events)
        return self.actor.last_event

    def poll(self) -> int:
        """Collect this rank's finished copies and publish its watermark (non-blocking); return
        how many of this rank's jobs are still copying.  A rank's jobs are decided only after
        it polled past them, so an engine loop polls every step (or until this reaches 0
        before it blocks in a collective of its own)."""
        self.actor.progress_copies()
        self._refresh_ready()
        return self.actor.in_flight

    def finished(self, mark: DecisionMark | None = None) -> list[TransferResult]:
        """The jobs decided since the last call, in submission order (non-blocking).

        On the decider call it without ``mark``: it reads every rank's watermark, decides
        every job all ranks have completed, returns them and moves `mark`.  It raises
        `PeerError` naming the ranks that hold back a job older than the tier's timeout.

        On every other rank pass the decider's `mark` as it stood at this point of the step
        sequence (the engine sends it with its step broadcast): the call returns exactly the
        results the decider's calls up to that mark returned -- same jobs, same order, same
        success flags -- whatever this rank's timing.  Jobs already returned by `wait` are
        left out on every rank alike."""
        self.actor.progress_copies()
        self._refresh_ready()
        quorum = self.actor.quorum
        if self.topology.rank == self.decider:
            if mark is not None:
                raise OffloadError(f"rank {self.decider} is the decider: call finished() "
                                   "without a mark")
            words = quorum.words()
            self.last_words = words
            through = quorum.through(words)
            self._drained(through)
            if through == self._learned:
                self._check_overdue(words)
                return []
            quorum.read(words)
            return self._learn(through)
        if mark is None:
            raise OffloadError(f"rank {self.topology.rank} is not the decider (rank "
                               f"{self.decider}); pass the decider's tier.mark from your step "
                               "broadcast")
        if mark.through < self._learned or mark.through > self.actor.submitted:
            raise OffloadError(f"decision mark {mark} does not follow this rank's "
                               f"(through {self._learned} of {self.actor.submitted} submitted "
                               "jobs); pass the decider's latest mark of this tier")
        self._drained(mark.through)
        quorum.catch_up(mark.records)  # this rank's view of the decider's node may be stale
        return self._learn(mark.through, mark)

    def wait(self, job_ids: Sequence[int], timeout_s: float | None = None) -> None:
        """Block until every rank has completed the jobs (for simple programs; engines use
        `finished`).  Every rank calls it at the same point, and it returns the jobs' ids for
        reuse however it ends -- also when it raises -- so the ranks' in-flight jobs stay the
        same.  Raises `OffloadError` naming a failed job and its rank, or `PeerError` naming
        the ranks still behind after ``timeout_s`` (default: the tier's; 0 checks once)."""
        book = self.actor.jobs
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return
        missing = [job_id for job_id in ids if not book.is_live(job_id)]
        if missing:
            raise OffloadError(f"job id {missing[0]} is not in flight on rank "
                               f"{self.topology.rank}; submit it first (a job is returned "
                               "once)")
        seqs = book.live_seqs(ids)
        timeout = self.actor.config.timeout_s if timeout_s is None else timeout_s
        try:
            words = self._await(seqs[-1], time.monotonic() + timeout)
        except BaseException:
            book.take(seqs)  # returned, failed: a timeout on one rank must not leave them here
            raise
        failed = self.actor.quorum.failures(words, seqs[0], seqs[-1] + 1)
        taken = book.take(seqs)
        self._count(taken, failed)
        self.actor.quorum.settle()
        bad = [e for e in taken if e.seq in failed]
        if bad:
            rank, message = failed[bad[0].seq]
            raise JobFailed(bad[0].job_id, rank, message)

    @property
    def _learned(self) -> int:
        return self.mark.through

    @property
    def _failed(self) -> int:
        return self.mark.failed

    def _learn(self, through: int, mark: DecisionMark | None = None
               ) -> list[TransferResult]:
        """Results of the live jobs below ``through`` (the decided ones), in order, from the
        failure records read.  A follower passes the decider's ``mark``: its failure count
        must match before anything moves, so a failed check leaves the jobs, the mark and the
        records as they were."""
        quorum = self.actor.quorum
        entries = self.actor.jobs.kept_below(through)
        failed = {e.seq: f for e in entries if (f := quorum.failure(e.seq)) is not None}
        results = []
        for entry in entries:
            rank, reason = failed.get(entry.seq, (None, None))
            if not entry.ok and rank is None:
                raise RuntimeError(f"job {entry.job_id} failed on rank {self.topology.rank} "
                                   "but the quorum has no record of it")
            results.append(TransferResult(entry.job_id, rank is None, entry.bytes,
                                          entry.seconds, rank, reason))
        failures = self._failed + len(failed)
        if mark is not None and failures != mark.failed:
            raise RuntimeError(f"rank {self.topology.rank} counted {failures} failed jobs "
                               f"where the decider counted {mark.failed}")
        self.actor.jobs.take([e.seq for e in entries])
        self._count(entries, failed)
        self.mark = DecisionMark(through, failures, quorum.counts()) if mark is None else mark
        quorum.settle()
        return results

    def _first_needed(self) -> int:
        """The lowest sequence whose failure record this rank may still look up: its oldest
        job `finished` or `wait` has not returned, the driven job `run` waits for, or else the
        next job it submits (`Quorum.settle`)."""
        oldest = self.actor.jobs.oldest_live()
        first = self.actor.submitted if oldest is None else oldest.seq
        return first if self._awaiting is None else min(first, self._awaiting)

    def _count(self, entries: Sequence[Entry], failed: dict[int, tuple[int, str]]) -> None:
        """Feed decided jobs to the live metrics; the decider also times them (submit to
        decided)."""
        now = time.perf_counter() if self.topology.rank == self.decider else None
        for e in entries:
            rank, reason = failed.get(e.seq, (None, None))
            if rank is None:
                self._succeeded()
            self.tally.add(e.job.direction, rank is None, reason, e.bytes,
                           None if now is None else now - e.started)

    def _check_overdue(self, words: Words) -> None:
        """Decider: a job waiting longer than the timeout names the ranks holding it back."""
        oldest = self.actor.jobs.oldest_live()
        if oldest is None:
            return
        waited = time.monotonic() - oldest.submitted_at
        if waited > self.actor.config.timeout_s:
            raise self._overdue(oldest.job_id, oldest.seq, words, waited)

    def _overdue(self, job_id: int, seq: int, words: Words, waited: float) -> PeerError:
        late = self.actor.quorum.laggards(words, seq)
        return PeerError(f"job {job_id}: ranks {late}{_whole_nodes(self.topology, late)} have "
                         f"not completed it within {waited:.3g} s (timeout "
                         f"{self.actor.config.timeout_s:g} s); a rank died or stopped polling")

    def _await(self, seq: int, deadline: float) -> Words:
        """Poll until every rank has completed job ``seq``; past ``deadline`` raise `PeerError`
        naming the ranks behind (and any node they all left).
        Spins (yielding the CPU) for the first ``_SPIN_POLLS`` polls, then sleeps from 10 us
        doubling to at most ``_MAX_PAUSE_S``: a job that completes soon is seen at once (no fixed
        sleep on the hot path), a long wait costs little CPU."""
        quorum = self.actor.quorum
        began = time.monotonic()
        polls = 0
        while True:
            self.actor.progress_copies()
            self._refresh_ready()
            words = quorum.words()
            if self._drained(quorum.through(words)) > seq:
                return words
            now = time.monotonic()
            if now >= deadline:
                raise self._overdue(self._job_id(seq), seq, words, now - began)
            polls += 1
            if polls < _SPIN_POLLS:
                os.sched_yield()
            else:
                time.sleep(min(_MAX_PAUSE_S, 1e-5 * 2 ** min(polls - _SPIN_POLLS, 7),
                               max(0.0, deadline - now)))

    def _job_id(self, seq: int) -> int:
        """The id of job ``seq`` while this rank holds it (its sequence number otherwise)."""
        entry = self.actor.jobs.find(seq)
        return entry.job_id if entry is not None else seq

    def _drained(self, through: int) -> int:
        """Every rank completed the jobs below ``through``: release quarantined chunks."""
        if self.manager is not None:
            self.manager.drained(through)
        return through

    # ------------------------------------------------------------------ driven data path
    def run(self, job: CopyJob) -> None:
        """Rank 0: every rank's actor copies ``job``; return once every rank completed it.

        The command goes out as a posted RPC request (one store write; workers on rank 0's
        node see it on the board's doorbell) and completes through the same watermarks as
        SPMD jobs: a worker whose `submit` refused the job reports it failed there, so nothing
        needs to come back.  Raises `OffloadError` naming the rank whose copy failed,
        `PeerError` naming the ranks that did not complete it within the timeout; after either,
        pass `submitted` as the fence to the chunk manager's ``complete_*``."""
        seq = self._awaiting = self.actor.submitted  # its failure record stays until read
        try:
            request, _ = self.rpc.post(_submit_quietly, job, actor=self.actor)
            words = self._await(seq, time.monotonic() + self.actor.config.timeout_s)
            self.rpc.forget(request)  # every rank executed it: its watermark passed the job
            failed = self.actor.quorum.failures(words, seq, seq + 1)
        finally:
            self._awaiting = None
        self.actor.quorum.settle()
        if failed:
            rank, message = failed[seq]
            raise JobFailed(job.job_id, rank, message)
        self._succeeded()

    def _succeeded(self) -> None:
        """A job was decided successfully: the first one times the tier's readiness
        (``first_job_s`` in the main job's report)."""
        if self.first_success_at is None:
            self.first_success_at = time.perf_counter()

    def promote(self, keys: Sequence[Hashable]) -> tuple[PromoteJob, list[Hashable]]:
        """Rank 0 (driven, with a file tier): bring the disk copies of ``keys`` back into
        host memory (`ChunkManager.prepare_promote`).  Every rank writes out the rows the
        promotion evicts, then reads its slot of each key's file into the key's new row; a key
        is readable once every rank verified its bytes.  Returns the job and the keys whose
        read failed on some rank (damaged or missing file): those are discarded on every rank
        and are misses.  SPMD programs use `collective_promote`."""
        manager = self.manager
        if manager is None:
            raise OffloadError("promote is driven from rank 0, which owns the chunk manager; "
                               "SPMD programs call collective_promote on every rank")
        job = manager.prepare_promote(keys)
        try:
            results = self.call(fs_actions.promote, job.spills, job.chunks, job.job_id)
        except BaseException:  # a rank may still be reading: its rows stay quarantined
            manager.complete_promote(job.job_id, failed=[k for k, _ in job.chunks],
                                     busy=[c for _, c in job.chunks])
            raise
        failed = _unverified(job, [verified for verified, _ in results])
        if failed:
            self.call(fs_actions.discard, failed)
        manager.complete_promote(job.job_id, failed, fs_actions.busy_rows(results))
        return job, failed

    def collective_promote(self, job: PromoteJob) -> list[Hashable]:
        """SPMD, every rank at the same point with the same ``job`` (rank 0's
        `ChunkManager.prepare_promote`, sent with the engine's step broadcast): write out the
        rows the promotion evicts, read this rank's slot of each key's file into its new row,
        then agree with every rank (one all-gather over the tier's group) on which reads
        verified.  Keys that failed anywhere are discarded on every rank and the manager
        completes the promotion; returns them (the same list everywhere): misses.  Blocks for
        the disk reads; a rank that raised makes every rank raise its error."""
        try:
            mine: tuple[list[bool], list[int]] | str = fs_actions.promote(
                self.actor, job.spills, job.chunks, job.job_id)
        except Exception as exc:
            mine = one_line(exc)
        everyone: list[Any] = [None] * self.topology.world_size
        try:
            dist.all_gather_object(everyone, mine, group=self.topology.group)
        except RuntimeError as exc:  # a rank died mid-promotion: its reads may still run
            if self.manager is not None:
                chunks = [c for _, c in job.chunks]
                self.manager.complete_promote(job.job_id, [k for k, _ in job.chunks], chunks)
            raise PeerError(f"promotion {job.job_id}: the ranks could not agree on its reads "
                            f"({one_line(exc)}); a rank died or left the group") from None
        errors = [(rank, e) for rank, e in enumerate(everyone) if isinstance(e, str)]
        failed = ([k for k, _ in job.chunks] if errors
                  else _unverified(job, [verified for verified, _ in everyone]))
        # rows some rank's read may still fill stay quarantined (all of them after an error)
        busy = [c for _, c in job.chunks] if errors else fs_actions.busy_rows(everyone)
        if failed:  # best effort after an error: the rank's own error is the one raised
            with contextlib.suppress(Exception) if errors else contextlib.nullcontext():
                fs_actions.discard(self.actor, failed)
        if self.manager is not None:
            self.manager.complete_promote(job.job_id, failed, busy)
        if errors:
            rank, message = errors[0]
            raise OffloadError(f"promotion {job.job_id} failed on rank {rank}: {message}")
        return failed

    def call(self, fn: Any, *args: Any) -> list[Any]:
        """Rank 0: run ``fn(actor, *args)`` on every rank and gather the results."""
        return self.rpc.call(fn, *args, actor=self.actor)

    def serve(self, idle_limit_s: float | None = None) -> None:
        """Ranks other than 0: execute rank 0's commands until it releases them.  With
        ``idle_limit_s``, raise `PeerError` after that long without a command (default: wait
        as long as rank 0 lives)."""
        try:
            self.rpc.serve(self.actor, idle=self.actor.progress_copies,
                           idle_limit_s=idle_limit_s)
        except BaseException:
            self.actor.close()
            raise

    def release(self) -> None:
        """Rank 0: end the other ranks' `serve`."""
        self.rpc.release()

    def abort(self, message: str) -> None:
        """Rank 0: make the other ranks' `serve` fail with ``message``."""
        self.rpc.abort(message)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Collective: fence in-flight copies, barrier, unpin, unmap, unlink.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.actor.drain()
            dist.barrier(group=self.topology.group)
        finally:
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None
            self.actor.close()
            self.actor.quorum.board.close()
            cleanup.unregister(self.actor.close)


def _whole_nodes(topology: Topology, late: Sequence[int]) -> str:
    """The nodes all of whose ranks are among ``late`` (in a tier of several nodes), as a
    clause for the timeout error: a dead host is named, not just its ranks."""
    if len(topology.nodes) < 2:
        return ""
    down = [n.node_id for n in topology.nodes if set(n.ranks) <= set(late)]
    if not down:
        return ""
    return f" (every rank of node {', '.join(down)}: the node is down or cut off)"


def _submit_quietly(actor: RankActor, job: CopyJob) -> None:
    """A driven job on one rank: a refusal is recorded as the job's failure by `submit` and
    reaches rank 0 through the quorum, so a malformed job's `MalformedJob` (the only refusal
    `submit` raises) is not raised here."""
    with contextlib.suppress(OffloadError):
        actor.submit(job)


_SPIN_POLLS = 64
_MAX_PAUSE_S = 0.001
_READY_INTERVAL_S = 0.005


def control_group(group: Any, timeout_s: float) -> Any:
    """The gloo group the tier's control plane runs on: ``group`` itself when it is gloo, else
    a gloo twin of its ranks.  ``new_group`` is collective over the default group and must see
    the same rank lists in the same order on every process, while each process knows only its
    own group: so every process publishes its group's ranks (an object all-gather over the
    default group) and creates a twin of every distinct group, in sorted order, keeping its
    own.  Twins wait as long as node groups do: node exchanges run over them."""
    if not dist.is_initialized():
        raise OffloadError("no torch.distributed process group; call "
                           "torch.distributed.init_process_group before HostTier.create")
    if group is not None and dist.get_rank(group) < 0:
        raise OffloadError(f"rank {dist.get_rank()} is not a member of the group given to "
                           "HostTier.create; call it with the group this rank belongs to")
    if dist.get_backend(group) == "gloo":
        return group
    mine = tuple(range(dist.get_world_size()) if group is None
                 else dist.get_process_group_ranks(group))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    timeout = datetime.timedelta(seconds=max(timeout_s, NODE_GROUP_MIN_TIMEOUT_S))
    twin = None
    for ranks in sorted(set(everyone)):
        created = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
        if ranks == mine:
            twin = created
    return twin


def _unverified(job: PromoteJob, verified: Sequence[Sequence[bool]]) -> list[Hashable]:
    """The keys of ``job`` some rank could not read back (``verified[rank][i]`` is False)."""
    return [key for i, (key, _) in enumerate(job.chunks) if not all(v[i] for v in verified)]


def _tier_store(topology: Topology, config: TierConfig, store: dist.Store | None
                ) -> tuple[str, dist.Store]:
    """A fresh tier id (rank 0's uuid, shared through the store) and this tier's store.  The
    id's key lives under the group's namespace (its global ranks) and counts that group's
    tiers, so tiers on disjoint groups never read each other's ids."""
    namespace = "offload"
    if topology.group is not None:
        ranks = ",".join(map(str, dist.get_process_group_ranks(topology.group)))
        namespace += "/group-" + hashlib.sha1(ranks.encode()).hexdigest()[:16]
    base = (default_store(namespace, config.timeout_s) if store is None
            else dist.PrefixStore(namespace, store))
    key = f"tier{next(_tier_seq[namespace])}/tier_id"
    if topology.rank == 0:
        tier_id = uuid.uuid4().hex[:16]
        base.set(key, tier_id)
    else:
        tier_id = await_key(base, key, config.timeout_s, topology.rank, "rank 0's tier id",
                            f"rank {topology.rank} got no tier id from rank 0 within "
                            f"{config.timeout_s:g} s; rank 0 is not creating the tier").decode()
    return tier_id, dist.PrefixStore(tier_id, base)


def _describe(actor: RankActor) -> RankDescriptor | str:
    """This rank's descriptor, or its one-line error (sent instead, so no rank hangs)."""
    try:
        return actor.describe()
    except OffloadError as exc:
        return f"rank {actor.topology.rank}: {exc}"
    except Exception as exc:  # e.g. something that is not a tensor among the KV tensors
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"rank {actor.topology.rank}: {type(exc).__name__}: {first}"


def _drive_setup(actor: RankActor, rpc: CollectiveRPC, gathered: list[Any]
                 ) -> tuple[Plan, list[bytes], list[Adopted]]:
    """Rank 0's set-up; returns the plan, with a file tier the keys its files hold, and
    with retention the chunks a kept index names (docs/KEEP.md)."""
    try:
        errors = [g for g in gathered if isinstance(g, str)]
        if errors:
            raise OffloadError(errors[0])
        plan = compute_plan(gathered)
        fs_dir = actor.config.fs_dir
        if fs_dir is not None:  # a budget below one chunk fails before any region exists
            disk_capacity(plan, actor.topology, actor.config.fs_bytes_per_node)
        digests = rpc.call(RankActor.install_plan, plan, actor=actor)
        wrong = [r for r, d in enumerate(digests) if d != plan.digest()]
        if wrong:  # the plan travels pickled, so this is a bug, not a user error
            raise RuntimeError(f"ranks {wrong} acknowledged a different plan than rank 0's "
                               f"{plan.digest()}")
        life = None  # the kept life this one adopts
        if actor.config.keep_s > 0:  # adopt only where every node's keeper holds this plan,
            answers = rpc.call(RankActor.probe_keep, actor=actor)  # made by one life
            lives = {a for a in answers if a is not None}
            life = lives.pop() if len(lives) == 1 and "" not in lives else None
        adopt = life is not None
        pinned = rpc.call(RankActor.build_region, adopt, actor=actor)
        if any(pinned) and not all(pinned) and actor.config.background:
            raise OffloadError(f"ranks {[r for r, p in enumerate(pinned) if not p]} cannot pin "
                               "host memory (KV not on CUDA) while the others can; background "
                               "set-up needs every rank pinned or none: drop --background-setup")
        if any(pinned) and not all(pinned):
            log.warning("ranks %s could not pin their region; the whole group runs unpinned",
                        [r for r, p in enumerate(pinned) if not p])
            rpc.call(RankActor.unpin, actor=actor)
        rpc.call(RankActor.start_engine, actor=actor)
        kept = actor.open_index(life) if actor.config.keep_s > 0 else []
        if adopt and actor.keep_index is not None:  # every rank, before any job
            rpc.call(RankActor.adopt_generations, [(a.chunk, a.generations) for a in kept],
                     actor.keep_index.generation_base, actor=actor)
        disk_keys = fs_actions.setup(actor, rpc) if fs_dir is not None else []
        rpc.release()
        return plan, disk_keys, kept
    except BaseException as exc:
        rpc.abort(str(exc) or type(exc).__name__)
        actor.close()
        raise


def _serve_setup(actor: RankActor, rpc: CollectiveRPC) -> None:
    try:
        rpc.serve(actor)
    except BaseException:
        actor.close()
        raise
