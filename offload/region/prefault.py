"""Populate a mapping's pages up front, in parallel, without holding the GIL.

``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) allocates and maps every page of a range in one
call.  Python's ``mmap.madvise`` holds the GIL, so libc is called through ctypes (which releases
it) from a thread pool; work is cut into pieces ordered so that threads starting together land
in different shm files (one file serialises page-cache insertion).  Kernels without the advice
answer EINVAL; then one byte per page is rewritten through a strided torch view, which also runs
without the GIL and without a Python loop per page.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from offload.errors import OffloadError
from offload.region.geometry import ByteRange, interleave_by_segment, split_work
from offload.sizes import format_size
from offload.system.shm import libc, tensor_at

MADV_POPULATE_WRITE = 23
MIN_PIECE = 2 << 20
# NOTE: a pipelined registration starts once the pieces holding its pages are in, so large
# pieces delay pinning behind pre-fault, while below a few MiB per-call overhead shows.  32 MiB
# was the fastest of a 256-8 MiB sweep and populates as fast as larger pieces
# (docs/BENCHMARKS.md, "Nameless regions: node start-up", the registration variants).
MAX_PIECE = 32 << 20

PopulateFn = Callable[[int, int], int]
"""``populate(address, length) -> errno`` (0 on success): the seam tests replace."""
ProgressFn = Callable[[int, int, float], None]
"""``progress(bytes_done, bytes_total, elapsed_s)``."""


def madvise_populate(address: int, length: int) -> int:
    """MADV_POPULATE_WRITE through libc; returns 0 or the errno."""
    if libc.madvise(address, length, MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


def touch_pages(address: int, length: int) -> None:
    """Write-fault every system page of the range by rewriting its first byte in place (a
    strided view copied onto a clone of itself: one torch op, GIL released)."""
    view = tensor_at(address, length)[::mmap.PAGESIZE]
    view.copy_(view.clone())


@dataclass
class PrefaultResult:
    bytes: int
    seconds: float
    fallback: bool
    """True when the kernel refused MADV_POPULATE_WRITE and pages were touched instead."""


def piece_bytes(total: int, threads: int) -> int:
    """Small enough that every thread gets several pieces (and pinning can start early),
    large enough that per-call overhead vanishes."""
    return max(MIN_PIECE, min(MAX_PIECE, total // (threads * 4)))


def plan_pieces(ranges: Sequence[ByteRange], segments: Sequence[ByteRange], threads: int,
                page_size: int) -> list[ByteRange]:
    """The pieces ``prefault`` executes, in order (exposed so a pinner can track them)."""
    total = sum(r.length for r in ranges)
    pieces = split_work(ranges, piece_bytes(total, threads), page_size)
    return interleave_by_segment(pieces, segments)


class Populator:
    """Runs pieces; after the first EINVAL every piece goes straight to the touch fallback."""

    def __init__(self, base: int, populate: PopulateFn) -> None:
        self.base = base
        self.populate = populate
        self.unsupported = threading.Event()

    def run(self, piece: ByteRange) -> None:
        address = self.base + piece.offset
        if not self.unsupported.is_set():
            err = self.populate(address, piece.length)
            if err == 0:
                return
            if err != errno.EINVAL:
                raise populate_error(err, address, piece.length)
            self.unsupported.set()
        touch_pages(address, piece.length)


def populate_error(err: int, address: int, length: int) -> Exception:
    """What a failed ``MADV_POPULATE_WRITE`` of ``length`` bytes at ``address`` raises."""
    if err in (errno.ENOMEM, errno.EFAULT):  # EFAULT: the page would SIGBUS
        return OffloadError(
            f"pre-faulting {format_size(length)} at {address:#x} ran out of memory "
            f"({errno.errorcode[err]}): the host or its cgroup has no room left for the "
            "region; lower --cpu-bytes or free memory")
    return OSError(err, f"madvise(MADV_POPULATE_WRITE) of {length} B at {address:#x} failed: "
                        f"{errno.errorcode.get(err, err)}")


def prefault(base: int, pieces: Sequence[ByteRange], *, threads: int,
             populate: PopulateFn = madvise_populate,
             on_piece: Callable[[ByteRange], None] | None = None,
             progress: ProgressFn | None = None, interval_s: float = 2.0,
             on_thread_start: Callable[[], None] | None = None) -> PrefaultResult:
    """Populate ``pieces`` (offsets from ``base``) with ``threads`` workers.

    ``on_thread_start`` runs first in each worker (NUMA placement binds the thread there);
    ``on_piece`` runs in the worker right after each piece (the pipelined pinner uses it);
    ``progress`` runs in the calling thread every ``interval_s`` and once at the end.  The
    first failure cancels the pieces not yet started and propagates.
    """
    total = sum(p.length for p in pieces)
    populator = Populator(base, populate)
    done = [0]
    lock = threading.Lock()

    def work(piece: ByteRange) -> None:
        populator.run(piece)
        with lock:
            done[0] += piece.length
        if on_piece is not None:
            on_piece(piece)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="prefault",
                                               initializer=on_thread_start) as pool:
        futures = [pool.submit(work, p) for p in pieces]
        pending = set(futures)
        try:
            while pending:
                finished, pending = concurrent.futures.wait(
                    pending, timeout=interval_s,
                    return_when=concurrent.futures.FIRST_EXCEPTION)
                for f in finished:
                    f.result()
                if progress is not None and pending:
                    progress(done[0], total, time.perf_counter() - start)
        except BaseException:
            for f in pending:
                f.cancel()
            raise
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(total, total, seconds)
    return PrefaultResult(total, seconds, populator.unsupported.is_set())


def progress_logger(log: logging.Logger, label: str = "pre-fault") -> ProgressFn:
    """A ``progress`` callback that logs bytes done, rate and ETA (for rank 0)."""

    def report(done: int, total: int, elapsed: float) -> None:
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else float("inf")
        log.info("%s: %s of %s, %.2f GiB/s, ETA %.1f s", label, format_size(done),
                 format_size(total), rate / (1 << 30), eta)

    return report
