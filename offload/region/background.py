"""Background set-up: a mapped region populated and registered unit by unit, in row order,
on the tier's own threads, while the engine loads its weights and serves (DESIGN.md section 3.9).

``BackgroundSetup`` runs `geometry.setup_units`: a pool of pre-fault threads populates the
units ahead (``MADV_POPULATE_WRITE``, GIL released), and one pin thread registers each unit as
soon as it is populated, strictly in order, then announces "rows below R are usable" through
``on_ready`` (the rank's ready word on the node board).  Registration is kept off every
caller's path: a registration call holds the CUDA driver for its whole duration, so units are
small (`UNIT_BYTES`) and nothing here ever runs inside ``submit``.

A failure (no memory, a refused registration) stops the set-up where it is: the rows already
announced stay usable, ``error`` says why, and ``on_ready(rows, stopped=True)`` tells the
other ranks, so nobody waits for rows that will never come.  ``stop`` (close, error paths)
abandons the remaining units and waits for the threads; registered ranges stay with the
``Pinner``, whose owner unpins them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence

from offload.errors import one_line
from offload.geometry import SetupUnit
from offload.region.pin import Pinner
from offload.region.prefault import PopulateFn, Populator, ProgressFn, madvise_populate

log = logging.getLogger(__name__)

# NOTE: one unit is one registration call at most (or one per slot): a registration holds the
# CUDA driver, so an engine launch issued meanwhile waits for it -- up to 19 ms behind 256 MiB
# pieces of 4 KiB shmem pages, measured (docs/BENCHMARKS.md, "Ready to serve at once").  At
# ~6 GiB/s per process 8 MiB keeps that wait near 1 ms; a unit is never less than one row.
UNIT_BYTES = 8 << 20
# NOTE: set-up runs beside the engine's own threads (weights, graph capture, the scheduler), so
# it populates from few threads: with 2 ranks on 16 cores, a thread launching a tiny kernel every
# millisecond waited over 2 ms in 1-4 of ~850 launches beside 4 pre-fault threads per rank, in
# ~480 beside 16 (docs/BENCHMARKS.md, "Ready to serve at once").
THREADS = 4
PROGRESS_INTERVAL_S = 2.0

ReadyFn = Callable[[int, bool], None]
"""``on_ready(rows, stopped)``: rows below ``rows`` are usable on this rank; ``stopped`` when
set-up ended on an error there."""


class BackgroundSetup:
    """Populates and registers ``units`` (offsets from ``base``) on its own threads once
    `start` is called.  Read ``ready_rows`` / ``error`` / ``done`` from any thread."""

    def __init__(self, base: int, units: Sequence[SetupUnit], pinner: Pinner, threads: int,
                 on_ready: ReadyFn, *, populate: PopulateFn = madvise_populate,
                 on_thread_start: Callable[[], None] | None = None,
                 progress: ProgressFn | None = None) -> None:
        self._units = list(units)
        self._pinner = pinner
        self._on_ready = on_ready
        self._progress = progress
        self._populator = Populator(base, populate)
        self._stopping = threading.Event()
        self.done = threading.Event()
        self.ready_rows = 0
        self.error: str | None = None
        self.started = time.perf_counter()
        self.finished: float | None = None  # perf_counter when the last unit was registered
        self.populated_s = 0.0  # from start until the last unit was populated
        self.busy_s = 0.0  # inside registration calls
        self.longest_call_s = 0.0  # the longest single registration call
        self.total_bytes = sum(u.length for u in self._units)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(1, threads), thread_name_prefix="offload-bg-prefault",
            initializer=on_thread_start)
        self._populated: list[concurrent.futures.Future[None]] = []
        self._thread = threading.Thread(target=self._register, name="offload-bg-pin",
                                        daemon=True)

    def start(self) -> BackgroundSetup:
        self.started = time.perf_counter()
        self._populated = [self._pool.submit(self._populate, u) for u in self._units]
        self._thread.start()
        return self

    @property
    def fallback(self) -> bool:
        """True when the kernel refused MADV_POPULATE_WRITE and pages were touched instead."""
        return self._populator.unsupported.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until set-up ended (every unit, an error or `stop`); False on timeout."""
        return self.done.wait(timeout_s)

    def stop(self) -> None:
        """Abandon the units not yet registered and wait for the threads (idempotent; never
        from the set-up's own threads)."""
        self._stopping.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _populate(self, unit: SetupUnit) -> None:
        if self._stopping.is_set():
            return
        for r in unit.ranges:
            self._populator.run(r)
        self.populated_s = time.perf_counter() - self.started

    def _register(self) -> None:
        rows, done_bytes, last_log = 0, 0, self.started
        try:
            for unit, populated in zip(self._units, self._populated, strict=True):
                populated.result()  # its pages are in (or its error is ours)
                if self._stopping.is_set():
                    return
                for r in unit.ranges:
                    began = time.perf_counter()
                    self._pinner.pin(r)
                    took = time.perf_counter() - began
                    self.busy_s += took
                    self.longest_call_s = max(self.longest_call_s, took)
                rows = self.ready_rows = unit.rows_end
                self._on_ready(rows, False)
                done_bytes += unit.length
                now = time.perf_counter()
                if self._progress is not None and now - last_log >= PROGRESS_INTERVAL_S:
                    self._progress(done_bytes, self.total_bytes, now - self.started)
                    last_log = now
            self.finished = time.perf_counter()
            if self._progress is not None:
                self._progress(done_bytes, self.total_bytes, self.finished - self.started)
        except concurrent.futures.CancelledError:  # stopped while a unit waited
            return
        except BaseException as exc:
            if not self._stopping.is_set():
                self.error = one_line(exc)
                log.error("background set-up stopped at row %d of %d: %s", rows,
                          self._units[-1].rows_end, self.error)
                self._on_ready(rows, True)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.done.set()
