# SPDX-License-Identifier: Apache-2.0
"""The metrics endpoint under connections another local user holds, over real sockets
(`offload.observe.metrics_http`): idle and trickling connections cost a bounded number of
threads and sockets and are closed at their deadline, and a normal scrape is still answered
in bounded time; the server's threads and port are gone after close."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tests.harness import free_port

pytest.importorskip("prometheus_client")

IDLE = 300


def _registry() -> object:
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    Counter("offload_probe", "A counter the scrape must see", registry=registry).inc(7)
    return registry


def _scrape(url: str, timeout: float = 10.0) -> tuple[str, float]:
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    return text, time.monotonic() - started


@contextlib.contextmanager
def _idle_connections(port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` connections that connect and then send nothing, as a squatter's would."""
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        yield held
    finally:
        for sock in held:
            sock.close()


def _wait_for(condition: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_idle_connections_hold_a_bounded_number_of_threads_and_a_scrape_still_answers(
        ) -> None:
    """300 idle connections to a rank's metrics port used to start 300 threads in the rank
    (one per connection, none ever timing out).  Now the rank keeps its selector thread and a
    pool of two, at most 32 connections stay open (the oldest idle ones are closed for new
    ones), and a scrape made meanwhile is answered within a second."""
    from offload.observe.metrics import serve_metrics

    before = threading.active_count()
    port = free_port()
    served = serve_metrics(SimpleNamespace(local_rank=0, rank=0), port, "127.0.0.1",
                           _registry())
    try:
        assert served.server is not None
        with _idle_connections(port, IDLE):
            time.sleep(0.5)  # the server has seen every one of them
            assert threading.active_count() - before <= 3
            text, seconds = _scrape(f"http://127.0.0.1:{port}/metrics")
            assert "offload_probe_total 7.0" in text and seconds < 1.0
            assert served.server.connections() <= 32
            assert threading.active_count() - before <= 3
    finally:
        served.close()
    assert _wait_for(lambda: threading.active_count() == before, 5.0)
    with pytest.raises(OSError):
        _scrape(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_client_that_trickles_its_request_is_closed_at_the_deadline() -> None:
    """A request head that never completes (one byte at a time) holds no worker and is closed
    once its deadline passes, however often it sends."""
    from offload.observe.metrics_http import MetricsHTTPServer

    server = MetricsHTTPServer("127.0.0.1", 0, _registry(), request_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            started = time.monotonic()
            closed = False
            while time.monotonic() - started < 3 and not closed:
                try:
                    sock.sendall(b"G")
                    sock.settimeout(0.1)
                    closed = sock.recv(1) == b""
                except TimeoutError:
                    continue
                except OSError:  # reset by the server
                    closed = True
            assert closed and time.monotonic() - started < 1.5
        assert _wait_for(lambda: server.connections() == 0, 2.0)
    finally:
        server.close()


@pytest.mark.parametrize(("request_line", "expected"), [
    (b"GET /metrics HTTP/1.1", b"HTTP/1.1 200 OK"),
    (b"GET /metrics?name[]=offload_probe_total HTTP/1.1", b"HTTP/1.1 200 OK"),
    (b"POST /metrics HTTP/1.1", b"HTTP/1.1 405 Method Not Allowed"),
])
def test_requests_are_answered_and_closed(request_line: bytes, expected: bytes) -> None:
    from offload.observe.metrics_http import MetricsHTTPServer

    server = MetricsHTTPServer("127.0.0.1", 0, _registry())
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(request_line + b"\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(expected)
        assert (b"offload_probe_total 7.0" in answer) == (b"GET" in request_line)
    finally:
        server.close()
