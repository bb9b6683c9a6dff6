"""Nameless shared memory: sealed ``memfd`` files and their hand-off to a node's peers.

A file that has no name cannot outlive the processes holding it: whatever kills the job -- an
exception, SIGKILL of one rank or of the whole node, the OOM killer -- the kernel frees the
memory when the last descriptor or mapping goes away.  Named files in ``/dev/shm`` stay until
someone unlinks them, and a node-wide SIGKILL leaves no one to do it.  ``memfd_create`` memory is
also not bounded by the size of the ``/dev/shm`` mount (containers mount 64 MiB there).

Peers cannot open a nameless file, so the node leader hands its descriptors over a Unix domain
socket (``SCM_RIGHTS``).  The socket lives in the abstract namespace (no file is created, nothing
to clean up) under a name derived from the tier's random id; the leader accepts only peers that
run as its own user (``SO_PEERCRED``).  Every wait is bounded by a deadline, so a leader that died
makes its peers fail with a clear error instead of hanging, and a peer that died makes the leader
fail likewise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import struct
import time
from collections.abc import Sequence

from offload.errors import OffloadError, PeerError

_HEADER = struct.Struct("!II")  # magic, descriptor count
_MAGIC = 0x0FF10AD0
_RETRY_S = 0.002


def create_memfd(name: str, length: int) -> int:
    """A nameless file of ``length`` bytes (sparse; the caller reserves or populates it),
    sealed against shrinking so no holder can make another's mapping SIGBUS."""
    fd = os.memfd_create(f"offload-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, length)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def socket_name(tier_id: str, tag: str) -> str:
    """The abstract socket name of one hand-off (unique per tier and node)."""
    return f"offload/{tier_id}/{tag}"


class FdOffer:
    """The leader's side of a hand-off: a listening socket, bound *before* the node learns that
    the descriptors exist, so a peer that connects right after that exchange finds it."""

    def __init__(self, name: str, peers: int) -> None:
        self.name = name
        self.peers = peers
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind("\0" + name)
            self._sock.listen(max(1, peers))
        except OSError as exc:
            self.close()
            if exc.errno == errno.EADDRINUSE:
                raise OffloadError(f"hand-off socket {name!r} is already in use on this host; "
                                   "another tier uses the same id: start with a new one") from None
            raise

    def hand_out(self, fds: Sequence[int], timeout_s: float) -> None:
        """Send ``fds`` to each of ``peers`` connecting processes of this user; bounded by
        ``timeout_s`` for all of them together."""
        sock = self._socket()
        deadline = time.monotonic() + timeout_s
        served = 0
        while served < self.peers:
            sock.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                raise PeerError(f"only {served} of {self.peers} node peers fetched the region "
                                f"descriptors within {timeout_s:g} s; a peer died or stopped "
                                "answering") from None
            with conn:
                uid = _peer_uid(conn)
                if uid != os.geteuid():  # a stranger found the name: ignore it
                    continue
                conn.settimeout(max(0.0, deadline - time.monotonic()))
                socket.send_fds(conn, [_HEADER.pack(_MAGIC, len(fds))], list(fds))
                served += 1

    def close(self) -> None:
        """Stop listening (idempotent); the abstract name disappears with the socket."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _socket(self) -> socket.socket:
        if self._sock is None:
            raise RuntimeError(f"hand-off {self.name!r} is closed")
        return self._sock

    def __enter__(self) -> FdOffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_fds(name: str, count: int, timeout_s: float) -> list[int]:
    """A peer's side: connect to the leader's offer ``name`` (retrying until it exists) and
    receive exactly ``count`` descriptors, close-on-exec."""
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        while True:
            try:
                sock.connect("\0" + name)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                if time.monotonic() >= deadline:
                    raise PeerError(f"the node leader offered no region descriptors under "
                                    f"{name!r} within {timeout_s:g} s; check the leader's "
                                    "error") from None
                time.sleep(_RETRY_S)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            data, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max(1, count),
                                              socket.MSG_CMSG_CLOEXEC)
        except TimeoutError:
            raise PeerError(f"the node leader sent no descriptors under {name!r} within "
                            f"{timeout_s:g} s") from None
    if len(data) != _HEADER.size or _HEADER.unpack(data) != (_MAGIC, count) or len(fds) != count:
        close_all(fds)
        raise PeerError(f"hand-off {name!r} delivered {len(fds)} descriptors and header "
                        f"{data!r}; expected {count} from the node leader")
    return fds


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid
