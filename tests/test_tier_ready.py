"""Background set-up across real gloo ranks (DESIGN.md section 3.9): `create` returns before
the rows are set up, rows come online as every rank registers its part, a job touching a row
that some rank has not set up is decided failed -- "not ready" -- on every rank alike (never
wrong bytes, never a wait), the chunk manager hands out only ready rows, and close or a dead
rank during set-up leaves nothing behind.

Set-up is held back by the registrar (the seam `HostTier.create` offers for pinning): a
``GatedRegistrar`` registers a few ranges, then waits for a gate file, so a test decides
exactly how far each rank gets.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time

import pytest

from offload.config import TierConfig
from offload.region.pin import RecordingRegistrar
from tests.harness import decide_all, run_group

MiB = 1 << 20
PAGE = 4096
BLOCKS = 8


class GatedRegistrar(RecordingRegistrar):
    """Registers ``free`` ranges, then each further one only once ``gate`` exists (checked
    every 10 ms, at most ``limit_s``); ``delay_s`` slows every call."""

    def __init__(self, gate: str, free: int, delay_s: float = 0.0, limit_s: float = 30.0,
                 fail_at: int | None = None) -> None:
        super().__init__()
        self.gate, self.free, self.delay_s, self.limit_s = gate, free, delay_s, limit_s
        self.fail_at = fail_at

    def register(self, address: int, length: int) -> None:
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise OSError(12, "stand-in registration refused")
        deadline = time.monotonic() + self.limit_s
        while self.calls >= self.free and not os.path.exists(self.gate):
            if time.monotonic() > deadline:
                raise TimeoutError("the test's gate never opened")
            time.sleep(0.01)
        time.sleep(self.delay_s)
        super().register(address, length)


def _kv(rank: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(7 + rank)
    return [torch.randint(1, 256, (BLOCKS, PAGE), generator=gen, dtype=torch.uint8)]


def _background_tier(rank: int, layout: str, registrar, world: int = 2,
                     unit_bytes: int = 2 * PAGE, **config):
    """A background tier of one-block rows (about 20), each registering two pages: one row
    per set-up unit, or with ``unit_bytes`` = one page each row in two pieces (its page,
    then its checksum trailer)."""
    import offload.region.host_region as host_region
    from offload import HostTier

    host_region.UNIT_BYTES = unit_bytes  # the test steps rows (or pieces) one at a time
    budget = 40 * PAGE * (1 if layout == "replicated" else world)
    tier_config = TierConfig(cpu_bytes_per_node=budget, layout=layout, blocks_per_chunk=1,
                             tp=world, timeout_s=20, background=True, **config)
    # replicated: a stage's ranks hold the same KV (the node keeps one copy per stage)
    kv = _kv(0 if layout == "replicated" else rank)
    return HostTier.create(kv, tier_config, registrar_factory=lambda device: registrar)


def _wait_rows(tier, rows: int, limit_s: float = 20) -> None:
    deadline = time.monotonic() + limit_s
    while tier.ready.rows < rows:
        assert time.monotonic() < deadline, f"never reached {rows} ready rows: {tier.ready}"
        time.sleep(0.005)


def _decide_all(tier, rank: int) -> list:
    """`decide_all` with each error cut to its first words."""
    return [(j, ok, f, (e or "")[:9]) for j, ok, f, e in decide_all(tier, rank)]


def _not_ready_everywhere(rank: int, layout: str, gate: str, pieces: bool) -> object:
    """Rank 1 sets up 2 rows (with ``pieces``: and the first piece of the third) and waits at
    the gate; rank 0 sets up everything.  A store into row 5 (ready on rank 0 only) fails on
    both ranks, naming rank 1; the manager hands out the two ready rows only; after the gate
    opens, every row stores and loads byte-exact."""
    import torch
    import torch.distributed as dist

    from offload import CopyJob, OffloadError

    registrar = GatedRegistrar(gate, free=(5 if pieces else 2) if rank == 1 else 10 ** 6)
    tier = _background_tier(rank, layout, registrar, unit_bytes=PAGE if pieces else 2 * PAGE)
    total = tier.plan.chunk_count
    created_ready = tier.actor.ready_rows
    assert tier.wait_ready(20, rows=2).rows == 2  # rank 1 stops at the gate after two rows
    if rank == 0:  # rank 0 itself gets everything; the tier stays at rank 1's rows
        deadline = time.monotonic() + 20
        while tier.actor.ready_rows < total and time.monotonic() < deadline:
            time.sleep(0.005)
    dist.barrier()
    seen = tier.ready
    refused = None
    try:
        tier.submit(CopyJob(1, "store", (0,), (5,), (0,)))
    except OffloadError as exc:
        refused = str(exc).split(":")[0]
    early = _decide_all(tier, rank)
    handed = None
    if rank == 0:
        job = tier.manager.prepare_store(["a", "b", "c"])
        handed = ([c for _, c in job.chunks], list(job.dropped))
        tier.manager.complete_store(job.job_id, ok=False)
    dist.barrier()
    if rank == 0:
        open(gate, "w").close()
    full = tier.wait_ready(20)
    for block in range(BLOCKS):
        tier.submit(CopyJob(10 + block, "store", (block,), (total - 1 - block,), (0,)))
    stored = _decide_all(tier, rank)
    original = [t.clone() for t in tier.actor.kv_tensors]
    for t in tier.actor.kv_tensors:
        t.zero_()
    for block in range(BLOCKS):
        tier.submit(CopyJob(20 + block, "load", (block,), (total - 1 - block,), (0,)))
    loaded = _decide_all(tier, rank)
    exact = all(torch.equal(a, b) for a, b in zip(original, tier.actor.kv_tensors, strict=True))
    report = tier.actor.report()
    tier.close()
    return {"created_ready": created_ready, "total": total, "seen": (seen.rows, seen.total),
            "refused": refused, "early": early, "handed": handed, "full": full.full,
            "stored_ok": all(ok for _, ok, _, _ in stored), "loaded_ok":
            all(ok for _, ok, _, _ in loaded), "exact": exact,
            "report": (report["background"], report["ready_rows"], report["ready_s"] is not None),
            "cuts": tier.actor.region.cuts, "registrations": registrar.calls,
            "slot_offset": tier.plan.slots[rank].slot_offset,
            "share": tier.actor.region.background_setup.share}


@pytest.mark.parametrize(("layout", "pieces"), [("private", False), ("shared", False),
                                                ("replicated", False), ("private", True),
                                                ("shared", True)])
def test_a_row_not_ready_on_one_rank_fails_the_job_on_every_rank_and_nothing_is_wrong(
        tmp_path, layout, pieces):
    """Also with rows registered in pieces: a row whose first piece is registered on rank 1
    is not ready there, and the tier counts it as not ready."""
    gate = str(tmp_path / "gate")
    outcomes = run_group(_not_ready_everywhere, 2, args=(layout, gate, pieces), timeout=120)
    for o in outcomes:
        assert o.ok, o.error
    values = [o.value for o in outcomes]
    total = values[0]["total"]
    assert total >= 10
    assert values[1]["created_ready"] <= 2  # create returned while rank 1 waited at the gate
    assert [v["seen"] for v in values] == [(2, total)] * 2  # rank 1's two rows, on both ranks
    # rank 1 refused (rank 0 ran it), yet its submit returned like rank 0's: no rank diverges
    assert [v["refused"] for v in values] == [None, None]
    # ... and the job is decided failed on both ranks alike, naming rank 1 and "not ready"
    assert [v["early"] for v in values] == [[(1, False, 1, "not ready")]] * 2
    assert values[0]["handed"] == ([0, 1], ["c"])  # only the ready rows were handed out
    for v in values:
        assert v["full"] and v["stored_ok"] and v["loaded_ok"] and v["exact"], v
        assert v["report"] == (True, total, True)
        # pieces: each row's page, then its trailer (a page further), registered apart
        assert v["cuts"] == ((v["slot_offset"] + PAGE,) if pieces else ())
        assert v["registrations"] == total * (2 if pieces else 1)
    # a replicated stage's ranks populate the same pages: each writes its own share first
    assert [v["share"] for v in values] == ([(0, 2), (1, 2)] if layout == "replicated"
                                            else [(0, 1)] * 2)


def _stops_on_error(rank: int, gate: str) -> object:
    from offload import OffloadError

    registrar = GatedRegistrar(gate, free=10 ** 6, fail_at=3 if rank == 1 else None)
    tier = _background_tier(rank, "shared", registrar)
    try:
        tier.wait_ready(20)
        outcome = "full"
    except OffloadError as exc:
        outcome = str(exc)
    _wait_rows(tier, 3)  # rank 0 may not have got as far as rank 1 when rank 1 stopped
    ready = tier.ready
    tier.close()
    return outcome, ready.rows, ready.stopped


def test_a_rank_whose_set_up_fails_stops_the_tier_where_it_is_and_wait_ready_says_so(tmp_path):
    outcomes = run_group(_stops_on_error, 2, args=(str(tmp_path / "gate"),), timeout=90)
    for o in outcomes:
        assert o.ok, o.error
    for rank, (outcome, rows, stopped) in enumerate(o.value for o in outcomes):
        assert rows == 3 and stopped == (1,)
        # the rows usable when it was raised: rank 0 may have had fewer than rank 1's 3 yet
        assert re.search(r"background set-up stopped on ranks \[1\] with rows below [0-3] of",
                         outcome), outcome
        assert ("stand-in registration refused" in outcome) == (rank == 1)


def _open_memfds() -> list[str]:
    """This process's descriptors of the tier's memfds."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [name for name in names if name.startswith("/memfd:offload")]


def _close_during_set_up(rank: int, gate: str, layout: str, shm_dir: str | None) -> object:
    import offload.region.background as background

    fallocate = os.posix_fallocate

    def slow(fd: int, offset: int, length: int) -> None:
        time.sleep(0.2)
        fallocate(fd, offset, length)

    # the Python loop, reserving slowly: the reservation of memfds is still in flight at close
    os.posix_fallocate = slow
    background.native_populator = lambda: None
    registrar = GatedRegistrar(gate, free=10 ** 6, delay_s=0.05)
    memory = {"private_memory": "memfd"} if layout == "private" else {}
    # several files: a background reservation of nameless memfds still has some in hand
    tier = _background_tier(rank, layout, registrar, shm_dir=shm_dir, min_segment_bytes=64 << 10,
                            segment_threshold=128 << 10, **memory)
    _wait_rows(tier, 1)
    began = time.perf_counter()
    ready = tier.actor.ready_rows
    tier.close()
    took = time.perf_counter() - began
    threads = [t.name for t in threading.enumerate()
               if t.name.startswith(("offload-bg", "offload-jit"))]
    return (ready, tier.plan.chunk_count, took, dict(registrar.registered), threads,
            _open_memfds())


@pytest.mark.parametrize(("layout", "named"), [("shared", True), ("shared", False),
                                               ("private", False)])
def test_close_during_background_set_up_stops_it_unpins_and_leaves_nothing(
        tmp_path, shm_dir, layout: str, named: bool):
    """Named files, and nameless memfds (a node region's, a private rank's) whose reservation
    runs behind `create`: closed mid-set-up, nothing registered, no thread, no descriptor."""
    outcomes = run_group(_close_during_set_up, 2, args=(
        str(tmp_path / "gate"), layout, str(shm_dir) if named else None), timeout=90)
    for o in outcomes:
        assert o.ok, o.error
        ready, total, took, registered, threads, memfds = o.value
        assert ready < total  # closed while set-up was still running
        assert took < 5, took  # close waits for one registration, not for the region
        assert registered == {} and threads == [] and memfds == []
    assert os.listdir(shm_dir) == []


def _killed_during_set_up(rank: int, gate: str) -> object:
    from offload import PeerError

    registrar = GatedRegistrar(gate, free=2 if rank == 1 else 10 ** 6)
    tier = _background_tier(rank, "shared", registrar, world=2)
    _wait_rows(tier, 2)
    if rank == 1:
        os._exit(9)  # dies while its set-up waits at the gate
    began = time.monotonic()
    try:
        tier.wait_ready(3)
        return "full"
    except PeerError as exc:
        return str(exc), time.monotonic() - began


