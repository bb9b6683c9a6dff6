"""A thread pool whose tasks of one key run one after another, in submission order.

The file tier decides everything (store, evict, read) when it is called and leaves the I/O to
threads; operations on *different* files may run in any order and in parallel, but those on
*one* file must not overtake each other (an eviction's unlink must not remove a newer write, a
read must see the write it was promised).  Chaining each task behind the previous task of its
key with a done-callback gives that order without a caller or a pool thread ever blocking.

NOTE: the workers are daemon threads and `shutdown` waits at most a deadline.  A stalled file
system can hold a thread in a system call indefinitely; the tier's close and the process's exit
must not hang with it (the tier's callers already treated that I/O as a miss).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, TypeVar

T = TypeVar("T")


class KeyedPool:
    """``threads`` worker threads; `submit` runs tasks of the same key in order."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()
        self._lock = threading.Lock()
        self._tails: dict[Hashable, Future[Any]] = {}  # the last task submitted per key
        self._finished = 0  # tasks run so far: `drain` tells a long queue from a stall
        self._progress = threading.Condition(self._lock)

    def submit(self, key: Hashable, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` after every task submitted earlier for ``key``; its future carries the
        result (or the exception, which is a bug of ``fn``)."""
        result: Future[T] = Future()

        def run() -> None:
            try:
                result.set_result(fn())
            except BaseException as exc:
                result.set_exception(exc)
            with self._progress:
                self._finished += 1
                self._progress.notify_all()

        def start(_: object = None) -> None:
            self._queue.put(run)

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

    def drain(self, timeout_s: float | None = None, stall_s: float | None = None) -> bool:
        """Wait until every task submitted so far (and any chained behind them) has run, or
        ``timeout_s`` passed, or ``stall_s`` passed without a task finishing (None: no such
        limit; a long queue of healthy I/O keeps finishing tasks, a stalled file system does
        not).  Returns True when nothing is left."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._progress:
            while self._tails:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                stalls = stall_s is not None and (left is None or stall_s <= left)
                finished = self._finished
                self._progress.wait(stall_s if stalls else left)
                if stalls and self._finished == finished:  # stall_s without a task finishing
                    return False
            return True

    def pending(self) -> int:
        """Keys with a task queued or running."""
        with self._lock:
            return len(self._tails)

    def map(self, fn: Callable[[Any], T], items: list[Any], stall_s: float) -> list[T | None]:
        """``fn`` over ``items`` in parallel, ignoring keys (start-up work); None for the items
        still running once ``stall_s`` passed without one finishing (a stalled file system:
        their threads are left to end with them)."""
        futures = [self.submit(object(), functools.partial(fn, item)) for item in items]
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=stall_s, return_when=FIRST_COMPLETED)
            if not finished:
                break
        return [f.result() if f.done() else None for f in futures]

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Finish the tasks (waiting at most ``timeout_s``) and stop the threads; a thread
        still inside a task is left to end with it.  Returns True when every task ran."""
        drained = self.drain(timeout_s)
        if drained:
            self._stop()
        else:  # tasks chained behind a stalled one must still run once it returns
            threading.Thread(target=self._stop_when_drained, name="offload-pool-stopper",
                             daemon=True).start()
        return drained

    def _stop(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def _stop_when_drained(self) -> None:
        self.drain()
        self._stop()

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            task()


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
