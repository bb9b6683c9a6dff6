"""Background set-up: a mapped region populated and registered unit by unit, in row order,
on the tier's own threads, while the engine loads its weights and serves (DESIGN.md section 3.9).

``BackgroundSetup`` runs `geometry.setup_units` once the copy kernel is compiled: a pool of
pre-fault threads populates the units ahead (write faults, page by page: `populate.c`), and one
pin thread, beside them, registers each unit once it is populated, strictly in order, and
announces after each "rows below R are usable" through ``on_ready`` (the rank's ready word on
the node board).

The pre-fault threads never hold the GIL while they work: each makes one call into
``populate.c`` (built like the package's other C code, `offload.system.build_cache`), which takes
units from a shared counter and populates them until none is left.  Python threads would take
the GIL back after every unit; sixteen of them doing so hand it around the engine's own
threads (and, under SCHED_IDLE, could be preempted holding it).  Without a C compiler, or with
a test's ``populate`` stand-in, the same loop runs in Python (``MADV_POPULATE_WRITE``, or
`Populator`'s touch fallback).  Every thread is a daemon: interpreter exit never waits for the
rest of a region's pre-fault (a thread pool's workers would be joined, queue drained, before
any ``atexit`` closer could stop them).  Registration is kept off every caller's path: a
registration call holds the CUDA driver for its whole duration, so units are small
(`UNIT_BYTES`) and nothing here ever runs inside ``submit``.

A failure (no memory, a refused registration) stops the set-up where it is: the rows already
announced stay usable, ``error`` says why, and ``on_ready(rows, stopped=True)`` tells the
other ranks, so nobody waits for rows that will never come.  ``stop`` (close, error paths)
abandons the remaining units and waits for the threads; registered ranges stay with the
``Pinner``, whose owner unpins them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from functools import cache

import numpy as np

from offload.errors import one_line
from offload.region.geometry import SetupUnits
from offload.region.pin import Pinner
from offload.region.prefault import (
    PopulateFn,
    Populator,
    ProgressFn,
    madvise_populate,
)
from offload.system.build_cache import SOURCES, load
from offload.system.shm import close_fds

log = logging.getLogger(__name__)

# NOTE: one unit is one registration call at most (or one per slot): a registration holds the
# CUDA driver, so an engine launch issued meanwhile waits for it -- up to 19 ms behind 256 MiB
# pieces of 4 KiB shmem pages, measured (docs/BENCHMARKS.md, "Ready to serve at once").  At
# ~6 GiB/s per process 8 MiB keeps that wait near 1 ms.  A row larger than this is registered
# in pieces (`geometry.registration_cuts`), which the copy paths split their copies at.
UNIT_BYTES = 8 << 20
# NOTE: a process's ~8,500th-11,800th host registration (100 GiB in 8 MiB units, 12,790 calls,
# one rank on an H200 host) waits 50-130 ms inside the driver, and the engine's launches with
# it; in pieces of 13.3 MiB (7,680 calls) or whole 40 MiB rows (2,560) no run stalled
# (docs/BENCHMARKS.md, "Fewer registrations, no stall").  Units double past 8 MiB to stay
# within that many calls, up to the 256 MiB behind which a launch waited up to 19 ms; beyond
# 100 GiB a rank (not measured: the lent hosts have 128 GiB) that cap may bind first.
MAX_REGISTRATIONS = 7680
MAX_UNIT_BYTES = 256 << 20
# NOTE: the C loop populates by write faults, not MADV_POPULATE_WRITE: the advice holds the mmap
# lock for reading for a whole call, and the engine's threads that map, unmap or protect memory
# waited 6-15 ms behind the calls in flight on an H200 host at any call length, priority or
# thread count, while a fault takes only its VMA's lock (the NOTE at the top of populate.c).
# On the CI machine (2 cores, a 2 GiB memfd, 2 idle-priority workers beside a spinning process,
# `scratch` probe): a 4 KiB mmap + munmap + mprotect every ms waited p50 0.02-0.03 / p99
# 0.06-0.20 ms against 19-21 / 28-29 ms, and populating took 2.7-3.4 s against 5.2-9.9 s.
# NOTE: the pin thread registers beside the populating, never holding it back.  Beside
# MADV_POPULATE_WRITE calls a registration took 30-100 ms (both wait for the mmap lock), so the
# two used to take turns; beside write faults they overlap as in the blocking create.  Measured
# in one call, 48 GiB over 2 ranks on an H200 host, own registration context: every row ready
# 3.39 / 4.45 s (private / shared) against 4.80 / 8.65 s with turns, the blocking create
# 5.71 / 4.83 s, and no longer launch waits (worst 5.5 / 3.5 ms against 6.6 / 7.0 ms;
# docs/BENCHMARKS.md, "Registering beside write faults").
# The background reservation's piece: what `close` may wait for (one `fallocate` per thread).
RESERVE_BYTES = 256 << 20
# NOTE: set-up runs beside the engine's own threads (weights, graph capture, the scheduler), so
# its C pre-fault threads (`setup_threads` of them, below) run under SCHED_IDLE: they take
# only CPU time nothing else wants (on a host whose every CPU is busy, set-up waits), and any
# engine thread that wakes preempts them at once.  Measured with Python workers, 2 ranks on 16
# cores, 16 such threads per rank: a thread launching a tiny kernel every millisecond waited
# over 2 ms in 7 of ~1,600 launches (shared layout; 8 of ~1,200 beside 4 normal threads) and
# set-up finished within 1.06x the blocking create (1.25x with 4 normal threads;
# docs/BENCHMARKS.md, "Set-up that leaves the engine alone").  The pin thread keeps its
# priority: it holds the driver while it registers, and nothing should wait behind it longer.
# NOTE: set-up begins once the copy kernel is compiled (`start`'s ``after``): no row is usable
# before the JIT anyway, and the JIT beside set-up is slowed several times over (its own mmaps
# wait for the populating madvise calls, its CUDA calls for the registrations).  Measured in
# one run each, 48 GiB over 2 ranks on an H200 host: the JIT took 1.5-3.6 s beside one
# populating thread and 0.6-0.9 s alone; the first job was decided 1.7-3.7 -> 0.8-1.0 s after
# create began, and every row was ready no later (docs/BENCHMARKS.md, "Set-up after the JIT").
# NOTE: background set-up leaves at least half of its CPUs to the engine (`setup_threads`).
# Idle priority alone does not keep its launches from waiting: beside 8 idle-priority write-
# faulting threads per rank (2 ranks, 16 cores) the probe's launching thread sat runnable, not
# running, for 2-7 ms a few times a run, and registrations took 7-8 ms against 3-5 ms.  Measured
# on an H200 host, 48 GiB over 2 ranks, alternated within each call: with 4 threads a rank the
# worst launch wait was at most 1.9 ms in 17 of 19 layout runs, with 8 in 4 of 18 (up to 6.9
# ms); every row ready as soon (private) to 1.24x (shared) as late (docs/BENCHMARKS.md, "Fewer
# pre-fault threads bound the launch waits").
# NOTE: a replicated stage's ranks each write their share of every range and map the rest by
# read faults (``share``, `populate.c`).  Each writing every page, the two ranks of a stage took
# 5.10-5.13 s to have every row of 48 GiB ready against 4.19-4.46 s for the blocking create, which
# shards the writing; with shares 2.70-2.74 s, worst launch wait 0.8-2.0 ms (H200 host, old and
# new alternated in one call; docs/BENCHMARKS.md, "A replicated stage's ranks share the
# writing").  On the CI machine a rank mapping pages its peer wrote took 547 faults per 1,024
# pages against 1,031 (`tests/region/test_region_background.py`).
PROGRESS_INTERVAL_S = 2.0


def setup_threads(requested: int, sharing: int, cpus: int) -> int:
    """Pre-fault threads of one rank's background set-up: ``requested``
    (`TierConfig.prefault_threads`), but together with the ``sharing`` processes whose set-up
    runs on the same ``cpus`` CPUs (this one included) at most half of them, and at least one."""
    return max(1, min(requested, cpus // (2 * max(1, sharing))))


def process_cpus() -> frozenset[int]:
    """The CPUs this process may run on: its affinity (a container's cpuset, a launcher's
    binding), else the host's."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def setup_cpus(affinity: frozenset[int], placement_cpus: frozenset[int] = frozenset()
               ) -> frozenset[int]:
    """The CPUs set-up's threads will run on: those of ``affinity`` on the GPU's NUMA node
    (``placement_cpus``) where it has some there, as `Placement.enter` binds them, else all of
    ``affinity``."""
    return (affinity & placement_cpus) or affinity


