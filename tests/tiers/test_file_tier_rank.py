"""One rank's file tier over real host rows (an anonymous mapping standing for the region):
spills from the row itself, promotions into another row, who keeps files, restart agreement."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from offload.config import TierConfig
from offload.control.plan import Plan, RankDescriptor, compute_plan
from offload.control.topology import NodeInfo, Topology
from offload.errors import OffloadError
from offload.integrity import move_sums, promotion_generation, trailer_bytes
from offload.tiers.rank_files import RankFiles, agree_on_files, disk_capacity, file_writers

KiB = 1 << 10
PAGE = 16 * KiB  # bytes of one block: slot = 16 blocks = 256 KiB


@pytest.fixture(params=["/tmp", "/dev/shm"])
def fs_dir(request: pytest.FixtureRequest) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="pytest-rankfiles-", dir=request.param)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _grid(layout: str, tp: int = 2, pp: int = 1) -> tuple[Plan, list[Topology]]:
    """One node of tp x pp ranks, 8 chunks."""
    world = tp * pp
    config = TierConfig(cpu_bytes_per_node=8 * world * 16 * PAGE, layout=layout, tp=tp, pp=pp)
    plan = compute_plan([RankDescriptor(r, "n0", r, world, r % tp, r // tp, (PAGE,), config)
                         for r in range(world)])
    nodes = (NodeInfo("n0", tuple(range(world))),)
    return plan, [Topology(r, world, tp, pp, nodes) for r in range(world)]


GENERATION = promotion_generation(7)  # the promotions' generation here


def _moved(plan: Plan, rank: int, slot_bytes: bytes, from_chunk: int, to_chunk: int,
           from_generations: object = 0) -> bytes:
    """``slot_bytes`` with its checksum trailer re-mixed from one chunk (its pages of
    ``from_generations``) to another under `GENERATION`: what a spill from ``from_chunk`` and
    a promotion into ``to_chunk`` leave (the pages unchanged)."""
    slot = plan.slots[rank]
    data = np.frombuffer(slot_bytes, dtype=np.uint8).copy()
    assert slot.trailer_offset is not None
    end = slot.trailer_offset + trailer_bytes(slot.page_bytes, plan.blocks_per_chunk)
    move_sums(data[slot.trailer_offset:end].view(np.uint64), slot.page_bytes,
              plan.blocks_per_chunk, slot.integrity_seed, (from_chunk, from_generations),
              (to_chunk, GENERATION))
    return data.tobytes()


class _Region:
    """Page-aligned host memory laid out like ``rank``'s region."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.map = mmap.mmap(-1, plan.region_bytes(rank))
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))


def _open(plan: Plan, topo: Topology, region: _Region, fs_dir: str, fs_bytes: int = 64 << 20,
          generations: np.ndarray | None = None) -> RankFiles:
    if generations is None:
        generations = np.zeros(plan.chunk_count * plan.blocks_per_chunk, dtype=np.int64)
    return RankFiles.open(plan, topo, fs_dir, fs_bytes, region.address, {"dtype": "uint8"},
                          generations)


def test_a_spilled_row_is_promoted_into_another_row_byte_exact(fs_dir: str) -> None:
    plan, topos = _grid("private")
    region = _Region(plan, 0)
    bpc = plan.blocks_per_chunk
    generations = np.zeros(plan.chunk_count * bpc, dtype=np.int64)
    stored = np.arange(bpc) + 11  # row 2's pages, each stored by another job
    generations[2 * bpc:3 * bpc] = stored
    files = _open(plan, topos[0], region, fs_dir, generations=generations)
    try:
        payload = os.urandom(plan.slots[0].slot_bytes)
        files.row(2)[:] = payload
        files.spill([(("k", 2), 2)])
        files.wait_rows([2])
        files.row(2)[:] = bytes(len(payload))  # the row is reused
        assert files.promote([(("k", 2), 5), (("never", 1), 6)], GENERATION) == [True, False]
        # the pages come back byte-exact; their checksums now name chunk 5 and the promotion
        assert bytes(files.row(5)) == _moved(plan, 0, payload, 2, 5, stored) != payload
        assert (generations[5 * bpc:7 * bpc] == GENERATION).all()  # both rows renewed
        files.discard([("k", 2)])
        assert files.promote([(("k", 2), 5)], GENERATION) == [False]
        report = files.to_json()
        assert report is not None and report["hits"] == 1 and report["misses"] == 2
    finally:
        files.close()
        region.map.close()


def test_shared_slots_spill_their_own_bytes_only(fs_dir: str) -> None:
    """In a node row of two slots, each rank writes and reads back only its own slot."""
    plan, topos = _grid("shared")
    region = _Region(plan, 0)  # one node region, both ranks map it
    ranks = [_open(plan, t, region, fs_dir) for t in topos]
    try:
        slot = plan.slots[0].slot_bytes
        row = memoryview(region.map)[: 2 * slot]
        row[:] = os.urandom(2 * slot)
        before = bytes(row)
        for files in ranks:
            files.spill([("k", 0)])
        for files in ranks:
            files.wait_rows([0])
        assert [f.promote([("k", 3)], GENERATION) for f in ranks] == [[True], [True]]
        third = memoryview(region.map)[3 * 2 * slot: 4 * 2 * slot]
        assert bytes(third) == (_moved(plan, 0, before[:slot], 0, 3)
                                + _moved(plan, 1, before[slot:], 0, 3))
        row.release()
        third.release()
    finally:
        for files in ranks:
            files.close()
        region.map.close()


