# SPDX-License-Identifier: Apache-2.0
"""`HostTierSpec`: the tier as a vLLM offloading spec (thin shells over `offload.vllm.core`).

Runs in two kinds of process:

* the scheduler: `HostTierManager` (vLLM's ``OffloadingManager``) answers lookups and
  prepares loads and stores on the `TierIndex`;
* every TP x PP worker: `HostTierWorker` (vLLM's ``OffloadingWorker``) creates the worker's
  `HostTier` collectively over vLLM's gloo world group and submits vLLM's transfers to it.

It needs `offload.vllm.HostTierConnector` as vLLM's connector: vLLM's stock
``OffloadingConnector`` asserts that every transfer succeeded and has no way to carry the
tier's decisions between the workers.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from offload.errors import OffloadError
from offload.vllm import core

log = logging.getLogger(__name__)

_LOOKUP = {"hit": LookupResult.HIT, "miss": LookupResult.MISS,
           "pending": LookupResult.HIT_PENDING}


class HostTierChunks(LoadStoreSpec):
    """Where offloaded blocks live: their chunk ids (rows) in the tier, in vLLM's order,
    the manager's job for them and, for a store, the evicted keys to write to disk first and
    (retention) the keys' stored form for the kept index."""

    def __init__(self, chunks: np.ndarray, manager_job: int,
                 spills: tuple[tuple[Any, int], ...] = (),
                 stored: tuple[bytes, ...] = ()) -> None:
        self.chunks = chunks
        self.manager_job = manager_job
        self.spills = spills
        self.stored = stored

    def __repr__(self) -> str:
        return f"HostTierChunks({self.chunks.tolist()}, job={self.manager_job})"


# ---------------------------------------------------------------------- scheduler


class HostTierManager(OffloadingManager):
    """vLLM's manager calls on the `TierIndex`.  Loads and stores are completed by vLLM job
    id when the decider reports them (`HostTierConnector`), so ``complete_load`` and
    ``complete_store`` have nothing left to do."""

    def __init__(self, index: core.TierIndex) -> None:
        self.index = index
        self.promotions: list[core.PromotePlan] = []  # for the next step's metadata

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP[self.index.lookup(key)]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext
                     ) -> LoadStoreSpec:
        plan = self.index.prepare_load(list(keys))
        return HostTierChunks(plan.chunks, plan.job_id)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext
                      ) -> PrepareStoreOutput | None:
        plan = self.index.prepare_store(list(keys))
        if plan is None:
            return None
        return PrepareStoreOutput(keys_to_store=_keys(plan.keys),
                                  store_spec=HostTierChunks(plan.chunks, plan.job_id,
                                                            plan.spills, plan.stored),
                                  evicted_keys=_keys(plan.evicted))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        plan = self.index.flush_promotions()
        if plan is not None:
            self.promotions.append(plan)

    def has_pending_work(self) -> bool:
        return self.index.pending_work or bool(self.promotions)

    def reset_cache(self) -> None:
        self.index.reset()

    def take_events(self) -> Iterable[OffloadingEvent]:
        for keys, removed in self.index.take_events():
            yield OffloadingEvent(keys=_keys(keys), medium=Medium.CPU, removed=removed)

    def take_promotions(self) -> list[core.PromotePlan]:
        plans, self.promotions = self.promotions, []
        return plans


def _keys(keys: Iterable[Any]) -> list[OffloadKey]:
    """The index's keys are the offload keys vLLM gave it."""
    return [OffloadKey(k) for k in keys]


# ---------------------------------------------------------------------- worker


class HostTierWorker(OffloadingWorker):
    """vLLM's handler calls on the `TierWorker` of this rank."""

    def __init__(self, worker: core.TierWorker) -> None:
        self.core = worker

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, HostTierChunks)
        self.core.submit(job_id, "store", src_spec.block_ids, _first_block(src_spec),
                         dst_spec.chunks, dst_spec.spills, dst_spec.stored)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, HostTierChunks)
        self.core.submit(job_id, "load", dst_spec.block_ids, _first_block(dst_spec),
                         src_spec.chunks)
        return True

    def outcomes(self) -> list[core.Outcome]:
        """The decided jobs (the decider's; other ranks get none)."""
        return self.core.finished()

    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(o.job_id, o.success, o.bytes, o.seconds)
                for o in self.outcomes()]

    def wait(self, job_ids: set[int]) -> None:
        self.core.flush()

    def shutdown(self) -> None:
        try:
            self.core.close()
        except Exception as exc:  # a peer already gone: this rank's memory is freed anyway
            log.warning("closing the host tier: %s", exc)


def _first_block(spec: GPULoadStoreSpec) -> int:
    if len(spec.group_sizes) != 1:
        raise OffloadError(f"HostTierSpec moves one KV cache group; this job has "
                           f"{len(spec.group_sizes)}: use a model with one attention group")
    return int(spec.block_indices[0])


# ---------------------------------------------------------------------- the spec


class HostTierSpec(OffloadingSpec):
    """The host tier as vLLM's offloading spec.  ``kv_connector_extra_config`` is parsed once,
    here, into the tier's `TierConfig` (`core.parse_extra_config`)."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if len(config.groups) != 1:
            raise OffloadError(f"HostTierSpec offloads one KV cache group; this model has "
                               f"{len(config.groups)}: use a model with one attention group")
        parallel = config.parallel
        self.tier_config = core.parse_extra_config(
            config.extra_config, blocks_per_chunk=self.blocks_per_chunk,
            tp=parallel.tp_size, pp=parallel.pp_size,
            model=f"{config.model.name}:{config.model.dtype}",
            kv_identical_across_tp=config.replicated_layout)
        # vLLM's stock worker skips stores on non-writers when this is set; our workers all
        # submit every job (the tier's writer_only does the skipping, in sequence)
        self.replicated_layout = False
        self.attached = False  # set by HostTierConnector
        self._manager: HostTierManager | None = None
        self._worker: HostTierWorker | None = None

    def get_manager(self) -> HostTierManager:
        if self._manager is None:
            events = self.kv_events_config.enable_kv_cache_events
            self._manager = HostTierManager(core.TierIndex(
                events=events, keep=self.tier_config.keep_s > 0))
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> HostTierWorker:
        if not self.attached:
            raise OffloadError("HostTierSpec needs kv_connector \"HostTierConnector\" with "
                               "kv_connector_module_path \"offload.vllm\": vLLM's stock "
                               "OffloadingConnector cannot carry a failed load (docs/VLLM.md)")
        if self._worker is None:
            from offload.tier import HostTier

            tensors = [t.tensor for t in kv_caches.tensors]
            tier = HostTier.create(tensors, self.tier_config, group=_worker_group(),
                                   decider=0)
            self._worker = HostTierWorker(core.TierWorker(
                tier, self.blocks_per_chunk,
                replicated=self.tier_config.layout == "replicated"))
        return self._worker


def _worker_group() -> Any:
    """The gloo group of this engine's TP x PP workers (one DP replica)."""
    from vllm.distributed.parallel_state import get_inner_dp_world_group, get_world_group

    try:
        return get_inner_dp_world_group().cpu_group
    except AssertionError:
        return get_world_group().cpu_group
