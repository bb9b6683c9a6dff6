"""`BackgroundSetup` on a real mapping: units populated (really: write faults, or madvise) and
registered strictly in row order, the ready rows announced after each registration, an error
that stops set-up where it is, and `stop` that abandons the rest without a stray thread."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import resource
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload.config import TierConfig
from offload.region import background
from offload.region.background import BackgroundSetup, native_populator
from offload.region.geometry import ByteRange, RegionGeometry, setup_units
from offload.region.hugepages import shmem_huge_mode
from offload.region.pin import Pinner, RecordingRegistrar
from offload.region.prefault import madvise_populate
from offload.system.nameless import create_memfds
from offload.system.shm import Mapping, close_fds, libc
from tests.region.test_region_prefault import all_pages_mapped

PAGE = 4096
ROWS = 24


def _shared_geometry() -> RegionGeometry:
    """A shared rank's slot (2 pages) in rows of 5 pages: registered slot by slot."""
    return RegionGeometry("shared", ROWS, 5 * PAGE, 2 * PAGE, 2 * PAGE, PAGE)


class _Recorder:
    def __init__(self) -> None:
        self.announced: list[tuple[int, bool]] = []
        self.populated: list[ByteRange] = []
        self.policies: set[int] = set()  # the populating threads' scheduling policies
        self.lock = threading.Lock()

    def on_ready(self, rows: int, stopped: bool) -> None:
        self.announced.append((rows, stopped))

    def populate_from(self, base: int, fail_at: int | None = None):
        def populate(address: int, length: int) -> int:
            with self.lock:
                self.populated.append(ByteRange(address - base, length))
                self.policies.add(os.sched_getscheduler(0))
                if fail_at is not None and address - base >= fail_at:
                    return errno.ENOMEM
            return madvise_populate(address, length)
        return populate


def _run(unit_bytes: int, registrar: RecordingRegistrar, fail_at: int | None = None,
         threads: int = 3):
    geometry = _shared_geometry()
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), unit_bytes)
    mapping = Mapping.anonymous(geometry.total_bytes)
    recorder = _Recorder()
    pinner = Pinner(registrar, mapping.address)
    setup = BackgroundSetup(mapping.address, units, pinner, threads, recorder.on_ready,
                            populate=recorder.populate_from(mapping.address, fail_at))
    return geometry, units, mapping, recorder, pinner, setup


def test_units_are_populated_then_registered_in_row_order_and_announced() -> None:
    registrar = RecordingRegistrar()
    geometry, units, mapping, recorder, pinner, setup = _run(3 * 2 * PAGE, registrar)
    try:
        assert setup.start().wait(20)
        assert setup.error is None and setup.ready_rows == ROWS
        assert [rows for rows, _ in recorder.announced] == [u.rows_end for u in units]
        assert not any(stopped for _, stopped in recorder.announced)
        assert len(units) == ROWS // 3  # three slots per unit
        slots = [ByteRange(r * geometry.row_stride + geometry.slot_offset, geometry.slot_bytes)
                 for r in range(ROWS)]
        assert pinner.registered == slots  # one registration per slot, in row order
        assert sorted(recorder.populated) == slots  # exactly what it registers, populated
        assert setup.finished is not None and setup.busy_s >= setup.longest_call_s > 0
    finally:
        setup.stop()
        pinner.unpin_all()
        mapping.close()


def test_a_failure_stops_set_up_where_it_is_and_says_so() -> None:
    registrar = RecordingRegistrar()
    geometry, units, mapping, recorder, pinner, setup = _run(2 * PAGE, registrar,
                                                             fail_at=10 * 5 * PAGE)
    try:
        assert setup.start().wait(20)
        assert setup.error is not None and "ran out of memory" in setup.error
        assert setup.ready_rows == 10  # rows 0..9 made it, row 10's pre-fault failed
        assert recorder.announced[-1] == (10, True)
        assert [r for r, _ in recorder.announced[:-1]] == list(range(1, 11))
        assert len(pinner.registered) == 10
    finally:
        setup.stop()
        pinner.unpin_all()
        mapping.close()


