# SPDX-License-Identifier: Apache-2.0
"""The vLLM integration's logic, free of vLLM: it imports and runs without vLLM installed.

vLLM's offloading connector splits the work in two (vLLM's `v1/kv_offload/abstract.py`):

* on the **scheduler**, a manager decides which offloaded block (an *offload key*: a block
  hash and its KV cache group) lives where.  Ours is `TierIndex`: the `ChunkManager` keyed by
  vLLM's offload keys.  One key is one chunk (one row of the host regions), holding
  vLLM's ``blocks_per_chunk`` GPU blocks at positions ``0 .. blocks_per_chunk - 1``: vLLM's
  offloaded block size *is* the tier's ``blocks_per_chunk``.
* on every **TP x PP worker**, a handler moves the blocks.  Ours is `TierWorker`: the
  `HostTier`, created collectively over the workers' gloo group, so every layout, pipeline
  stages and the completion quorum work as in any other program.

Decisions travel as the tier wants them (docs/API.md, "SPMD"): worker rank 0 is the *decider*;
it alone calls `HostTier.finished` and reports to the scheduler, for every worker, in a
`StepReport` (the jobs that failed, whether a failed load found damaged bytes, the tier's
`DecisionMark`, rows ready).  The scheduler sends the mark back with the next step, and the
other workers learn the same results with ``finished(mark)``.  vLLM's own job ids are the tier's
job ids.

Primitives (scheduler side, `TierIndex`):
    parse_extra_config -- ``kv_connector_extra_config`` into a `TierConfig`, once.
    lookup / prepare_load / prepare_store -- vLLM's manager calls, on offload keys.
    bind -- which tier job a vLLM job id is (when the job is sent to the workers).
    apply -- the decider's `StepReport`: marks, readiness, failures, promotions.
    decided -- a job every worker has finished: its chunks become readable / are released.
    flush_promotions -- keys found on disk only, brought back to host memory as one job.
    reset -- vLLM's cache reset: every key forgotten.

Primitives (worker side, `TierWorker`):
    submit -- one vLLM store or load (GPU block ids, chunks) as one `CopyJob`.
    learn / finished -- the decision mark in, the decided jobs out (`Outcome`).
    flush -- this rank's copies done (vLLM re-allocates their GPU blocks next).
    promote -- a promotion, collectively on every worker.
    report -- the decider's `StepReport` for this step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from offload.actor import CopyJob
from offload.config import LAYOUTS, TierConfig
from offload.errors import OffloadError, is_damage
from offload.manager import ChunkManager, NotReadableError, PromoteJob
from offload.sizes import parse_size
from offload.tiers.file_format import key_bytes

if TYPE_CHECKING:  # the tier imports torch; the index needs neither
    from offload.keep_index import KeepIndex
    from offload.tier import DecisionMark, HostTier

log = logging.getLogger(__name__)

Key = Hashable  # vLLM's OffloadKey (bytes: block hash + group index)
Lookup = Literal["hit", "miss", "pending"]

# ---------------------------------------------------------------------- configuration

VLLM_KEYS = frozenset({"spec_name", "spec_module_path", "blocks_per_chunk", "block_size",
                       "offload_prompt_only", "self_describing_kv_events",
                       "canonical_layout"})
"""Keys vLLM itself reads from ``kv_connector_extra_config``; passed through untouched."""


@dataclass(frozen=True)
class _Key:
    """One of our extra-config keys: the `TierConfig` field it sets and how to read it."""

    field: str
    kind: Literal["size", "int", "float", "bool", "str", "layout"]
    meaning: str


EXTRA_KEYS: dict[str, _Key] = {
    "cpu_bytes_per_node": _Key("cpu_bytes_per_node", "size",
                               "host memory per node (per DP replica), e.g. \"64GiB\""),
    "layout": _Key("layout", "layout", "private, shared or replicated (docs/LAYOUTS.md)"),
    "integrity": _Key("integrity", "bool", "checksum every page, check it on load"),
    "background": _Key("background", "bool", "background set-up: serve while rows come up"),
    "setup_context": _Key("setup_context", "bool",
                          "background registration in the tier's own CUDA context"),
    "metrics_port": _Key("metrics_port", "int", "serve offload_* metrics on this port + rank"),
    "metrics_addr": _Key("metrics_addr", "str", "address the metrics servers listen on"),
    "staging_bytes": _Key("staging_bytes", "size", "GPU staging ring per rank (0: off)"),
    "fs_tier": _Key("fs_dir", "str", "directory of the file tier behind host memory"),
    "fs_bytes": _Key("fs_bytes", "size", "file tier budget per node"),
    "fs_namespace": _Key("fs_namespace", "str",
                         "what computed the KV (default: the model name and dtype)"),
    "fs_io_timeout_s": _Key("fs_io_timeout_s", "float", "deadline of one file read/write"),
    "keep_s": _Key("keep_s", "float",
                   "seconds the host tier is kept for the next engine (docs/KEEP.md)"),
    "timeout_s": _Key("timeout_s", "float", "seconds a rank waits for a peer"),
    "prefault_threads": _Key("prefault_threads", "int", "pre-fault threads per rank"),
    "shm_dir": _Key("shm_dir", "str", "keep visible region files there (default: nameless)"),
    "numa": _Key("numa", "bool", "place each rank's memory on its GPU's NUMA node"),
    "private_memory": _Key("private_memory", "str", "anonymous or memfd"),
}
"""Our keys in ``kv_connector_extra_config`` (docs/VLLM.md lists them)."""


def parse_extra_config(extra: Mapping[str, Any], *, blocks_per_chunk: int, tp: int, pp: int,
                       model: str = "", kv_identical_across_tp: bool = False) -> TierConfig:
    """``kv_connector_extra_config`` as our typed `TierConfig`, read once.

    Every bad key gets one line of the error (an unknown key, a value of the wrong type, a
    size that does not parse); then `TierConfig` checks the values together.

    Args:
        extra: the extra config as vLLM holds it (vLLM's own keys, `VLLM_KEYS`, pass).
        blocks_per_chunk: vLLM's GPU blocks per offloaded block (its ``blocks_per_chunk``
            or ``block_size``): the tier's blocks per chunk.
        tp, pp: vLLM's tensor- and pipeline-parallel sizes.
        model: the model's name and dtype, the default namespace of the file tier and of a
            kept tier (``keep_s``).
        kv_identical_across_tp: vLLM found the KV of every TP rank identical (MLA): only
            then may TP ranks share one copy (``layout: replicated``).

    Returns:
        The tier's settings.

    Raises:
        OffloadError: one line per bad key, naming the key, the value and the fix.
    """
    problems: list[str] = []
    values: dict[str, Any] = {}
    for name, raw in extra.items():
        if name in VLLM_KEYS:
            continue
        spec = EXTRA_KEYS.get(name)
        if spec is None:
            problems.append(f"kv_connector_extra_config key {name!r} is unknown; use one of "
                            f"{', '.join(sorted(EXTRA_KEYS))} (docs/VLLM.md)")
            continue
        try:
            values[spec.field] = _read(name, spec, raw)
        except OffloadError as exc:
            problems.append(str(exc))
    if "cpu_bytes_per_node" not in values and not any("cpu_bytes_per_node" in p
                                                      for p in problems):
        problems.append("kv_connector_extra_config has no 'cpu_bytes_per_node'; give the "
                        "host memory per node, e.g. \"cpu_bytes_per_node\": \"64GiB\"")
    if extra.get("canonical_layout"):
        problems.append("kv_connector_extra_config 'canonical_layout' = true is not supported "
                        "by HostTierSpec; drop it (the tier keeps each rank's pages as they "
                        "are)")
    layout = values.get("layout")
    if layout == "replicated" and tp > 1 and not kv_identical_across_tp:
        problems.append("kv_connector_extra_config 'layout' = 'replicated' needs KV identical "
                        f"on every TP rank (MLA), but this model's KV differs across its {tp} "
                        "TP ranks; use 'private' or 'shared'")
    if problems:
        raise OffloadError("\n".join(problems))
    # the file tier's files and a kept tier are found again by what computed the KV
    if (values.get("fs_dir") is not None or values.get("keep_s")) and \
            "fs_namespace" not in values:
        values["fs_namespace"] = model or "vllm"
    return TierConfig(blocks_per_chunk=blocks_per_chunk, tp=tp, pp=pp, **values)


def _read(name: str, spec: _Key, raw: Any) -> Any:
    """One extra-config value, typed; `OffloadError` (one line) when it is not."""
    where = f"kv_connector_extra_config {name!r} = {raw!r}"
    if spec.kind == "size":
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise OffloadError(f"{where} is not a size; give bytes or a string like \"64GiB\"")
        return parse_size(raw, f"kv_connector_extra_config {name!r}")
    if spec.kind == "bool":
        if not isinstance(raw, bool):
            raise OffloadError(f"{where} is not a boolean; give true or false")
        return raw
    if spec.kind == "int":
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise OffloadError(f"{where} is not an integer; give a whole number")
        return raw
    if spec.kind == "float":
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise OffloadError(f"{where} is not a number; give seconds such as 5")
        return float(raw)
    if not isinstance(raw, str):
        raise OffloadError(f"{where} is not a string; give {spec.meaning}")
    if spec.kind == "layout" and raw not in LAYOUTS:
        raise OffloadError(f"{where} is not a layout; choose one of {', '.join(LAYOUTS)}")
    return raw


# ---------------------------------------------------------------------- messages


@dataclass(frozen=True)
class TierSetup:
    """What the scheduler's index needs from the workers' tier, sent once after it is
    created (vLLM's connector handshake): the plan's rows and the file tier's size; after a
    restart what the file tier found and the (key, chunk) pairs a kept tier's index named
    (docs/KEEP.md), which the tier adopted."""

    chunk_count: int
    disk_capacity: int = 0
    ready_rows: int | None = None  # None: every row (no background set-up)
    disk_keys: tuple[bytes, ...] = ()  # what a restarted file tier found, LRU first
    kept: tuple[tuple[Key, int], ...] = ()  # adopted from a kept tier, in the index's order


@dataclass(frozen=True)
class Outcome:
    """One decided job, as the decider learned it.  ``damaged``: a load whose host bytes did
    not match their checksums (its keys are dropped); ``blocks``: a failed load's GPU
    blocks, which vLLM recomputes."""

    job_id: int
    success: bool
    direction: str
    damaged: bool = False
    error: str | None = None
    bytes: int = 0
    seconds: float = 0.0
    blocks: tuple[int, ...] = ()


@dataclass
class StepReport:
    """The decider's news for the scheduler, once per step (merged across steps when vLLM
    aggregates several outputs).  Successful jobs travel in vLLM's own completion counts;
    this carries what vLLM has no field for."""

    mark: DecisionMark | None = None
    ready_rows: int | None = None
    failed: dict[int, Outcome] = field(default_factory=dict)
    promoted: dict[int, tuple[Key, ...]] = field(default_factory=dict)  # job -> failed keys

    def empty(self) -> bool:
        return (self.mark is None and self.ready_rows is None and not self.failed
                and not self.promoted)

    def merge(self, other: StepReport) -> StepReport:
        """Both reports in one; the later mark (the larger ``through``) wins."""
        marks = [m for m in (self.mark, other.mark) if m is not None]
        rows = [r for r in (self.ready_rows, other.ready_rows) if r is not None]
        return StepReport(max(marks, key=lambda m: m.through) if marks else None,
                          max(rows) if rows else None, {**self.failed, **other.failed},
                          {**self.promoted, **other.promoted})


@dataclass(frozen=True)
class PromotePlan:
    """Keys on disk only, brought back into host memory before they are loaded: the
    manager's `PromoteJob`, which every worker runs collectively."""

    job: PromoteJob