def sharing_processes(mine: tuple[frozenset[int], frozenset[int]],
                      node: Sequence[tuple[Sequence[int], Sequence[int]]],
                      processes: int) -> int:
    """How many processes run set-up on this rank's CPUs.  ``mine`` and each entry of
    ``node`` (the tier's ranks on this node, this one among them) are (set-up CPUs, process
    affinity).  The ranks whose set-up CPUs overlap this rank's count; where the processes'
    affinities overlap too (no launcher bound each to CPUs of its own), so do the node's other
    ``processes`` (other DP replicas' ranks, which the tier cannot ask) in proportion.
    Ranks bound to CPUs of their own count only those that share them."""
    cpus, affinity = mine
    sharing = sum(1 for setup, _ in node if cpus.intersection(setup))
    if len(node) == 1:  # nothing tells shared CPUs from bound ones: assume shared
        return max(1, processes)
    bound = sum(1 for _, other in node if affinity.intersection(other)) == 1
    if bound:
        return sharing
    return max(sharing, -(-sharing * processes // len(node)))


def yield_cpu() -> None:
    """Run the calling thread under SCHED_IDLE (Linux; best effort: elsewhere, or where it is
    refused, the thread keeps its policy).  Lowering a thread's own policy needs no privilege.

    Only the C loop's workers call it: a Python worker takes the GIL back after every call,
    and preempted at idle priority while holding it, it would make every other thread wait for
    a free CPU.  A C worker preempted inside a unit holds no lock the engine waits for (its
    faults take only the region's VMA lock); only the rows from that unit on wait for it."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is not None:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: this thread on Linux


@cache
def native_populator() -> ctypes.CDLL | None:
    """The compiled ``populate.c``, or None where it cannot be built (`offload.system.build_cache`).
    Loaded with ``CDLL``: a call releases the GIL for as long as it runs."""
    lib = load(SOURCES["populate"], "background pre-fault", "offload_populate_units")
    if lib is not None:
        pointer = ctypes.c_void_p
        lib.offload_populate_units.argtypes = [ctypes.c_uint64, pointer, pointer, ctypes.c_int64,
                                               pointer, pointer, pointer, ctypes.c_int64,
                                               ctypes.c_int64]
        lib.offload_populate_units.restype = ctypes.c_int64
        lib.offload_reserve_files.argtypes = [pointer, pointer, ctypes.c_int64, pointer, pointer,
                                              pointer, ctypes.c_int64]
        lib.offload_reserve_files.restype = ctypes.c_int64
    return lib


ReadyFn = Callable[[int, bool], None]
"""``on_ready(rows, stopped)``: rows below ``rows`` are usable on this rank; ``stopped`` when
set-up ended on an error there."""


class BackgroundSetup:
    """Populates and registers ``units`` (offsets from ``base``) on its own threads once
    `start` is called.  Read ``ready_rows`` / ``error`` / ``done`` from any thread.

    ``share`` is (this process's index, count) among the processes that populate the same
    shared pages -- the replicated layout's ranks of one stage on a node, which all register the
    stage's slots.  The C loop then writes its own share of each range first and maps the rest,
    which the others write meanwhile, mostly by fault-around (`populate.c`); each page still
    gets mapped by every process, so no unit waits for a peer."""

    def __init__(self, base: int, units: SetupUnits, pinner: Pinner, threads: int,
                 on_ready: ReadyFn, *, populate: PopulateFn = madvise_populate,
                 on_thread_start: Callable[[], None] | None = None,
                 progress: ProgressFn | None = None, share: tuple[int, int] = (0, 1)) -> None:
        index, count = share
        if not 0 <= index < count:
            raise ValueError(f"share {share}: want (index, count) with 0 <= index < count")
        self._share = share
        self._units = units
        self._pinner = pinner
        self._on_ready = on_ready
        self._progress = progress
        self._on_thread_start = on_thread_start
        self._populator = Populator(base, populate)
        self._stopping = threading.Event()  # `stop`: abandon the rest quietly
        self.done = threading.Event()
        self.launched = False  # `start` was called
        self._go = threading.Event()  # every thread exists: populate
        self._after: threading.Event | None = None  # `start`'s: set-up begins once it is set
        self._begun = False  # some thread is past `_begin` (and reset `started`)
        self._begun_lock = threading.Lock()
        self.ready_rows = 0
        self.error: str | None = None
        self.started = time.perf_counter()  # `start`, then when set-up could begin (`_begin`)
        self.finished: float | None = None  # perf_counter when the last unit was registered
        self.populated_s = 0.0  # from start until the last unit was populated
        self.first_ready_s: float | None = None  # from start until the first row was usable
        self.busy_s = 0.0  # inside registration calls
        self._registered_bytes = 0  # of the units registered so far (progress)
        self.longest_call_s = 0.0  # the longest single registration call
        # every registration call: (perf_counter when it began, seconds it took); what a
        # benchmark lines the engine's launch waits up against
        self.calls: list[tuple[float, float]] = []
        self.total_bytes = units.total_bytes
        # unit i: _state[i] is 0 while pending, 1 once populated, -1 when the Python loop
        # failed on it (the error in _failed[i]; the C loop's faults do not fail, they do not
        # return).  Written by the pre-fault threads, read by the pin thread.
        self._state = np.zeros(len(self._units), dtype=np.int32)
        self._failed: list[BaseException | None] = [None] * len(self._units)
        # set: the pre-fault threads take no further unit (a failed unit, `stop`, the pin
        # thread's error); an aligned store populate.c reads with acquire
        self._stop_flag = np.zeros(1, dtype=np.int32)
        # the C loop (write faults: any kernel); with a test's stand-in, or without a
        # compiler, the Python loop (the advice, or `Populator`'s touch fallback)
        self._native = native_populator() if populate is madvise_populate else None
        self._base = base
        if self._native is not None:  # populate.c reads the units' own arrays
            self._counter = np.zeros(1, dtype=np.int64)  # the next unit to take (atomic in C)
        self._next_unit = itertools.count()  # the Python loop's shared counter (atomic)
        self._workers = [threading.Thread(target=self._populate_units, daemon=True,
                                          name=f"offload-bg-prefault-{i}")
                         for i in range(max(1, threads))]
        self._thread = threading.Thread(target=self._register, name="offload-bg-pin",
                                        daemon=True)

    def start(self, after: threading.Event | None = None) -> BackgroundSetup:
        """Start the threads; with ``after``, they populate and register only once it is set
        (`offload.actor` passes the copy kernel's JIT: the NOTE above `yield_cpu`)."""
        self._after = after
        self.launched = True
        self.started = time.perf_counter()
        for thread in (*self._workers, self._thread):
            thread.start()
        # NOTE: no thread populates before every thread exists.  Creating a thread maps its
        # stack, which takes the mmap lock for writing, so it waits for every populating
        # madvise in flight (the Python loop's) -- while holding the GIL: starting 8 workers
        # one after another beside the first ones' populating stalled the whole process for
        # 0.4 s on the CI machine and is the suspect of 1.5-2.3 s on the device
        # (docs/BENCHMARKS.md, "Set-up that leaves the engine alone").
        self._go.set()
        return self

    @property
    def share(self) -> tuple[int, int]:
        """(this process's index, count) among those populating the same pages."""
        return self._share

    def thread_ids(self) -> dict[int, str]:
        """The kernel thread ids of the started set-up threads and their roles (``pin``,
        ``prefault``), for tools that watch them (`tools/wait_sampler.py`)."""
        roles = [(t, "prefault") for t in self._workers] + [(self._thread, "pin")]
        return {t.native_id: role for t, role in roles if t.native_id is not None}

    @property
    def fallback(self) -> bool:
        """True when the Python loop found MADV_POPULATE_WRITE refused and touched pages
        instead (the C loop always write-faults: False there)."""
        return self._populator.unsupported.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until set-up ended (every unit, an error or `stop`); False on timeout."""
        return self.done.wait(timeout_s)

    def stop(self) -> None:
        """Abandon the units not yet registered and wait for the threads: each finishes the
        unit or registration in hand (idempotent; never from the set-up's own threads)."""
        self._stopping.set()
        self._halt_workers()
        self._go.set()  # workers of a `start` that failed part-way: let them see the stop
        for thread in (*self._workers, self._thread):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join()

    def _halt_workers(self) -> None:
        """Make the pre-fault threads take no further unit."""
        self._stop_flag[0] = 1

    def _begin(self) -> bool:
        """Wait until every thread exists and `start`'s ``after`` is set; False once `stop`
        was called (checked every 50 ms meanwhile).  The first thread through restarts the
        clock: set-up's timings count from when it could begin, not from the JIT's wait."""
        self._go.wait()
        while self._after is not None and not self._after.wait(0.05):
            if self._stopping.is_set():
                return False
        with self._begun_lock:
            if not self._begun:
                self._begun, self.started = True, time.perf_counter()
        return not self._stopping.is_set()

    def _populate_units(self) -> None:
        if not self._begin():
            return
        if self._native is not None:  # a Python worker would take the GIL at idle priority
            yield_cpu()
        if self._on_thread_start is not None:
            try:  # placement is best effort: a worker that cannot be placed still works
                self._on_thread_start()
            except Exception:
                log.exception("background set-up: placing a pre-fault thread failed")
        if self._native is not None:
            self._native.offload_populate_units(
                self._base, self._units.ranges.ctypes.data, self._units.first.ctypes.data,
                len(self._units), self._counter.ctypes.data, self._state.ctypes.data,
                self._stop_flag.ctypes.data, *self._share)
            self.populated_s = time.perf_counter() - self.started  # no unit left to take
            return
        while not self._stop_flag[0]:
            i = next(self._next_unit)  # units are taken in order: all below i were taken
            if i >= len(self._units):
                return
            try:
                for r in self._units[i].ranges:
                    self._populator.run(r)
                self.populated_s = time.perf_counter() - self.started
                self._state[i] = 1
            except BaseException as exc:
                self._failed[i] = exc
                self._state[i] = -1
                self._halt_workers()  # later units are moot: set-up stops at this one

    def _poll(self, done: Callable[[], bool]) -> bool:
        """Wait until ``done()`` or `stop` was called; whether it is done and `stop` was not
        called.  Polls, backing off to 2 ms: the pre-fault threads may be in C, where no
        Python event can be set."""
        delay = 50e-6
        while not (finished := done()):
            if self._stopping.is_set():
                break
            time.sleep(delay)
            delay = min(2 * delay, 0.002)
        return finished and not self._stopping.is_set()

    def _wait_populated(self, i: int) -> bool:
        """Wait until unit ``i`` has a state; False once `stop` was called."""
        return self._poll(lambda: self._state[i] != 0)

    def _populated(self, i: int) -> None:
        """Raise unit ``i``'s failure, if it had one (only the Python loop's units fail: a
        write fault that cannot be served does not return)."""
        if self._state[i] > 0:
            return
        failure = self._failed[i]
        if failure is None:  # the Python loop records the error before the state
            raise RuntimeError(f"unit {i} failed to populate and left no error")
        raise failure

    def _register_unit(self, i: int) -> None:
        """Register unit ``i`` (populated) and announce the rows it completes."""
        unit = self._units[i]
        for r in unit.ranges:
            began = time.perf_counter()
            self._pinner.pin(r)
            took = time.perf_counter() - began
            self.calls.append((began, took))
            self.busy_s += took
            self.longest_call_s = max(self.longest_call_s, took)
        if unit.rows_end > self.ready_rows:  # a row's last piece (or whole rows)
            self.ready_rows = unit.rows_end
            if self.first_ready_s is None:
                self.first_ready_s = time.perf_counter() - self.started
            self._on_ready(self.ready_rows, False)
        self._registered_bytes += unit.length

    def _register(self) -> None:
        try:
            if self._stopping.is_set():  # closed at once: no context to make for nothing
                return
            # a registration context of its own takes a few tenths of a second to make
            # (`CudaRegistrar.prepare`): here, beside the JIT that `_begin` waits for
            self._pinner.registrar.prepare()
            if not self._begin():
                return
            last_log = self.started
            for i in range(len(self._units)):
                if not self._wait_populated(i):
                    return
                self._populated(i)
                if self._stopping.is_set():
                    return
                self._register_unit(i)
                now = time.perf_counter()
                if self._progress is not None and now - last_log >= PROGRESS_INTERVAL_S:
                    self._progress(self._registered_bytes, self.total_bytes, now - self.started)
                    last_log = now
            self.finished = time.perf_counter()
            if self._progress is not None:
                self._progress(self._registered_bytes, self.total_bytes,
                               self.finished - self.started)
        except BaseException as exc:
            self._halt_workers()
            if not self._stopping.is_set():
                self.error = one_line(exc)
                log.error("background set-up stopped at row %d of %d: %s", self.ready_rows,
                          self._units.rows, self.error)
                self._on_ready(self.ready_rows, True)
        finally:
            self.done.set()


class BackgroundReservation:
    """The reservation of a region's memfds by the rank that created them (a node region's
    leader, or a private rank), on its own threads, in file (row) order, while set-up populates
    them: `create` then costs no reservation.

    Nothing waits for it.  A page the ranks' pre-fault reaches first is allocated by the fault
    and skipped by the reservation, and the other way round; reserving files in parallel ahead
    of the row-order pre-fault is what keeps it fast, since pages of one shmem file are
    allocated one at a time.  A reservation that fails is logged once and the rest of the files
    are left to the ranks' pre-fault, whose faults allocate them (memory that is not there is
    then the OOM killer's, as for any allocation; hosts that refuse to overcommit, where a fault
    past the commit limit would be a SIGBUS, reserve in `create` instead:
    `space.strict_overcommit`).

    Each thread makes one call into ``populate.c`` (``offload_reserve_files``): ``fallocate(2)``
    in `RESERVE_BYTES` pieces, at idle priority and without the GIL.  Without a compiler, Python
    threads do the same at normal priority (one preempted at idle priority while holding the
    GIL would stall the process) through ``posix_fallocate``.  Only for memfds: where a file
    system lacks ``fallocate``, glibc's ``posix_fallocate`` rewrites a byte of every block,
    which beside rows already served would overwrite stored bytes.  Owns ``fds`` (duplicates
    the caller made): each is closed once its file is reserved, `stop` closes the rest.
    """

    def __init__(self, fds: Sequence[int], lengths: Sequence[int], threads: int) -> None:
        self._fds = np.array(fds, dtype=np.int32)
        self._lengths = np.array(lengths, dtype=np.int64)
        # file i: 0 pending (or left part-way), 1 reserved and its descriptor closed, <0 -errno
        self._state = np.zeros(len(self._fds), dtype=np.int32)
        self._counter = np.zeros(1, dtype=np.int64)  # the next file to take (atomic in C)
        self._stop_flag = np.zeros(1, dtype=np.int32)
        self._next_file = itertools.count()  # the Python loop's counter
        self._native = native_populator()
        self._closed = False
        self.error: str | None = None
        self.started = time.perf_counter()
        self.finished_s: float | None = None  # from start until every file was reserved
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._reserve_files, daemon=True,
                                          name=f"offload-bg-reserve-{i}")
                         for i in range(max(1, min(threads, len(self._fds))))]

    def start(self) -> BackgroundReservation:
        self.started = time.perf_counter()
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Take no further piece, wait for the threads (each finishes the `RESERVE_BYTES` in
        hand) and close the descriptors left.  Idempotent."""
        self._stop_flag[0] = 1
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        close_fds([int(fd) for fd, state in zip(self._fds, self._state, strict=True)
                   if state != 1])

    def _reserve_files(self) -> None:
        if self._native is not None:
            yield_cpu()
            self._native.offload_reserve_files(
                self._fds.ctypes.data, self._lengths.ctypes.data, len(self._fds),
                self._counter.ctypes.data, self._state.ctypes.data, self._stop_flag.ctypes.data,
                RESERVE_BYTES)
        else:
            self._reserve_in_python()
        with self._lock:
            failed = [i for i, state in enumerate(self._state) if state < 0]
            if failed and self.error is None:
                i = failed[0]
                err = -int(self._state[i])
                self.error = f"reserving file {i}: {os.strerror(err)}"
                log.warning("reserving the region's memfds in the background stopped at "
                            "file %d of %d (pre-fault allocates the rest): %s", i,
                            len(self._fds), self.error)
            if self.finished_s is None and bool((self._state == 1).all()):
                self.finished_s = time.perf_counter() - self.started

    def _reserve_in_python(self) -> None:
        while not self._stop_flag[0]:
            i = next(self._next_file)  # files are taken in order: row order
            if i >= len(self._fds):
                return
            fd, length = int(self._fds[i]), int(self._lengths[i])
            try:
                for offset in range(0, length, RESERVE_BYTES):
                    if self._stop_flag[0]:
                        return
                    os.posix_fallocate(fd, offset, min(RESERVE_BYTES, length - offset))
            except OSError as exc:
                self._state[i] = -(exc.errno or errno.EIO)
                self._stop_flag[0] = 1
                return
            os.close(fd)
            self._state[i] = 1
