"""A thread pool whose tasks of one key run one after another, in submission order.

The file tier decides everything (store, evict, read) when it is called and leaves the I/O to
threads; operations on *different* files may run in any order and in parallel, but those on
*one* file must not overtake each other (an eviction's unlink must not remove a newer write, a
read must see the write it was promised).  Chaining each task behind the previous task of its
key with a done-callback gives that order without a caller or a pool thread ever blocking.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")


class KeyedPool:
    """``threads`` worker threads; `submit` runs tasks of the same key in order."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._tails: dict[Hashable, Future[Any]] = {}  # the last task submitted per key

    def submit(self, key: Hashable, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` after every task submitted earlier for ``key``; its future carries the
        result (or the exception, which is a bug of ``fn``)."""
        result: Future[T] = Future()

        def run() -> None:
            try:
                result.set_result(fn())
            except BaseException as exc:
                result.set_exception(exc)

        def start(_: object = None) -> None:
            self._pool.submit(run)

        def forget(_: object) -> None:
            with self._lock:
                if self._tails.get(key) is result:
                    del self._tails[key]

        with self._lock:
            previous = self._tails.get(key)
            self._tails[key] = result
        result.add_done_callback(forget)
        if previous is None:
            start()
        else:
            previous.add_done_callback(start)  # runs at once if it is already done
        return result

    def drain(self) -> None:
        """Wait until every task submitted so far (and any chained behind them) has run."""
        while True:
            with self._lock:
                pending = list(self._tails.values())
            if not pending:
                return
            wait(pending)

    def map(self, fn: Callable[[Any], T], items: list[Any]) -> list[T]:
        """``fn`` over ``items`` in parallel, ignoring keys (start-up work)."""
        return list(self._pool.map(fn, items))

    def shutdown(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)


def done(value: T) -> Future[T]:
    """A future that already holds ``value``."""
    future: Future[T] = Future()
    future.set_result(value)
    return future


def all_done(futures: list[Future[None]]) -> Future[None]:
    """One future that completes when all of ``futures`` have."""
    result: Future[None] = Future()
    remaining = [len(futures)]
    lock = threading.Lock()
    if not futures:
        result.set_result(None)

    def one(_: object) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            result.set_result(None)

    for future in futures:
        future.add_done_callback(one)
    return result
