# SPDX-License-Identifier: Apache-2.0
"""NUMA placement (offload/region/numa.py): the sysfs mapping on fake trees (GPUs on two nodes,
a device sysfs calls -1, no sysfs at all), the plan's choice of node per slot, the numa_maps
check on made-up text, and real placement on this machine's node 0 -- a mapping pre-faulted by
placed threads, and a whole tier whose ranks are told their GPU is on node 0."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from offload.config import TierConfig
from offload.control.plan import RankDescriptor, compute_plan
from offload.region.geometry import ByteRange
from offload.region.numa import (
    Placement,
    bytes_on_node,
    node_cpus,
    parse_cpulist,
    pci_numa_node,
)
from offload.region.prefault import prefault
from offload.system.shm import Mapping
from tests.harness import run_group

MiB = 1 << 20
ON_NODE0 = Path("/sys/devices/system/node/node0").is_dir()


@pytest.fixture
def fake_sysfs(tmp_path: Path) -> Path:
    """Two GPUs on node 0 and one on node 1, one device sysfs knows no node for."""
    for bus, node in {"0000:3b:00.0": 0, "0000:5e:00.0": 0, "0000:af:00.0": 1,
                      "0000:19:00.0": -1}.items():
        device = tmp_path / "bus/pci/devices" / bus
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{node}\n")
    for node, cpus in ((0, "0-3,8-11\n"), (1, "4-7,12-15\n")):
        (tmp_path / f"devices/system/node/node{node}").mkdir(parents=True)
        (tmp_path / f"devices/system/node/node{node}/cpulist").write_text(cpus)
    return tmp_path


def test_cpu_lists_parse() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5} and parse_cpulist("\n") == frozenset()


def test_gpus_map_to_their_nodes_and_cpus(fake_sysfs: Path) -> None:
    assert [pci_numa_node(b, fake_sysfs) for b in
            ("0000:3b:00.0", "0000:5E:00.0", "0000:af:00.0")] == [0, 0, 1]
    assert pci_numa_node("0000:19:00.0", fake_sysfs) is None  # -1: no placement
    assert pci_numa_node("0000:01:00.0", fake_sysfs) is None  # unknown device
    assert node_cpus(1, fake_sysfs) == {4, 5, 6, 7, 12, 13, 14, 15}
    placement = Placement.for_node(0, fake_sysfs)
    assert placement == Placement(0, frozenset({0, 1, 2, 3, 8, 9, 10, 11}))
    assert Placement.for_node(None, fake_sysfs) is None


def test_no_sysfs_means_no_placement(tmp_path: Path) -> None:
    assert pci_numa_node("0000:3b:00.0", tmp_path / "none") is None
    assert node_cpus(0, tmp_path / "none") == frozenset()


@pytest.mark.parametrize("layout,expected", [("private", [0, 1, 1, 0]),
                                             ("shared", [0, 1, 1, 0]),
                                             ("replicated", [0, 0, 1, 1])])
def test_the_plan_places_each_slot_on_its_gpus_node(layout: str, expected: list[int]) -> None:
    """TP2 x PP2 on one host, GPUs of ranks 0..3 on nodes 0, 1, 1, 0: a replicated stage's
    shared copy goes where its writer (the stage's lowest rank) is."""
    config = TierConfig(cpu_bytes_per_node=64 * MiB, layout=layout, tp=2, pp=2)
    nodes = [0, 1, 1, 0]
    plan = compute_plan([RankDescriptor(r, "h", r, 4, r % 2, r // 2, (4096,), config, nodes[r])
                         for r in range(4)])
    assert [s.numa_node for s in plan.slots] == expected


def test_bytes_on_node_reads_numa_maps() -> None:
    maps = ("7f0000000000-7f0000400000 rw-s 00000000 00:01 1 /memfd:offload (deleted)\n"
            "7f0000400000-7f0000800000 rw-s 00400000 00:01 1 /memfd:offload (deleted)\n"
            "7f1000000000-7f1000200000 rw-p 00000000 00:00 0\n")
    numa_maps = ("7f0000000000 default file=/memfd:offload dirty=1024 N0=1000 N1=24 "
                 "kernelpagesize_kB=4\n"
                 "7f0000400000 default file=/memfd:offload dirty=2 N1=2 kernelpagesize_kB=2048\n"
                 "7f1000000000 default anon=512 N0=512 kernelpagesize_kB=4\n")
    region = (0x7F0000000000, 0x800000)
    assert bytes_on_node(*region, 0, maps, numa_maps) == 1000 * 4096
    assert bytes_on_node(*region, 1, maps, numa_maps) == 24 * 4096 + 2 * (2 << 20)


@pytest.mark.skipif(not ON_NODE0, reason="no NUMA node 0 in sysfs")
def test_placed_threads_fault_their_pages_onto_the_node() -> None:
    placement = Placement.for_node(0)
    assert placement is not None
    mapping = Mapping.anonymous(16 * MiB)
    try:
        seen: list[set[int]] = []

        def enter() -> None:
            placement.enter()
            seen.append(os.sched_getaffinity(0))

        prefault(mapping.address, [ByteRange(0, 8 * MiB), ByteRange(8 * MiB, 8 * MiB)],
                 threads=2, on_thread_start=enter)
        assert seen and all(cpus == placement.cpus for cpus in seen)
        assert bytes_on_node(mapping.address, 16 * MiB, 0) == 16 * MiB
    finally:
        mapping.close()
    assert os.sched_getaffinity(0) != set() and threading.current_thread().name == "MainThread"


def _told_node0(rank: int, layout: str) -> object:
    import torch

    import offload.actor
    from offload import HostTier

    offload.actor.cuda_numa_node = lambda device: 0  # type: ignore[assignment]
    tier = HostTier.create([torch.ones((8, 4096), dtype=torch.uint8)],
                           TierConfig(cpu_bytes_per_node=8 * MiB, layout=layout, tp=2,
                                      blocks_per_chunk=4, timeout_s=20))
    report = tier.actor.report()
    tier.close()
    return report["numa_node"], report["numa_bytes"], report["prefault_bytes"]


@pytest.mark.skipif(not ON_NODE0, reason="no NUMA node 0 in sysfs")
@pytest.mark.parametrize("layout", ["private", "shared"])
def test_a_tier_places_and_reports_its_pages_on_the_gpus_node(layout: str) -> None:
    out = run_group(_told_node0, 2, args=(layout,), timeout=90)
    assert all(o.ok for o in out), [o.error for o in out]
    for node, on_node, populated in (o.value for o in out):
        assert node == 0 and on_node == populated > 0  # every page this rank faulted in


def test_a_refused_policy_is_said_once_and_changes_nothing(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    """Node 70 (past one word of the node mask) does not exist here: the kernel refuses the
    policy; the thread goes on unplaced and the log says so once."""
    import offload.region.numa as numa

    numa._refused.cache_clear()
    before = os.sched_getaffinity(0)

    def enter_twice() -> None:
        Placement(70, frozenset()).enter()
        Placement(70, frozenset()).enter()

    thread = threading.Thread(target=enter_twice)
    with caplog.at_level("WARNING", logger="offload.region.numa"):
        thread.start()
        thread.join()
    refusals = [r for r in caplog.records if "set_mempolicy refused" in r.getMessage()]
    assert len(refusals) == 1 and os.sched_getaffinity(0) == before


def test_entering_a_placement_never_widens_the_threads_cpus() -> None:
    """A thread bound to some CPUs (a launcher's binding) keeps to those of the node's among
    them, and to all of its own where the node has none of them; never the node's others."""
    affinity = sorted(os.sched_getaffinity(0))
    seen: dict[str, set[int]] = {}

    def bound_then_placed(name: str, node_cpus: frozenset[int]) -> None:
        os.sched_setaffinity(0, {affinity[0]})  # this thread only
        Placement(0, node_cpus).enter()
        seen[name] = os.sched_getaffinity(0)

    cases = {"within": frozenset(affinity), "elsewhere": frozenset({10 ** 4})}
    for name, cpus in cases.items():
        thread = threading.Thread(target=bound_then_placed, args=(name, cpus))
        thread.start()
        thread.join()
    assert seen == {"within": {affinity[0]}, "elsewhere": {affinity[0]}}
