# SPDX-License-Identifier: Apache-2.0
"""What a node peer trusts when it maps the progress board (offload/board.py).

The board's words decide when jobs are complete, so a forged board would let another process
decide for the node.  A peer (local rank 1 of a two-rank node) opens the board:

* from the real leader (a thread of this process, pid given): mapped, and the words are shared;
* from a squatter of another user (uid 65534) that bound the name first and serves a board
  claiming every job done: refused with the squatter's uid, nothing mapped (root only);
* from a process of this user that is not the leader (pid given): refused;
* a board of the wrong size, or unsealed: refused.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable

import pytest

from offload.board import LINE_BYTES, Board, pack
from offload.errors import PeerError
from offload.region.nameless import socket_name
from offload.topology import NodeInfo, Topology
from tests.other_user import NOBODY, as_root, other_process
from tests.test_region_nameless import KEY, _serve

NODE = "node-a"


def make_topology(rank: int) -> Topology:
    return Topology(rank=rank, world_size=2, tp=2, pp=1, nodes=(NodeInfo(NODE, (0, 1)),))


def board_name(tier_id: str) -> str:
    return socket_name(tier_id, f"board-{NODE}", KEY)


def open_peer(tier_id: str, leader_pid: int | None = None) -> Board:
    return Board.open(make_topology(1), tier_id, KEY, timeout_s=5, leader_pid=leader_pid)


def in_thread(fn: Callable[[], Board]) -> tuple[threading.Thread, list[Board | BaseException]]:
    out: list[Board | BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_peer_maps_the_leaders_board() -> None:
    tier_id = uuid.uuid4().hex
    thread, out = in_thread(lambda: Board.open(make_topology(0), tier_id, KEY, timeout_s=10))
    peer = open_peer(tier_id, leader_pid=os.getpid())
    thread.join(10)
    (leader,) = out
    assert isinstance(leader, Board)
    try:
        peer.publish(5, 1)
        assert leader.words() == [0, pack(5, 1)]
    finally:
        peer.close()
        leader.close()


@as_root
def test_a_board_served_by_another_user_is_refused() -> None:
    tier_id = uuid.uuid4().hex
    with other_process(_serve(board_name(tier_id), 2 * LINE_BYTES)) as squatter:
        assert squatter.read() == b"r"
        with pytest.raises(PeerError, match=f"served by uid {NOBODY}"):
            open_peer(tier_id)


def test_a_board_served_by_a_process_other_than_the_leader_is_refused() -> None:
    tier_id = uuid.uuid4().hex
    with other_process(_serve(board_name(tier_id), 2 * LINE_BYTES), uid=None) as server:
        assert server.read() == b"r"
        with pytest.raises(PeerError, match=f"served by pid {server.pid}"):
            open_peer(tier_id, leader_pid=server.pid + 1)


@pytest.mark.parametrize(("length", "sealed", "why"), [
    (LINE_BYTES, True, r"files of \[128\] B; the plan expects \[256\]"),
    (4 * LINE_BYTES, True, r"files of \[512\] B; the plan expects \[256\]"),
    (2 * LINE_BYTES, False, "not sealed against shrinking")], ids=["short", "long", "unsealed"])
def test_a_board_of_the_wrong_size_or_unsealed_is_refused(length: int, sealed: bool,
                                                          why: str) -> None:
    tier_id = uuid.uuid4().hex
    with other_process(_serve(board_name(tier_id), length, sealed), uid=None) as server:
        assert server.read() == b"r"
        with pytest.raises(PeerError, match=why):
            open_peer(tier_id)


def _leader_pids_in_use(rank: int) -> object:
    """A real 2-rank tier: what leader pid did rank 1 check the board and region against?"""
    import torch

    import offload.board
    import offload.region.host_region
    from offload import HostTier
    from offload.config import TierConfig

    seen: list[int | None] = []
    for module in (offload.board, offload.region.host_region):
        real = module.fetch_fds

        def spy(*args, _real=real, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(kwargs.get("leader_pid"))
            return _real(*args, **kwargs)

        module.fetch_fds = spy  # type: ignore[attr-defined]
    tier = HostTier.create([torch.ones((4, 512), dtype=torch.uint8)],
                           TierConfig(cpu_bytes_per_node=1 << 20, blocks_per_chunk=2, tp=2,
                                      layout="shared", timeout_s=20))
    pid = os.getpid()
    leader = tier.topology.leader_pid()
    tier.close()
    return pid, leader, seen


def test_peers_check_the_board_and_region_against_the_leaders_pid() -> None:
    from tests.harness import run_group

    out = run_group(_leader_pids_in_use, 2, timeout=90)
    assert all(o.ok for o in out), [o.error for o in out]
    (pid0, leader0, seen0), (_, leader1, seen1) = (o.value for o in out)
    assert leader0 == leader1 == pid0
    assert seen0 == [] and seen1 == [pid0, pid0]  # the board's and the region's hand-off