class _SlowRegistrar(RecordingRegistrar):
    def register(self, address: int, length: int) -> None:
        time.sleep(0.05)
        super().register(address, length)


def test_stop_abandons_the_rest_and_leaves_no_thread() -> None:
    registrar = _SlowRegistrar()
    geometry, units, mapping, recorder, pinner, setup = _run(2 * PAGE, registrar)
    try:
        setup.start()
        while setup.ready_rows < 2:
            time.sleep(0.005)
        began = time.perf_counter()
        setup.stop()
        assert time.perf_counter() - began < 1.0  # one registration at most, not the region
        announced = len(recorder.announced)
        time.sleep(0.2)
        assert len(recorder.announced) == announced  # nothing after stop
        assert setup.done.is_set() and setup.error is None and setup.ready_rows < ROWS
        assert not [t for t in (*setup._workers, setup._thread) if t.is_alive()]
    finally:
        pinner.unpin_all()
        mapping.close()
    assert registrar.registered == {}


def test_interpreter_exit_does_not_wait_for_the_rest_of_the_pre_fault(tmp_path) -> None:
    """A program that ends while set-up has 10 s of units left exits at once: every set-up
    thread is a daemon (a thread pool's workers would be joined, queue drained, first).
    Timed from the end of the program's last line, so a slow import on a busy host does not
    count."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "exits.py"
    script.write_text(textwrap.dedent("""
        import time
        from offload.config import TierConfig
        from offload.region.geometry import RegionGeometry, setup_units
        from offload.region.background import BackgroundSetup
        from offload.region.pin import Pinner, RecordingRegistrar
        from offload.system.shm import Mapping

        geometry = RegionGeometry("private", 100, 4096, 0, 4096, 4096)
        units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), 4096)
        mapping = Mapping.anonymous(geometry.total_bytes)

        def slow(address, length):
            time.sleep(0.1)
            return 0

        BackgroundSetup(mapping.address, units, Pinner(RecordingRegistrar(), mapping.address),
                        1, lambda rows, stopped: None, populate=slow).start()
        time.sleep(0.3)
        print(time.time(), flush=True)  # the program's end
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)
    exited = time.time()
    assert proc.returncode == 0, proc.stderr
    assert exited - float(proc.stdout.split()[-1]) < 4  # not the ~10 s of units left


class _PolicyRegistrar(RecordingRegistrar):
    """Records the scheduling policy of the thread that registers."""

    def __init__(self) -> None:
        super().__init__()
        self.policies: set[int] = set()

    def register(self, address: int, length: int) -> None:
        self.policies.add(os.sched_getscheduler(0))
        super().register(address, length)


needs_cc = pytest.mark.skipif(native_populator() is None, reason="needs a C compiler")


