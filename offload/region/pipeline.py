"""Pinning pipelined with pre-fault: register a range as soon as its pages are populated.

Registration is serialised host-wide by the driver and runs at about the pre-fault rate, so
doing it after pre-fault nearly doubles start-up.  A ``PinPipeline`` counts, for every
registration range, the pre-fault pieces that overlap it; the worker that finishes a range's
last piece queues it, and one pin thread registers queued ranges while later pieces populate.
Ranges whose pages other processes populate (a replicated rank registers the whole node region
but pre-faults only its shard) are ``held`` as well: they wait for `release`, which the region
calls after the node's pre-fault exchange.  Built with no pieces and nothing held, every range
is ready at once (pinning after a barrier).
"""

from __future__ import annotations

import bisect
import queue
import threading
import time
from collections.abc import Iterator, Sequence

from offload.geometry import ByteRange
from offload.region.pin import Pinner


def split_rows(ranges: Sequence[ByteRange], row_stride: int, grain: int) -> list[ByteRange]:
    """Cut row-aligned ranges into runs of whole rows of about ``grain`` bytes (at least one
    row), so a range's pages are all populated soon after pre-fault reaches it instead of at
    the very end.  Cuts fall on row boundaries, so no block ever spans two registrations;
    ranges that are not row-aligned (one slot per row) are kept whole."""
    rows_per = max(1, grain // row_stride)
    out: list[ByteRange] = []
    for r in ranges:
        if r.offset % row_stride or r.length % row_stride:
            out.append(r)
            continue
        step = rows_per * row_stride
        out.extend(ByteRange(start, min(step, r.end - start))
                   for start in range(r.offset, r.end, step))
    return out


PIN_THREADS = 1  # registration threads per process


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
        self._threads = [threading.Thread(target=self._run, name=f"offload-pin-{i}", daemon=True)
                         for i in range(PIN_THREADS)]
        for thread in self._threads:
            thread.start()

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
        self._join()
        if self._error is not None:
            raise self._error
        pending = [r for r, n in zip(self._ranges, self._remaining, strict=True) if n]
        if pending:
            raise RuntimeError(f"{len(pending)} registration ranges still wait for pre-fault "
                               f"pieces, first {pending[0]}")

    def stop(self) -> None:
        """Abandon queued ranges and wait for the thread (error paths, close)."""
        self._stopped.set()
        self._join()

    def _join(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def _run(self) -> None:
        while (i := self._queue.get()) is not None:
            if self._stopped.is_set() or self._error is not None:
                continue
            start = time.perf_counter()
            try:
                self._pinner.pin(self._ranges[i])
            except BaseException as exc:
                self._error = exc
            with self._lock:
                self.busy_s += time.perf_counter() - start

    def _overlapping(self, piece: ByteRange) -> Iterator[int]:
        i = max(0, bisect.bisect_right(self._starts, piece.offset) - 1)
        while i < len(self._ranges) and self._ranges[i].offset < piece.end:
            if self._ranges[i].end > piece.offset:
                yield i
            i += 1
