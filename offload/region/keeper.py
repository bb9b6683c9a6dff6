# SPDX-License-Identifier: Apache-2.0
"""The keeper: a small process that holds a node's region memfds (and, on rank 0's node, the
tier's index) between two lives of a tier, for at most ``keep_s`` seconds (docs/KEEP.md).

Why a process: a memfd lives exactly as long as some process holds it, so retention needs a
holder that is not the engine.  A fresh interpreter (``python -m offload.region.keeper``,
never a fork of a CUDA process) in a session of its own, with no torch: it only keeps
descriptors and answers a few requests.

Lifetime: the tier stays *attached* through open connections (one per region creator: the node
leader, and each rank of a private layout).  When the last attached connection closes --
a clean exit, or SIGKILL, whose descriptors the kernel closes -- the countdown starts; no
attach within ``keep_s`` and the keeper exits, and with it the kernel frees every memfd.  A
killed keeper frees them at once.  Nothing else outlives it: the socket is abstract (no file),
the memfds have no name.

Trust: the socket's name is predictable (`keeper_name`: uid, node, namespace digest), so both
ends check the other's credentials (``SO_PEERCRED``): the keeper serves only its own user, and
a client accepts only a keeper of its own user (a squatter means no retention, with a warning,
never adoption).  Descriptors handed in are checked to be sealed memfds of this user.

Wire: each message is a 4-byte length and a JSON object; descriptors ride ``SCM_RIGHTS`` on the
message that names them.  Requests: ``info``, ``claim`` (attach, as tier ``owner``), ``reset``
(owner only: forget every part, set the geometry and the *life*, the tier that makes the next
parts), ``put`` / ``get`` (a part by tag, owner only) and ``drop`` (exit, idle only).  Stdlib
only, so that starting one costs milliseconds.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

PREFIX = "offload-keep"
_LEN = struct.Struct("!I")
_MAX_MESSAGE = 1 << 16
_MAX_FDS = 64
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
START_GRACE_S = 10.0  # a keeper nobody attaches to at all lives this long past keep_s


class KeeperError(Exception):
    """A keeper refused a request, went away, or is not ours."""


def digest(text: str, chars: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:chars]


def keeper_name(uid: int, node_id: str, namespace: str) -> str:
    """The abstract socket name of this user's keeper for ``namespace`` on ``node_id``: found
    again by the next tier of the same user, node and model (no file anywhere)."""
    return f"{node_prefix(uid, node_id)}{digest(namespace, 16)}"


def node_prefix(uid: int, node_id: str | None = None) -> str:
    """The name prefix of a user's keepers (on one node, where ``node_id`` is given)."""
    return f"{PREFIX}/{uid}/" + (f"{digest(node_id, 12)}/" if node_id is not None else "")


def listening_names(prefix: str) -> list[str]:
    """Abstract names under ``prefix`` that some socket listens on (``/proc/net/unix``), sorted.
    Anyone may bind any name, so a caller still checks whom it reaches."""
    names = set()
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return []
    for line in lines:
        # Num RefCount Protocol Flags Type St Inode Path; a listener has __SO_ACCEPTCON.  The
        # kernel prints a name raw, newlines included, so another user's name can forge lines:
        # one that does not parse is skipped, and a name found here is only a hint.
        fields = line.split()
        if len(fields) != 8 or not fields[7].startswith("@" + prefix):
            continue
        try:
            listening = int(fields[3], 16) & 0x10000
        except ValueError:
            continue
        if listening:
            names.add(fields[7][1:])
    return sorted(names)


# ---------------------------------------------------------------------- wire
def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = _LEN.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [payload], list(fds))
        if sent < len(payload):
            sock.sendall(payload[sent:])
    else:
        sock.sendall(payload)


def receive_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it (close-on-exec).

    Raises:
        ConnectionError: the other end closed or sent something malformed.
    """
    data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    try:
        if not data:
            raise ConnectionError("closed")
        data = _read_until(sock, data, _LEN.size)
        (length,) = _LEN.unpack(data[:_LEN.size])
        if length > _MAX_MESSAGE:
            raise ConnectionError("message too long")  # refused before it is read
        data = _read_until(sock, data, _LEN.size + length)
        message = json.loads(data[_LEN.size:_LEN.size + length])
        if not isinstance(message, dict):
            raise ConnectionError("not a JSON object")
        return message, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("malformed message") from None


def _read_until(sock: socket.socket, data: bytes, size: int) -> bytes:
    """``data`` and what follows it on ``sock`` until it holds at least ``size`` bytes."""
    while len(data) < size:
        more = sock.recv(_MAX_MESSAGE)
        if not more:
            raise ConnectionError("closed mid-message")
        data += more
    return data


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the other end, as the kernel recorded them."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def memfd_problem(fd: int) -> str | None:
    """Why ``fd`` is not a sealed memfd of this user (None when it is)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}"
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return "is not a memfd"
    return None if seals & _SEALS == _SEALS else "is not sealed against shrinking"


