"""The library API: one host tier per rank, created collectively.

Every rank of a torch.distributed job calls `HostTier.create` with its own KV tensors.  Inside,
rank 0 gathers the ranks' descriptors, computes the plan and drives set-up through the collective
RPC (install plan → build region → agree on pinning → start engines) while the other ranks serve;
then every rank gets its `HostTier` back.

Two ways to move blocks afterwards:

* **SPMD** (an engine whose scheduler already sends each step's decisions to every worker): every
  rank calls `submit` with the same `CopyJob`, `poll`s, and asks `done(job_id)` for the quorum.
* **driven** (the main job): rank 0 owns the `ChunkManager` and calls `run` (every rank's actor
  copies, rank 0 waits for the quorum) while the other ranks sit in `serve`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from offload import cleanup
from offload.actor import CopyJob, RankActor
from offload.audit import Auditor
from offload.config import TierConfig
from offload.errors import OffloadError, PeerError
from offload.manager import ChunkManager
from offload.plan import Plan, RankDescriptor, compute_plan
from offload.quorum import Quorum, default_store
from offload.region.pin import Registrar, choose_registrar
from offload.region.prefault import progress_logger
from offload.rpc import CollectiveRPC
from offload.topology import Topology, discover

log = logging.getLogger(__name__)
_tier_seq = itertools.count()


class HostTier:
    """One rank's handle on the host tier."""

    def __init__(self, actor: RankActor, rpc: CollectiveRPC, plan: Plan):
        self.actor = actor
        self.rpc = rpc
        self.plan = plan
        self.manager = ChunkManager(plan.chunk_count) if actor.topology.rank == 0 else None
        self._spmd = Quorum(actor.quorum.store, actor.quorum.members, prefix="spmd")
        self._spmd_seq = itertools.count()
        self._spmd_live: dict[int, int] = {}
        self._closed = False
        cleanup.register(self.actor.close)

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, kv_tensors: Sequence[torch.Tensor], config: TierConfig, *,
               backend: str = "auto", audit: bool = False,
               registrar_factory: Callable[[torch.device], Registrar] = choose_registrar
               ) -> HostTier:
        """Collective: every rank calls it with its own KV tensors and the same config.

        ``backend`` picks the transfer backend (``auto``: by device and pinning); ``audit``
        hashes every block before store and after load and counts mismatches
        (`offload.audit`).  ``registrar_factory`` makes the object that pins host memory for
        the KV device (default: CUDA's driver API for CUDA tensors, a recording no-op else)."""
        started = time.perf_counter()
        topology = discover(config.tp, config.pp, config.timeout_s)
        config = dataclasses.replace(config, tp=topology.tp)  # None meant world // pp
        tier_id, store = _tier_store(topology, config)
        rpc = CollectiveRPC(dist.PrefixStore("rpc", store), topology.rank,
                            topology.world_size, config.timeout_s)
        quorum = Quorum(store, topology.world_size)
        progress = (progress_logger(log, f"pre-fault ({config.layout})")
                    if topology.rank == 0 else None)
        actor = RankActor(topology, config, list(kv_tensors), tier_id, quorum, progress, backend,
                          auditor=Auditor() if audit else None,
                          registrar_factory=registrar_factory, created_at=started)
        descriptor = _describe(actor)
        gathered: list[Any] | None = [None] * topology.world_size if topology.rank == 0 else None
        dist.gather_object(descriptor, gathered, dst=0)
        if topology.rank == 0:
            assert gathered is not None
            plan = _drive_setup(actor, rpc, gathered)
        else:
            _serve_setup(actor, rpc)
            plan = actor._installed()
        return cls(actor, rpc, plan)

    @property
    def topology(self) -> Topology:
        return self.actor.topology

    # ------------------------------------------------------------------ SPMD data path
    def submit(self, job: CopyJob) -> None:
        """Queue this rank's share of ``job``; every rank submits the same jobs in the same
        order.  The quorum counts jobs by their place in that order, so a job id may be reused
        once its previous job was seen done."""
        if job.job_id in self._spmd_live:
            raise OffloadError(f"job id {job.job_id} is still in flight; wait for it before "
                               "reusing the id")
        seq = next(self._spmd_seq)
        self.actor.submit(job, self._spmd, seq)
        self._spmd_live[job.job_id] = seq

    def poll(self) -> None:
        """Report this rank's finished copies to the quorum (non-blocking)."""
        self.actor.progress_copies()

    def done(self, job_id: int) -> bool:
        """True once every rank has finished its copy of ``job_id`` (non-blocking).  The first
        True retires the job on this rank; asking again about it is an error."""
        seq = self._live_seq(job_id)
        self.actor.progress_copies()
        if not self._spmd.done(seq):
            return False
        self._retire(job_id, seq)
        return True

    def wait(self, job_ids: Sequence[int], timeout_s: float | None = None) -> None:
        """Block until the quorum has reported every job (bounded by the tier's timeout)."""
        deadline = time.monotonic() + (timeout_s or self.actor.config.timeout_s)
        for job_id in job_ids:
            seq = self._live_seq(job_id)
            self._await_quorum(self._spmd, seq, deadline)
            self._retire(job_id, seq)

    def _live_seq(self, job_id: int) -> int:
        seq = self._spmd_live.get(job_id)
        if seq is None:
            raise OffloadError(f"job id {job_id} is not in flight on rank "
                               f"{self.topology.rank}; submit it first (a job reads done once)")
        return seq

    def _retire(self, job_id: int, seq: int) -> None:
        del self._spmd_live[job_id]
        self._spmd.retire(seq)

    def _await_quorum(self, quorum: Quorum, key: int, deadline: float) -> None:
        """Report this rank's finished copies until every rank has reported ``key``; past
        ``deadline`` raise `PeerError` naming how many did."""
        while not quorum.done(key):
            self.actor.progress_copies()
            if time.monotonic() > deadline:
                quorum.wait([key], 0.0)
            time.sleep(0.0005)

    # ------------------------------------------------------------------ driven data path
    def run(self, job: CopyJob) -> None:
        """Rank 0: every rank's actor copies ``job``; return once the quorum reported.  The
        job id must be unique for the tier (the chunk manager's ids are)."""
        quorum = self.actor.quorum
        try:
            self.rpc.call(RankActor.submit, job, actor=self.actor)
            self._await_quorum(quorum, job.job_id,
                               time.monotonic() + self.actor.config.timeout_s)
        except BaseException:
            # a slow rank may still report and recreate the key: one stray key per failed job
            with contextlib.suppress(dist.DistError):
                quorum.forget(job.job_id)
            raise
        quorum.forget(job.job_id)

    def call(self, fn: Any, *args: Any) -> list[Any]:
        """Rank 0: run ``fn(actor, *args)`` on every rank and gather the results."""
        return self.rpc.call(fn, *args, actor=self.actor)

    def serve(self) -> None:
        """Ranks other than 0: execute rank 0's commands until it releases them."""
        try:
            self.rpc.serve(self.actor, idle=self.actor.progress_copies)
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
            dist.barrier()
        finally:
            self.actor.close()
            cleanup.unregister(self.actor.close)