def _anonymous_bytes(address: int) -> int:
    """The anonymous memory resident in the mapping that holds ``address`` (/proc/self/smaps):
    pages written to, not the zero page a read fault maps."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Anonymous:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def _native_run(registrar: RecordingRegistrar):
    """The default populate (populate.c) over a real mapping."""
    geometry = _shared_geometry()
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), 2 * PAGE)
    mapping = Mapping.anonymous(geometry.total_bytes)
    recorder = _Recorder()
    pinner = Pinner(registrar, mapping.address)
    setup = BackgroundSetup(mapping.address, units, pinner, 3, recorder.on_ready)
    return geometry, mapping, recorder, pinner, setup


@needs_cc
def test_the_native_loop_populates_every_unit_it_registers() -> None:
    """populate.c takes the units (no Python between two pieces) and every registered
    slot's pages are in this process's page tables when the pin thread registers them."""
    registrar = RecordingRegistrar()
    geometry, mapping, recorder, pinner, setup = _native_run(registrar)
    try:
        assert setup._native is not None  # the default path, not the Python fallback
        assert setup.start().wait(20) and setup.error is None
        assert setup.ready_rows == ROWS and recorder.announced[-1] == (ROWS, False)
        for r in pinner.registered:
            assert all_pages_mapped(mapping.address + r.offset, r.length)
        # written to, not read: anonymous pages of its own, not the shared zero page
        assert _anonymous_bytes(mapping.address) >= sum(r.length for r in pinner.registered)
        assert not setup.fallback
    finally:
        setup.stop()
        pinner.unpin_all()
        mapping.close()


def _populate_shared_pages(share: tuple[int, int]) -> tuple[int, int, bool]:
    """A peer process's stand-in (a second mapping of the same memfd) writes every page and a
    pattern; then set-up populates this mapping as ``share``.  Returns the page faults set-up
    took, the pages, and whether every byte is as the peer left it and every page is mapped."""
    rows, row = 16, 64 * PAGE  # one row a unit, one range a row
    geometry = RegionGeometry("private", rows, row, 0, row, PAGE)
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), row)
    pages = geometry.total_bytes // PAGE
    fds = create_memfds("test-share", [geometry.total_bytes], 1)
    try:
        peer, ours = Mapping(fds, [geometry.total_bytes]), Mapping(fds, [geometry.total_bytes])
    finally:
        close_fds(fds)
    pinner = Pinner(RecordingRegistrar(), ours.address)
    try:
        written = np.frombuffer((ctypes.c_uint8 * geometry.total_bytes).from_address(
            peer.address), dtype=np.uint8)
        written[:] = np.arange(geometry.total_bytes, dtype=np.int64) % 251
        setup = BackgroundSetup(ours.address, units, pinner, 1, lambda rows, stopped: None,
                                share=share)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        assert setup.start().wait(20) and setup.error is None
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        seen = np.frombuffer((ctypes.c_uint8 * geometry.total_bytes).from_address(
            ours.address), dtype=np.uint8)
        intact = all_pages_mapped(ours.address, geometry.total_bytes) and bool(
            (seen == np.arange(geometry.total_bytes, dtype=np.int64) % 251).all())
        setup.stop()
        return faults, pages, intact
    finally:
        pinner.unpin_all()
        ours.close()
        peer.close()


@needs_cc
@pytest.mark.skipif(shmem_huge_mode() not in ("never", "deny", None)
                    or mmap.PAGESIZE != 4096,
                    reason="counts the faults of 4 KiB shared memory pages")
@pytest.mark.parametrize("share", [(0, 2), (1, 2), (1, 3)])
def test_a_replicated_rank_maps_the_pages_its_peers_populated_by_fault_around(
        share: tuple[int, int]) -> None:
    """A replicated stage's ranks populate the same memfd pages.  Alone, a rank takes a fault
    per page; as the i-th of n it writes its n-th of each range and reads the rest (populated
    by its peers) first, which the kernel maps sixteen pages a fault.  Nothing the peers wrote
    changes, and every page ends up mapped either way.  (The share first, then the pages
    after it, then those before: (0, 2) reads only after its half, (1, 2) only before it.)"""
    alone, pages, intact = _populate_shared_pages((0, 1))
    assert intact and alone >= 0.9 * pages, (alone, pages)
    index, count = share
    faults, pages, intact = _populate_shared_pages(share)
    own = pages / count  # written: a fault each; the rest ~1 in 16
    assert intact and own <= faults <= own + 0.15 * (pages - own), (faults, pages)


@pytest.mark.parametrize("share", [(0, 0), (2, 2), (-1, 2)])
def test_a_share_outside_its_count_is_refused(share: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match=r"want \(index, count\) with 0 <= index < count"):
        BackgroundSetup(0, setup_units(_shared_geometry(), TierConfig(cpu_bytes_per_node=1 << 30),
                                       PAGE), Pinner(RecordingRegistrar(), 0), 1,
                        lambda rows, stopped: None, share=share)


class _PreparingRegistrar(RecordingRegistrar):
    """Records where `prepare` ran (the registrar's own CUDA context is made there)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.prepared_on: list[str] = []

    def prepare(self) -> None:
        self.prepared_on.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("cuCtxCreate failed: out of memory (stand-in)")


def test_nothing_is_populated_or_registered_before_the_kernel_is_compiled() -> None:
    """No row is usable before the copy kernel's JIT, and populating beside it slows it
    several times over: until ``after`` is set no thread populates or registers; then all
    of them do.  The registrar is prepared meanwhile, on the pin thread (beside the JIT, not
    on the caller's path), once."""
    geometry = _shared_geometry()
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), 2 * PAGE)
    mapping = Mapping.anonymous(geometry.total_bytes)
    workers: list[str] = []

    def slow(address: int, length: int) -> int:
        workers.append(threading.current_thread().name)
        time.sleep(0.01)
        return madvise_populate(address, length)

    compiled = threading.Event()
    registrar = _PreparingRegistrar()
    pinner = Pinner(registrar, mapping.address)
    setup = BackgroundSetup(mapping.address, units, pinner, 3, _Recorder().on_ready,
                            populate=slow)
    try:
        setup.start(after=compiled)
        time.sleep(0.3)
        assert workers == [] and registrar.calls == 0 and setup.ready_rows == 0
        assert registrar.prepared_on == ["offload-bg-pin"]
        ids = setup.thread_ids()  # the threads a wait sampler watches, with their roles
        assert sorted(ids.values()) == ["pin", "prefault", "prefault", "prefault"]
        assert {str(t) for t in ids} <= set(os.listdir("/proc/self/task"))
        compiled.set()
        assert setup.wait(20) and setup.error is None and setup.ready_rows == ROWS
        assert set(workers) == {f"offload-bg-prefault-{i}" for i in range(3)}
        assert registrar.prepared_on == ["offload-bg-pin"]
    finally:
        setup.stop()
        pinner.unpin_all()
        mapping.close()