# ---------------------------------------------------------------------- the keeper
class Keeper:
    """The keeper's state and loop (runs in its own process, `main`)."""

    def __init__(self, listener: socket.socket, keep_s: float, info: dict[str, Any]) -> None:
        self.listener = listener
        self.keep_s = keep_s
        self.info = info  # node, namespace: shown by `list`
        self.geometry: str | None = None
        # the tier (its id) that last reset this keeper: what every part was made by; a tier
        # adopts only parts of one life on every node
        self.life: str | None = None
        self.parts: dict[str, tuple[list[int], list[int]]] = {}  # tag -> (fds, sizes)
        self.conns: set[socket.socket] = set()
        self.attached: set[socket.socket] = set()
        self.owner: str | None = None
        self.deadline = time.monotonic() + keep_s + START_GRACE_S
        self.running = True

    def serve(self) -> None:
        while self.running:
            now = time.monotonic()
            if not self.attached and now >= self.deadline:
                return
            wait = None if self.attached else max(0.0, self.deadline - now)
            readable, _, _ = select.select([self.listener, *self.conns], [], [], wait)
            for sock in readable:
                if sock is self.listener:
                    self._accept()
                else:
                    self._serve_one(sock)

    def close(self) -> None:
        self.listener.close()
        for conn in list(self.conns):
            conn.close()
        for fds, _ in self.parts.values():
            for fd in fds:
                os.close(fd)
        self.parts.clear()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if peer_credentials(conn)[1] != os.geteuid():  # another user: serve it nothing
            conn.close()
            return
        conn.settimeout(2.0)  # a client that stalls mid-message is dropped, not waited for
        self.conns.add(conn)

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            message, fds = receive_message(conn)
        except (ConnectionError, OSError):
            self._forget(conn)
            return
        try:
            reply, out = self._handle(conn, message, fds)
        except KeeperError as exc:
            for fd in fds:
                os.close(fd)
            reply, out = {"ok": False, "error": str(exc)}, []
        try:
            send_message(conn, reply, out)
        except OSError:
            self._forget(conn)
        if reply.get("exit"):
            self.running = False

    def _forget(self, conn: socket.socket) -> None:
        conn.close()
        self.conns.discard(conn)
        if conn in self.attached:
            self.attached.discard(conn)
            if not self.attached:  # the last life ended: the countdown starts
                self.owner = None
                self.deadline = time.monotonic() + self.keep_s

    def describe(self) -> dict[str, Any]:
        left = None if self.attached else max(0.0, self.deadline - time.monotonic())
        return {"ok": True, "pid": os.getpid(), **self.info, "geometry": self.geometry,
                "life": self.life,
                "parts": {tag: sizes for tag, (_, sizes) in self.parts.items()},
                "bytes": sum(sum(sizes) for _, sizes in self.parts.values()),
                "attached": len(self.attached), "owner": self.owner, "left_s": left,
                "keep_s": self.keep_s}

    def _handle(self, conn: socket.socket, message: dict[str, Any], fds: list[int]
                ) -> tuple[dict[str, Any], list[int]]:
        op = message.get("op")
        if op == "info":
            return self.describe(), []
        if op == "drop":
            if self.attached:
                raise KeeperError(f"attached to a live tier ({self.owner}); not dropped")
            return {"ok": True, "exit": True}, []
        if op == "claim":
            owner = str(message.get("owner"))
            if self.attached and owner != self.owner:
                raise KeeperError(f"in use by the live tier {self.owner}")
            keep_s = message.get("keep_s")
            if isinstance(keep_s, (int, float)) and keep_s > 0:
                self.keep_s = float(keep_s)
            self.owner = owner
            self.attached.add(conn)
            return self.describe(), []
        if conn not in self.attached:
            raise KeeperError(f"{op!r} needs a claim first")
        if op == "reset":
            self.close_parts()
            self.geometry = str(message.get("geometry"))
            self.life = str(message.get("life"))
            return {"ok": True}, []
        if op == "put":
            return self._put(str(message.get("tag")), message.get("sizes"), fds), []
        if op == "get":
            tag = str(message.get("tag"))
            if tag not in self.parts:
                raise KeeperError(f"holds no part {tag!r}")
            held, sizes = self.parts[tag]
            return {"ok": True, "sizes": sizes}, held
        raise KeeperError(f"unknown request {op!r}")

    def close_parts(self) -> None:
        for held, _ in self.parts.values():
            for fd in held:
                os.close(fd)
        self.parts.clear()

    def _put(self, tag: str, sizes: object, fds: list[int]) -> dict[str, Any]:
        if (not isinstance(sizes, list) or len(sizes) != len(fds)
                or not all(isinstance(s, int) for s in sizes)):
            raise KeeperError(f"part {tag!r}: {len(fds)} descriptors for sizes {sizes!r}")
        for i, fd in enumerate(fds):
            why = memfd_problem(fd)
            if why is None and os.fstat(fd).st_size != sizes[i]:
                why = f"has {os.fstat(fd).st_size} B, not {sizes[i]}"
            if why is not None:
                raise KeeperError(f"part {tag!r}: descriptor {i} {why}")
        old = self.parts.pop(tag, None)
        if old is not None:
            for fd in old[0]:
                os.close(fd)
        self.parts[tag] = (fds, list(sizes))
        return {"ok": True}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="offload keeper (started by a tier; docs/KEEP.md)")
    p.add_argument("--fd", type=int, required=True, help="the bound, listening socket")
    p.add_argument("--keep", type=float, required=True)
    p.add_argument("--node", default="")
    p.add_argument("--namespace", default="")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the engine's, not ours
    listener = socket.socket(fileno=args.fd)
    keeper = Keeper(listener, args.keep, {"node": args.node, "namespace": args.namespace})
    try:
        keeper.serve()
    finally:
        keeper.close()
    return 0