def _tier_store(topology: Topology, config: TierConfig) -> tuple[str, dist.Store]:
    """A fresh tier id (rank 0's uuid, shared through the store) and this tier's store."""
    base = default_store("offload", config.timeout_s)
    key = f"tier{next(_tier_seq)}/tier_id"
    if topology.rank == 0:
        tier_id = uuid.uuid4().hex[:16]
        base.set(key, tier_id)
    else:
        try:  # bounded by the tier's timeout without touching the store's own setting
            base.wait([key], datetime.timedelta(seconds=config.timeout_s))
        except dist.DistError:
            raise PeerError(f"rank {topology.rank} got no tier id from rank 0 within "
                            f"{config.timeout_s:g} s; rank 0 is not creating the tier") from None
        tier_id = base.get(key).decode()
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


def _drive_setup(actor: RankActor, rpc: CollectiveRPC, gathered: list[Any]) -> Plan:
    try:
        errors = [g for g in gathered if isinstance(g, str)]
        if errors:
            raise OffloadError(errors[0])
        plan = compute_plan(gathered)
        digests = rpc.call(RankActor.install_plan, plan, actor=actor)
        wrong = [r for r, d in enumerate(digests) if d != plan.digest()]
        if wrong:  # the plan travels pickled, so this is a bug, not a user error
            raise RuntimeError(f"ranks {wrong} acknowledged a different plan than rank 0's "
                               f"{plan.digest()}")
        pinned = rpc.call(RankActor.build_region, actor=actor)
        if any(pinned) and not all(pinned):
            log.warning("ranks %s could not pin their region; the whole group runs unpinned",
                        [r for r, p in enumerate(pinned) if not p])
            rpc.call(RankActor.unpin, actor=actor)
        rpc.call(RankActor.start_engine, actor=actor)
        rpc.release()
        return plan
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