def test_replicated_stage_writers_keep_files_and_the_others_none(fs_dir: str) -> None:
    plan, topos = _grid("replicated", tp=2, pp=2)
    assert file_writers(plan, topos[0]) == (0, 2)
    assert file_writers(_grid("private")[0], _grid("private")[1][0]) == (0, 1)
    region = _Region(plan, 1)
    files = _open(plan, topos[1], region, fs_dir)  # rank 1: stage 0, not its writer
    try:
        assert files.tier is None and files.stored_names() is None
        files.spill([("k", 0)])
        assert files.promote([("k", 1)], GENERATION) == [True] and files.to_json() is None
        bpc = plan.blocks_per_chunk  # renewed without files: it checks the writer's sums
        assert (files._generations[bpc:2 * bpc] == GENERATION).all()
        assert os.listdir(fs_dir) == []
    finally:
        files.close()
        region.map.close()


def test_capacity_is_one_for_all_writers_and_a_small_budget_is_one_line() -> None:
    plan, topos = _grid("private")
    file_bytes = plan.slots[0].slot_bytes + 4096
    assert disk_capacity(plan, topos[0], 10 * 2 * file_bytes) == 10
    with pytest.raises(OffloadError, match="holds no chunk"):
        disk_capacity(plan, topos[0], 2 * file_bytes - 1)


def test_a_restart_agrees_on_the_files_every_writer_has(fs_dir: str) -> None:
    plan, topos = _grid("private")
    regions = [_Region(plan, r) for r in range(2)]
    ranks = [_open(plan, t, g, fs_dir) for t, g in zip(topos, regions, strict=True)]
    for files in ranks:
        files.spill([(("a",), 0), (("b",), 1), (("c",), 2)])
    ranks[1].discard([("b",)])  # as if rank 1 had lost b's file
    for files in ranks:
        files.close()
    ranks = [_open(plan, t, g, fs_dir) for t, g in zip(topos, regions, strict=True)]
    try:
        names = agree_on_files([f.stored_names() for f in ranks] + [None])
        assert len(names) == 2
        for files in ranks:
            files.keep_only(names)
        assert [f.stored_keys() for f in ranks] == [[b"('a',)", b"('c',)"]] * 2
        assert agree_on_files([None]) == frozenset()
    finally:
        for files in ranks:
            files.close()
        for region in regions:
            region.map.close()


def test_the_config_checks_the_directory_and_the_budget(tmp_path: Path) -> None:
    MiB = 1 << 20
    ns = {"fs_namespace": "model-a@rev1"}
    assert TierConfig(cpu_bytes_per_node=MiB, fs_dir=str(tmp_path),
                      **ns).fs_bytes_per_node == 4 * MiB
    assert TierConfig(cpu_bytes_per_node=MiB, fs_dir=str(tmp_path), fs_bytes=3 * MiB,
                      **ns).fs_bytes_per_node == 3 * MiB
    assert TierConfig(cpu_bytes_per_node=MiB).fs_bytes_per_node == 0
    (tmp_path / "f").write_text("")
    cases = [({"fs_dir": str(tmp_path / "nope"), **ns},
              "fs_dir (--fs-tier) .*nope does not exist"),
             ({"fs_dir": str(tmp_path / "f"), **ns}, "fs_dir (--fs-tier) .*/f is not a directory"),
             ({"fs_bytes": MiB}, r"fs_bytes \(--fs-bytes\) = 1048576 is given without fs_dir"),
             ({"fs_dir": str(tmp_path), "fs_bytes": 0, **ns}, "= 0 is below its minimum 1"),
             ({"fs_dir": str(tmp_path), "fs_io_timeout_s": 0, **ns},
              r"fs_io_timeout_s \(--fs-io-timeout\) = 0 must be positive"),
             ({"fs_io_timeout_s": float("nan")}, "= nan must be positive"),
             ({"fs_dir": str(tmp_path)}, r"fs_dir \(--fs-tier\) is given but fs_namespace "
                                         r"\(--fs-namespace\) is not given; name what computes "
                                         "the KV"),
             ({"fs_dir": str(tmp_path), "fs_namespace": ""}, "fs_namespace .* is empty"),
             (ns, r"fs_namespace \(--fs-namespace\) = 'model-a@rev1' is given without fs_dir")]
    if os.geteuid() != 0:  # root may write into a 0500 directory
        ro = tmp_path / "ro"
        ro.mkdir(0o500)
        cases.append(({"fs_dir": str(ro), **ns}, "is not writable by uid"))
    for kw, needle in cases:
        with pytest.raises(OffloadError, match=needle.replace("(--fs-tier)", r"\(--fs-tier\)")):
            TierConfig(cpu_bytes_per_node=MiB, **kw)  # type: ignore[arg-type]