# ---------------------------------------------------------------------- clients
class KeeperLink:
    """A client's connection to a keeper.  Claimed (`claim`), it keeps the tier attached for as
    long as it stays open."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.name = name

    @classmethod
    def connect(cls, name: str, timeout_s: float) -> KeeperLink | None:
        """A link to the keeper listening on ``name``, or None if nothing listens there.

        Raises:
            KeeperError: what listens there runs as another user.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + name)
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            return None
        except OSError as exc:  # e.g. EAGAIN: a full backlog, perhaps another user's listener
            sock.close()
            raise KeeperError(f"keeper name {name!r} cannot be reached: {exc}") from None
        except BaseException:
            sock.close()
            raise
        pid, uid, _ = peer_credentials(sock)
        if uid != os.geteuid():
            sock.close()
            raise KeeperError(f"keeper name {name!r} is held by uid {uid} (pid {pid}), not by "
                              f"this user (uid {os.geteuid()})")
        return cls(sock, name)

    def request(self, op: str, fds: Sequence[int] = (), **fields: Any
                ) -> tuple[dict[str, Any], list[int]]:
        """Send one request; return the reply and its descriptors.

        Raises:
            KeeperError: the keeper refused (its reason) or went away.
        """
        try:
            send_message(self.sock, {"op": op, **fields}, fds)
            reply, got = receive_message(self.sock)
        except (OSError, ConnectionError) as exc:
            raise KeeperError(f"keeper {self.name!r} went away during {op!r}: {exc}") from None
        if not reply.get("ok"):
            for fd in got:
                os.close(fd)
            raise KeeperError(f"keeper {self.name!r} refused {op!r}: {reply.get('error')}")
        return reply, got

    def close(self) -> None:
        self.sock.close()


def start_keeper(name: str, keep_s: float, node: str, namespace: str,
                 timeout_s: float) -> KeeperLink | None:
    """Start a keeper on ``name`` and return a link to it; None when the name is taken (a
    keeper started meanwhile, or a squatter: the caller connects and finds out).  The name is
    bound and listening here, before the child starts, so no one can take it in between and
    the first connection never races the child's start."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + name)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    try:
        listener.listen(64)
        fd = listener.fileno()
        subprocess.Popen(
            [sys.executable, "-m", "offload.region.keeper", "--fd", str(fd), "--keep",
             repr(float(keep_s)), "--node", node, "--namespace", namespace],
            pass_fds=(fd,), close_fds=True, start_new_session=True,
            # no inherited stream: a keeper holding the engine's log pipe open would keep
            # whoever reads that pipe to its end (a launcher, a test) waiting for keep_s
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": _package_root()})
    finally:
        listener.close()  # the keeper holds it now
    return KeeperLink.connect(name, timeout_s)


def _package_root() -> str:
    """``PYTHONPATH`` for the keeper: the directory holding this ``offload`` package first, so
    the child runs this very code."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = os.environ.get("PYTHONPATH")
    return root if not rest else f"{root}{os.pathsep}{rest}"


if __name__ == "__main__":
    sys.exit(main())