@given(requested=st.integers(1, 64), sharing=st.integers(1, 16), cpus=st.integers(1, 512))
def test_set_up_leaves_at_least_half_the_cpus(requested: int, sharing: int, cpus: int) -> None:
    """Each rank runs what was asked, but the processes sharing the CPUs together at most half
    of them (never none)."""
    threads = background.setup_threads(requested, sharing, cpus)
    assert 1 <= threads <= requested
    assert threads == 1 or threads * sharing <= cpus // 2
    if requested * sharing <= cpus // 2:
        assert threads == requested  # room for all of them: nothing taken away
    else:  # the most that fit
        assert threads == max(1, cpus // (2 * sharing))


def _cpus(*ranges: tuple[int, int]) -> frozenset[int]:
    return frozenset(c for a, b in ranges for c in range(a, b))


ALL, LOW, HIGH = _cpus((0, 16)), _cpus((0, 8)), _cpus((8, 16))


@pytest.mark.parametrize(("node", "processes", "sharing"), [
    ([(ALL, ALL), (ALL, ALL)], 2, 2),       # one set for both ranks
    ([(LOW, LOW), (HIGH, HIGH)], 2, 1),     # a launcher bound each rank to its own
    ([(ALL, ALL), (ALL, ALL)], 4, 4),       # two DP replicas alike
    ([(LOW, LOW), (HIGH, HIGH)], 4, 1),     # bound replicas: each on its own still
    ([(LOW, ALL), (HIGH, ALL)], 4, 2),      # NUMA nodes apart, the CPUs shared: replicas too
    ([(LOW, ALL), (LOW, ALL)], 4, 4),       # one NUMA node, shared
    ([(ALL, ALL)], 2, 2),                   # alone in its tier: assume the node shared
    ([(ALL, ALL)], 1, 1),
    ([(LOW, LOW), (_cpus((4, 12)), _cpus((4, 12))), (HIGH, HIGH)], 3, 2),  # overlaps count
])
def test_sharing_processes_tells_one_cpu_set_from_bound_ranks(
        node: list[tuple[frozenset[int], frozenset[int]]], processes: int, sharing: int
) -> None:
    """Rank 0's view: the ranks and processes whose set-up runs on its CPUs."""
    lists = [(sorted(cpus), sorted(affinity)) for cpus, affinity in node]
    assert background.sharing_processes(node[0], lists, processes) == sharing


def test_set_up_runs_on_the_placements_cpus_within_the_process_affinity() -> None:
    affinity = background.process_cpus()
    assert affinity == frozenset(os.sched_getaffinity(0))
    assert background.setup_cpus(affinity) == affinity
    first = min(affinity)
    assert background.setup_cpus(affinity, frozenset({first, 10 ** 6})) == {first}
    assert background.setup_cpus(affinity, frozenset({10 ** 6})) == affinity  # none there


def test_set_up_threads_on_the_hosts_measured() -> None:
    assert background.setup_threads(8, 2, 16) == 4  # the H200 host: 2 ranks of 16 cores
    assert background.setup_threads(8, 1, 16) == 8
    assert background.setup_threads(8, 8, 128) == 8
    assert background.setup_threads(8, 2, 2) == 1  # the CI machine


def test_a_registrar_that_cannot_be_prepared_stops_set_up_and_says_why() -> None:
    """No context to register in: no row comes online, the error says why and the other
    ranks are told (``stopped``)."""
    geometry = _shared_geometry()
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), 2 * PAGE)
    mapping = Mapping.anonymous(geometry.total_bytes)
    registrar = _PreparingRegistrar(fail=True)
    pinner = Pinner(registrar, mapping.address)
    recorder = _Recorder()
    setup = BackgroundSetup(mapping.address, units, pinner, 2, recorder.on_ready,
                            populate=recorder.populate_from(mapping.address))
    try:
        assert setup.start().wait(20)
        assert setup.error is not None and "cuCtxCreate failed" in setup.error
        assert recorder.announced == [(0, True)] and setup.ready_rows == 0
        assert registrar.calls == 0
    finally:
        setup.stop()
        pinner.unpin_all()
        mapping.close()


