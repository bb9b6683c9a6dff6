# SPDX-License-Identifier: Apache-2.0
"""Live Prometheus metrics of one rank's tier (the optional extra ``offload[metrics]``).

Runs in every rank's process.  Nothing here touches the copy path: the tier bumps plain integers
in a `JobTally` where it decides jobs (one dict update and one bisect per decided job, no lock),
and a `TierCollector` turns those and the tier's other counters (chunk manager, file tier,
watermarks) into metric families only when Prometheus scrapes.  The core package imports
without ``prometheus_client``; only `serve_metrics` and `TierCollector` need it.

Primitives:

* `JobTally` -- per-direction bytes, jobs by outcome and a latency histogram, as plain ints;
* `outcome_of` -- a decided job's outcome label from its failure reason;
* `TierCollector` -- a ``prometheus_client`` collector over one tier (`MetricsSource`);
* `serve_metrics` -- register it and serve ``/metrics`` (``TierConfig.metrics_port`` + local
  rank; `offload.observe.metrics_http`, bounded against idle connections), or register it in the
  caller's registry.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from offload.bounds import MAX_PORT
from offload.errors import OffloadError, is_damage
from offload.observe.metrics_http import MetricsHTTPServer

if TYPE_CHECKING:
    from offload.actor import RankActor
    from offload.control.plan import Plan
    from offload.control.quorum import Words
    from offload.control.topology import Topology
    from offload.manager import ChunkManager

log = logging.getLogger(__name__)

DIRECTIONS = ("store", "load")
OUTCOMES = ("ok", "failed", "not_ready", "integrity")
# submit -> decided, seconds: from a small job decided within one poll to a large load behind
# a busy link
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)


def outcome_of(success: bool, error: str | None) -> str:
    """The ``outcome`` label of a decided job: ``ok``, ``integrity`` (a page did not match its
    checksum), ``not_ready`` (a row not yet usable on some rank) or ``failed`` (anything else)."""
    if success:
        return "ok"
    reason = error or ""
    if is_damage(reason):
        return "integrity"
    if reason.startswith("not ready"):
        return "not_ready"
    return "failed"


@dataclass
class JobTally:
    """Decided jobs of this rank, as plain integers the scrape reads (a scrape may see one job
    half counted; Prometheus counters tolerate that, and nothing on the data path waits)."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    jobs: dict[tuple[str, str], int] = field(
        default_factory=lambda: {(d, o): 0 for d in DIRECTIONS for o in OUTCOMES})
    buckets: dict[str, list[int]] = field(
        default_factory=lambda: {d: [0] * (len(LATENCY_BUCKETS) + 1) for d in DIRECTIONS})
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0.0))

    def add(self, direction: str, success: bool, error: str | None, size: int,
            seconds: float | None) -> None:
        """Count one decided job; ``seconds`` (submit -> decided) only where it was timed.  A
        job of neither direction (malformed: refused at `submit` on every rank) has no label
        to count under and is left out."""
        if direction not in self.bytes:
            return
        self.jobs[direction, outcome_of(success, error)] += 1
        if success:
            self.bytes[direction] += size
        if seconds is not None:
            self.buckets[direction][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self.seconds[direction] += seconds


def _require_client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise OffloadError("live metrics need prometheus_client; pip install 'offload[metrics]' "
                           "or drop metrics_port (--metrics-port)") from None
    return prometheus_client


class ReadyRows(Protocol):
    @property
    def rows(self) -> int: ...


class MetricsSource(Protocol):
    """What the collector reads of a tier at scrape time; `offload.tier.HostTier` is one.  Named
    here, read-only, so that this module needs nothing of the tier that serves it."""

    @property
    def tally(self) -> JobTally: ...
    @property
    def actor(self) -> RankActor: ...
    @property
    def plan(self) -> Plan: ...
    @property
    def manager(self) -> ChunkManager | None: ...
    @property
    def last_ready(self) -> ReadyRows: ...
    @property
    def last_words(self) -> Words | None: ...
    @property
    def submitted(self) -> int: ...
    def keep_report(self) -> dict[str, Any] | None: ...


class TierCollector:
    """Builds the ``offload_*`` families from one tier's counters at scrape time (nothing until
    the tier exists: the server is up before set-up, so a taken port fails early)."""

    def __init__(self) -> None:
        self.tier: MetricsSource | None = None

    def describe(self) -> list[Any]:
        return []  # families are built on collect; nothing to pre-register

    def collect(self) -> Iterator[Any]:
        tier = self.tier
        if tier is None:
            return
        _require_client()
        from prometheus_client import metrics_core as core
        tally = tier.tally
        moved = core.CounterMetricFamily("offload_transfer_bytes", "Bytes this rank moved in "
                                         "jobs decided successfully", labels=["direction"])
        jobs = core.CounterMetricFamily("offload_jobs", "Jobs decided, by outcome",
                                        labels=["direction", "outcome"])
        latency = core.HistogramMetricFamily("offload_job_seconds", "Submit to decided, on "
                                             "the decider", labels=["direction"])
        for d in DIRECTIONS:
            moved.add_metric([d], tally.bytes[d])
            for o in OUTCOMES:
                jobs.add_metric([d, o], tally.jobs[d, o])
            counts = tally.buckets[d]
            cumulative, total = [], 0
            for bound, count in zip((*map(str, LATENCY_BUCKETS), "+Inf"), counts, strict=True):
                total += count
                cumulative.append((bound, total))
            latency.add_metric([d], cumulative, sum_value=tally.seconds[d])
        yield from (moved, jobs, latency)
        engine = tier.actor.engine
        if engine is not None:
            paths = core.CounterMetricFamily("offload_copies_by_path", "This rank's copies by "
                                             "the path that moved them", labels=["path"])
            for name, count in engine.routes.items():
                paths.add_metric([name], count)
            yield paths
        plan = tier.plan
        rows = core.GaugeMetricFamily("offload_rows_total", "Rows (chunks) of the tier")
        rows.add_metric([], plan.chunk_count)
        ready = core.GaugeMetricFamily("offload_rows_ready", "Rows every rank can use")
        ready.add_metric([], tier.last_ready.rows)  # as of the tier's last look (its polls)
        yield from (rows, ready)
        yield from self._manager(core, tier)
        yield from self._adopted(core, tier)
        yield from self._files(core, tier)
        yield from self._lag(core, tier)

    @staticmethod
    def _manager(core: Any, tier: MetricsSource) -> Iterator[Any]:
        manager = tier.manager
        if manager is None:
            return
        stats = manager.stats()
        chunks = core.GaugeMetricFamily("offload_chunks", "Chunks by state (the chunk "
                                        "manager's rank)", labels=["state"])
        for state in ("free", "storing", "readable", "quarantined", "not_ready"):
            chunks.add_metric([state], getattr(stats, state))
        evictions = core.CounterMetricFamily("offload_evictions", "Readable chunks reused")
        evictions.add_metric([], stats.evictions)
        yield from (chunks, evictions)
        lookups = getattr(manager, "lookups", None)
        if lookups is not None:
            family = core.CounterMetricFamily("offload_lookups", "Prefix lookups by result",
                                              labels=["result"])
            for result, count in lookups.items():
                family.add_metric([result], count)
            yield family

    @staticmethod
    def _adopted(core: Any, tier: MetricsSource) -> Iterator[Any]:
        """With retention (docs/KEEP.md), on the chunk manager's rank: what this tier adopted
        from a kept one, and when its first adopted chunk loaded."""
        kept = tier.keep_report()
        if kept is None:
            return
        chunks = core.GaugeMetricFamily("offload_adopted_chunks", "Chunks adopted from a kept "
                                        "tier at create")
        chunks.add_metric([], kept["adopted_chunks"])
        size = core.GaugeMetricFamily("offload_adopted_bytes", "Bytes of the adopted chunks "
                                      "(every rank's rows)")
        size.add_metric([], kept["adopted_bytes"])
        yield from (chunks, size)
        if kept["first_hit_s"] is not None:
            first = core.GaugeMetricFamily("offload_first_adopted_hit_seconds", "From create "
                                           "to the first load of an adopted chunk that "
                                           "succeeded")
            first.add_metric([], kept["first_hit_s"])
            yield first

    @staticmethod
    def _files(core: Any, tier: MetricsSource) -> Iterator[Any]:
        files = tier.actor.files
        if files is None or files.tier is None:  # no file tier, or not a writer of one
            return
        stats = files.tier.stats()
        moved = core.CounterMetricFamily("offload_fs_bytes", "File tier bytes",
                                         labels=["direction"])
        moved.add_metric(["write"], stats.written_bytes)
        moved.add_metric(["read"], stats.read_bytes)
        errors = core.CounterMetricFamily("offload_fs_errors", "File tier errors by kind",
                                          labels=["kind"])
        for kind in ("write_errors", "read_errors", "corrupt", "timeouts"):
            errors.add_metric([kind.removesuffix("_errors")], getattr(stats, kind, 0))
        yield from (moved, errors)

    @staticmethod
    def _lag(core: Any, tier: MetricsSource) -> Iterator[Any]:
        words = tier.last_words
        if words is None:
            return
        from offload.control.board import unpack

        submitted = tier.submitted
        lag = core.GaugeMetricFamily("offload_watermark_lag_jobs", "Jobs the decider "
                                     "submitted that each rank has not completed",
                                     labels=["rank"])
        for rank, word in sorted(words.items()):
            lag.add_metric([str(rank)], max(0, submitted - unpack(word)[0]))
        yield lag


class MetricsServer:
    """What `serve_metrics` started; `bind` gives it the tier, `close` stops the HTTP server
    and unregisters the collector."""

    def __init__(self, registry: Any, collector: TierCollector,
                 server: MetricsHTTPServer | None = None, url: str | None = None) -> None:
        self.registry, self.collector, self.server, self.url = registry, collector, server, url

    def bind(self, tier: MetricsSource) -> None:
        self.collector.tier = tier

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.collector is not None:
            self.registry.unregister(self.collector)
            self.collector = None  # type: ignore[assignment]


def serve_metrics(topology: Topology, port: int | None, addr: str, registry: Any = None
                  ) -> MetricsServer:
    """Register a tier collector in ``registry`` (a new one when None) and, with ``port``,
    serve it on ``port`` + this rank's local rank, so ranks of one host never collide."""
    client = _require_client()
    registry = registry if registry is not None else client.CollectorRegistry()
    collector = TierCollector()
    registry.register(collector)
    server, url = None, None
    if port is not None:
        own = port + topology.local_rank
        try:
            if own > MAX_PORT:
                raise OverflowError(f"port {own} is past {MAX_PORT}")
            server = MetricsHTTPServer(addr, own, registry)
        except (OSError, OverflowError) as exc:
            registry.unregister(collector)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise OffloadError(f"cannot serve metrics on {addr}:{own} ({reason}); pick "
                               "another metrics_port (--metrics-port; each rank uses port + its "
                               "local rank)") from None
        url = f"http://{addr}:{own}/metrics"
        log.info("rank %d: metrics on %s", topology.rank, url)
    return MetricsServer(registry, collector, server, url)
