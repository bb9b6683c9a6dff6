"""The rank actor: everything one rank owns and does.

One actor lives in every rank's process.  It holds the rank's KV tensors, its installed plan,
its host region and its transfer engine, executes the jobs it is given in order and reports each
finished copy to the quorum.  Rank 0 drives actors through the collective RPC
(`offload.control.rpc`): every public method here that takes only picklable arguments can be sent as
``rpc.call(RankActor.method, ...)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from offload.config import TierConfig
from offload.control.jobs import Entry, JobBook
from offload.control.plan import Plan, RankDescriptor
from offload.control.quorum import Quorum
from offload.control.topology import Topology
from offload.errors import MalformedJob, OffloadError, one_line
from offload.keep_index import Adopted, KeepIndex, index_bytes
from offload.region.host_region import HostRegion, KeepSpec
from offload.region.numa import cuda_numa_node
from offload.region.pin import Registrar, choose_registrar
from offload.region.retain import Retention, claim_node_keeper, node_parts
from offload.tiers.rank_files import RankFiles, WorkItem, check_work_items
from offload.transfer import (
    SlotLayout,
    TransferEngine,
    kv_geometry,
    make_engine,
    triton_available,
)
from offload.transfer.audit import Auditor
from offload.transfer.base import After, Direction
from offload.transfer.layout import Indices, Job, show_value

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyJob:
    """One store or load on one rank: ``blocks[i]`` <-> position ``positions[i]`` of chunk
    ``chunks[i]``.  ``writer_only`` (replicated stores) makes ranks other than their (node, stage)'s
    writer report the job done without copying: the node holds one copy per stage.
    ``spills`` (a store's evicted chunks, from `StoreJob.spills`): (key, chunk) pairs each rank
    with a file tier writes out before it copies, and no row is overwritten before its spill
    released it.  The index fields take tuples, lists or 1-D numpy integer arrays; pass arrays:
    they cost no conversion per job, where long tuples add to every ``submit``
    (docs/BENCHMARKS.md, "Engine-shaped transfers")."""

    job_id: int
    direction: Direction
    blocks: Indices
    chunks: Indices
    positions: Indices
    writer_only: bool = False
    spills: tuple[tuple[Hashable, int], ...] = ()


def refuse_unready(chunks: Indices, ready: int, rank: int, what: str, fix: str,
                   total: int | None = None) -> None:
    """Raise the "not ready" refusal (DESIGN.md section 3.9) when ``chunks`` reach past the
    ``ready`` rows rank ``rank`` has set up; ``what`` names the work, ``fix`` the way out."""
    array = np.asarray(chunks)
    if array.size and int(array.max()) >= ready:
        of = f" of {total}" if total is not None else ""
        raise OffloadError(f"not ready: {what} chunk {int(array.max())}, but rank {rank} has "
                           f"only rows below {ready}{of} set up yet; {fix}")


def kv_page_bytes(kv_tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """Bytes of one block in each KV tensor, after checking every tensor can be moved page by
    page (`kv_geometry`): called by ``describe``, so a bad tensor fails before any host memory
    is created."""
    return kv_geometry(kv_tensors).page_bytes


@dataclass(eq=False, repr=False)  # identity, not field-wise equality over tensors and regions
class RankActor:
    """One rank's KV tensors, plan, region and engine (module docstring)."""

    topology: Topology
    config: TierConfig
    kv_tensors: list[torch.Tensor]
    tier_id: str
    quorum: Quorum
    progress: Callable[[int, int, float], None] | None = None
    backend: str = "auto"
    auditor: Auditor | None = None
    # None: `choose_registrar`, in a context of its own for background set-up
    registrar_factory: Callable[[torch.device], Registrar] | None = None
    plan: Plan | None = None
    region: HostRegion | None = None
    engine: TransferEngine | None = None
    files: RankFiles | None = None  # this rank's file tier (TierConfig.fs_dir), if any
    timings_s: dict[str, float] = field(default_factory=dict)
    created_at: float = field(default_factory=time.perf_counter)
    jobs: JobBook = field(default_factory=JobBook)  # every job until its result is taken
    _block_bytes: int = 0  # this rank's bytes per job entry (every tensor's page), once started
    last_event: torch.cuda.Event | None = None  # the last submitted copy's completion
    layer_events: list[torch.cuda.Event | None] = field(default_factory=list)  # its groups
    ready_at: float | None = None  # perf_counter when this rank's set-up ended
    _region_rows: int = 0  # rows the region has set up (`_set_up`)
    _stopped: bool = False  # the region's background set-up ended on an error
    _compiled: threading.Event = field(default_factory=threading.Event)  # the JIT is done
    _ready_lock: threading.Lock = field(default_factory=threading.Lock)
    _compiler: threading.Thread | None = None
    # retention (docs/KEEP.md): the node leader's claimed keeper link, rank 0's kept index
    retention: Retention | None = None
    keep_index: KeepIndex | None = None

    # ------------------------------------------------------------------ set-up
    def describe(self) -> RankDescriptor:
        t = self.topology
        node = (cuda_numa_node(self.kv_tensors[0].device)
                if self.config.numa and self.kv_tensors else None)
        return RankDescriptor(t.rank, t.node_id, t.local_rank, t.local_world_size, t.tp_rank,
                              t.pp_rank, kv_page_bytes(self.kv_tensors), self.config, node)

    def install_plan(self, plan: Plan) -> str:
        """Adopt the plan rank 0 computed and return its digest (the ack)."""
        if plan.slots[self.topology.rank].page_bytes != kv_page_bytes(self.kv_tensors):
            raise OffloadError(f"the plan's page sizes for rank {self.topology.rank} do not "
                               "match its KV tensors")
        self.plan = plan
        self.timed("plan", self.created_at)
        return plan.digest()

    def probe_keep(self) -> str | None:
        """Node leaders (with ``keep_s``): claim the node's keeper and name the life whose
        parts it keeps, where they are exactly this plan's regions (and index, on rank 0's
        node), else ""; None on other ranks."""
        if not self.topology.is_leader:
            return None
        plan = self._installed()
        index = index_bytes(plan) if 0 in self.topology.node.ranks else None
        parts = node_parts(plan, self.topology, self.config, index)
        self.retention, life = claim_node_keeper(self.topology, self.config, self.tier_id,
                                                 plan, parts)
        return life or ""

    def open_index(self, life: str | None) -> list[Adopted]:
        """Rank 0 (with ``keep_s``): the index of the adopted ``life`` (its valid records
        returned), or a new one of this life handed to the keeper; nothing where this node
        keeps nothing."""
        if self.retention is None:
            return []
        if life is not None:
            self.keep_index, records = KeepIndex.adopt(self.retention.link, self._installed(),
                                                       life)
            return records
        self.keep_index = KeepIndex.create(self.retention.link, self._installed(),
                                           self.tier_id)
        return []

    def adopt_generations(self, pages: list[tuple[int, tuple[int, ...]]], base: int) -> None:
        """Give the adopted chunks' pages the generations they were stored with (their page
        checksums mix them in), and this life's stores a base above every one of them."""
        engine, bpc = self._engine(), self._installed().blocks_per_chunk
        engine.generation_base = base
        for chunk, generations in pages:
            engine.generations[chunk * bpc:(chunk + 1) * bpc] = generations

    def build_region(self, adopt: bool = False) -> bool:
        """Create, pre-fault and pin this rank's region; return whether it is pinned.

        A thread compiles the copy kernel against a one-row scratch buffer.  In the node
        layouts the JIT, seconds on a cold cache, overlaps the pre-fault instead of following it
        (docs/BENCHMARKS.md, "Node start-up"); a blocking private region is set up only once it
        is done (the NOTE below); background set-up waits for it on its own threads."""
        plan = self._installed()
        device = self.kv_tensors[0].device
        registrar = (self.registrar_factory(device) if self.registrar_factory is not None else
                     choose_registrar(device, self.config.background and self.config.setup_context))
        began = time.perf_counter()
        compiler = self._compiler = threading.Thread(target=self._compile_kernel,
                                                     name="offload-jit", daemon=True)
        compiler.start()
        if not self.config.background and plan.layout == "private":
            # NOTE: a private rank registers its region in ranges of gigabytes after pre-fault,
            # and each call holds the CUDA driver, which the JIT needs too: beside set-up the
            # JIT took 2.5-9.6 s (create with it), alone 0.6 s.  Measured in one run, 48 GiB
            # over 2 ranks on an H200 host: create 2.5-9.6 s with the JIT beside set-up,
            # 2.6-3.0 s with it first; the node layouts lost 4-18% that way and keep the
            # overlap (docs/BENCHMARKS.md, "Set-up after the JIT").
            compiler.join()
        keep = None
        if self.config.keep_s > 0:
            if self.retention is not None and not adopt:  # the kept regions go, now
                self.retention.link.request("reset", geometry=plan.digest(), life=self.tier_id)
            keep = KeepSpec(self.tier_id, adopt, self.retention)
        try:
            self.region = HostRegion.create(plan, self.topology, self.config, self.tier_id,
                                            registrar, self.progress, self._set_up, keep)
        except BaseException:
            compiler.join()
            try:  # a region that failed closed it too (idempotent); one refused early did not
                registrar.close()
            except Exception:
                log.exception("rank %d: closing the registrar", self.topology.rank)
            raise
        if not self.config.background:  # background: rows wait for the JIT instead
            compiler.join()
            self._set_up(plan.chunk_count, False)
        self.timed("region", began)
        return self.region.pinned

    def _set_up(self, rows: int, stopped: bool) -> None:
        """The region has this rank's rows below ``rows`` populated and registered (the
        background set-up's pin thread calls it as rows come online)."""
        with self._ready_lock:
            self._region_rows, self._stopped = rows, stopped
        self._publish_ready()

    def _publish_ready(self) -> None:
        """Announce this rank's usable rows on its ready word: the region's, once the copy
        kernel is compiled (a job never waits for the JIT nor compiles beside it).  Under a
        lock: the pin and JIT threads both announce, and the word must only rise."""
        with self._ready_lock:
            rows = self.ready_rows
            done = rows == self._installed().chunk_count or self._stopped
            if done and self.ready_at is None and self._compiled.is_set():
                self.ready_at = time.perf_counter()
            if rows and "first_row" not in self.timings_s:  # the first row it could serve
                self.timed("first_row", self.created_at)
            self.quorum.board.publish_ready(rows, self._stopped and self._compiled.is_set())

    @property
    def ready_rows(self) -> int:
        """Rows this rank can copy into and out of (all of them once set-up finished)."""
        return self._region_rows if self._compiled.is_set() else 0

    def _rows(self, checked: Job) -> np.ndarray:
        """The region row (chunk) of each entry of a checked job."""
        return checked.host_pages // self._installed().blocks_per_chunk

    def _check_ready(self, job: CopyJob, checked: Job) -> None:
        """Refuse a job that touches a row this rank has not made usable yet (background
        set-up): copying into unregistered memory would fault the GPU, so the job fails
        here and, through the quorum, on every rank -- never waits, never moves a byte."""
        refuse_unready(self._rows(checked),
                       self.ready_rows, self.topology.rank,
                       f"{_owner(job)} {job.direction}s",
                       "use the chunks the manager hands out (HostTier.ready) or call "
                       "HostTier.wait_ready() first", self._installed().chunk_count)

    def _compile_kernel(self) -> None:
        """Compile the copy kernel on scratch buffers shaped and aligned like the real ones
        (one block per KV tensor, one pinned row), so the real engine finds it compiled and no
        user block or region byte is touched; then let the rows set up so far be used."""
        began = time.perf_counter()
        try:
            self._compile_on_scratch()
        finally:
            self.timed("jit", began)
            self._compiled.set()
            self._publish_ready()

    def _compile_on_scratch(self) -> None:
        kv = self.kv_tensors
        kernel_backend = self.backend in ("auto", "hybrid", "triton")
        if not (kv[0].is_cuda and kernel_backend and triton_available()):
            return
        try:
            layout = SlotLayout.from_plan(self._installed(), self.topology.rank)
            with torch.cuda.device(kv[0].device):
                scratch_kv = [torch.empty((1, *t.shape[1:]), dtype=t.dtype, device=t.device)
                              for t in kv]
                row = torch.empty(layout.region_bytes(1), dtype=torch.uint8, pin_memory=True)
                engine = make_engine(scratch_kv, row, None, layout, 1, True, "triton")
                engine.compile_all()  # type: ignore[attr-defined]
                engine.close()
        except Exception as exc:  # the first real job then compiles it
            log.warning("rank %d could not pre-compile the copy kernel: %s",
                        self.topology.rank, exc)

    def unpin(self) -> None:
        """The group decided to run unpinned (some rank could not pin)."""
        if self.region is not None:
            self.region.unpin()

    def start_engine(self) -> str:
        plan, region = self._installed(), self._region()
        # every copy split where the region registers a row in pieces (background set-up)
        layout = replace(SlotLayout.from_plan(plan, self.topology.rank), cuts=region.cuts)
        began = time.perf_counter()
        self.engine = make_engine(self.kv_tensors, region.tensor, region.address, layout,
                                  plan.chunk_count, region.pinned, self.backend,
                                  staging_bytes=self.config.staging_bytes)
        self._block_bytes = sum(layout.page_bytes)  # per job entry, counted per submit
        self.timed("engine", began)
        self.timed("total", self.created_at)
        # background set-up: after the engine's CUDA allocations, populating once the JIT is done
        region.start_setup(self._compiled)
        return self.engine.name

    # ------------------------------------------------------------------ serving
    @property
    def submitted(self) -> int:
        """Jobs this rank has submitted: the next job's sequence number."""
        return self.jobs.submitted

    def submit(self, job: CopyJob, keep: bool = False, after: After = None,
               layer_groups: int | None = None) -> int:
        """Queue a copy on this rank (non-blocking where the backend allows) and return its
        sequence number: its place in the submission order, the same on every rank.

        Every job takes its place, whatever happens next, and its spills run in that place
        (`_screen`).  A job the plan alone refuses -- an index out of range, a field of the
        wrong type, a repeated destination: `MalformedJob` -- is refused alike on every rank,
        failed, and the error raised.  A job only this rank refuses (a reused id, a row not
        set up yet, a block past its KV cache, an engine error) is failed with its reason and
        the call returns normally: the quorum reports the failure on every rank alike, so no
        rank's control flow diverges.  ``keep`` keeps the job in the book until the tier
        takes its result (SPMD); its id is live until then.  ``after`` (a CUDA event or
        stream; default the current stream) is what the copy waits for; the copy's own
        completion event is left in `last_event` (None when this rank moves nothing -- a
        refused job, a replicated store's non-writer -- or on the host backend).
        ``layer_groups`` loads layer group by layer group (`TransferEngine.load_layers`),
        leaving the groups' events in `layer_events` (Nones for a refused job)."""
        self.last_event = None
        self.layer_events = []
        valid_id = type(job.job_id) is int or _is_id(job.job_id)
        # a job without an int id is refused on every rank and never kept: no rank returns it
        entry = self.jobs.open(job.job_id, job, keep and valid_id, time.perf_counter(),
                               time.monotonic(), self.topology.rank)
        taken = False  # whether the engine holds the job (it then reports it in poll)
        try:
            checked = self._screen(entry, job, layer_groups, valid_id)
            engine = self._engine()
            if self.files is not None and job.direction == "store":
                # no row is overwritten while a spill reads it (the checked rows: the job's
                # own fields may be any shape that holds those integers)
                self.files.wait_rows(self._rows(checked).tolist())
            if job.writer_only and not self.topology.is_stage_writer:
                engine.renew_store(entry.seq, checked)  # the stage's writer copies
                entry.done = True
            else:
                if layer_groups is not None:
                    self.layer_events = engine.issue_layers(entry.seq, checked, layer_groups,
                                                            after=after)
                    self.last_event = self.layer_events[-1]
                else:
                    self.last_event = engine.issue(entry.seq, job.direction, checked,
                                                   after=after)
                taken = True
                entry.bytes = len(checked) * self._block_bytes
            if self.auditor is not None and job.direction == "store":
                # after the job was checked; hashes read the blocks in compute-stream order
                self.auditor.record(self.kv_tensors, checked.blocks, checked.host_pages)
            elif self.auditor is not None:  # the job's arrays may be reused by the next job
                entry.audited = (checked.blocks.copy(), checked.host_pages.copy())
        except MalformedJob as exc:  # the same on every rank: raised on every rank
            entry.error = None  # its reason wins over this rank's own (a reused id)
            self._refused(entry, exc, taken, layer_groups)
            raise
        except Exception as exc:  # this rank's alone: every rank learns it from the quorum
            self._refused(entry, exc, taken, layer_groups)
        except BaseException as exc:
            self._refused(entry, exc, taken, layer_groups)
            raise
        self.progress_copies()
        return entry.seq

    def _screen(self, entry: Entry, job: CopyJob, layer_groups: int | None, valid_id: bool
                ) -> Job:
        """Check every field of ``job`` before anything of it runs, then write out its spills
        whatever its fate -- in sequence on every rank, so the ranks' file tiers (their LRUs)
        stay in step with each other and the chunk manager's -- and return the checked job,
        or raise its refusal: `MalformedJob` first (the same on every rank), then this rank's
        own."""
        plan = self._installed()
        malformed: MalformedJob | None = None
        if not valid_id:
            malformed = MalformedJob(f"job id {show_value(job.job_id)} is not an int; give "
                                     "every job an int id")
        local: Exception | None = None
        spills: tuple[WorkItem, ...] = ()
        if not (type(job.spills) is tuple and not job.spills):  # () is every job's but stores'
            try:
                spills = check_work_items(job.spills, "spills", plan.chunk_count,
                                          plan.page_size, _owner(job))
            except MalformedJob as exc:
                malformed = malformed or exc
        checked: Job | None = None
        try:
            checked = self._prepare(entry.seq, job, layer_groups)
        except MalformedJob as exc:
            malformed = malformed or exc
        except Exception as exc:
            local = exc
        if spills:
            local = self._spill(job, spills) or local
        if malformed is not None:
            raise malformed
        if entry.error is not None:  # a reused id
            raise OffloadError(entry.error)
        if local is not None:
            raise local
        assert checked is not None
        if self.ready_rows < plan.chunk_count:
            self._check_ready(job, checked)
        return checked

    def _prepare(self, seq: int, job: CopyJob, layer_groups: int | None) -> Job:
        """The job's own rules, then the engine's check of its indices (`EngineBase.prepare`):
        `MalformedJob` for anything the plan and the job alone decide."""
        direction, writer_only = job.direction, job.writer_only
        if type(direction) is not str or (direction != "store" and direction != "load"):
            raise MalformedJob(f"{_owner(job)} has direction {show_value(direction)}; use "
                               "'store' or 'load'")
        if writer_only is not False:
            self._check_writer_only(job)
        if layer_groups is not None and direction != "load":
            raise MalformedJob(f"{_owner(job)}: layer_groups applies to loads, not a "
                               f"{direction}; drop layer_groups")
        moves = not (writer_only and not self.topology.is_stage_writer)
        return self._engine().prepare(seq, direction, job.blocks, job.chunks, job.positions,
                                      move=moves)

    def _check_writer_only(self, job: CopyJob) -> None:
        """``writer_only`` is a bool, and True only for a store in the replicated layout."""
        if not isinstance(job.writer_only, bool | np.bool_):
            raise MalformedJob(f"{_owner(job)}: writer_only is {show_value(job.writer_only)}; "
                               "give True or False")
        if job.writer_only and not (job.direction == "store" and self.config.layout ==
                                    "replicated"):
            raise MalformedJob(f"{_owner(job)}: writer_only applies to stores in the replicated "
                               f"layout, not a {job.direction} in {self.config.layout!r}; "
                               "drop writer_only")

    def _spill(self, job: CopyJob, spills: Sequence[WorkItem]) -> Exception | None:
        """Start writing out checked ``spills`` (`RankFiles.spill`); return this rank's
        refusal, if any: a spill of a row it has not set up is skipped ("not ready": such a
        row cannot be read), or the error that stopped the spills."""
        if self.files is None:
            return None
        ready = self.ready_rows
        try:
            self.files.spill([item for item in spills if item[1] < ready])
            refuse_unready([chunk for _, chunk in spills], ready, self.topology.rank,
                           f"{_owner(job)} spills", "spill the chunks the manager hands out",
                           self._installed().chunk_count)
        except Exception as exc:
            return exc
        return None

    def _refused(self, entry: Entry, exc: BaseException, taken: bool,
                 layer_groups: int | None) -> None:
        """Fail ``entry`` with ``exc``'s reason (unless it has one) and complete it now unless
        the engine holds it; a job not issued leaves no events (a None per layer group)."""
        entry.error = entry.error or one_line(exc)
        entry.done = entry.done or not taken  # not the engine's: it completes (failed) now
        self._advance()
        if not taken:
            self.last_event = None
            groups = (layer_groups if type(layer_groups) is int and
                      1 <= layer_groups <= len(self.kv_tensors) else 0)
            self.layer_events = [None] * groups

    def progress_copies(self) -> float:
        """Collect copies that finished since the last call and raise this rank's watermark;
        return a suggested pause before the next call."""
        if self.engine is not None and self.jobs.in_flight:
            self._collect(self.engine.poll)
        self.quorum.share()
        return 0.0005 if self.jobs.in_flight else 0.02

    @property
    def in_flight(self) -> int:
        """This rank's jobs whose copies are not yet complete (as of the last progress)."""
        return self.jobs.in_flight

    def drain(self) -> None:
        """Wait for every copy this rank has in flight (the compute fence before close)."""
        if self.engine is not None and self.jobs.in_flight:
            self._collect(self.engine.wait_all)
            self.quorum.share()

    def _collect(self, finished_copies: Callable[[], list[int]]) -> None:
        """Retire the copies the engine reports finished (all of its jobs, failed, when it
        raises) and raise the watermark past every completed job at the head."""
        try:
            finished = finished_copies()
        except Exception as exc:
            finished = self._engine_failed(exc)
        for seq in finished:
            self._finish(seq)
        self._advance()

    def _finish(self, seq: int) -> None:
        """The engine finished ``seq`` on this rank: take the engine's verdict on it (an
        integrity mismatch fails it) and audit a load.  (A job already completed as failed,
        after the engine raised, is not reported twice.)"""
        entry = self.jobs.get(seq)
        if entry is None or entry.done:
            return
        entry.done = True
        entry.seconds = time.perf_counter() - entry.started
        verdict = self._engine().job_error(seq)
        if verdict is not None and entry.error is None:
            entry.error = verdict
        if self.auditor is not None and entry.audited is not None and entry.error is None:
            self.auditor.check(self.kv_tensors, *entry.audited)

    def _engine_failed(self, exc: Exception) -> list[int]:
        """The engine raised while reporting: which of its jobs finished is unknown, so every
        job it holds completes as failed on this rank (the quorum learns it; nobody hangs)."""
        log.error("rank %d: the %s engine failed: %s", self.topology.rank,
                  getattr(self.engine, "name", "?"), exc)
        held = self.jobs.undone()
        for entry in held:
            entry.error = entry.error or f"the transfer engine failed: {one_line(exc)}"
        return [entry.seq for entry in held]

    def _advance(self) -> None:
        """Retire the done jobs at the head of the order and publish the new watermark
        (failure records first: `Quorum.advance`)."""
        moved = self.jobs.retire()
        if moved is not None:
            completed, failures = moved
            self.quorum.advance(completed, failures)

    # ------------------------------------------------------------------ reporting and close
    def report(self) -> dict[str, Any]:
        t, plan, region = self.topology, self._installed(), self._region()
        stats = region.stats
        timings = {**self.timings_s, **stats.timings_s}
        return {
            "rank": t.rank, "node_id": t.node_id, "local_rank": t.local_rank,
            "tp_rank": t.tp_rank, "pp_rank": t.pp_rank, "slot": plan.slots[t.rank].slot,
            "slot_bytes": plan.slots[t.rank].slot_bytes,
            "region_bytes": stats.region_bytes, "prefault_bytes": stats.prefault_bytes,
            "pinned_bytes": stats.pinned_bytes, "pin_plan_bytes": stats.pin_plan_bytes,
            "registrations": stats.registrations, "segments": stats.segments,
            "memory": stats.memory, "shmem_huge": stats.shmem_huge,
            "pinned": region.pinned,
            "numa_node": stats.numa_node, "numa_bytes": stats.numa_bytes,
            "background": stats.background, "ready_rows": self.ready_rows,
            "setup_error": stats.pin_error if stats.background else None,
            "longest_registration_s": stats.longest_registration_s,
            "own_registration_context": stats.own_context,
            "setup_threads": stats.setup_threads,
            "ready_s": (None if self.ready_at is None
                        else round(self.ready_at - self.created_at, 6)),
            "engine": self.engine.name if self.engine else None,
            "paths": dict(self.engine.routes) if self.engine else {},
            "audit": self.auditor.to_json() if self.auditor else None,
            "integrity": {"enabled": self.engine.integrity if self.engine else False,
                          "mismatches": self.engine.mismatches if self.engine else 0},
            "timings_s": timings,
        }

    def close(self) -> None:
        """Fence in-flight copies, then unpin, unmap and unlink.  Idempotent."""
        if self.region is not None:  # no row comes online after close (nor set-up after the JIT)
            self.region.stop_setup()
        if self._compiler is not None and self._compiler is not threading.current_thread():
            self._compiler.join()  # it announces on the board, which closes after us
        try:
            self.drain()
        finally:
            if self.engine is not None:
                self.engine.close()
                self.engine = None
            if self.files is not None:  # its I/O reads and writes the region's rows
                files, self.files = self.files, None
                if not files.close() and self.region is not None:
                    # NOTE: a stalled read still writes into its row when it returns, so the
                    # region is closed only after it did (or with the process).
                    region, self.region = self.region, None
                    log.warning("rank %d: file-tier I/O still stalled at close; the region is "
                                "released once it returns", self.topology.rank)
                    threading.Thread(target=_close_after_io, args=(files, region),
                                     name="offload-region-closer", daemon=True).start()
            if self.region is not None:
                self.region.close()
            index, self.keep_index = self.keep_index, None
            if index is not None:
                index.close()
            retention, self.retention = self.retention, None
            if retention is not None:  # the keeper's countdown starts with the tier's end
                retention.close()

    def timed(self, phase: str, started: float) -> None:
        self.timings_s[phase] = round(time.perf_counter() - started, 6)

    def _installed(self) -> Plan:
        if self.plan is None:
            raise RuntimeError("no plan installed on this rank yet")
        return self.plan

    def _region(self) -> HostRegion:
        if self.region is None:
            raise RuntimeError("this rank has no region yet")
        return self.region

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise RuntimeError("this rank has no transfer engine yet")
        return self.engine


def _owner(job: CopyJob) -> str:
    """A job as error lines name it."""
    return f"job {show_value(job.job_id)}"


def _is_id(job_id: object) -> bool:
    """Whether ``job_id`` is an integer (a numpy one too), the only ids the book keeps."""
    return isinstance(job_id, int | np.integer) and not isinstance(job_id, bool)


def _close_after_io(files: RankFiles, region: HostRegion) -> None:
    files.wait_idle()
    region.close()
