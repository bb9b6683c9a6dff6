"""HostRegion end to end: real processes (gloo groups), real /dev/shm files, real mappings.

Regions are a few MiB with MiB-sized segment thresholds so every layout gets several files.
Each test checks that /dev/shm holds nothing new afterwards.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from offload.config import TierConfig
from offload.errors import OffloadError
from offload.plan import Plan, RankDescriptor, compute_plan
from offload.region import HostRegion, RecordingRegistrar
from offload.region.pin import Registrar
from offload.topology import NodeInfo, Topology
from tests.harness import Outcome, run_group, shm_entries
from tests.test_region_prefault import resident_bytes

KiB, MiB = 1 << 10, 1 << 20
PAGES = (4 * KiB, 8 * KiB)  # two KV tensors per rank
SLOW_PAGES = (12 * KiB, 4 * KiB)


def tier_config(layout: str, cpu_bytes: int, tp: int = 1, **overrides: Any) -> TierConfig:
    settings: dict[str, Any] = dict(
        cpu_bytes_per_node=cpu_bytes, layout=layout, blocks_per_chunk=4, tp=tp,
        segment_threshold=1 * MiB, min_segment_bytes=512 * KiB, max_segments=4,
        prefault_threads=2)
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
                 **overrides: Any) -> tuple[HostRegion, Plan, RecordingRegistrar]:
    """Inside a run_group rank: discover, agree on a plan, create the region."""
    import torch.distributed as dist

    from offload.topology import discover

    world = dist.get_world_size()
    topology = discover(tp=world // pp, pp=pp)
    config = tier_config(layout, cpu_bytes, tp=world // pp, pp=pp, **overrides)
    mine = RankDescriptor(rank, topology.node_id, topology.local_rank,
                          topology.local_world_size, topology.tp_rank, topology.pp_rank,
                          tuple(pages(rank)), config)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    plan = compute_plan(everyone)
    registrar = RecordingRegistrar()
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


def job_files(job_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if job_id in n]


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

def test_private_region_is_unlinked_at_once_and_maps_every_segment(job: str) -> None:
    region = single_rank_region("private", 3 * MiB, job_id=job)
    try:
        assert region.stats.segments > 1 and job_files(job) == []
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


# ---------------------------------------------------------------- shared / replicated

def _shared_body(rank: int, job_id: str) -> dict[str, Any]:
    import torch.distributed as dist

    created = counting_creates(rank)
    region, plan, registrar = group_region(rank, job_id, "shared", 3 * MiB,
                                           pages=lambda r: PAGES if r == 0 else SLOW_PAGES)
    try:
        left = job_files(job_id)
        resident = resident_bytes(region.address, region.size)
        fill_own_slot(region)
        dist.barrier()
        # Both ranks' bytes, read through this rank's own mapping of the shared files.
        same = torch.equal(region.tensor, expected_region(plan, [0, 1], region.size))
        slot = plan.slots[rank]
        return {"created": bool(created), "left": left, "same": same,
                "segments": region.stats.segments,
                "registered": sorted((a - region.address, n)
                                     for a, n in registrar.registered.items()),
                "slot": (slot.slot_offset, slot.slot_bytes, plan.row_stride(rank),
                         plan.chunk_count),
                "prefault": region.stats.prefault_bytes,
                "resident": resident}
    finally:
        dist.barrier()
        region.close()


def test_shared_one_creator_and_each_rank_lands_in_its_slot(job: str) -> None:
    out = run_group(_shared_body, 2, args=(job,))
    assert all(o.ok for o in out), errors(out)
    values = [o.value for o in out]
    assert [v["created"] for v in values] == [True, False]
    for v in values:
        assert v["left"] == [] and v["same"] and v["segments"] > 1
        offset, size, stride, rows = v["slot"]
        # one registration per row over exactly this rank's slot
        assert v["registered"] == [(r * stride + offset, size) for r in range(rows)]
        assert v["prefault"] == v["resident"] == rows * size


def _replicated_body(rank: int, job_id: str) -> dict[str, Any]:
    import torch.distributed as dist

    region, _plan, registrar = group_region(rank, job_id, "replicated", 3 * MiB)
    try:
        resident = resident_bytes(region.address, region.size)
        if rank == 0:  # the single writer
            fill_own_slot(region)
        dist.barrier()
        seen = torch.equal(region.tensor, expected_region(region.plan, [0], region.size))
        return {"resident": resident, "prefault": region.stats.prefault_bytes,
                "size": region.size, "seen": seen,
                "registered": sum(registrar.registered.values())}
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
    real_create = hr.create_segments

    def counting_create(*args: Any, **kwargs: Any) -> list[int]:
        created.append(rank)
        return real_create(*args, **kwargs)

    hr.create_segments = counting_create
    return created


def _two_nodes_body(rank: int, job_id: str) -> tuple[bool, int]:
    created = counting_creates(rank)
    region, _plan, _reg = group_region(rank, job_id, "shared", 2 * MiB)
    try:
        return bool(created), region.size
    finally:
        region.close()


def test_each_simulated_node_has_its_own_leader_and_files(job: str) -> None:
    out = run_group(_two_nodes_body, 2, args=(job,), nodes=["a", "b"])
    assert all(o.ok for o in out), errors(out)
    assert [o.value[0] for o in out] == [True, True]


# ---------------------------------------------------------------- failures

def _failing_joiner_body(rank: int, job_id: str) -> None:
    import offload.region.host_region as hr

    if rank == 1:
        def broken_open(path: str, length: int) -> int:
            raise OffloadError(f"injected failure opening {path}")

        hr.open_segment = broken_open
    group_region(rank, job_id, "shared", 2 * MiB)


def test_a_rank_failing_mid_protocol_fails_every_peer_cleanly(job: str) -> None:
    start = time.monotonic()
    out = run_group(_failing_joiner_body, 2, args=(job,), pg_timeout=10)
    assert time.monotonic() - start < 20
    assert [o.error_type for o in out] == ["PeerError", "OffloadError"]
    first = errors(out)
    assert "rank 1 failed while mapping the node's region" in first[0]
    assert "injected failure opening" in first[0]


def _killed_leader_body(rank: int, job_id: str) -> None:
    import offload.region.host_region as hr

    if rank == 0:
        real_create = hr.create_segments

        def create_then_die(*args: Any, **kwargs: Any) -> list[int]:
            real_create(*args, **kwargs)
            assert job_files(job_id)
            os.kill(os.getpid(), signal.SIGKILL)
            raise AssertionError("unreachable")

        hr.create_segments = create_then_die
    group_region(rank, job_id, "shared", 2 * MiB)


def test_a_leader_killed_after_creating_files_leaves_nothing(job: str) -> None:
    start = time.monotonic()
    out = run_group(_killed_leader_body, 2, args=(job,), pg_timeout=10, timeout=40)
    assert time.monotonic() - start < 30
    assert out[0].exitcode == -signal.SIGKILL
    assert out[1].exitcode not in (0, None) and out[1].error_type == "PeerError"
    assert "stopped answering" in errors(out)[1]


def _too_big_body(rank: int, job_id: str, budget: int) -> None:
    group_region(rank, job_id, "shared", budget, max_segments=32)


def test_shm_too_small_is_a_clear_error_before_anything_is_created(job: str) -> None:
    st = os.statvfs("/dev/shm")
    budget = 2 * st.f_bavail * st.f_frsize
    out = run_group(_too_big_body, 2, args=(job, budget))
    assert [o.error_type for o in out] == ["OffloadError", "PeerError"]
    leader, peer = errors(out)
    assert leader.startswith("/dev/shm has") and "lower --cpu-bytes or enlarge the mount" \
        in leader
    assert peer.startswith("rank 0 failed while creating the node's region files: /dev/shm has")


def test_a_symlink_at_a_region_path_is_refused(job: str) -> None:
    link = f"/dev/shm/offload-{job}-L0-s0"
    os.symlink("/tmp/not-yours", link)
    try:
        out = run_group(_too_big_body, 2, args=(job, 2 * MiB))
        assert [o.error_type for o in out] == ["OffloadError", "PeerError"]
        assert f"{link} is already a symbolic link" in errors(out)[0]
        assert os.path.islink(link)  # left alone: it is not ours
    finally:
        os.unlink(link)
