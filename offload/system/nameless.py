# SPDX-License-Identifier: Apache-2.0
"""Nameless shared memory: sealed ``memfd`` files and their hand-off to a node's peers.

A file that has no name cannot outlive the processes holding it: whatever kills the job -- an
exception, SIGKILL of one rank or of the whole node, the OOM killer -- the kernel frees the
memory when the last descriptor or mapping goes away.  Named files in ``/dev/shm`` stay until
someone unlinks them, and a node-wide SIGKILL leaves no one to do it.  ``memfd_create`` memory is
also not bounded by the size of the ``/dev/shm`` mount (containers mount 64 MiB there).

Peers cannot open a nameless file, so the node leader hands its descriptors over a Unix domain
socket (``SCM_RIGHTS``).  The socket lives in the abstract namespace (no file is created, nothing
to clean up).  Every wait, ``connect`` included, is bounded by a deadline, so a leader that
died makes its peers fail with a clear error instead of hanging, and a peer that died makes the
leader fail likewise.

Trust: any local user may bind or connect to an abstract name it knows, and a bound name is no
secret (``/proc/net/unix`` lists it to every user).  So no name is known before it is bound:
the leader binds a name ending in 128 random bits (`new_socket_name`) and only then tells the
node's ranks (the region's in the node exchange, `offload.region.sync.NodeSync.step` with
``share``; the board's through the tier's store, `offload.control.board.Board.open`).  A user who
learnt the tier id (from a bound name or a ``/dev/shm`` file), or who reads the store, cannot
bind a hand-off's name first and fail the tier's start.  Both ends also check the other's
credentials (``SO_PEERCRED``, set by the kernel):

* the leader serves only peers that run as its own user; a stranger's connection is dropped
  unserved and does not count as a peer;
* a peer accepts descriptors only from a server of its own user -- and, where the caller knows
  the leader's pid, from that very process -- so a squatter that bound the name first is refused
  with an error naming its uid and pid;
* `check_sizes` checks what arrived: sealed memfds (``F_SEAL_SHRINK``, ``F_SEAL_SEAL``) of this
  user, of the plan's sizes.

The boundary that remains is torch.distributed's: the tier id and the leader's pid come from
the rendezvous store, which anyone who can reach it can read and write.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Sequence

from offload.errors import OffloadError, PeerError
from offload.system.shm import Mapping, close_fds, reserve

_HEADER = struct.Struct("!II")  # magic, descriptor count
_MAGIC = 0x0FF10AD0
_RETRY_S = 0.002
_POLL_S = 0.05
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL  # what `create_memfd` adds


def create_memfd(name: str, length: int) -> int:
    """A nameless file of ``length`` bytes (sparse; the caller reserves or populates it),
    sealed against shrinking so no holder can make another's mapping SIGBUS."""
    fd = os.memfd_create(f"offload-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, length)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_memfds(name: str, lengths: Sequence[int], threads: int,
                  reserved: bool = True) -> list[int]:
    """One sealed memfd per segment (``offload-<name>-s<i>`` in ``/proc/<pid>/fd``), reserved
    in parallel unless ``reserved`` is False (the caller reserves them later); on any failure
    every one of them is closed, which frees it."""
    fds: list[int] = []
    try:
        for i, length in enumerate(lengths):
            fds.append(create_memfd(f"{name}-s{i}", length))
        if reserved:
            reserve(fds, lengths, threads)
    except BaseException:
        close_fds(fds)
        raise
    return fds


def memfd_mapping(name: str, nbytes: int, threads: int = 8) -> Mapping:
    """One nameless mapping of ``nbytes`` (rounded up to the system page): host memory laid
    out as the tier's, page-aligned.  For benchmarks and tests that stand in for a region: a
    large ``torch.empty`` is only 64-byte aligned, so every page straddles one more host page
    than in a region and the copy kernel over it runs measurably slower (docs/BENCHMARKS.md,
    "Engine-shaped transfers", the host-buffer table)."""
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    fds = create_memfds(name, [length], threads)
    try:
        return Mapping(fds, [length])
    finally:
        close_fds(fds)


def check_sizes(fds: Sequence[int], lengths: Sequence[int], name: str) -> None:
    """A peer's check that the descriptors it received are the plan's segments: memfds of this
    user, sealed against shrinking (a shorter file would SIGBUS on first touch of its missing
    tail, and a holder could shrink an unsealed one at any time), of the plan's sizes.

    Raises:
        PeerError: naming the first check that failed.
    """
    for i, fd in enumerate(fds):
        st = os.fstat(fd)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # EINVAL: not a memfd (a file, a socket, a pipe)
            seals = None
        why = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"is owned by uid {st.st_uid}, not this user (uid {os.geteuid()})"
               if st.st_uid != os.geteuid() else
               "is not a memfd" if seals is None else
               f"is not sealed against shrinking (seals {seals:#x})"
               if seals & _SEALS != _SEALS else None)
        if why is not None:
            raise PeerError(f"hand-off {name!r} delivered a file that {why} as segment {i}; "
                            "only the node leader's sealed memfds are accepted")
    sizes = [os.fstat(fd).st_size for fd in fds]
    if sizes != list(lengths):
        raise PeerError(f"hand-off {name!r} delivered files of {sizes} B; the plan expects "
                        f"{list(lengths)} B")


def new_socket_name(tier_id: str, tag: str) -> str:
    """A fresh abstract socket name for one hand-off: readable parts for whoever lists sockets
    (the tier and the creator's tag), then 128 random bits, so no one can bind it before the
    leader does (module docstring)."""
    return f"offload/{tier_id}/{tag}/{secrets.token_hex(16)}"