def test_a_rank_that_dies_during_background_set_up_fails_its_peers_within_the_timeout(tmp_path):
    outcomes = run_group(_killed_during_set_up, 2, args=(str(tmp_path / "gate"),), timeout=60)
    assert outcomes[1].exitcode == 9
    message, took = outcomes[0].value
    assert "rows below 2 of" in message and "ranks [1] are behind" in message
    assert took < 10


def _two_nodes(rank: int, gate: str) -> object:
    """One rank per simulated node: each learns the other's rows through the store key its
    node leader shares on its polls."""
    import torch.distributed as dist

    registrar = GatedRegistrar(gate, free=3 if rank == 1 else 10 ** 6)
    tier = _background_tier(rank, "shared", registrar)
    reached = tier.wait_ready(20, rows=3).rows
    dist.barrier()
    if rank == 0:
        open(gate, "w").close()
    full = tier.wait_ready(20)
    tier.close()
    return reached, full.full, full.rows == full.total


def test_readiness_crosses_nodes_through_the_store(tmp_path) -> None:
    outcomes = run_group(_two_nodes, 2, args=(str(tmp_path / "gate"),), nodes=["a", "b"],
                         timeout=90)
    for o in outcomes:
        assert o.ok, o.error
    assert [o.value for o in outcomes] == [(3, True, True)] * 2


def _jit_gates_rows(rank: int, gate: str) -> object:
    """The copy kernel's JIT is held at a gate: set-up waits for it (nothing is registered),
    no row is usable and a job is refused "not ready"; once it is compiled, all rows are."""
    import torch.distributed as dist

    from offload import CopyJob, OffloadError
    from offload.actor import RankActor

    def slow_jit(actor) -> None:
        deadline = time.monotonic() + 20
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)

    RankActor._compile_on_scratch = slow_jit  # the JIT's seam: compilation itself
    registrar = RecordingRegistrar()
    tier = _background_tier(rank, "private", registrar)
    time.sleep(0.3)
    held = (tier.ready.rows, tier.actor.ready_rows, registrar.calls)
    try:
        tier.submit(CopyJob(1, "store", (0,), (0,), (0,)))
        refused = None
    except OffloadError as exc:
        refused = str(exc)[:9]
    dist.barrier()  # both ranks looked before the JIT may finish
    if rank == 0:
        open(gate, "w").close()
    full = tier.wait_ready(20).full
    decided = _decide_all(tier, rank)
    tier.close()
    return held, refused, full, decided


def test_no_row_is_usable_before_the_copy_kernel_is_compiled(tmp_path) -> None:
    outcomes = run_group(_jit_gates_rows, 2, args=(str(tmp_path / "gate"),), timeout=90)
    for o in outcomes:
        assert o.ok, o.error
        held, refused, full, decided = o.value
        assert held == (0, 0, 0) and refused is None and full  # refused through the quorum
        assert decided == [(1, False, 0, "not ready")]


def _wants_fewer_than_a_stopped_rank_has(rank: int, gate: str) -> object:
    """Rank 1's set-up fails after 10 rows; rank 0 waits at a gate after 3.  Waiting for 5
    rows must not fail while rank 0 can still get there; waiting for all of them must."""
    import torch.distributed as dist

    from offload import OffloadError

    registrar = GatedRegistrar(gate, free=3 if rank == 0 else 10 ** 6,
                               fail_at=10 if rank == 1 else None)
    tier = _background_tier(rank, "shared", registrar)
    if rank == 0:
        deadline = time.monotonic() + 20
        while not tier.ready.stopped and time.monotonic() < deadline:
            time.sleep(0.005)  # rank 1 has stopped at 10 rows; we are at 3
        threading.Timer(0.3, lambda: open(gate, "w").close()).start()
    dist.barrier()
    some = tier.wait_ready(20, rows=5).rows
    try:
        tier.wait_ready(20)
        everything = "full"
    except OffloadError as exc:
        everything = str(exc)[:43]
    tier.close()
    return some, everything


