"""Pinning on its own thread, each range as soon as its pages are populated.

A ``PinPipeline`` counts, for every registration range, the pre-fault pieces that overlap it;
the worker that finishes a range's last piece queues it, and one pin thread registers queued
ranges while later pieces populate (the shared layout's slot-sized registrations).  Ranges
registered after pre-fault instead -- whole rows, or pages other processes populate -- are
``held``: they wait for `release`, which the region calls once pre-fault (and the node's
exchange) is over.  Why which ranges go which way: ``host_region``'s docstring.
"""

from __future__ import annotations

import bisect
import queue
import threading
import time
from collections.abc import Iterator, Sequence

from offload.geometry import ByteRange
from offload.region.pin import Pinner


class PinPipeline:
    """Registers ``ranges`` (sorted, disjoint) through ``pinner`` on its own thread; each waits
    for the ``pieces`` that overlap it and, if listed in ``held``, for `release`."""

    def __init__(self, pinner: Pinner, ranges: Sequence[ByteRange],
                 pieces: Sequence[ByteRange] = (), held: Sequence[ByteRange] = ()) -> None:
        self._pinner = pinner
        self._ranges = list(ranges)
        self._starts = [r.offset for r in self._ranges]
        self._remaining = [0] * len(self._ranges)
        for piece in pieces:
            for i in self._overlapping(piece):
                self._remaining[i] += 1
        index = {r: i for i, r in enumerate(self._ranges)}
        self._held = [index[r] for r in held]
        for i in self._held:
            self._remaining[i] += 1
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self.busy_s = 0.0
        for i, count in enumerate(self._remaining):
            if count == 0:
                self._queue.put(i)
        self._thread = threading.Thread(target=self._run, name="offload-pin", daemon=True)
        self._thread.start()

    def piece_done(self, piece: ByteRange) -> None:
        """Called by a pre-fault worker once ``piece`` is populated."""
        self._count_down(self._overlapping(piece))

    def release(self) -> None:
        """The ``held`` ranges' pages are in (every local rank finished its pre-fault)."""
        held, self._held = self._held, []
        self._count_down(iter(held))

    def _count_down(self, indices: Iterator[int]) -> None:
        ready = []
        with self._lock:
            for i in indices:
                self._remaining[i] -= 1
                if self._remaining[i] == 0:
                    ready.append(i)
        for i in ready:
            self._queue.put(i)

    def finish(self) -> None:
        """Wait until every range is registered (all pieces must be done) or raise the
        registration error.  Rolling back is the pinner owner's job."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        pending = [r for r, n in zip(self._ranges, self._remaining, strict=True) if n]
        if pending:
            raise RuntimeError(f"{len(pending)} registration ranges still wait for pre-fault "
                               f"pieces, first {pending[0]}")

    def stop(self) -> None:
        """Abandon queued ranges and wait for the thread (error paths, close)."""
        self._stopped.set()
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while (i := self._queue.get()) is not None:
            if self._stopped.is_set() or self._error is not None:
                continue
            start = time.perf_counter()
            try:
                self._pinner.pin(self._ranges[i])
            except BaseException as exc:
                self._error = exc
            self.busy_s += time.perf_counter() - start

    def _overlapping(self, piece: ByteRange) -> Iterator[int]:
        i = max(0, bisect.bisect_right(self._starts, piece.offset) - 1)
        while i < len(self._ranges) and self._ranges[i].offset < piece.end:
            if self._ranges[i].end > piece.offset:
                yield i
            i += 1