def test_a_set_up_stopped_before_the_kernel_is_compiled_ends_at_once() -> None:
    """`close` while the JIT still runs: the waiting threads see the stop within their poll
    and end without populating or registering."""
    geometry = _shared_geometry()
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), 2 * PAGE)
    mapping = Mapping.anonymous(geometry.total_bytes)
    registrar = RecordingRegistrar()
    pinner = Pinner(registrar, mapping.address)
    setup = BackgroundSetup(mapping.address, units, pinner, 3, _Recorder().on_ready)
    try:
        setup.start(after=threading.Event())
        stopper = threading.Thread(target=setup.stop, daemon=True)  # a hang fails, not hangs
        stopper.start()
        stopper.join(5)
        assert not stopper.is_alive()
        assert setup.done.is_set() and registrar.calls == 0 and setup.error is None
        assert not [t for t in (*setup._workers, setup._thread) if t.is_alive()]
    finally:
        pinner.unpin_all()
        mapping.close()


@needs_cc
def test_c_pre_fault_threads_yield_the_cpu_and_the_pin_thread_keeps_its_priority() -> None:
    """The C loop's workers run under SCHED_IDLE, so the engine's threads preempt them; the pin
    thread, which holds the CUDA driver while it registers, keeps the caller's policy."""
    geometry = _shared_geometry()
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), 2 * PAGE)
    mapping = Mapping.anonymous(geometry.total_bytes)
    registrar = _PolicyRegistrar()
    pinner = Pinner(registrar, mapping.address)
    workers: set[int] = set()  # each worker's policy as it starts (its placement hook)
    setup = BackgroundSetup(mapping.address, units, pinner, 3, _Recorder().on_ready,
                            on_thread_start=lambda: workers.add(os.sched_getscheduler(0)))
    try:
        assert setup._native is not None
        assert setup.start().wait(20) and setup.error is None
        assert workers == {os.SCHED_IDLE}
        assert registrar.policies == {os.sched_getscheduler(0)} != {os.SCHED_IDLE}
    finally:
        setup.stop()
        pinner.unpin_all()
        mapping.close()


def test_python_pre_fault_threads_keep_their_priority() -> None:
    """A Python worker takes the GIL back after every madvise: at idle priority, preempted
    holding it, it would stall every other thread of the process."""
    geometry, units, mapping, recorder, pinner, setup = _run(2 * PAGE, RecordingRegistrar())
    try:
        assert setup.start().wait(20) and setup.error is None
        assert recorder.policies == {os.sched_getscheduler(0)} != {os.SCHED_IDLE}
    finally:
        setup.stop()
        pinner.unpin_all()
        mapping.close()


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split(".")
    try:
        return (int(release[0]), int(release[1].split("-")[0])) >= (major, minor)
    except (IndexError, ValueError):
        return False