def test_wait_ready_waits_for_rows_a_stopped_rank_still_covers(tmp_path) -> None:
    outcomes = run_group(_wants_fewer_than_a_stopped_rank_has, 2,
                         args=(str(tmp_path / "gate"),), timeout=90)
    for o in outcomes:
        assert o.ok, o.error
        some, everything = o.value
        assert 5 <= some <= 10  # reached although rank 1 had stopped (at 10 rows)
        assert everything == "background set-up stopped on ranks [1] with"


def test_a_promotion_into_a_row_not_set_up_is_refused_before_any_read() -> None:
    from types import SimpleNamespace

    from offload import OffloadError, fs_actions

    class NoReads:
        def promote(self, reads, generation, spills):  # pragma: no cover - never reached
            raise AssertionError("read into a row that is not set up")

    plan = SimpleNamespace(chunk_count=8, page_size=4096)
    actor = SimpleNamespace(files=NoReads(), ready_rows=4, topology=SimpleNamespace(rank=1),
                            _installed=lambda: plan)
    with pytest.raises(OffloadError, match="not ready: a promotion reads into chunk 4, but "
                                           "rank 1 has only rows below 4"):
        fs_actions.promote(actor, [], [("a", 3), ("b", 4)], 7)


class _CountsAsPinned(RecordingRegistrar):
    counts_as_pinned = True


def _mixed_pinning(rank: int) -> object:
    from offload import OffloadError

    registrar = _CountsAsPinned() if rank == 0 else RecordingRegistrar()
    try:
        _background_tier(rank, "shared", registrar).close()
        return "created"
    except OffloadError as exc:
        return str(exc)


def test_a_group_where_only_some_ranks_can_pin_is_refused_in_background() -> None:
    outcomes = run_group(_mixed_pinning, 2, timeout=60)
    assert "ranks [1] cannot pin host memory" in outcomes[0].value
    assert "drop --background-setup" in outcomes[0].value
    assert outcomes[1].value != "created"  # the workers fail with rank 0's abort


def _last_rows_while_sharing(rank: int, gate: str) -> object:
    """Rank 1 (the leader of its node) finishes set-up between sharing its node's words and
    reading them, then stops polling: rank 0, on the other node, must still learn the last
    rows -- the leader shares again what it read."""
    import torch.distributed as dist

    from offload.control.quorum import Quorum

    registrar = GatedRegistrar(gate, free=3 if rank == 1 else 10 ** 6)
    tier = _background_tier(rank, "shared", registrar)
    tier.wait_ready(20, rows=3)
    deadline = time.monotonic() + 20
    while rank == 0 and tier.actor.ready_rows < tier.plan.chunk_count:  # only rank 1 lags
        assert time.monotonic() < deadline, "rank 0 never set up its rows"
        time.sleep(0.005)
    dist.barrier()
    if rank == 1:
        plain, armed = Quorum.share, [True]

        def share_then_finish(quorum) -> None:
            plain(quorum)
            if armed.pop() if armed else False:  # once: the last rows land right after
                open(gate, "w").close()
                deadline = time.monotonic() + 20
                while tier.actor.ready_rows < tier.plan.chunk_count and \
                        time.monotonic() < deadline:
                    time.sleep(0.005)

        Quorum.share = share_then_finish
        seen = tier.ready.full  # one look, then no more polling until close
        dist.barrier()
    else:
        try:
            seen = tier.wait_ready(10).full
        except Exception as exc:
            seen = str(exc)[:60]
        dist.barrier()
    tier.close()
    return seen


def test_a_leader_that_stops_polling_still_shares_the_last_rows_it_saw(tmp_path) -> None:
    outcomes = run_group(_last_rows_while_sharing, 2, args=(str(tmp_path / "gate"),),
                         nodes=["a", "b"], timeout=90)
    for o in outcomes:
        assert o.ok, o.error
    assert [o.value for o in outcomes] == [True, True]


