"""Nameless memfd files and their hand-off to peers, across real processes, and what each end of
a hand-off trusts: the leader serves only its own user's processes, a peer takes descriptors only
from its own user's process (the leader's pid where known) and only sealed memfds of its user of
the plan's sizes.  Tests of another user fork a child of uid 65534 (root only)."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from offload.errors import PeerError
from offload.system.nameless import (
    _HEADER,
    _MAGIC,
    FdOffer,
    check_sizes,
    create_memfd,
    fetch_fds,
    memfd_mapping,
    new_socket_name,
)
from offload.system.shm import close_fds
from tests.harness import run_group
from tests.other_user import NOBODY, as_root, other_process


def _peer(name: str, count: int, results: mp.Queue) -> None:
    fds = fetch_fds(name, count, timeout_s=10)
    try:
        with mmap.mmap(fds[0], 4096) as view:
            seen = view[:5]
            view[5:10] = b"peer!"  # visible to the leader: the same memory
        results.put((seen, [os.fstat(fd).st_size for fd in fds]))
    finally:
        close_fds(fds)


def test_peers_map_the_leaders_nameless_files() -> None:
    name = new_socket_name(uuid.uuid4().hex, "test")
    fds = [create_memfd("t0", 4096), create_memfd("t1", 8192)]
    os.pwrite(fds[0], b"hello", 0)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    try:
        with FdOffer(name, peers=2) as offer:
            peers = [ctx.Process(target=_peer, args=(name, 2, results)) for _ in range(2)]
            for p in peers:
                p.start()
            offer.hand_out(fds, timeout_s=30)
            got = [results.get(timeout=30) for _ in peers]
            for p in peers:
                p.join(10)
                assert p.exitcode == 0
        assert got == [(b"hello", [4096, 8192])] * 2
        assert os.pread(fds[0], 10, 0) == b"hellopeer!"
    finally:
        close_fds(fds)


def test_memfd_is_nameless_and_sealed_against_shrinking() -> None:
    fd = create_memfd("sealed", 8192)
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:offload-sealed")
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        os.ftruncate(fd, 16384)  # growing stays allowed
    finally:
        os.close(fd)


def test_memfd_mapping_is_page_aligned_writable_and_rounded_up() -> None:
    name = f"t-{uuid.uuid4().hex[:8]}"
    mapping = memfd_mapping(name, 3 * mmap.PAGESIZE + 1)
    try:
        assert mapping.address % mmap.PAGESIZE == 0 and mapping.size == 4 * mmap.PAGESIZE
        mapping.tensor.fill_(7)
        assert int(mapping.tensor.sum()) == 7 * mapping.size
        assert not any(name in os.readlink(f"/proc/self/fd/{fd}")
                       for fd in map(int, os.listdir("/proc/self/fd"))
                       if os.path.exists(f"/proc/self/fd/{fd}"))  # no descriptor kept
    finally:
        mapping.close()


def test_a_peer_whose_leader_closed_the_offer_fails_at_once() -> None:
    """A name is told only once bound, so a refused connection means the leader is gone:
    the peer fails at once instead of waiting out its timeout."""
    name = new_socket_name(uuid.uuid4().hex, "gone")
    FdOffer(name, peers=1).close()
    started = time.monotonic()
    with pytest.raises(PeerError, match="offer .* is gone: the leader failed or died"):
        fetch_fds(name, 1, timeout_s=30)
    assert time.monotonic() - started < 5


def test_a_leader_whose_peers_never_come_fails_within_its_timeout() -> None:
    fd = create_memfd("lonely", 4096)
    try:
        with FdOffer(new_socket_name(uuid.uuid4().hex, "lonely"), peers=1) as offer, \
                pytest.raises(PeerError, match="0 of 1 node peers"):
            offer.hand_out([fd], timeout_s=0.3)
    finally:
        os.close(fd)


def test_a_second_offer_under_the_same_name_is_refused() -> None:
    name = new_socket_name(uuid.uuid4().hex, "twice")
    with FdOffer(name, peers=1), pytest.raises(Exception, match="already in use"):
        FdOffer(name, peers=1)


# ---------------------------------------------------------------------------- trust


def _connect_and_count_fds(name: str) -> Callable[[int], None]:
    """A child action: connect to ``name``, write how many descriptors it was sent."""
    def action(pipe: int) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect("\0" + name)
            _, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
        os.write(pipe, str(len(fds)).encode())
    return action


def _serve(name: str, length: int, sealed: bool = True) -> Callable[[int], None]:
    """A child action: bind ``name`` first, say "r", hand one memfd of ``length`` bytes (every
    watermark word set: "all jobs done") to the first process that connects."""
    def action(pipe: int) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind("\0" + name)
            sock.listen(4)
            os.write(pipe, b"r")
            sock.settimeout(10)
            conn, _ = sock.accept()
            fd = (create_memfd("forged", length) if sealed
                  else os.memfd_create("forged", os.MFD_CLOEXEC))
            os.ftruncate(fd, length)
            os.pwrite(fd, b"\xff\xff\xff\x7f" * (length // 4), 0)
            with conn:
                socket.send_fds(conn, [_HEADER.pack(_MAGIC, 1)], [fd])
                conn.recv(1)  # until the peer hangs up
    return action


@as_root
def test_the_leader_serves_no_process_of_another_user() -> None:
    """The leader offers one descriptor to one peer.  A process of uid 65534 connects first:
    the leader checks its credentials (SO_PEERCRED), drops it unserved and does not count it,
    so the stranger receives nothing and the real peer is still served."""
    name = new_socket_name(uuid.uuid4().hex, "stranger")
    fd = create_memfd("t", 4096)
    try:
        with FdOffer(name, peers=1) as offer:
            offer.start([fd], timeout_s=30)
            with other_process(_connect_and_count_fds(name)) as stranger:
                received = stranger.read_all()
            assert received == b"0", received.decode(errors="replace")
            close_fds(fetch_fds(name, 1, timeout_s=10))  # the node's peer
        assert offer.error is None
    finally:
        os.close(fd)


@as_root
def test_a_peer_refuses_a_server_of_another_user() -> None:
    """A process of uid 65534 binds the hand-off name before the leader and serves a forged
    sealed memfd: the peer checks the server's credentials and refuses, naming its uid; it
    receives no descriptor."""
    name = new_socket_name(uuid.uuid4().hex, "squat")
    with other_process(_serve(name, 4096)) as squatter:
        assert squatter.read() == b"r"
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(PeerError, match=f"served by uid {NOBODY} \\(pid {squatter.pid}\\)"):
            fetch_fds(name, 1, timeout_s=5)
        assert set(os.listdir("/proc/self/fd")) <= before  # nothing received and kept


def test_a_peer_refuses_a_server_other_than_the_leaders_pid() -> None:
    """Where the caller knows the leader's pid, a process of the same user serving the name is
    refused too; the real leader's process is accepted."""
    name = new_socket_name(uuid.uuid4().hex, "pid")
    with other_process(_serve(name, 4096), uid=None) as server:
        assert server.read() == b"r"
        with pytest.raises(PeerError, match=f"served by pid {server.pid}, not by the node "
                                            f"leader \\(pid {os.getpid()}\\)"):
            fetch_fds(name, 1, timeout_s=5, leader_pid=os.getpid())
    name = new_socket_name(uuid.uuid4().hex, "pid")
    with other_process(_serve(name, 4096), uid=None) as server:
        assert server.read() == b"r"
        fds = fetch_fds(name, 1, timeout_s=5, leader_pid=server.pid)
        try:
            check_sizes(fds, [4096], name)
        finally:
            close_fds(fds)