class FdOffer:
    """The leader's side of a hand-off: a listening socket, bound *before* the node learns that
    the descriptors exist, so a peer that connects right after that exchange finds it.

    ``hand_out`` serves the peers in the calling thread; ``start`` serves them on a thread of
    its own, so the leader can meanwhile map the files and join the node exchange that tells it
    whether every peer got them -- a peer that failed before fetching then costs the leader
    nothing but that exchange.  ``close`` stops serving (within ``_POLL_S``)."""

    def __init__(self, name: str, peers: int) -> None:
        self.name = name
        self.peers = peers
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind("\0" + name)
            self._sock.listen(max(1, peers))
        except OSError as exc:
            self.close()
            if exc.errno == errno.EADDRINUSE:
                raise OffloadError(f"hand-off socket {name!r} is already in use on this host, "
                                   "though its name ends in 128 random bits: another process "
                                   "bound it (find it with `ss -xlp`); start again") from None
            raise

    def hand_out(self, fds: Sequence[int], timeout_s: float) -> None:
        """Send ``fds`` to each of ``peers`` connecting processes of this user; bounded by
        ``timeout_s`` for all of them together."""
        sock = self._socket()
        deadline = time.monotonic() + timeout_s
        served = 0
        while served < self.peers:
            left = deadline - time.monotonic()
            if left <= 0 or self._stop.is_set():
                why = f"within {timeout_s:g} s" if left <= 0 else "before the offer closed"
                raise PeerError(f"only {served} of {self.peers} node peers fetched the region "
                                f"descriptors {why}; a peer failed, died or stopped answering")
            sock.settimeout(min(_POLL_S, left))
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            with conn:
                _pid, uid, _gid = peer_credentials(conn)
                if uid != os.geteuid():  # a stranger found the name: serve it nothing
                    continue
                conn.settimeout(max(0.0, deadline - time.monotonic()))
                socket.send_fds(conn, [_HEADER.pack(_MAGIC, len(fds))], list(fds))
                served += 1

    def start(self, fds: Sequence[int], timeout_s: float) -> None:
        """``hand_out`` on a thread; its error, if any, lands in ``error``.  The caller keeps
        ``fds`` open until ``close``."""
        def serve() -> None:
            try:
                self.hand_out(fds, timeout_s)
            except BaseException as exc:
                self.error = exc

        self._thread = threading.Thread(target=serve, name="offload-handoff", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and listening (idempotent); the abstract name disappears with the
        socket."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
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


def fetch_fds(name: str, count: int, timeout_s: float, leader_pid: int | None = None
              ) -> list[int]:
    """A peer's side: connect to the leader's offer ``name`` and receive exactly ``count``
    descriptors, close-on-exec.  The leader tells a name only once it is bound (`FdOffer`), so
    a refused connection means the leader closed it (it failed or died) and waiting cannot
    help; only a full backlog is retried, until ``timeout_s``.

    The server must run as this user, and be process ``leader_pid`` where given (the caller
    learnt it through the store; give it only where leader and peer share a pid namespace, as
    the kernel reports the pid as seen from the peer's); nothing is received from any other.
    The caller checks the descriptors (`check_sizes`).

    Raises:
        PeerError: no offer under ``name`` (the leader failed or died), none served within
            ``timeout_s``, or the server is not the leader (another user's process, or
            another process than ``leader_pid``).
    """
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)  # a full backlog then fails at once, not blocks for ever
        while True:
            try:
                sock.connect("\0" + name)
                break
            except BlockingIOError:  # the listener's backlog is full: it is not accepting
                if time.monotonic() >= deadline:
                    raise PeerError(f"the hand-off {name!r} accepted no connection within "
                                    f"{timeout_s:g} s: its backlog stayed full (a server "
                                    "that does not serve); check the leader's error") from None
                time.sleep(_RETRY_S)
            except (ConnectionRefusedError, FileNotFoundError):
                raise PeerError(f"the node leader's offer {name!r} is gone: the leader "
                                "failed or died; check its error") from None
        check_server(sock, name, leader_pid)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            data, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max(1, count),
                                              socket.MSG_CMSG_CLOEXEC)
        except TimeoutError:
            raise PeerError(f"the node leader sent no descriptors under {name!r} within "
                            f"{timeout_s:g} s") from None
        except ConnectionError as exc:
            raise PeerError(f"the node leader dropped the hand-off {name!r} ({exc.strerror}): "
                            "it failed or died; check its error") from None
    if len(data) != _HEADER.size or _HEADER.unpack(data) != (_MAGIC, count) or len(fds) != count:
        close_fds(fds)
        raise PeerError(f"hand-off {name!r} delivered {len(fds)} descriptors and header "
                        f"{data!r}; expected {count} from the node leader")
    return fds


def check_server(sock: socket.socket, name: str, leader_pid: int | None = None) -> None:
    """A peer's check of the process serving the hand-off ``name`` on connected ``sock``:
    this user's, and process ``leader_pid`` where given.

    Raises:
        PeerError: naming the server's uid and pid.
    """
    pid, uid, _gid = peer_credentials(sock)
    if uid != os.geteuid():
        raise PeerError(f"hand-off {name!r} is served by uid {uid} (pid {pid}), not by this "
                        f"user (uid {os.geteuid()}): another local user's process holds the "
                        "name; refusing its descriptors (find that process; a rerun gets a new "
                        "name)")
    if leader_pid is not None and pid != leader_pid:
        raise PeerError(f"hand-off {name!r} is served by pid {pid}, not by the node leader "
                        f"(pid {leader_pid}); refusing its descriptors")


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, as the kernel
    recorded them (at ``connect`` for a client, at ``listen`` for a server)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid
