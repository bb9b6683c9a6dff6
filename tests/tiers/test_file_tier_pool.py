"""The file tier's keyed pool: tasks of one key in submission order, other keys in parallel."""

from __future__ import annotations

import threading
import time

import pytest

from offload.tiers.keyed_pool import KeyedPool, all_done, done


def test_tasks_of_one_key_run_in_order_and_other_keys_overtake() -> None:
    pool = KeyedPool(4, "test")
    order: list[str] = []
    gate = threading.Event()
    first = pool.submit("a", lambda: (gate.wait(10), order.append("a1"))[1])
    second = pool.submit("a", lambda: order.append("a2"))
    other = pool.submit("b", lambda: order.append("b"))
    other.result(10)
    assert order == ["b"] and not second.done()  # a2 waits for a1, b did not
    gate.set()
    second.result(10)
    assert first.done() and order == ["b", "a1", "a2"]
    pool.shutdown()


def test_drain_waits_for_chained_tasks_and_errors_reach_the_future() -> None:
    pool = KeyedPool(2, "test")
    seen: list[int] = []
    gate = threading.Event()
    pool.submit("k", gate.wait)
    tail = [pool.submit("k", lambda i=i: seen.append(i)) for i in range(5)]
    failing = pool.submit("x", lambda: 1 // 0)
    gate.set()
    pool.drain()
    assert seen == list(range(5)) and all(f.done() for f in tail)
    with pytest.raises(ZeroDivisionError):
        failing.result()
    pool.shutdown()


def test_done_helpers() -> None:
    assert done(3).result() == 3
    assert all_done([]).done()
    pending = [done(None), done(None)]
    assert all_done(pending).done()


def test_drain_gives_up_on_a_stall_but_not_on_a_long_queue_of_one_key() -> None:
    """``stall_s`` bounds the time without a task finishing, not the whole wait: six chained
    tasks of one key taking 0.15 s each drain (0.9 s > stall_s), a blocked task does not."""
    pool = KeyedPool(2, "test-pool")
    try:
        for _ in range(6):
            pool.submit("one key", lambda: time.sleep(0.15))
        began = time.monotonic()
        assert pool.drain(stall_s=0.6) is True
        assert time.monotonic() - began > 0.6
        gate = threading.Event()
        pool.submit("stuck", lambda: gate.wait(30))
        began = time.monotonic()
        assert pool.drain(stall_s=0.3) is False
        assert 0.25 < time.monotonic() - began < 5
        gate.set()
        assert pool.drain(stall_s=5) is True
    finally:
        pool.shutdown(5)