def test_received_files_must_be_sealed_memfds_of_the_plans_sizes(tmp_path: Path) -> None:
    sealed = create_memfd("ok", 4096)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 4096)
    plain = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(plain, 4096)
    try:
        check_sizes([sealed], [4096], "n")
        with pytest.raises(PeerError, match="not sealed against shrinking"):
            check_sizes([sealed, unsealed], [4096, 4096], "n")
        with pytest.raises(PeerError, match="not a memfd"):
            check_sizes([plain], [4096], "n")
        with pytest.raises(PeerError, match=r"files of \[4096\] B; the plan expects \[8192\]"):
            check_sizes([sealed], [8192], "n")
    finally:
        close_fds([sealed, unsealed, plain])


@as_root
def test_a_received_memfd_of_another_user_is_refused() -> None:
    fd = create_memfd("theirs", 4096)
    try:
        os.fchown(fd, NOBODY, NOBODY)
        with pytest.raises(PeerError, match=f"owned by uid {NOBODY}"):
            check_sizes([fd], [4096], "n")
    finally:
        os.close(fd)


def test_every_hand_off_gets_a_fresh_name_the_tier_id_does_not_tell() -> None:
    """A bound name is public (``/proc/net/unix``) and shows the tier id and tag; the rest
    is random per offer, so no one can form a name before the leader binds it."""
    tier_id = uuid.uuid4().hex
    names = {new_socket_name(tier_id, "L0") for _ in range(3)}
    assert len(names) == 3
    for name in names:
        prefix, _, token = name.rpartition("/")
        assert prefix == f"offload/{tier_id}/L0" and len(bytes.fromhex(token)) == 16