@needs_cc
@pytest.mark.skipif(not _kernel_at_least(6, 7),
                    reason="shared-memory faults take the mmap lock before Linux 6.7")
def test_the_c_loops_populating_never_holds_the_engines_mmaps_back() -> None:
    """The C loop populates by write faults, which take only the region's VMA lock: a thread
    of the process that maps, unmaps and protects memory every millisecond (what malloc does)
    is not held behind the populating, on a host kept busy by another process (the engine).
    With MADV_POPULATE_WRITE, whose calls hold the mmap lock for reading, the same thread
    waited a median of ~20 ms on the CI machine: a worker at idle priority, preempted inside a
    call, holds every writer of the lock back."""
    size = 512 << 20
    geometry = RegionGeometry("private", size // (8 << 20), 8 << 20, 0, 8 << 20, PAGE)
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), 8 << 20)
    fd = os.memfd_create("offload-test-touch", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    mapping = mmap.mmap(fd, size)
    os.close(fd)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    own = mmap.mmap(-1, 256 * PAGE)
    own_address = ctypes.addressof(ctypes.c_char.from_buffer(own))
    waits: list[float] = []
    failed: list[int] = []
    done = threading.Event()

    def probe() -> None:
        k = 0
        while not done.is_set():
            began = time.perf_counter()
            page = mmap.mmap(-1, PAGE)
            page[0] = 1
            page.close()
            if libc.mprotect(ctypes.c_void_p(own_address + PAGE * (k % 256)),
                             ctypes.c_size_t(PAGE), 1 if (k // 256) % 2 else 3) != 0:
                failed.append(ctypes.get_errno())
            waits.append(time.perf_counter() - began)
            k += 1
            time.sleep(0.001)

    pinner = Pinner(RecordingRegistrar(), address)
    setup = BackgroundSetup(address, units, pinner, 2, _Recorder().on_ready)
    watcher = threading.Thread(target=probe)
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 60\n"
                             "while time.time() < end: pass"])
    try:
        assert setup._native is not None
        watcher.start()
        assert setup.start().wait(120) and setup.error is None
        assert all_pages_mapped(address, size)
    finally:
        busy.kill()
        busy.wait()
        done.set()
        if watcher.is_alive():
            watcher.join()
        setup.stop()
        pinner.unpin_all()
        del address
        mapping.close()
        own.close()
    assert not failed
    assert len(waits) >= 20 and float(np.median(waits)) < 0.005, sorted(waits)[-5:]


def _unreserved_memfds(count: int, length: int) -> list[int]:
    from offload.system.nameless import create_memfds

    return create_memfds("test-reserve", [length] * count, 1, reserved=False)


@needs_cc
def test_the_background_reservation_allocates_every_file_and_lets_go_of_it() -> None:
    """populate.c's reservation: every file allocated, each duplicate closed once reserved."""
    from offload.system.shm import close_fds

    fds = _unreserved_memfds(3, 8 << 20)
    open_before = len(os.listdir("/proc/self/fd"))
    try:
        reservation = background.BackgroundReservation([os.dup(fd) for fd in fds],
                                                       [8 << 20] * 3, 2)
        assert reservation._native is not None
        reservation.start()
        deadline = time.monotonic() + 20
        while reservation.finished_s is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert all(os.fstat(fd).st_blocks * 512 >= 8 << 20 for fd in fds)
        assert reservation._state.tolist() == [1, 1, 1]  # reserved, duplicate closed in C
        assert len(os.listdir("/proc/self/fd")) == open_before
        reservation.stop()
        assert reservation.error is None
    finally:
        close_fds(fds)


@needs_cc
def test_a_reservation_that_fails_stops_and_says_why() -> None:
    from offload.system.shm import close_fds

    fds = _unreserved_memfds(3, 8 << 20)
    readonly = os.open(f"/proc/self/fd/{fds[1]}", os.O_RDONLY)  # fallocate: EBADF
    try:
        reservation = background.BackgroundReservation(
            [os.dup(fds[0]), readonly, os.dup(fds[2])], [8 << 20] * 3, 1).start()
        reservation._threads[0].join(20)
        assert reservation.error == "reserving file 1: Bad file descriptor"
        assert reservation._state.tolist() == [1, -errno.EBADF, 0]  # the rest left alone
        reservation.stop()  # closes what C did not
        with pytest.raises(OSError):
            os.fstat(readonly)
    finally:
        close_fds(fds)


def test_stopping_the_background_reservation_waits_for_one_piece_only(monkeypatch) -> None:
    """The Python loop (no compiler): `stop` waits for the piece in hand, not the file."""
    from offload.system.shm import close_fds

    pieces: list[int] = []

    def slow(fd: int, offset: int, length: int) -> None:
        pieces.append(offset)
        time.sleep(0.05)

    monkeypatch.setattr(background, "native_populator", lambda: None)
    monkeypatch.setattr(background, "RESERVE_BYTES", 1 << 20)
    monkeypatch.setattr(os, "posix_fallocate", slow)
    fds = _unreserved_memfds(2, 64 << 20)
    try:
        reservation = background.BackgroundReservation([os.dup(fd) for fd in fds],
                                                       [64 << 20] * 2, 2).start()
        time.sleep(0.2)
        began = time.perf_counter()
        reservation.stop()
        assert time.perf_counter() - began < 1.5  # a piece each, not a 64-piece file (3.2 s)
        assert len(pieces) < 2 * 64 and reservation._state.tolist() == [0, 0]
        assert not [t for t in reservation._threads if t.is_alive()]
    finally:
        close_fds(fds)


def test_no_unit_is_populated_before_every_set_up_thread_exists() -> None:
    """Creating a thread maps its stack under the mmap lock while holding the GIL, so it waits
    for every populating madvise in flight and stalls the process: set-up creates all its
    threads first.  Here the pin thread's creation is slowed by 0.2 s."""
    geometry = _shared_geometry()
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), 2 * PAGE)
    mapping = Mapping.anonymous(geometry.total_bytes)
    seen: list[bool] = []

    def populate(address: int, length: int) -> int:
        seen.append(setup._thread.ident is not None)
        return madvise_populate(address, length)

    pinner = Pinner(RecordingRegistrar(), mapping.address)
    setup = BackgroundSetup(mapping.address, units, pinner, 3, _Recorder().on_ready,
                            populate=populate)
    start = setup._thread.start

    def slow_start() -> None:
        time.sleep(0.2)
        start()

    setup._thread.start = slow_start  # type: ignore[method-assign]
    try:
        assert setup.start().wait(20) and setup.error is None
        assert seen and all(seen)
    finally:
        setup.stop()
        pinner.unpin_all()
        mapping.close()


