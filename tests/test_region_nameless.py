"""Nameless memfd files and their hand-off to peers, across real processes."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import time
import uuid

import pytest

from offload.errors import PeerError
from offload.region.nameless import FdOffer, create_memfd, fetch_fds, memfd_mapping, socket_name
from offload.region.shm import close_fds


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
    name = socket_name(uuid.uuid4().hex, "test")
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


def test_a_peer_without_a_leader_fails_within_its_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(PeerError, match="offered no region descriptors"):
        fetch_fds(socket_name(uuid.uuid4().hex, "none"), 1, timeout_s=0.3)
    assert time.monotonic() - started < 5


def test_a_leader_whose_peers_never_come_fails_within_its_timeout() -> None:
    fd = create_memfd("lonely", 4096)
    try:
        with FdOffer(socket_name(uuid.uuid4().hex, "lonely"), peers=1) as offer, \
                pytest.raises(PeerError, match="0 of 1 node peers"):
            offer.hand_out([fd], timeout_s=0.3)
    finally:
        os.close(fd)


def test_a_second_offer_under_the_same_name_is_refused() -> None:
    name = socket_name(uuid.uuid4().hex, "twice")
    with FdOffer(name, peers=1), pytest.raises(Exception, match="already in use"):
        FdOffer(name, peers=1)