def _listen_without_accepting(name: str) -> Callable[[int], None]:
    """A child action: bind ``name``, fill its backlog with one connection of its own and
    never accept, say "r", then wait until killed."""
    def action(pipe: int) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as filler:
            sock.bind("\0" + name)
            sock.listen(0)
            filler.connect("\0" + name)  # the one connection a backlog of 0 queues
            os.write(pipe, b"r")
            time.sleep(60)
    return action


def test_a_listener_that_never_accepts_fails_the_peer_within_its_timeout() -> None:
    """A squatter (or a wedged leader) whose backlog is full makes ``connect`` block; the
    peer's deadline covers it and the error names the name."""
    name = new_socket_name(uuid.uuid4().hex, "wedged")
    with other_process(_listen_without_accepting(name), uid=None, timeout_s=0) as server:
        assert server.read() == b"r"
        outcome: list[BaseException | float] = []

        def peer() -> None:
            began = time.monotonic()
            try:
                close_fds(fetch_fds(name, 1, timeout_s=0.5))
            except BaseException as exc:  # the outcome checked below
                outcome.append(exc)
            outcome.append(time.monotonic() - began)

        thread = threading.Thread(target=peer, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "fetch_fds blocked in connect past its timeout"
        error, waited = outcome
        assert isinstance(error, PeerError) and "accepted no connection" in str(error)
        assert isinstance(waited, float) and waited < 3


def _squat(names: Sequence[str]) -> Callable[[int], None]:
    """A child action: bind every one of ``names``, say "r", and hold them until killed."""
    def action(pipe: int) -> None:
        socks = []
        for name in names:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind("\0" + name)
            sock.listen(0)
            socks.append(sock)
        os.write(pipe, b"r")
        time.sleep(60)
    return action


def _shared_tier_binding(rank: int, tier_id: str) -> object:
    """Create and close a 2-rank shared tier whose id is ``tier_id`` (as if foreseen); return
    the hand-off names this rank bound, and whether each was bound before the store heard of
    it (read from /proc/net/unix at the moment the store was told)."""
    import uuid as uuid_module

    import torch
    import torch.distributed as dist

    import offload.system.nameless as nameless
    from offload import HostTier, TierConfig

    uuid_module.uuid4 = lambda: uuid_module.UUID(hex=tier_id * 2)
    bound: list[str] = []
    told: list[tuple[str, bool]] = []  # (name, listed in /proc/net/unix when the store got it)
    for cls in (dist.PrefixStore, dist.TCPStore):
        def spy(self: object, key: str, value: object, _real=cls.set) -> None:
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            for name in bound:
                if name in text:
                    with open("/proc/net/unix") as f:
                        told.append((name, "@" + name in f.read()))
            _real(self, key, value)
        cls.set = spy  # type: ignore[method-assign]
    real_offer = nameless.FdOffer.__init__

    def offer(self: nameless.FdOffer, name: str, peers: int) -> None:
        bound.append(name)
        real_offer(self, name, peers)
    nameless.FdOffer.__init__ = offer  # type: ignore[method-assign]
    tier = HostTier.create([torch.zeros((8, 4096), dtype=torch.uint8)],
                           TierConfig(cpu_bytes_per_node=4 << 20, blocks_per_chunk=4, tp=2,
                                      layout="shared", timeout_s=20))
    assert tier.actor.tier_id == tier_id
    tier.close()
    return bound, told


@as_root
def test_another_user_who_knows_the_tier_id_cannot_squat_its_hand_offs() -> None:
    """Another user learns a shared tier's id (a bound name or a shm file shows it) and binds,
    before the tier starts, every hand-off name it can form from the id -- even every name a
    first tier of that very id bound: the second tier still starts.  A name reaches the store
    (which any local user can read) only once it is bound."""
    tier_id = uuid.uuid4().hex[:16]
    first = run_group(_shared_tier_binding, 2, args=(tier_id,))
    assert all(o.ok for o in first), [o.error for o in first]
    (bound, told), _ = (o.value for o in first)
    assert len(bound) == 2  # the board's and the region's, on the node leader
    assert told and all(listed for _, listed in told)  # the board's name, once it was bound
    guesses = [*bound, *(f"offload/{tier_id}/{tag}{end}" for tag in ("L0", "board-node0")
                         for end in ("", "/"))]
    with other_process(_squat(guesses), timeout_s=0) as squatter:
        assert squatter.read() == b"r"
        second = run_group(_shared_tier_binding, 2, args=(tier_id,))
    assert all(o.ok for o in second), [o.error for o in second]
    assert not set(second[0].value[0]) & set(bound)