def _private_geometry(rows: int, row_bytes: int) -> RegionGeometry:
    return RegionGeometry("private", rows, row_bytes, 0, row_bytes, PAGE)


MADV_NOHUGEPAGE = mmap.MADV_NOHUGEPAGE


def _resident_pages(address: int, length: int) -> int:
    """Pages of [address, address + length) resident in this process (``mincore``)."""
    vec = np.zeros(length // PAGE, dtype=np.uint8)
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length),
                        ctypes.c_void_p(vec.ctypes.data)) == 0
    return int((vec & 1).sum())


@needs_cc
def test_the_c_loop_populates_while_a_unit_is_registered() -> None:
    """Registering and populating overlap, as in the blocking create: beside write faults a
    registration waits for no lock they hold, and holding populating back while registering
    made every row ready up to 2x later.  The oracle is the mapping's own residency: row 0's
    registration returns only once later rows were populated meanwhile (a set-up that held the
    workers back for it would never see them grow, and fails on the deadline)."""
    rows = 16
    geometry = _private_geometry(rows, 2 << 20)
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), 2 << 20)
    mapping = Mapping.anonymous(geometry.total_bytes)
    # 4 KiB pages: residency grows page by page, not 2 MiB at once
    libc.madvise(ctypes.c_void_p(mapping.address), ctypes.c_size_t(geometry.total_bytes),
                 MADV_NOHUGEPAGE)
    grew: list[int] = []

    class Registrar(RecordingRegistrar):
        def register(self, address: int, length: int) -> None:
            if not self.calls:  # row 0: wait for populating to go on beside this call
                before = _resident_pages(mapping.address, geometry.total_bytes)
                deadline = time.monotonic() + 10
                while (time.monotonic() < deadline and
                       _resident_pages(mapping.address, geometry.total_bytes) == before):
                    time.sleep(0.001)
                grew.append(_resident_pages(mapping.address, geometry.total_bytes) - before)
            super().register(address, length)

    pinner = Pinner(Registrar(), mapping.address)
    setup = BackgroundSetup(mapping.address, units, pinner, 1, _Recorder().on_ready)
    try:
        assert setup._native is not None
        assert setup.start().wait(60) and setup.error is None and setup.ready_rows == rows
        assert grew and grew[0] > 0
    finally:
        setup.stop()
        pinner.unpin_all()
        mapping.close()


