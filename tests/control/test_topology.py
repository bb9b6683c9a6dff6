"""Topology: pure node grouping and the real collective discovery on simulated nodes."""

from __future__ import annotations

import pytest

from offload.control.topology import (
    NodeInfo,
    RankPlace,
    Topology,
    build_nodes,
    check_grid,
    discover,
    processes_on_node,
)
from offload.errors import OffloadError
from tests.harness import run_group


def test_build_nodes_groups_by_node_and_orders_by_leader() -> None:
    places = [RankPlace(r, n, None) for r, n in enumerate(["b", "b", "a", "a", "b"])]
    nodes = build_nodes(places)
    assert [(n.node_id, n.ranks, n.leader_rank) for n in nodes] == [
        ("b", (0, 1, 4), 0), ("a", (2, 3), 2)]


def test_local_world_size_must_match_observation() -> None:
    places = [RankPlace(0, "a", 2), RankPlace(1, "a", 2), RankPlace(2, "b", 2)]
    with pytest.raises(OffloadError, match=r"rank 2 has LOCAL_WORLD_SIZE=2 but 1 ranks"):
        build_nodes(places)


@pytest.mark.parametrize(("value", "processes"), [("4", 4), ("1", 1), (None, None), ("", None),
                                                  ("0", None), ("-2", None), ("two", None)])
def test_processes_on_node_reads_the_launchers_local_world_size(
        monkeypatch: pytest.MonkeyPatch, value: str | None, processes: int | None) -> None:
    if value is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert processes_on_node() == processes


@pytest.mark.parametrize("tp,pp,nodes,writers", [
    (2, 2, [(0, 1, 2, 3)], (0, 2)),               # one node: one writer per stage
    (1, 4, [(0, 1), (2, 3)], (0, 1, 2, 3)),       # every rank is its stage on its node
    (4, 1, [(0, 1), (2, 3)], (0, 2)),             # one stage spanning two nodes: one per node
    (2, 2, [(0, 3), (1, 2)], (0, 1, 2, 3)),       # scattered: stage 0 on both nodes, 1 too
])
def test_stage_writers_are_the_lowest_rank_of_each_node_and_stage(
        tp: int, pp: int, nodes: list[tuple[int, ...]], writers: tuple[int, ...]) -> None:
    infos = tuple(NodeInfo(f"n{i}", ranks) for i, ranks in enumerate(nodes))
    views = [Topology(r, tp * pp, tp, pp, infos) for r in range(tp * pp)]
    assert views[0].stage_writers == writers
    assert [t.rank for t in views if t.is_stage_writer] == list(writers)
    for t in views:
        writer = t.stage_writer_of(t.rank)
        assert writer // tp == t.pp_rank and writer in t.node.ranks and writer <= t.rank
        assert t.stage_peers[0] == writer and t.rank in t.stage_peers


@pytest.mark.parametrize("tp,pp,nodes,peers", [
    (2, 2, [(0, 1, 2, 3)], [(0, 1), (0, 1), (2, 3), (2, 3)]),
    (4, 1, [(0, 1), (2, 3)], [(0, 1), (0, 1), (2, 3), (2, 3)]),   # a stage split over nodes
    (2, 2, [(0, 3), (1, 2)], [(0,), (1,), (2,), (3,)]),          # no stage twice on a node
    (1, 4, [(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)]),
])
def test_stage_peers_are_the_ranks_of_one_stage_on_one_node(
        tp: int, pp: int, nodes: list[tuple[int, ...]], peers: list[tuple[int, ...]]) -> None:
    infos = tuple(NodeInfo(f"n{i}", ranks) for i, ranks in enumerate(nodes))
    assert [Topology(r, tp * pp, tp, pp, infos).stage_peers for r in range(tp * pp)] == peers


@pytest.mark.parametrize("tp,pp", [(3, 1), (2, 3), (0, 4), (4, 0)])
def test_grid_must_cover_the_world(tp: int, pp: int) -> None:
    with pytest.raises(OffloadError, match=r"choose tp and pp whose product is 4"):
        check_grid(4, tp, pp)


def test_discover_on_two_simulated_nodes_builds_leaders_and_node_groups() -> None:
    def body(rank: int) -> object:
        import torch
        import torch.distributed as dist

        topo = discover(tp=2, pp=2)
        total = torch.tensor([rank])
        dist.all_reduce(total, group=topo.node_group)  # node-local group really works
        dist.barrier(group=topo.node_group)
        return (topo.node_id, topo.local_rank, topo.local_world_size, topo.is_leader,
                topo.tp_rank, topo.pp_rank, int(total.item()), topo.to_json())

    out = run_group(body, 4, nodes=["n0", "n0", "n1", "n1"])
    assert all(o.ok for o in out), [o.error for o in out]
    values = [o.value for o in out]
    assert [v[:7] for v in values] == [
        ("n0", 0, 2, True, 0, 0, 1), ("n0", 1, 2, False, 1, 0, 1),
        ("n1", 0, 2, True, 0, 1, 5), ("n1", 1, 2, False, 1, 1, 5)]
    assert values[0][7] == [{"node_id": "n0", "leader_rank": 0, "ranks": [0, 1]},
                            {"node_id": "n1", "leader_rank": 2, "ranks": [2, 3]}]


def test_discover_rejects_a_bad_grid_on_every_rank() -> None:
    out = run_group(lambda rank: discover(tp=3, pp=1), 2)
    assert all(not o.ok and "choose tp and pp" in (o.error or "") for o in out)