@dataclass(frozen=True)
class StorePlan:
    """`TierIndex.prepare_store`'s answer: the keys that get chunks (in the order asked),
    their chunks, the keys evicted for them and the evicted keys to write to disk first;
    with retention the keys' stored form (`file_format.key_bytes`), for the decider's kept
    index (`TierWorker.submit`)."""

    job_id: int
    keys: tuple[Key, ...]
    chunks: np.ndarray
    evicted: tuple[Key, ...]
    spills: tuple[tuple[Key, int], ...]
    stored: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class LoadPlan:
    """`TierIndex.prepare_load`'s answer: the chunks of the keys, in the order asked."""

    job_id: int
    chunks: np.ndarray


# ---------------------------------------------------------------------- job mapping


def copy_job(job_id: int, direction: Literal["store", "load"],
             gpu_blocks: Sequence[int] | np.ndarray, first_block: int,
             chunks: Sequence[int] | np.ndarray, blocks_per_chunk: int,
             writer_only: bool = False, spills: tuple[tuple[Key, int], ...] = ()) -> CopyJob:
    """vLLM's transfer of ``gpu_blocks`` as the tier's `CopyJob`.

    vLLM lists a request's GPU blocks in order; ``first_block`` is the first one's index in
    the request (``GPULoadStoreSpec.block_indices``), so a load may begin in the middle of its
    first chunk: block ``i`` goes to chunk ``chunks[(skip + i) // bpc]`` at position
    ``(skip + i) % bpc`` with ``skip = first_block % bpc``.

    Raises:
        ValueError: the blocks do not fill exactly the chunks given (a bug in the caller).
    """
    bpc = blocks_per_chunk
    blocks = np.asarray(gpu_blocks, dtype=np.int64)
    rows = np.asarray(chunks, dtype=np.int64)
    logical = first_block % bpc + np.arange(blocks.size, dtype=np.int64)
    needed = -(-(int(logical[-1]) + 1) // bpc) if blocks.size else 0
    if needed != rows.size:
        raise ValueError(f"job {job_id}: {blocks.size} GPU blocks from block {first_block} "
                         f"span {needed} chunks of {bpc} blocks, but {rows.size} chunks were "
                         "given")
    return CopyJob(job_id, direction, blocks, rows[logical // bpc], logical % bpc,
                   writer_only=writer_only and direction == "store", spills=spills)


# ---------------------------------------------------------------------- scheduler side


@dataclass
class IndexStats:
    """Counters of the scheduler's index since start (chunks are vLLM's offloaded blocks)."""

    lookups: int = 0
    hits: int = 0
    stored_chunks: int = 0
    loaded_chunks: int = 0
    failed_stores: int = 0
    failed_loads: int = 0
    damaged_loads: int = 0
    promotions: int = 0
    promoted_chunks: int = 0
    failed_promotions: int = 0
    adopted_chunks: int = 0  # seeded from a kept tier at start (docs/KEEP.md)
    adopted_loads: int = 0  # chunks loaded whose bytes a kept tier's engine stored


class TierIndex:
    """vLLM's offloading manager on our `ChunkManager`, keyed by vLLM's offload keys
    (module docstring).  Runs in the scheduler process; pure bookkeeping.

    Until the workers' tier reports its plan (`configure`) every lookup misses and nothing is
    stored.  A job's chunks change state only when the decider reports it decided
    (`decided`), by vLLM job id, so a job vLLM no longer tracks (after a cache reset) still
    releases what it holds.

    With ``keep`` (retention, docs/KEEP.md) the store plans carry their keys' stored form to
    the workers, whose decider keeps the tier's index of kept chunks (`TierWorker`), and a
    cache reset is passed on (`take_forget`) so the index forgets too.
    """

    def __init__(self, events: bool = False, keep: bool = False) -> None:
        self.manager: ChunkManager | None = None
        self.stats = IndexStats()
        self.keep = keep
        self._forget = False  # a reset the decider's kept index has not heard of yet
        self._adopted: set[Key] = set()  # adopted keys not stored again since
        self._events: list[tuple[tuple[Key, ...], bool]] | None = [] if events else None
        self._bound: dict[int, tuple[str, int]] = {}  # vLLM job id -> (direction, manager job)
        self._jobs: dict[int, tuple[str, tuple[Key, ...]]] = {}  # manager job -> keys
        self._failed: dict[int, Outcome] = {}  # vLLM job id -> failure, until decided
        self._promote: dict[Key, None] = {}  # disk-only keys lookups asked for, in order
        self._promoting: dict[int, PromoteJob] = {}  # promotions sent to the workers
        self._no_room: set[Key] = set()  # dropped from a promotion: the next lookup misses

    # ------------------------------------------------------------------ set-up
    @property
    def configured(self) -> bool:
        return self.manager is not None

    def configure(self, setup: TierSetup) -> None:
        """Take the workers' plan: from now on keys can be stored."""
        self.manager = ChunkManager(setup.chunk_count, setup.disk_capacity,
                                    ready=setup.ready_rows)
        self.manager.seed(setup.kept)  # a restarted engine finds its kept host memory ...
        self.manager.seed_disk(setup.disk_keys)  # ... and its files
        self._adopted = {k for k, _ in setup.kept if self.manager.residence(k) == "host"}
        self.stats.adopted_chunks = len(self._adopted)

    # ------------------------------------------------------------------ lookups
    def lookup(self, key: Key) -> Lookup:
        """``hit``: readable in host memory; ``pending``: being stored, or on disk only
        (a promotion is queued: vLLM asks again later); ``miss`` otherwise."""
        self.stats.lookups += 1
        manager = self.manager
        if manager is None:
            return "miss"
        where = manager.residence(key)
        if where in ("host", "both"):
            self.stats.hits += 1
            return "hit"
        if manager.storing(key):  # a store, or a promotion already on its way
            return "pending"
        if where == "disk":
            if key in self._no_room:
                self._no_room.discard(key)
                return "miss"
            self._promote[key] = None
            return "pending"
        return "miss"

    # ------------------------------------------------------------------ jobs
    def prepare_load(self, keys: Sequence[Key]) -> LoadPlan:
        """Hold the chunks of ``keys`` until the load is decided.

        Raises:
            NotReadableError: some key is not readable (vLLM loads only what it looked up).
        """
        job = self._manager().prepare_load(list(keys))
        self._jobs[job.job_id] = ("load", tuple(keys))
        return LoadPlan(job.job_id, np.fromiter((c for _, c in job.chunks), np.int64,
                                                len(job.chunks)))

    def prepare_store(self, keys: Sequence[Key]) -> StorePlan | None:
        """Chunks for the keys not cached yet, evicting the least recently used; None when
        none of the new keys found room (vLLM retries later)."""
        if self.manager is None:
            return StorePlan(-1, (), np.empty(0, np.int64), (), ())
        job = self.manager.prepare_store(list(keys))
        stored = tuple(k for k, _ in job.chunks)
        if self._events is not None and job.evicted:
            self._events.append((job.evicted, True))
        if not stored:  # nothing will be sent: the manager's job ends here
            self.manager.complete_store(job.job_id, ok=True)
            return None if job.dropped else StorePlan(job.job_id, (), np.empty(0, np.int64),
                                                      job.evicted, ())
        self._jobs[job.job_id] = ("store", stored)
        chunks = np.fromiter((c for _, c in job.chunks), np.int64, len(job.chunks))
        forms = tuple(key_bytes(k) for k in stored) if self.keep else ()
        return StorePlan(job.job_id, stored, chunks, job.evicted, job.spills, forms)

    def bind(self, vllm_job_id: int, manager_job_id: int) -> None:
        """vLLM sent the job ``vllm_job_id`` for the manager's ``manager_job_id``."""
        direction, _ = self._jobs[manager_job_id]
        self._bound[vllm_job_id] = (direction, manager_job_id)

    def decided(self, vllm_job_id: int) -> None:
        """Every worker has finished the job: a successful store's keys become readable, a
        load's holds are released; a failure the decider reported (`apply`) makes the store's
        keys never readable and drops a damaged load's keys.  Unknown ids (never bound)
        are ignored."""
        bound = self._bound.pop(vllm_job_id, None)
        failure = self._failed.pop(vllm_job_id, None)
        if bound is None:
            return
        direction, job_id = bound
        _, keys = self._jobs.pop(job_id)
        manager = self._manager()
        if direction == "store":
            manager.complete_store(job_id, ok=failure is None)
            if failure is None:
                self.stats.stored_chunks += len(keys)
                self._adopted.difference_update(keys)
                if self._events is not None:
                    self._events.append((keys, False))
            else:
                self.stats.failed_stores += 1
            return
        damaged = keys if failure is not None and failure.damaged else ()
        manager.complete_load(job_id, damaged=damaged)
        if failure is None:
            self.stats.loaded_chunks += len(keys)
            self.stats.adopted_loads += sum(k in self._adopted for k in keys)
        else:
            self.stats.failed_loads += 1
            self.stats.damaged_loads += bool(damaged)
            if damaged and self._events is not None:
                self._events.append((tuple(damaged), True))

    def apply(self, report: StepReport) -> None:
        """The decider's news: failures (before their jobs are `decided`), rows ready, the
        watermark (quarantines end), promotions done."""
        self._failed.update(report.failed)
        manager = self.manager
        if manager is None:
            return
        if report.ready_rows is not None:
            manager.set_ready(report.ready_rows)
        if report.mark is not None:
            manager.drained(report.mark.through)
        for job_id, failed in report.promoted.items():
            self._promoted(job_id, failed)

    # ------------------------------------------------------------------ promotions
    @property
    def pending_work(self) -> bool:
        """Promotions queued or running: vLLM must keep stepping until they are done."""
        return bool(self._promote or self._promoting)

    def flush_promotions(self) -> PromotePlan | None:
        """One promotion of the disk-only keys lookups asked for since the last call (at the
        end of vLLM's scheduling step); keys that find no host chunk miss once."""
        manager = self.manager
        keys = [k for k in self._promote if manager is not None
                and manager.residence(k) == "disk"]
        self._promote.clear()
        if not keys or manager is None:
            return None
        job = manager.prepare_promote(keys)
        self._no_room.update(job.dropped)
        if not job.chunks:
            manager.complete_promote(job.job_id, failed=())
            return None
        self._promoting[job.job_id] = job
        self.stats.promotions += 1
        if self._events is not None and job.evicted:
            self._events.append((job.evicted, True))
        return PromotePlan(job)

    def _promoted(self, job_id: int, failed: Sequence[Key]) -> None:
        job = self._promoting.pop(job_id, None)
        if job is None:
            return
        # a failed read may still be writing its row: keep those rows out of use until the
        # next promotion that reports them free (the manager's rule for `busy`)
        lost = set(failed)
        busy = [c for k, c in job.chunks if k in lost]
        self._manager().complete_promote(job_id, list(lost), busy)
        self.stats.promoted_chunks += len(job.chunks) - len(lost)
        self.stats.failed_promotions += len(lost)

    # ------------------------------------------------------------------ reset and events
    def reset(self) -> None:
        """vLLM's cache reset: forget every key; jobs in flight end as they are decided."""
        if self.manager is not None:
            self.manager.drop()
        self._promote.clear()
        self._no_room.clear()
        self._adopted.clear()
        self._forget = self.keep

    def take_forget(self) -> bool:
        """Whether the decider's kept index must forget every record (a reset since the last
        call): a restart must not bring back keys the engine dropped."""
        forget, self._forget = self._forget, False
        return forget

    def take_events(self) -> list[tuple[tuple[Key, ...], bool]]:
        """Keys stored (False) or removed (True) since the last call, if events are on."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def held(self) -> int:
        """Readable chunks some pending load holds (0 once every load is decided)."""
        return self.manager.stats().held if self.manager is not None else 0

    def _manager(self) -> ChunkManager:
        if self.manager is None:
            raise NotReadableError("the tier has not reported its plan yet; nothing is cached")
        return self.manager


# ---------------------------------------------------------------------- worker side


class TierWorker:
    """One TP x PP worker's side: vLLM's transfers as jobs of this rank's `HostTier`.

    Every worker submits the same jobs in the same order (vLLM sends each step's jobs to every
    worker).  A job refused on this rank still takes its place and comes back failed
    through the decision, never as an exception here.

    Retention (docs/KEEP.md): the kept index lives with the tier's rank 0, the decider, but
    the keys live in the scheduler's `TierIndex`; so the store plans bring each key's stored
    form, and the decider keeps the index as `KeptManager` does on rank 0 of other programs:
    a chunk's record is cleared before this rank issues a copy into it (a store, a
    promotion), written once the store is decided successful (with the pages' generations),
    cleared when a load finds it damaged, and every record forgotten on a cache reset.
    """

    def __init__(self, tier: HostTier, blocks_per_chunk: int, *, replicated: bool = False,
                 flush_timeout_s: float | None = None) -> None:
        self.tier = tier
        self.blocks_per_chunk = blocks_per_chunk
        self.replicated = replicated
        self.is_decider = tier.topology.rank == tier.decider
        self.flush_timeout_s = (tier.actor.config.timeout_s if flush_timeout_s is None
                                else flush_timeout_s)
        self._loads: dict[int, tuple[int, ...]] = {}  # load job id -> its GPU blocks
        self._promoted: dict[int, tuple[Key, ...]] = {}
        self._reported: tuple[DecisionMark | None, int | None] = (None, None)  # mark, rows
        self._closed = False
        # the scheduler's index owns the chunks; the tier's own manager is unused, except
        # for what a restarted file tier found and what a kept tier's index named, which the
        # scheduler's index adopts (`setup`)
        manager = tier.manager
        self._disk_keys = tuple(manager.disk_keys()) if manager is not None else ()
        self._kept = tuple(getattr(manager, "adopted_pairs", ()))
        self.index: KeepIndex | None = tier.actor.keep_index if self.is_decider else None
        self._recording: dict[int, tuple[tuple[int, bytes], ...]] = {}  # store -> records
        self._load_chunks: dict[int, tuple[int, ...]] = {}  # load -> chunks (with an index)
        if self.is_decider:
            tier.manager = None

    def setup(self) -> TierSetup:
        """What the scheduler's index needs to start (sent once)."""
        from offload.tiers.rank_files import disk_capacity

        tier = self.tier
        config = tier.actor.config
        disk = (disk_capacity(tier.plan, tier.topology, config.fs_bytes_per_node)
                if config.fs_dir is not None else 0)
        ready = tier.last_ready.rows if config.background else None
        return TierSetup(tier.plan.chunk_count, disk, ready, self._disk_keys, self._kept)

    def submit(self, job_id: int, direction: Literal["store", "load"],
               gpu_blocks: Sequence[int] | np.ndarray, first_block: int,
               chunks: Sequence[int] | np.ndarray,
               spills: tuple[tuple[Key, int], ...] = (), stored: Sequence[bytes] = ()) -> None:
        """Queue vLLM's job ``job_id`` on this rank (see `copy_job`); ``stored``: a store's
        keys in their stored form, one per chunk (retention, `TierIndex`)."""
        job = copy_job(job_id, direction, gpu_blocks, first_block, chunks,
                       self.blocks_per_chunk, writer_only=self.replicated, spills=spills)
        if direction == "load":
            self._loads[job_id] = tuple(int(b) for b in job.blocks)
        if self.index is not None:
            self._track(job_id, direction, [int(c) for c in chunks], stored)
        try:
            self.tier.submit(job)
        except OffloadError as exc:  # refused here: decided failed on every rank
            log.warning("rank %d refused job %d: %s", self.tier.topology.rank, job_id, exc)

    def _track(self, job_id: int, direction: str, chunks: list[int],
               stored: Sequence[bytes]) -> None:
        """The decider's kept index before a job is issued here: a store's chunks lose their
        records now (their bytes are about to change) and get them back when it is decided
        successful; a load's chunks are remembered in case it finds them damaged."""
        assert self.index is not None
        if direction == "load":
            self._load_chunks[job_id] = tuple(chunks)
            return
        for chunk in chunks:
            self.index.clear(chunk)
        if len(stored) == len(chunks):  # a plan without stored forms records nothing
            self._recording[job_id] = tuple(zip(chunks, stored, strict=True))

    def _account(self, job_id: int, success: bool, damaged: bool) -> None:
        """The decider's kept index after ``job_id`` was decided (see `_track`)."""
        assert self.index is not None
        records = self._recording.pop(job_id, ())
        loaded = self._load_chunks.pop(job_id, ())
        if success and records:
            self.index.write_decided(records, self.tier.actor._engine().generations)
        if damaged:
            for chunk in loaded:
                self.index.clear(chunk)

    def forget(self) -> None:
        """vLLM reset its cache: no record of the kept index stays valid (stores in flight
        still write theirs when decided; their keys stay cached in the scheduler too)."""
        if self.index is not None:
            for chunk in range(self.tier.plan.chunk_count):
                self.index.clear(chunk)

    def learn(self, mark: DecisionMark | None) -> list[int]:
        """Non-deciders: learn the decisions up to ``mark`` (from vLLM's step metadata);
        returns the ids of the jobs decided (the decider reported them already)."""
        if self.is_decider or mark is None or mark.through <= self.tier.mark.through:
            return []
        decided = [result.job_id for result in self.tier.finished(mark)]
        for job_id in decided:
            self._loads.pop(job_id, None)
        return decided

    def finished(self) -> list[Outcome]:
        """The decider: the jobs decided since the last call; others: poll (publish this
        rank's progress) and return nothing -- the decider speaks for every worker."""
        if not self.is_decider:
            self.tier.poll()
            return []
        outcomes = []
        for r in self.tier.finished():
            blocks = self._loads.pop(r.job_id, None)
            direction = "load" if blocks is not None else "store"
            damaged = not r.success and is_damage(r.error)
            if self.index is not None:
                self._account(r.job_id, r.success, damaged)
            outcomes.append(Outcome(r.job_id, r.success, direction, damaged=damaged,
                                    error=r.error, bytes=r.transfer_size,
                                    seconds=r.transfer_time,
                                    blocks=blocks if blocks is not None and not r.success
                                    else ()))
            if not r.success:
                log.warning("offload job %d (%s) failed on rank %s: %s", r.job_id, direction,
                            r.failed_rank, r.error)
        return outcomes

    def flush(self) -> None:
        """Wait until this rank's copies are done (vLLM is about to reuse their GPU blocks):
        a rank's own copies are what read its blocks, so no other rank is waited for."""
        deadline = time.monotonic() + self.flush_timeout_s
        while self.tier.poll():
            if time.monotonic() > deadline:
                raise OffloadError(f"rank {self.tier.topology.rank}: copies still running "
                                   f"after {self.flush_timeout_s:g} s; the transfer engine "
                                   "is stuck")
            time.sleep(0.0005)

    def promote(self, plan: PromotePlan) -> None:
        """Every worker, at the same point: read the plan's keys from disk into their rows;
        the keys some rank could not read back are misses (reported by the decider)."""
        if self.index is not None:  # the rows are rewritten: their records go first
            for _, chunk in plan.job.chunks:
                self.index.clear(chunk)
        failed = self.tier.collective_promote(plan.job)
        if self.is_decider:
            self._promoted[plan.job.job_id] = tuple(failed)

    def report(self, outcomes: Iterable[Outcome] = ()) -> StepReport:
        """The decider's `StepReport` for this step (empty on other ranks)."""
        if not self.is_decider:
            return StepReport()
        tier = self.tier
        # only news travels: vLLM builds the worker's metadata only when there is some
        mark = tier.mark if tier.mark != self._reported[0] else None
        rows = tier.last_ready.rows if tier.actor.config.background else None
        rows = rows if rows != self._reported[1] else None
        self._reported = (tier.mark, rows if rows is not None else self._reported[1])
        promoted, self._promoted = self._promoted, {}
        return StepReport(mark, rows, {o.job_id: o for o in outcomes if not o.success},
                          promoted)

    def close(self) -> None:
        """Close the tier (collective; every worker shuts down together).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.tier.close()

