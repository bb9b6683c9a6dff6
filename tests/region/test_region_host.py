"""HostRegion end to end: real processes (gloo groups), real memfds or shm files, real mappings.

Regions are a few MiB with MiB-sized segment thresholds so every layout gets several files.
Tests run nameless (the default) and, where the protocol differs, with named files in a private
shm directory (``--shm-dir``); each checks that nothing of its job is left afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import resource
import signal
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from offload.config import TierConfig
from offload.control.plan import Plan, RankDescriptor, compute_plan
from offload.control.topology import NodeInfo, Topology
from offload.errors import OffloadError
from offload.region import HostRegion, RecordingRegistrar
from offload.region.hugepages import shmem_huge_mode, small_page_hint
from offload.region.pin import Registrar
from tests.harness import Outcome, run_group, shm_entries
from tests.region.test_region_prefault import all_pages_mapped, resident_bytes

KiB, MiB = 1 << 10, 1 << 20
PAGES = (4 * KiB, 8 * KiB)  # two KV tensors per rank
SLOW_PAGES = (12 * KiB, 4 * KiB)


def tier_config(layout: str, cpu_bytes: int, tp: int = 1, **overrides: Any) -> TierConfig:
    # no checksum trailer: these tests check region geometry against the plain page math
    settings: dict[str, Any] = dict(
        cpu_bytes_per_node=cpu_bytes, layout=layout, blocks_per_chunk=4, tp=tp,
        segment_threshold=1 * MiB, min_segment_bytes=512 * KiB, max_segments=4,
        prefault_threads=2, integrity=False)
    settings.update(overrides)
    return TierConfig(**settings)


def single_rank_region(layout: str, cpu_bytes: int, registrar: Registrar | None = None,
                       job_id: str = "solo", **overrides: Any) -> HostRegion:
    """A private region needs no process group: build it in this process."""
    config = tier_config(layout, cpu_bytes, **overrides)
    plan = compute_plan([RankDescriptor(0, "n0", 0, 1, 0, 0, PAGES, config)])
    topology = Topology(0, 1, 1, 1, (NodeInfo("n0", (0,)),))
    return HostRegion.create(plan, topology, config, job_id, registrar or RecordingRegistrar())


def group_region(rank: int, job_id: str, layout: str, cpu_bytes: int,
                 pages: Callable[[int], Sequence[int]] = lambda rank: PAGES, pp: int = 1,
                 registrar: RecordingRegistrar | None = None,
                 **overrides: Any) -> tuple[HostRegion, Plan, RecordingRegistrar]:
    """Inside a run_group rank: discover, agree on a plan, create the region."""
    import torch.distributed as dist

    from offload.control.topology import discover

    world = dist.get_world_size()
    topology = discover(tp=world // pp, pp=pp)
    config = tier_config(layout, cpu_bytes, tp=world // pp, pp=pp, **overrides)
    mine = RankDescriptor(rank, topology.node_id, topology.local_rank,
                          topology.local_world_size, topology.tp_rank, topology.pp_rank,
                          tuple(pages(rank)), config)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    plan = compute_plan(everyone)
    registrar = registrar or RecordingRegistrar()
    return HostRegion.create(plan, topology, config, job_id, registrar), plan, registrar


def pattern(rank: int, t: int, chunk: int, block: int) -> int:
    return (rank * 37 + t * 11 + chunk * 3 + block) % 251 + 1


def fill_own_slot(region: HostRegion) -> None:
    for t in range(len(region.plan.slots[region.rank].page_bytes)):
        view = region.tensor_view(t)
        for chunk in range(view.shape[0]):
            for block in range(view.shape[1]):
                view[chunk, block].fill_(pattern(region.rank, t, chunk, block))


def expected_region(plan: Plan, ranks: Sequence[int], size: int) -> torch.Tensor:
    """The bytes ranks' fills must produce, placed by explicit offset arithmetic (rows, slot
    offset, tensor-major inside the slot) rather than by the view under test."""
    expected = torch.zeros(size, dtype=torch.uint8)
    for q in ranks:
        slot = plan.slots[q]
        for t, page in enumerate(slot.page_bytes):
            for chunk in range(plan.chunk_count):
                for block in range(plan.blocks_per_chunk):
                    start = (chunk * plan.row_stride(q) + slot.slot_offset
                             + slot.tensor_offsets[t] + block * page)
                    expected[start:start + page] = pattern(q, t, chunk, block)
    return expected


def job_files(job_id: str, directory: str = "/dev/shm") -> list[str]:
    return [n for n in os.listdir(directory) if job_id in n]


def memfd_mappings(job_id: str) -> set[str]:
    """The job's nameless files this process maps (``/proc/self/maps`` shows memfds as
    ``/memfd:<name> (deleted)``)."""
    with open("/proc/self/maps") as f:
        return {line.split()[-2] for line in f if f"/memfd:offload-{job_id}" in line}


@pytest.fixture(params=["nameless", "named"])
def mode(request: pytest.FixtureRequest, shm_dir: str) -> dict[str, Any]:
    """Config overrides of each kind of region file: nameless memfds or files in a private
    shm directory (checked empty afterwards by the ``shm_dir`` fixture)."""
    return {} if request.param == "nameless" else {"shm_dir": shm_dir}


@pytest.fixture
def job() -> Iterator[str]:
    """A fresh job id; afterwards /dev/shm must hold no new entry of this job.  (Only this
    job's names are compared: parallel test workers and multiprocessing's own semaphores come
    and go in /dev/shm meanwhile.)"""
    before = shm_entries()
    job_id = uuid.uuid4().hex[:12]
    yield job_id
    assert {n for n in shm_entries() - before if job_id in n} == set()


def errors(outcomes: list[Outcome]) -> list[str]:
    return [(o.error or "").split("\n", 1)[0] for o in outcomes]


# ---------------------------------------------------------------- private, in this process

def test_private_region_is_nameless_or_unlinked_and_maps_every_segment(
        job: str, mode: dict[str, Any]) -> None:
    region = single_rank_region("private", 3 * MiB, job_id=job, private_memory="memfd", **mode)
    try:
        assert region.stats.memory == ("file" if mode else "memfd")
        assert region.stats.segments > 1 and job_files(job, mode.get("shm_dir", "/dev/shm")) == []
        memfds = memfd_mappings(job)
        assert memfds == ({f"/memfd:offload-{job}-r0-s{i}" for i in range(region.stats.segments)}
                          if not mode else set())
        assert region.size == region.stats.region_bytes == region.geometry.total_bytes
        assert region.stats.prefault_bytes == region.size
        assert resident_bytes(region.address, region.size) == region.size
        fill_own_slot(region)
        assert torch.equal(region.tensor, expected_region(region.plan, [0], region.size))
        view = region.tensor_view(1)
        assert view.shape == (region.plan.chunk_count, 4, PAGES[1])
    finally:
        region.close()
    region.close()  # idempotent
    assert region.size == 0 and region.tensor.numel() == 0


def test_memfd_regions_report_the_shmem_mode_and_the_leader_logs_the_fix(
        job: str, caplog: pytest.LogCaptureFixture) -> None:
    """A memfd region reports the host's ``shmem_enabled`` mode; where that gives 4 KiB pages
    the node leader (here the only rank) logs how to get huge pages, once.  Anonymous memory
    reports no mode."""
    caplog.set_level(logging.INFO, logger="offload")
    for memory in ("memfd", "anonymous"):
        region = single_rank_region("private", 3 * MiB, job_id=job, private_memory=memory)
        region.close()
        mode = shmem_huge_mode() if memory == "memfd" else None
        assert region.stats.shmem_huge == mode
    hint = small_page_hint(shmem_huge_mode())
    logged = [r.getMessage() for r in caplog.records if "shmem_enabled" in r.getMessage()]
    assert logged == ([f"rank 0: {hint}"] if hint else [])


def vm_flags(address: int) -> set[str]:
    """The ``VmFlags`` of the mapping that starts at ``address`` (``/proc/self/smaps``)."""
    start = f"{address:x}-"
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            if "-" in line.split()[0] and not line.startswith("VmFlags"):
                inside = line.startswith(start)
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping starts at {address:#x}")


def test_private_region_by_default_is_anonymous_huge_page_memory_kept_from_forks(
        job: str) -> None:
    """No file at all (nothing in /dev/shm, no memfd), one mapping advised for transparent
    huge pages ("hg") and not copied into forked children ("dc"); a forked child that reads
    it dies instead of reading pages copy-on-write."""
    region = single_rank_region("private", 3 * MiB, job_id=job)
    try:
        assert region.stats.memory == "anonymous" and region.stats.segments == 1
        assert job_files(job) == [] and memfd_mappings(job) == set()
        assert {"hg", "dc"} <= vm_flags(region.address)
        assert resident_bytes(region.address, region.size) == region.size == \
            region.geometry.total_bytes
        fill_own_slot(region)
        assert torch.equal(region.tensor, expected_region(region.plan, [0], region.size))
        pid = os.fork()
        if pid == 0:  # the child: the range is not mapped here
            faulthandler.disable()  # dying is the expected outcome: no traceback, no core
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            ctypes.string_at(region.address, 1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    finally:
        region.close()
    assert region.size == 0


def test_an_unknown_private_memory_is_refused_in_one_line() -> None:
    with pytest.raises(OffloadError, match=r"private_memory \(--private-memory\) = 'hugetlb' "
                                           "is unknown; choose one of anonymous, memfd"):
        TierConfig(cpu_bytes_per_node=MiB, private_memory="hugetlb")


class ResidencyRegistrar(RecordingRegistrar):
    """Records, in order, each registration and whether this process had populated all of its
    pages then (pages another rank populated count only once this one touches them)."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[tuple[int, int, bool]] = []

    def register(self, address: int, length: int) -> None:
        self.order.append((address, length, all_pages_mapped(address, length)))
        super().register(address, length)