def test_a_unit_in_flight_delays_only_the_rows_from_it_on() -> None:
    """A pre-fault thread preempted inside a unit (here: a 1 s stand-in on row 1) holds back
    neither the registration of row 0 nor the populating of the rows after it: row 0 comes
    online at once, and the rest as soon as row 1 is done."""
    rows = 8
    geometry = _private_geometry(rows, 4 * PAGE)
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), 4 * PAGE)
    mapping = Mapping.anonymous(geometry.total_bytes)
    stuck = mapping.address + geometry.row_stride  # row 1: in flight for a second
    populated_while_stuck: list[int] = []
    recorder = _Recorder()

    def populate(address: int, length: int) -> int:
        if address == stuck:
            time.sleep(1.0)
            populated_while_stuck.append(len(recorder.populated))
        return recorder.populate_from(mapping.address)(address, length)

    announced: list[float] = []

    def on_ready(rows_ready: int, stopped: bool) -> None:
        announced.append(time.perf_counter())
        recorder.on_ready(rows_ready, stopped)

    pinner = Pinner(RecordingRegistrar(), mapping.address)
    setup = BackgroundSetup(mapping.address, units, pinner, 2, on_ready, populate=populate)
    try:
        began = time.perf_counter()
        assert setup.start().wait(30) and setup.error is None and setup.ready_rows == rows
        assert announced[0] - began < 0.6  # row 0 did not wait for row 1's second
        assert announced[1] - began >= 1.0  # row 1 and on: strictly in order
        assert populated_while_stuck == [rows - 1]  # every other row, populated meanwhile
    finally:
        setup.stop()
        pinner.unpin_all()
        mapping.close()


def test_the_python_loop_populates_while_a_unit_is_registered() -> None:
    """The same overlap in the Python loop (no compiler, a test's stand-in): row 0's
    registration returns only once some populating call began while it ran.  Rows from 1 on
    wait for that registration to begin, so there is populating left to do beside it."""
    geometry = _private_geometry(32, 4 * PAGE)
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=1 << 30), 4 * PAGE)
    mapping = Mapping.anonymous(geometry.total_bytes)
    registering = threading.Event()
    began_beside = threading.Event()
    beside: list[bool] = []

    def populate(address: int, length: int) -> int:
        if registering.is_set():
            began_beside.set()
        elif address > mapping.address:  # rows 1 and on: not before row 0 is registering
            registering.wait(10)
        return madvise_populate(address, length)

    class Registrar(RecordingRegistrar):
        def register(self, address: int, length: int) -> None:
            if not self.calls:
                registering.set()
                beside.append(began_beside.wait(10))
            super().register(address, length)

    pinner = Pinner(Registrar(), mapping.address)
    setup = BackgroundSetup(mapping.address, units, pinner, 3, _Recorder().on_ready,
                            populate=populate)
    try:
        assert setup.start().wait(30) and setup.error is None and setup.ready_rows == 32
        assert beside == [True]
    finally:
        setup.stop()
        pinner.unpin_all()
        mapping.close()
