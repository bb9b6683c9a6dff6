# SPDX-License-Identifier: Apache-2.0
"""`HostTierConnector`: vLLM's ``OffloadingConnector`` with the tier's decisions carried.

vLLM 0.32's ``OffloadingConnector`` asserts that every transfer succeeded, so a load that
fails its checksum would end the worker, and it counts a job done when every worker reports
it.  This thin subclass keeps everything else of it and changes only that:

* worker rank 0 (the tier's decider) reports every decided job for all workers, with a
  `StepReport` (failures, the decision mark, rows ready) in the worker metadata;
* a failed load's GPU blocks go to ``get_block_ids_with_load_errors``, and vLLM (with
  ``kv_load_failure_policy: "recompute"``) computes them again: the model never sees them;
* the scheduler sends the decider's mark (and promotions from the file tier) to every worker
  in the next step's metadata, where the other ranks learn the same decisions;
* the tier's plan reaches the scheduler in vLLM's connector handshake, before any request;
* with retention (``keep_s``), a cache reset reaches the decider, whose kept index forgets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    get_offloading_group_ids,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MLAAttentionSpec,
    iter_layer_specs,
)
from vllm.v1.outputs import KVConnectorOutput

from offload.errors import OffloadError
from offload.tier import DecisionMark
from offload.vllm import core
from offload.vllm.spec import HostTierChunks, HostTierManager, HostTierSpec, HostTierWorker

SPEC_DEFAULTS = {"spec_name": "HostTierSpec", "spec_module_path": "offload.vllm"}


@dataclass
class HostTierConnectorMetadata(OffloadingConnectorMetadata):
    """vLLM's step metadata plus the decider's latest mark, the promotions to run and
    whether the kept index must forget every record (a cache reset, with ``keep_s``)."""

    mark: DecisionMark | None = None
    promotions: list[core.PromotePlan] = field(default_factory=list)
    forget: bool = False


@dataclass
class HostTierWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's per-worker completion counts plus the decider's `StepReport`."""

    report: core.StepReport = field(default_factory=core.StepReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        report = self.report
        if isinstance(other, HostTierWorkerMetadata):
            report = report.merge(other.report)
        return HostTierWorkerMetadata(merged.completed_jobs, merged.transfer_stats, report)


@dataclass
class HostTierHandshake(KVConnectorHandshakeMetadata):
    """The decider's tier plan, for the scheduler's index."""

    setup: core.TierSetup


class HostTierConnectorWorker(OffloadingConnectorWorker):
    """vLLM's worker side, with failures reported instead of asserted away."""

    _connector_worker_meta: OffloadingWorkerMetadata

    def __init__(self, *args: Any, world_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.world_size = world_size
        self._load_errors: set[int] = set()
        self._report = core.StepReport()

    @property
    def tier_worker(self) -> HostTierWorker:
        assert isinstance(self.worker, HostTierWorker)
        return self.worker

    def handle_preemptions(self, kv_connector_metadata: OffloadingConnectorMetadata) -> None:
        meta = kv_connector_metadata
        if isinstance(meta, HostTierConnectorMetadata):
            if meta.forget:  # before this step's stores are issued
                self.tier_worker.core.forget()
            for job_id in self.tier_worker.core.learn(meta.mark):
                self._load_jobs.pop(job_id, None)  # the decider reported it finished
        super().handle_preemptions(meta)
        if isinstance(meta, HostTierConnectorMetadata):
            for plan in meta.promotions:  # after the stores sent before them, as planned
                self.tier_worker.core.promote(plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Decided jobs: the decider counts them for every worker (vLLM completes a job once
        its count reaches the world size); failed loads' blocks are recomputed."""
        finished_recving: set[str] = set()
        outcomes = self.tier_worker.outcomes()
        meta = self._connector_worker_meta
        for outcome in outcomes:
            req_id = self._load_jobs.pop(outcome.job_id, None)
            if outcome.success:
                stats = meta.transfer_stats.load if req_id else meta.transfer_stats.store
                stats.record(outcome.bytes, outcome.seconds)
            meta.completed_jobs[outcome.job_id] = self.world_size
            if req_id is not None:
                finished_recving.add(req_id)
            if not outcome.success and outcome.direction == "load":
                self._load_errors.update(outcome.blocks)
        self._report = self._report.merge(self.tier_worker.core.report(outcomes))
        return set(), finished_recving

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> HostTierWorkerMetadata | None:
        meta, report = self._connector_worker_meta, self._report
        if not meta.completed_jobs and meta.transfer_stats.is_empty() and report.empty():
            return None
        self._connector_worker_meta = OffloadingWorkerMetadata()
        self._report = core.StepReport()
        return HostTierWorkerMetadata(meta.completed_jobs, meta.transfer_stats, report)

    def handshake(self) -> HostTierHandshake | None:
        if self.worker is None or not self.tier_worker.core.is_decider:
            return None
        return HostTierHandshake(self.tier_worker.core.setup())


class HostTierConnector(OffloadingConnector):
    """vLLM's offloading connector for `HostTierSpec` (module docstring).  Load it with
    ``"kv_connector": "HostTierConnector", "kv_connector_module_path": "offload.vllm"``;
    ``spec_name`` and ``spec_module_path`` default to this package's spec."""

    connector_worker: OffloadingConnectorWorker | None

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        extra = transfer.kv_connector_extra_config
        for key, value in SPEC_DEFAULTS.items():
            extra.setdefault(key, value)
        _check_kv_groups(kv_cache_config)
        if transfer.kv_load_failure_policy != "recompute":
            raise OffloadError(f"kv_load_failure_policy = {transfer.kv_load_failure_policy!r}"
                               " would fail requests whose KV failed its checksum; add "
                               "\"kv_load_failure_policy\": \"recompute\" to "
                               "--kv-transfer-config")
        super().__init__(vllm_config, role, kv_cache_config)
        self._mark: DecisionMark | None = None
        if self.connector_worker is not None:
            spec = self.connector_worker.spec
            if not isinstance(spec, HostTierSpec):
                raise OffloadError(f"HostTierConnector drives HostTierSpec, not "
                                   f"{type(spec).__name__}; drop spec_name from "
                                   "kv_connector_extra_config")
            spec.attached = True
            self.connector_worker = HostTierConnectorWorker(
                spec, vllm_config, kv_cache_config,
                world_size=spec.config.parallel.world_size)
        if self.connector_scheduler is not None and \
                not isinstance(self.connector_scheduler.manager, HostTierManager):
            raise OffloadError("HostTierConnector drives HostTierSpec; drop spec_name from "
                               "kv_connector_extra_config")

    # ------------------------------------------------------------------ scheduler side
    @property
    def index(self) -> core.TierIndex:
        manager = self.scheduler.manager
        assert isinstance(manager, HostTierManager)
        return manager.index

    def get_finished_count(self) -> int | None:
        return 1  # the decider reports each finished load for every worker

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        for value in metadata.values():
            if isinstance(value, HostTierHandshake):
                self.index.configure(value.setup)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, OffloadingConnectorMetadata)
        for job_id, job in meta.load_jobs.items():
            assert isinstance(job.src_spec, HostTierChunks)
            self.index.bind(job_id, job.src_spec.manager_job)
        for job_id, job in meta.store_jobs.items():
            assert isinstance(job.dst_spec, HostTierChunks)
            self.index.bind(job_id, job.dst_spec.manager_job)
        manager = self.scheduler.manager
        assert isinstance(manager, HostTierManager)
        return HostTierConnectorMetadata(meta.load_jobs, meta.store_jobs, meta.jobs_to_flush,
                                         self._mark, manager.take_promotions(),
                                         self.index.take_forget())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, HostTierWorkerMetadata):
            self.index.apply(meta.report)
            if meta.report.mark is not None:
                self._mark = meta.report.mark
            for job_id in meta.completed_jobs:
                self.index.decided(job_id)
        super().update_connector_output(connector_output)

    # ------------------------------------------------------------------ worker side
    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker
        assert isinstance(worker, HostTierConnectorWorker)
        return worker.take_load_errors()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        worker = self.connector_worker
        if not isinstance(worker, HostTierConnectorWorker):
            return None
        return worker.handshake()


def _check_kv_groups(kv_cache_config: KVCacheConfig) -> None:
    """One full-attention KV cache group: every GPU block of an offloaded block is then
    present, in order (sliding-window and hybrid models skip blocks, which the job mapping
    does not express)."""
    groups = get_offloading_group_ids(kv_cache_config)
    kinds = sorted({type(spec).__name__ for g in groups
                    for spec in iter_layer_specs(kv_cache_config.kv_cache_groups[g]
                                                 .kv_cache_spec)})
    if len(groups) != 1 or not set(kinds) <= {FullAttentionSpec.__name__,
                                               MLAAttentionSpec.__name__}:
        raise OffloadError(f"HostTierConnector offloads one full-attention KV cache group; "
                           f"this model has {len(groups)} group(s) of {', '.join(kinds)}: "
                           "serve it without the host tier")