class _TimedRegistrar(RecordingRegistrar):
    """Records when its first registration began."""

    first_at: float | None = None

    def register(self, address: int, length: int) -> None:
        if self.first_at is None:
            self.first_at = time.perf_counter()
        super().register(address, length)


def _engine_then_set_up(rank: int) -> object:
    """Building the engine takes 0.3 s here: set-up must not start before it is built (its
    registrations would hold the CUDA driver against the engine's allocations)."""
    import offload.actor as actor_module

    made = actor_module.make_engine

    def slow_make_engine(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return made(*args, **kwargs)  # the JIT's scratch engine (on a GPU), not the tier's
        time.sleep(0.3)
        engine = made(*args, **kwargs)
        built_at.append(time.perf_counter())
        return engine

    built_at: list[float] = []
    actor_module.make_engine = slow_make_engine
    registrar = _TimedRegistrar()
    tier = _background_tier(rank, "shared", registrar)
    tier.wait_ready(20)
    report = tier.actor.report()
    tier.close()
    assert registrar.first_at is not None
    return registrar.first_at - built_at[-1], set(report["timings_s"]) >= {"first_row",
                                                                            "first_unit"}


def test_background_set_up_starts_once_the_engine_is_built() -> None:
    for o in run_group(_engine_then_set_up, 2, timeout=90):
        assert o.ok, o.error
        after_engine_s, timed = o.value
        assert after_engine_s >= 0 and timed


def _reserved_where(rank: int, mode: str, shm_dir: str, layout: str = "shared") -> object:
    """Background set-up of a region of 5 files (``layout`` shared: the node's; private: each
    rank's own memfds): what the creator's `BackgroundReservation` did
    (each file's state), and which threads called ``posix_fallocate`` (the reservation in
    `create`, or the Python loop's).  ``mode``: "ok"; "full" (the Python loop, whose every
    reservation fails with ENOSPC); "strict" (a host that refuses to overcommit, where a write
    fault on an unreserved memfd page would be a SIGBUS); "named" (files in ``shm_dir``, whose
    file system may lack fallocate)."""
    import errno

    import offload.region.background as background
    import offload.region.host_region as host_region

    calls: list[str] = []
    fallocate = os.posix_fallocate

    def recording(fd: int, offset: int, length: int) -> None:
        calls.append(threading.current_thread().name)
        if mode == "full":
            raise OSError(errno.ENOSPC, "stand-in: no space left")
        fallocate(fd, offset, length)

    os.posix_fallocate = recording
    if mode == "strict":
        host_region.strict_overcommit = lambda: True
    if mode == "full":
        background.native_populator = lambda: None
    files = {"shm_dir": shm_dir} if mode == "named" else {}
    if layout == "private":
        files["private_memory"] = "memfd"
    tier = _background_tier(rank, layout, RecordingRegistrar(), min_segment_bytes=64 << 10,
                            segment_threshold=128 << 10, **files)
    full = tier.wait_ready(20).full
    segments = tier.actor.report()["segments"]
    reservation = tier.actor.region._reservation
    deadline = time.monotonic() + 20
    while reservation is not None and any(t.is_alive() for t in reservation._threads):
        assert time.monotonic() < deadline, "the reservation never ended"
        time.sleep(0.005)
    states = reservation._state.tolist() if reservation is not None else None
    error = reservation.error if reservation is not None else None
    tier.close()
    return calls, full, error, segments, states


@pytest.mark.parametrize("mode", ["ok", "full", "strict", "named"])
def test_the_leader_reserves_the_node_files_behind_create(mode: str, shm_dir) -> None:
    """Background set-up leaves the memfds' reservation to the leader's threads, so `create`
    does not wait for it; a reservation that fails only logs (the pre-fault's faults allocate
    the rest); named files, and memfds on a host that refuses to overcommit, are reserved in
    `create` as before."""
    outcomes = run_group(_reserved_where, 2, args=(mode, str(shm_dir)), timeout=90)
    for o in outcomes:
        assert o.ok, o.error
    leader, peer = (o.value for o in outcomes)
    calls, full, error, segments, states = leader
    assert full and peer[1] and segments == 5
    assert peer[0] == [] and peer[4] is None  # peers reserve nothing
    if mode in ("strict", "named"):  # in create, every file
        assert states is None and len(calls) == segments
        assert not any(name.startswith("offload-bg-reserve") for name in calls)
    elif mode == "ok":  # in C, behind create: no posix_fallocate at all
        assert calls == [] and states == [1] * segments and error is None
    else:  # the Python loop, stopped at its first failure
        assert 1 <= len(calls) <= segments
        assert all(name.startswith("offload-bg-reserve") for name in calls)
        assert error is not None and "No space left" in error


def _set_up_threads(rank: int, layout: str, bound: bool) -> object:
    """A background tier asking for 8 pre-fault threads a rank, both ranks' set-up on the same
    8 CPUs, or (``bound``) each rank on 8 of its own: the threads its set-up and the creator's
    reservation started, and what the report says."""
    import offload.region.host_region as host_region

    cpus = frozenset(range(8 * rank, 8 * rank + 8) if bound else range(8))
    host_region.process_cpus = lambda: cpus  # the process's affinity
    memory = {"private_memory": "memfd"} if layout == "private" else {}
    tier = _background_tier(rank, layout, RecordingRegistrar(), prefault_threads=8,
                            min_segment_bytes=64 << 10, segment_threshold=128 << 10, **memory)
    try:
        region = tier.actor.region
        setup = region.background_setup
        assert setup is not None
        workers = sorted(role for role in setup.thread_ids().values())
        reservation = region._reservation
        reserving = len(reservation._threads) if reservation is not None else 0
        assert tier.wait_ready(20).full
        report = tier.actor.report()
        return workers.count("prefault"), reserving, report["setup_threads"], report["segments"]
    finally:
        tier.close()


@pytest.mark.parametrize("bound", [False, True])
@pytest.mark.parametrize("layout", ["private", "shared"])
def test_background_set_up_leaves_half_the_cpus_to_the_engine(layout: str, bound: bool) -> None:
    """Two ranks whose set-up runs on the same 8 CPUs: 2 pre-fault threads each, not the 8
    asked for; bound to 8 CPUs each: 4 each.  The rank that created memfds (each private rank
    of memfds, a node region's leader) reserves them on as many threads again, while that
    lasts."""
    outcomes = run_group(_set_up_threads, 2, args=(layout, bound), timeout=90)
    for o in outcomes:
        assert o.ok, o.error
    (workers0, reserving0, reported0, files0), (workers1, reserving1, reported1, files1) = (
        o.value for o in outcomes)
    threads = 4 if bound else 2
    assert workers0 == workers1 == reported0 == reported1 == threads
    assert reserving0 == min(threads, files0)  # one thread a file at most
    assert reserving1 == (min(threads, files1) if layout == "private" else 0)


def _replica_set_up_threads(rank: int) -> object:
    """Two DP replicas of one rank each on one node of 8 usable CPUs: the pre-fault threads
    each replica's tier ran (its own group sees one rank on the node; torchrun's
    ``LOCAL_WORLD_SIZE`` says two processes run here)."""
    import torch.distributed as dist

    import offload.region.host_region as host_region
    from offload import HostTier

    host_region.process_cpus = lambda: frozenset(range(8))
    groups = [dist.new_group([r]) for r in range(2)]  # collective: every rank makes both
    config = TierConfig(cpu_bytes_per_node=40 * PAGE, layout="private", blocks_per_chunk=1,
                        tp=1, timeout_s=20, background=True, prefault_threads=8)
    tier = HostTier.create(_kv(rank), config, group=groups[rank],
                           registrar_factory=lambda device: RecordingRegistrar())
    try:
        assert tier.wait_ready(20).full
        return os.environ["LOCAL_WORLD_SIZE"], tier.actor.report()["setup_threads"]
    finally:
        tier.close()


def test_dp_replicas_on_one_node_share_half_its_cpus() -> None:
    """Each replica's tier counts every process on the node, not only its group's ranks:
    2 threads each (8 CPUs, 2 processes), not 4."""
    for o in run_group(_replica_set_up_threads, 2, timeout=90):
        assert o.ok, o.error
        assert o.value == ("2", 2)


@pytest.mark.parametrize("mode", ["ok", "strict"])
def test_a_private_ranks_memfds_are_reserved_behind_create(mode: str, shm_dir) -> None:
    """Private regions of memfds (``private_memory="memfd"``): each rank reserves its own files
    on its own threads behind `create`, as a node leader does; on a host that refuses to
    overcommit, in `create`."""
    outcomes = run_group(_reserved_where, 2, args=(mode, str(shm_dir), "private"), timeout=90)
    for o in outcomes:
        assert o.ok, o.error
        calls, full, error, segments, states = o.value
        assert full and segments >= 2
        if mode == "strict":
            assert states is None and len(calls) == segments
        else:
            assert calls == [] and states == [1] * segments and error is None


def _blocking_jit_order(rank: int, layout: str) -> object:
    """A blocking create with a slow JIT: when it ended, and when the first registration
    began."""
    from offload import HostTier
    from offload.actor import RankActor

    ended: list[float] = []

    def slow_jit(actor) -> None:
        time.sleep(1.0)
        ended.append(time.perf_counter())

    RankActor._compile_on_scratch = slow_jit  # the JIT's seam: compilation itself
    registrar = _TimedRegistrar()
    config = TierConfig(cpu_bytes_per_node=40 * PAGE * 2, layout=layout, blocks_per_chunk=1,
                        tp=2, timeout_s=20)
    tier = HostTier.create(_kv(rank), config, registrar_factory=lambda device: registrar)
    tier.close()
    assert registrar.first_at is not None
    return registrar.first_at - ended[0]


@pytest.mark.parametrize("layout", ["private", "shared"])
def test_a_blocking_private_region_is_set_up_after_the_jit_and_a_node_region_beside_it(
        layout) -> None:
    """A private rank's long registrations hold the CUDA driver the JIT needs (beside them
    it took up to 16x longer), so its region is set up once the kernel is compiled; the node
    layouts keep the JIT beside their set-up, where it costs them nothing."""
    for o in run_group(_blocking_jit_order, 2, args=(layout,), timeout=90):
        assert o.ok, o.error
        if layout == "private":
            assert o.value >= 0  # registered after the JIT ended
        else:
            assert o.value < -0.5  # registered while the JIT still ran


@pytest.mark.parametrize(("background", "setup_context"), [(True, True), (True, False),
                                                            (False, True)])
def test_the_tier_asks_for_a_registrar_context_of_its_own_only_for_background_setup(
        background: bool, setup_context: bool) -> None:
    """With no registrar factory the tier picks `choose_registrar`, which makes the CUDA
    registrar's own context for background set-up with ``setup_context`` and for nothing
    else; the region closes the registrar it was given when the tier closes."""

    def body(rank: int) -> tuple[list[bool], bool]:
        import offload.actor as actor
        from offload import HostTier

        asked: list[bool] = []
        made: list[RecordingRegistrar] = []

        class Closing(RecordingRegistrar):
            closed = False

            def close(self) -> None:
                self.closed = True

        def spy(device: object, own_context: bool = False) -> RecordingRegistrar:
            asked.append(own_context)
            made.append(Closing())
            return made[-1]

        actor.choose_registrar = spy  # type: ignore[assignment]
        config = TierConfig(cpu_bytes_per_node=64 * MiB, layout="private", blocks_per_chunk=1,
                            tp=2, timeout_s=20, background=background,
                            setup_context=setup_context)
        tier = HostTier.create(_kv(rank), config)
        tier.wait_ready(20)
        tier.close()
        return asked, all(r.closed for r in made)

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]
    for asked, closed in (o.value for o in out):
        assert asked == [background and setup_context] and closed