def test_private_registers_whole_ranges_after_pre_fault() -> None:
    registrar = ResidencyRegistrar()
    region = single_rank_region("private", 3 * MiB, registrar)
    try:
        assert [(a - region.address, n, full) for a, n, full in registrar.order] == [
            (0, region.size, True)]
    finally:
        region.close()


# ---------------------------------------------------------------- shared / replicated

def _shared_body(rank: int, job_id: str, mode: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    created = counting_creates(rank)
    registrar = ResidencyRegistrar()
    region, plan, _ = group_region(rank, job_id, "shared", 3 * MiB,
                                   pages=lambda r: PAGES if r == 0 else SLOW_PAGES,
                                   registrar=registrar, **mode)
    try:
        left = job_files(job_id, mode.get("shm_dir", "/dev/shm"))
        memfds = sorted(memfd_mappings(job_id))
        resident = resident_bytes(region.address, region.size)
        fill_own_slot(region)
        dist.barrier()
        # Both ranks' bytes, read through this rank's own mapping of the shared files.
        same = torch.equal(region.tensor, expected_region(plan, [0, 1], region.size))
        slot = plan.slots[rank]
        return {"created": bool(created), "left": left, "same": same, "memfds": memfds,
                "segments": region.stats.segments, "shmem_huge": region.stats.shmem_huge,
                "registered": sorted((a - region.address, n)
                                     for a, n in registrar.registered.items()),
                "slot": (slot.slot_offset, slot.slot_bytes, plan.row_stride(rank),
                         plan.chunk_count),
                "prefault": region.stats.prefault_bytes,
                "resident": resident,
                "populated": [full for _, _, full in registrar.order]}
    finally:
        dist.barrier()
        region.close()


def test_shared_one_creator_and_each_rank_lands_in_its_slot(job: str,
                                                            mode: dict[str, Any]) -> None:
    out = run_group(_shared_body, 2, args=(job, mode))
    assert all(o.ok for o in out), errors(out)
    values = [o.value for o in out]
    assert [v["created"] for v in values] == [True, False]
    for v in values:
        assert v["left"] == [] and v["same"] and v["segments"] > 1
        assert v["shmem_huge"] == (None if mode else shmem_huge_mode())  # reported for memfds
        # nameless: both ranks map the leader's memfds (handed over, not opened by name)
        assert v["memfds"] == ([] if mode else [f"/memfd:offload-{job}-L0-s{i}"
                                                for i in range(v["segments"])])
        offset, size, stride, rows = v["slot"]
        # one registration per row over exactly this rank's slot, each once its pages were in
        assert v["registered"] == [(r * stride + offset, size) for r in range(rows)]
        assert all(v["populated"]), v["populated"]
        assert v["prefault"] == v["resident"] == rows * size


def _replicated_body(rank: int, job_id: str) -> dict[str, Any]:
    import torch.distributed as dist

    registrar = ResidencyRegistrar()
    region, _plan, _ = group_region(rank, job_id, "replicated", 3 * MiB, registrar=registrar)
    try:
        resident = resident_bytes(region.address, region.size)
        if rank == 0:  # the single writer
            fill_own_slot(region)
        dist.barrier()
        seen = torch.equal(region.tensor, expected_region(region.plan, [0], region.size))
        return {"resident": resident, "prefault": region.stats.prefault_bytes,
                "size": region.size, "seen": seen,
                "registered": sum(registrar.registered.values()),
                "order": [(a - region.address, n, full) for a, n, full in registrar.order]}
    finally:
        dist.barrier()
        region.close()


def test_replicated_shards_cover_the_region_exactly_once(job: str) -> None:
    out = run_group(_replicated_body, 2, args=(job,))
    assert all(o.ok for o in out), errors(out)
    values = [o.value for o in out]
    size = values[0]["size"]
    # each rank faulted in exactly its own shard; together exactly the region
    assert [v["resident"] for v in values] == [v["prefault"] for v in values]
    assert sum(v["prefault"] for v in values) == size
    assert all(v["prefault"] > 0 for v in values)
    assert all(v["seen"] and v["registered"] == size for v in values)
    # whole rows after the node's exchange: pages the other rank populated are in by then
    assert all(len(v["order"]) == 1 and v["order"][0][:2] == (0, size) for v in values)


def _replicated_stages_body(rank: int, job_id: str) -> dict[str, Any]:
    """TP1 x PP2: each rank is its stage's writer and fills its stage's slot."""
    import torch.distributed as dist

    region, plan, registrar = group_region(rank, job_id, "replicated", 3 * MiB, pp=2,
                                           pages=lambda r: PAGES if r == 0 else SLOW_PAGES)
    try:
        resident = resident_bytes(region.address, region.size)
        fill_own_slot(region)
        dist.barrier()
        both = torch.equal(region.tensor, expected_region(plan, [0, 1], region.size))
        slot = plan.slots[rank]
        return {"resident": resident, "prefault": region.stats.prefault_bytes,
                "size": region.size, "both": both,
                "registered": sorted((a - region.address, n)
                                     for a, n in registrar.registered.items()),
                "slot": (slot.slot, slot.slot_offset, slot.slot_bytes, plan.row_stride(rank),
                         plan.chunk_count)}
    finally:
        dist.barrier()
        region.close()


def test_replicated_stages_have_their_own_slots_shards_cover_and_each_registers_its_slot(
        job: str) -> None:
    out = run_group(_replicated_stages_body, 2, args=(job,))
    assert all(o.ok for o in out), errors(out)
    values = [o.value for o in out]
    size = values[0]["size"]
    assert [v["resident"] for v in values] == [v["prefault"] for v in values]
    assert sum(v["prefault"] for v in values) == size  # shards of the whole region
    assert all(v["both"] for v in values)  # the two stages' bytes side by side, intact
    stage0, stage1 = values[0]["slot"], values[1]["slot"]
    assert stage0[:3] == (0, 0, 4 * 12 * KiB) and stage1[:3] == (1, 4 * 12 * KiB, 4 * 16 * KiB)
    for v in values:
        _, offset, length, stride, rows = v["slot"]
        assert stride == 4 * 28 * KiB and size == rows * stride
        assert v["registered"] == [(r * stride + offset, length) for r in range(rows)]


def counting_creates(rank: int) -> list[int]:
    """Record (in the returned list) every time this rank creates region files."""
    import offload.region.host_region as hr

    created: list[int] = []
    real_create = hr._Files.create

    def counting_create(*args: Any, **kwargs: Any) -> list[int]:
        created.append(rank)
        return real_create(*args, **kwargs)

    hr._Files.create = counting_create  # type: ignore[method-assign]
    return created


def _two_nodes_body(rank: int, job_id: str) -> tuple[bool, int]:
    created = counting_creates(rank)
    region, _plan, _reg = group_region(rank, job_id, "shared", 2 * MiB)  # nameless: 2 sockets
    try:
        return bool(created), region.size
    finally:
        region.close()


def test_each_simulated_node_has_its_own_leader_and_files(job: str) -> None:
    out = run_group(_two_nodes_body, 2, args=(job,), nodes=["a", "b"])
    assert all(o.ok for o in out), errors(out)
    assert [o.value[0] for o in out] == [True, True]


# ---------------------------------------------------------------- failures

def _failing_joiner_body(rank: int, job_id: str, mode: dict[str, Any]) -> None:
    import offload.region.host_region as hr

    if rank == 1:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise OffloadError(f"injected failure receiving {args[0]}")

        if mode:
            hr.open_segment = broken
        else:
            hr.fetch_fds = broken
    group_region(rank, job_id, "shared", 2 * MiB, **mode)


def test_a_rank_failing_mid_protocol_fails_every_peer_cleanly(job: str,
                                                              mode: dict[str, Any]) -> None:
    start = time.monotonic()
    out = run_group(_failing_joiner_body, 2, args=(job, mode), pg_timeout=10)
    assert time.monotonic() - start < 20
    assert [o.error_type for o in out] == ["PeerError", "OffloadError"]
    first = errors(out)
    assert "rank 1 failed while handing the node's region over and mapping it" in first[0]
    assert "injected failure receiving" in first[0]


def _dying_leader_body(rank: int, job_id: str, mode: dict[str, Any], where: str) -> None:
    import offload.region.host_region as hr

    if rank == 0 and where == "created":
        real_create = hr._Files.create

        def create_then_die(*args: Any, **kwargs: Any) -> list[int]:
            real_create(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
            raise AssertionError("unreachable")

        hr._Files.create = create_then_die  # type: ignore[method-assign]
    if rank == 0 and where == "handing out":
        def die(*args: Any, **kwargs: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        hr.FdOffer.hand_out = die  # type: ignore[method-assign]
    group_region(rank, job_id, "shared", 2 * MiB, **mode)


@pytest.mark.parametrize("where", ["created", "handing out"])
def test_a_leader_killed_mid_protocol_leaves_nothing(job: str, mode: dict[str, Any],
                                                     where: str) -> None:
    if mode and where == "handing out":
        pytest.skip("named files are opened by name: there is no hand-out")
    start = time.monotonic()
    out = run_group(_dying_leader_body, 2, args=(job, mode, where), pg_timeout=10, timeout=40)
    assert time.monotonic() - start < 30
    assert out[0].exitcode == -signal.SIGKILL
    assert out[1].exitcode not in (0, None) and out[1].error_type == "PeerError"
    # after creation the peer learns it from the exchange; during the hand-out from the socket
    assert ("stopped answering" if where == "created" else "hand-off") in errors(out)[1]
    # named: the peer removes the dead leader's files (the shm_dir fixture checks)


def _rank_1_dies_in(rank: int, job_id: str, name: str, overrides: dict[str, Any]) -> None:
    """Rank 1 is SIGKILLed where ``host_region`` calls its ``name``; both build a shared
    region (with ``overrides``)."""
    import offload.region.host_region as hr

    if rank == 1:
        def die(*args: Any, **kwargs: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)
            raise AssertionError("unreachable")

        setattr(hr, name, die)
    region, _, _ = group_region(rank, job_id, "shared", 2 * MiB, timeout_s=60, **overrides)
    region.close()


def test_a_peer_killed_before_fetching_fails_the_leader_at_once(job: str) -> None:
    """The leader serves the hand-off on a thread and learns from the node exchange, not from
    waiting out its hand-off timeout (here 60 s)."""
    start = time.monotonic()
    out = run_group(_rank_1_dies_in, 2, args=(job, "fetch_fds", {}), pg_timeout=10,
                    timeout=40)
    assert time.monotonic() - start < 20
    assert out[1].exitcode == -signal.SIGKILL
    assert out[0].error_type == "PeerError"
    assert "stopped answering while handing the node's region over" in errors(out)[0]


def test_a_peer_killed_before_background_set_up_shares_its_cpus_fails_the_others(
        job: str) -> None:
    """Background set-up's exchange of the ranks' CPUs: a rank that dies before it fails its
    peers there at once (the collective breaks), never a hang."""
    start = time.monotonic()
    out = run_group(_rank_1_dies_in, 2, args=(job, "setup_cpus", {"background": True}),
                    pg_timeout=60, timeout=90)
    assert time.monotonic() - start < 20  # the collective broke: no group timeout waited out
    assert out[1].exitcode == -signal.SIGKILL
    assert out[0].error_type == "PeerError"
    assert "stopped answering while sharing out the node's CPUs" in errors(out)[0]


def _cpus_unreadable_body(rank: int, job_id: str) -> None:
    import offload.region.host_region as hr

    if rank == 1:
        def unreadable() -> frozenset[int]:
            raise OSError("stand-in: no affinity")

        hr.process_cpus = unreadable
    region, _, _ = group_region(rank, job_id, "shared", 2 * MiB, timeout_s=60, background=True)
    region.close()


def test_a_rank_that_cannot_say_its_cpus_fails_every_rank_at_once(job: str) -> None:
    """The CPU exchange is agreed like every node step: the rank whose part failed raises its
    error, its peers a `PeerError` naming it, without waiting out any timeout."""
    start = time.monotonic()
    out = run_group(_cpus_unreadable_body, 2, args=(job,), pg_timeout=60, timeout=90)
    assert time.monotonic() - start < 20
    assert out[1].error_type == "OSError" and "stand-in: no affinity" in errors(out)[1]
    assert out[0].error_type == "PeerError"
    assert "rank 1 failed while sharing out the node's CPUs" in errors(out)[0]


def _populating_share_body(rank: int, job_id: str, layout: str, pp: int,
                          max_slot_rows: int) -> object:
    region, _, registrar = group_region(rank, job_id, layout, 2 * MiB, pp=pp, background=True,
                                        max_slot_rows=max_slot_rows)
    try:
        setup = region.background_setup
        assert setup is not None
        region.start_setup()
        assert setup.wait(30) and setup.error is None, setup.error
        return setup.share, setup.ready_rows == region.plan.chunk_count
    finally:
        region.close()


@pytest.mark.parametrize(("layout", "pp", "max_slot_rows", "shares"), [
    ("replicated", 1, 65536, [(0, 2), (1, 2)]),  # one stage: both register its slots
    ("replicated", 2, 65536, [(0, 1), (0, 1)]),  # a stage each: own slots, own pages
    ("replicated", 2, 1, [(0, 2), (1, 2)]),      # whole rows: both stages' pages on each
    ("shared", 1, 65536, [(0, 1), (0, 1)]),      # a slot each
    ("shared", 1, 1, [(0, 2), (1, 2)]),          # whole rows: every rank every page
    ("private", 1, 1, [(0, 1), (0, 1)]),
])
def test_background_set_up_shares_the_writing_among_the_ranks_populating_the_same_pages(
        job: str, layout: str, pp: int, max_slot_rows: int, shares: list[tuple[int, int]]
) -> None:
    """Ranks that register the same pages (a replicated stage's, or a node's whose rows are
    registered whole) each write their own share of every range first; set-up completes."""
    out = run_group(_populating_share_body, 2, args=(job, layout, pp, max_slot_rows),
                    timeout=120)
    for o in out:
        assert o.ok, o.error
    assert [o.value for o in out] == [(share, True) for share in shares]


def _reservation_refused_body(rank: int, job_id: str) -> object:
    import offload.region.host_region as hr

    def refused(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("stand-in: no reservation")

    hr.BackgroundReservation = refused
    try:
        group_region(rank, job_id, "private", 2 * MiB, background=True, private_memory="memfd",
                     min_segment_bytes=64 << 10, segment_threshold=128 << 10)
    except RuntimeError as exc:
        error = str(exc)
    else:
        raise AssertionError("create went on without its reservation")
    left = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            left.append(os.readlink(f"/proc/self/fd/{fd}"))
    return error, [name for name in left if name.startswith("/memfd:offload")]


def test_a_reservation_that_cannot_be_made_leaves_no_descriptor(job: str) -> None:
    """The memfds and their duplicates for the reservation are all closed when the
    reservation itself cannot be made (an exception, an interrupt)."""
    for o in run_group(_reservation_refused_body, 1, args=(job,), timeout=60):
        assert o.ok, o.error
        assert o.value == ("stand-in: no reservation", [])


def _too_big_body(rank: int, job_id: str, budget: int, mode: dict[str, Any]) -> None:
    group_region(rank, job_id, "shared", budget, max_segments=32, **mode)


def test_too_little_memory_is_a_clear_error_before_anything_is_created(job: str) -> None:
    from offload.region.space import meminfo

    budget = 2 * meminfo()["MemAvailable"]
    out = run_group(_too_big_body, 2, args=(job, budget, {}))
    assert [o.error_type for o in out] == ["OffloadError", "PeerError"]
    leader, peer = errors(out)
    assert leader.startswith(f"the node's regions need {budget // 4096 * 4096} B") or \
        leader.startswith("the node's regions need"), leader
    assert "of memory is available (MemAvailable in /proc/meminfo); lower --cpu-bytes or " \
        "free memory" in leader
    assert peer.startswith("rank 0 failed while creating the node's region: the node's "
                           "regions need")


def test_a_full_shm_dir_is_a_clear_error_before_anything_is_created(job: str,
                                                                    shm_dir: str) -> None:
    st = os.statvfs(shm_dir)
    budget = 2 * st.f_bavail * st.f_frsize
    out = run_group(_too_big_body, 2, args=(job, budget, {"shm_dir": shm_dir}))
    assert [o.error_type for o in out] == ["OffloadError", "PeerError"]
    leader, peer = errors(out)
    assert leader.startswith(f"{shm_dir} has") and "lower --cpu-bytes or enlarge the mount" \
        in leader
    assert peer.startswith(f"rank 0 failed while creating the node's region: {shm_dir} has")


def _private_check_body(rank: int, job_id: str, available: int) -> int:
    import offload.region.space as space

    real = space.meminfo
    space.meminfo = lambda: {**real(), "MemAvailable": available}
    region, _plan, _reg = group_region(rank, job_id, "private", 4 * MiB)
    region.close()
    return region.stats.region_bytes


def test_private_regions_are_checked_together_against_the_nodes_memory(job: str) -> None:
    """Each rank's region (42 rows of 48 KiB) fits in 3 MiB; the node's two do not.
    (MemAvailable is faked: really exhausting this shared host's memory is not an option.)"""
    own = 42 * 48 * KiB
    out = run_group(_private_check_body, 2, args=(job, 3 * MiB))
    assert [o.error_type for o in out] == ["OffloadError", "PeerError"], errors(out)
    assert errors(out)[0].startswith(f"the node's regions need {2 * own} B (3.94 MiB) but only "
                                     "3145728 B (3.00 MiB) of memory is available")
    assert errors(out)[1].startswith("rank 0 failed while checking the node's memory")
    out = run_group(_private_check_body, 2, args=(job, 5 * MiB))
    assert all(o.ok for o in out) and [o.value for o in out] == [own, own]


def test_a_symlink_at_a_region_path_is_refused(job: str, shm_dir: str) -> None:
    link = f"{shm_dir}/offload-{job}-L0-s0"
    os.symlink("/tmp/not-yours", link)
    try:
        out = run_group(_too_big_body, 2, args=(job, 2 * MiB, {"shm_dir": shm_dir}))
        assert [o.error_type for o in out] == ["OffloadError", "PeerError"]
        assert f"{link} is already a symbolic link" in errors(out)[0]
        assert os.path.islink(link)  # left alone: it is not ours
    finally:
        os.unlink(link)
