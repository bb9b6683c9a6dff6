# SPDX-License-Identifier: Apache-2.0
"""The HTTP side of live metrics: ``GET /metrics`` of one registry, at a bounded cost.

Runs in every rank's process that serves metrics (`offload.observe.metrics.serve_metrics`).  Other
local users are untrusted (docs/SECURITY.md) and can open connections to the port: whatever
they do, the server holds at most ``1 + workers`` threads and ``max_connections`` sockets, and
a scraper that sends its request at once is answered within about one request deadline.
(``prometheus_client.start_http_server`` starts one thread per connection, without limit: 300
idle connections grew a rank by 74 threads.)

* one **selector thread** accepts connections and reads each request head without blocking,
  with a deadline per connection (``request_timeout_s``, a slow or idle client is closed) and
  a size limit;
* a complete request goes to a **pool** of ``workers`` threads, which builds the exposition
  and sends it with the same deadline for the whole response;
* at most ``max_connections`` connections are open; a new one past that closes the oldest
  still reading its request (an idle one, since a scraper sends its request right away), or
  itself when every open one is being answered.

Every response closes its connection (no keep-alive).  The request may ask for the
OpenMetrics format (``Accept``) and filter families (``name[]``), as
``prometheus_client``'s own server allows.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

REQUEST_LIMIT = 8192  # bytes of a request head; a scraper's is a few hundred
WORKERS = 2
MAX_CONNECTIONS = 32
REQUEST_TIMEOUT_S = 5.0


class _Reading:
    """A connection whose request head is still arriving."""

    __slots__ = ("deadline", "head", "sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.head = sock, deadline, bytearray()


class MetricsHTTPServer:
    """Serves ``registry`` over HTTP on ``addr:port`` (module docstring) until `close`.

    Raises (at construction):
        OSError: the address cannot be bound (taken, not local).
    """

    def __init__(self, addr: str, port: int, registry: Any, *, workers: int = WORKERS,
                 max_connections: int = MAX_CONNECTIONS,
                 request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.registry = registry
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        self._listener = socket.create_server((addr, port), family=family, backlog=64)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._reading: dict[socket.socket, _Reading] = {}  # oldest first
        self._lock = threading.Lock()
        self._answering: set[socket.socket] = set()  # handed to the pool, not yet closed
        self._stop = False
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="offload-metrics")
        self._thread = threading.Thread(target=self._loop, name="offload-metrics-accept",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ selector thread

    def _loop(self) -> None:
        while not self._stop:
            for key, _ in self._selector.select(self._next_wait()):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    return
                else:  # (None: dropped for room by an accept of this very round)
                    reading = self._reading.get(key.fileobj)  # type: ignore[call-overload]
                    if reading is not None:
                        self._read(reading)
            self._expire(time.monotonic())

    def _next_wait(self) -> float:
        if not self._reading:
            return self.request_timeout_s
        first = next(iter(self._reading.values()))  # the oldest has the nearest deadline
        return max(0.0, first.deadline - time.monotonic())

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE: the backlog keeps it, and the loop comes back
                return
            if not self._make_room():
                sock.close()
                continue
            sock.setblocking(False)
            self._reading[sock] = _Reading(sock, time.monotonic() + self.request_timeout_s)
            self._selector.register(sock, selectors.EVENT_READ)

    def _make_room(self) -> bool:
        """Room for one more connection, closing the oldest still reading if need be; False
        when every open connection is being answered."""
        with self._lock:
            answering = len(self._answering)
        if len(self._reading) + answering < self.max_connections:
            return True
        if not self._reading:
            return False
        self._drop(next(iter(self._reading)))
        return True

    def _read(self, reading: _Reading) -> None:
        try:
            data = reading.sock.recv(REQUEST_LIMIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        reading.head += data
        if not data or len(reading.head) > REQUEST_LIMIT:
            self._drop(reading.sock)
        elif b"\r\n\r\n" in reading.head or b"\n\n" in reading.head:
            self._selector.unregister(reading.sock)
            del self._reading[reading.sock]
            with self._lock:
                self._answering.add(reading.sock)
            self._pool.submit(self._answer, reading.sock, bytes(reading.head))

    def _expire(self, now: float) -> None:
        for sock, reading in list(self._reading.items()):
            if reading.deadline > now:
                break  # oldest first: the rest are later
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._reading[sock]
        sock.close()

    # ------------------------------------------------------------------ pool threads

    def _answer(self, sock: socket.socket, head: bytes) -> None:
        try:
            sock.settimeout(self.request_timeout_s)  # for the whole response (sendall)
            sock.sendall(self._response(head))
        except OSError:
            pass  # the client went away or stopped reading: its loss
        finally:
            sock.close()
            with self._lock:
                self._answering.discard(sock)

    def _response(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").splitlines()
        parts = lines[0].split() if lines else []
        if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
            return _http(405, "text/plain", b"only GET is served\n")
        headers = dict(_header(line) for line in lines[1:] if ":" in line)
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(headers.get("accept", ""))
        registry = self.registry
        names = urllib.parse.parse_qs(urllib.parse.urlsplit(parts[1]).query).get("name[]")
        if names:
            registry = registry.restricted_registry(names)
        body = encoder(registry)
        return _http(200, content_type, b"" if parts[0] == "HEAD" else body, len(body))

    # ------------------------------------------------------------------ life

    def connections(self) -> int:
        """Connections open now (reading or being answered)."""
        with self._lock:
            return len(self._reading) + len(self._answering)

    def close(self) -> None:
        """Stop accepting, close every connection and wait for the threads (a response in
        flight ends within its deadline).  Idempotent."""
        if self._stop:
            return
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join()
        for sock in list(self._reading):
            self._drop(sock)
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:  # the answers cancelled before they ran
            for sock in self._answering:
                sock.close()
            self._answering.clear()
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()


def _header(line: str) -> tuple[str, str]:
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


def _http(status: int, content_type: str, body: bytes, length: int | None = None) -> bytes:
    reason = {200: "OK", 405: "Method Not Allowed"}[status]
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode("latin-1") + body
