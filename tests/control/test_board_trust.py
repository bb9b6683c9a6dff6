# SPDX-License-Identifier: Apache-2.0
"""What a node peer trusts when it maps the progress board (offload/control/board.py).

The board's words decide when jobs are complete, so a forged board would let another process
decide for the node.  The leader binds a fresh random name before the node learns it, so no
one can bind it first; should a squatter serve the name anyway, a peer (local rank 1 of a
two-rank node) still checks what it fetches (`Board.fetch`):

* from the real leader (its pid given): mapped, and the words are shared;
* from a process of another user (uid 65534) serving a board claiming every job done:
  refused with its uid, nothing mapped (root only);
* from a process of this user that is not the leader (pid given): refused;
* a board of the wrong size, or unsealed: refused.
"""

from __future__ import annotations

import datetime
import os
import threading
import uuid

import pytest
import torch.distributed as dist

from offload.control.board import LINE_BYTES, Board, pack
from offload.control.topology import NodeInfo, Topology
from offload.errors import PeerError
from offload.system.nameless import new_socket_name
from tests.other_user import NOBODY, as_root, other_process
from tests.system.test_nameless import _serve

NODE = "node-a"


def board_name(tier_id: str) -> str:
    return new_socket_name(tier_id, f"board-{NODE}")


def open_peer(name: str, leader_pid: int | None = None) -> Board:
    """Local rank 1 of a two-rank node fetches the board offered under ``name``."""
    return Board.fetch(name, 2, 1, timeout_s=5, leader_pid=leader_pid)


def test_a_peer_maps_the_board_its_leader_serves() -> None:
    """The leader's process (pid given) serves a sealed board of the node's size: mapped,
    the leader's words are there, and the peer's own word lands in the shared memory."""
    name = board_name(uuid.uuid4().hex)
    with other_process(_serve(name, 2 * LINE_BYTES), uid=None) as leader:
        assert leader.read() == b"r"
        peer = open_peer(name, leader_pid=leader.pid)
    try:
        assert peer.words()[0] == int.from_bytes(b"\xff\xff\xff\x7f" * 2, "little")
        peer.publish(5, 1)
        assert peer.words()[1] == pack(5, 1)
    finally:
        peer.close()


def test_a_peer_maps_the_board_its_leader_opens() -> None:
    """Both sides of `Board.open` (two threads as the two ranks of a node, one store): the
    leader publishes its bound name, the peer fetches and maps the same memory."""
    timeout = datetime.timedelta(seconds=10)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout)  # (one per rank)
    node = (NodeInfo(NODE, (0, 1)),)
    tier_id = uuid.uuid4().hex
    boards: dict[int, Board] = {}

    def leader() -> None:
        boards[0] = Board.open(Topology(0, 2, 2, 1, node), tier_id, store, timeout_s=10)

    thread = threading.Thread(target=leader)
    thread.start()
    peer = Board.open(Topology(1, 2, 2, 1, node), tier_id, client, timeout_s=10,
                      leader_pid=os.getpid())
    thread.join(10)
    try:
        peer.publish(5, 1)
        assert boards[0].words() == [0, pack(5, 1)]
    finally:
        peer.close()
        boards[0].close()


@as_root
def test_a_board_served_by_another_user_is_refused() -> None:
    name = board_name(uuid.uuid4().hex)
    with other_process(_serve(name, 2 * LINE_BYTES)) as squatter:
        assert squatter.read() == b"r"
        with pytest.raises(PeerError, match=f"served by uid {NOBODY}"):
            open_peer(name)


def test_a_board_served_by_a_process_other_than_the_leader_is_refused() -> None:
    name = board_name(uuid.uuid4().hex)
    with other_process(_serve(name, 2 * LINE_BYTES), uid=None) as server:
        assert server.read() == b"r"
        with pytest.raises(PeerError, match=f"served by pid {server.pid}"):
            open_peer(name, leader_pid=server.pid + 1)


@pytest.mark.parametrize(("length", "sealed", "why"), [
    (LINE_BYTES, True, r"files of \[128\] B; the plan expects \[256\]"),
    (4 * LINE_BYTES, True, r"files of \[512\] B; the plan expects \[256\]"),
    (2 * LINE_BYTES, False, "not sealed against shrinking")], ids=["short", "long", "unsealed"])
def test_a_board_of_the_wrong_size_or_unsealed_is_refused(length: int, sealed: bool,
                                                          why: str) -> None:
    name = board_name(uuid.uuid4().hex)
    with other_process(_serve(name, length, sealed), uid=None) as server:
        assert server.read() == b"r"
        with pytest.raises(PeerError, match=why):
            open_peer(name)


def _leader_pids_in_use(rank: int) -> object:
    """A real 2-rank tier: what leader pid did rank 1 check the board and region against?"""
    import torch

    import offload.control.board
    import offload.region.host_region
    from offload import HostTier
    from offload.config import TierConfig

    seen: list[int | None] = []
    for module in (offload.control.board, offload.region.host_region):
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
