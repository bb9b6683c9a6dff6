"""Stream ordering shared by the CUDA backends, and the slow per-block fallback.

Every job runs on the engine's own stream, ordered after the caller's stream or event (default:
the current stream when the job was submitted): a store then sees the compute kernels' pending
writes and a load does not overtake them.  One event per job, queried without blocking, reports
completion and is handed back so a compute stream can wait for the job on the GPU.  A job's
checksum result (`Lease.failure`) is read when the job is found complete, before its lease is
released.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

import torch

from offload.errors import OffloadError
from offload.transfer.base import After, Direction, EngineBase
from offload.transfer.layout import Job, SlotLayout

log = logging.getLogger(__name__)

# Programs (so SMs) the kernel may occupy, per direction.  Stores are posted writes that, issued
# from many SMs, back up the memory system and stall concurrent compute.  From 8 programs up the
# copy rate is flat while a concurrent matmul loses more with every program added, most beside
# stores, so stores take 8.  Loads keep 32, the budget the engine figures were measured with:
# 8-16 copied as fast on 16-64 KiB pages and left compute more, but 4 starved loads of 64 KiB
# pages (docs/BENCHMARKS.md, "Engine-shaped transfers", the program budget;
# `scripts/bench_engine.py --sweep-programs` reruns it).
DEFAULT_COPY_PROGRAMS: dict[Direction, int] = {"load": 32, "store": 8}


class Lease:
    """Something a job holds until the engine found it complete; `release` hands it back
    (`offload.transfer.kernel.StagingSlot`).  Other objects `_launch` returns are only kept
    alive until then."""

    def failure(self) -> tuple[int, int, int] | None:
        """For a completed load whose checksums were checked: (job entry, tensor, piece of
        the page) of a unit that did not match, or None."""
        return None

    def release(self) -> None:
        """The job's copy is complete: nothing on the GPU reads this any more."""


class StreamEngine(EngineBase):
    """Orders jobs after ``after`` and tracks them with events; ``_launch`` enqueues the bytes
    on ``self._stream`` and may return objects that must live until the job is done (a
    `Lease` is released then)."""

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int, priority: int = 0) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count)
        self._device = self._geometry.device
        self._stream = torch.cuda.Stream(self._device, priority=priority)
        self._ordered = torch.cuda.Event()  # re-recorded per job: the caller's stream point
        self._ordered.record(self._stream)  # created now: native launches use its handle
        self._caller: tuple[int, torch.cuda.Stream] | None = None  # (raw handle, stream)
        self._pending: deque[tuple[int, torch.cuda.Event, object, Job]] = deque()

    @property
    def stream(self) -> torch.cuda.Stream:
        return self._stream

    def _issue(self, job_id: int, direction: Direction, job: Job, after: After
               ) -> torch.cuda.Event:
        return self._on_device(job_id, direction, job, after, None)[0]

    def _issue_layers(self, job_id: int, job: Job, ranges: list[tuple[int, int]], after: After
                      ) -> list[torch.cuda.Event | None]:
        return self._on_device(job_id, "load", job, after, ranges)[1]

    def _on_device(self, job_id: int, direction: Direction, job: Job, after: After,
                   ranges: list[tuple[int, int]] | None
                   ) -> tuple[torch.cuda.Event, list[torch.cuda.Event | None]]:
        """`_issue_here` on the engine's device: the driver calls of the launch paths act on
        the current context, so a caller whose current device is another GPU gets it switched
        for the call (one device query per job otherwise)."""
        if torch.cuda.current_device() != self._device.index:
            with torch.cuda.device(self._device):
                return self._issue_here(job_id, direction, job, after, ranges)
        return self._issue_here(job_id, direction, job, after, ranges)

    def _issue_here(self, job_id: int, direction: Direction, job: Job, after: After,
                    ranges: list[tuple[int, int]] | None
                    ) -> tuple[torch.cuda.Event, list[torch.cuda.Event | None]]:
        """Order, launch (the whole job, or a load group by group with ``ranges``), record
        the job's completion event; returns it and the groups' events."""
        stream = self._stream
        keep: object = None
        caller: int | None = None
        if after is None:  # the default: after the caller's current stream
            caller = torch._C._cuda_getCurrentRawStream(self._device.index)
        elif isinstance(after, torch.cuda.Event):
            stream.wait_event(after)
        elif isinstance(after, torch.cuda.Stream):
            stream.wait_stream(after)
        else:
            raise OffloadError(f"job {job_id}: after={after!r} is neither a torch.cuda."
                               "Event nor a torch.cuda.Stream; pass one of them or None")
        groups: list[torch.cuda.Event | None] = []
        if not len(job):
            if caller is not None:
                self._wait_for(caller)
        elif ranges is not None:
            keep, groups = self._launch_layers(job, ranges, caller)
        elif caller is not None:
            keep = self._launch_after(caller, direction, job)
        else:
            keep = self._launch(direction, job)
        done = torch.cuda.Event()
        done.record(stream)
        self._pending.append((job_id, done, keep, job))
        return done, groups or [done] * len(ranges or ())

    def _wait_for(self, caller: int) -> None:
        """Order the copy stream after the caller's current stream (raw handle ``caller``).
        The stream object is rebuilt only when the handle changes (``torch.cuda.
        current_stream`` builds a new one per call, which costs more than the rest of a small
        job's launch on a cold CPU)."""
        if self._caller is None or self._caller[0] != caller:
            self._caller = (caller, torch.cuda.current_stream(self._device))
        self._ordered.record(self._caller[1])
        self._stream.wait_event(self._ordered)

    def _launch_after(self, caller: int, direction: Direction, job: Job) -> object:
        """Order after the raw stream ``caller``, then `_launch`; the kernel backends do both
        in one native call where they can (`offload.transfer.native`)."""
        self._wait_for(caller)
        return self._launch(direction, job)

    def _launch(self, direction: Direction, job: Job) -> object:
        raise NotImplementedError

    def _launch_layers(self, job: Job, ranges: list[tuple[int, int]], caller: int | None
                       ) -> tuple[object, list[torch.cuda.Event | None]]:
        """Launch a load group by group (``ranges`` of tensors), after the raw stream
        ``caller`` when given; returns what the job holds and one event per group.  Here, for
        backends without group launches: the whole job, and no group events (each group then
        gets the job's completion event)."""
        if caller is not None:
            return self._launch_after(caller, "load", job), []
        return self._launch("load", job), []

    def poll(self) -> list[int]:
        finished = []
        while self._pending and self._pending[0][1].query():
            finished.append(self._retire(*self._pending.popleft()))
        return finished

    def wait_all(self) -> list[int]:
        if self._pending:
            self._pending[-1][1].synchronize()
        finished = [self._retire(*entry) for entry in self._pending]
        self._pending.clear()
        return finished

    def _retire(self, job_id: int, done: torch.cuda.Event, keep: object, job: Job) -> int:
        """A completed job: read its checksum result, release what it held (`Lease`s, alone
        or in a tuple); return its id.  The job's index arrays may live in the lease's
        staging buffer, so they are read first."""
        leases = [k for k in (keep if isinstance(keep, tuple) else (keep,))
                  if isinstance(k, Lease)]
        for lease in leases:
            failed = lease.failure()
            if failed is not None:
                entry, tensor, piece = failed
                self._mismatch(job_id, tensor, int(job.host_pages[entry]), piece)
                break
        for lease in leases:
            lease.release()
        return job_id


class PerBlockEngine(StreamEngine):
    """One ``copy_`` per page: correct with unpinned host memory (CUDA stages pageable copies
    itself) but slow for small blocks: one copy call per page (docs/BENCHMARKS.md, "Transfers",
    the ``per_blk`` column)."""

    name = "per_block"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int, priority: int = 0) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count, priority)
        self._pages = self._page_views()
        if layout.integrity:
            # NOTE: the region is not registered, so no GPU pass can reach its trailer; this
            # path is the fallback for unpinned memory and runs without checksums.
            log.warning("transfer backend 'per_block' (unpinned region) does not checksum "
                        "pages: integrity is off for this rank's jobs; pin the region")
        self.integrity = False

    def _launch(self, direction: Direction, job: Job) -> None:
        self._copy(direction, job, self._pages)

    def _launch_layers(self, job: Job, ranges: list[tuple[int, int]], caller: int | None
                       ) -> tuple[object, list[torch.cuda.Event | None]]:
        if caller is not None:
            self._wait_for(caller)
        events: list[torch.cuda.Event | None] = []
        for first, count in ranges:
            self._copy("load", job, self._pages[first:first + count])
            event = torch.cuda.Event()
            event.record(self._stream)
            events.append(event)
        return None, events

    def _copy(self, direction: Direction, job: Job,
              pages: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        bpc = self._layout.blocks_per_chunk
        with torch.cuda.stream(self._stream):
            for block, host_page in zip(job.blocks.tolist(), job.host_pages.tolist(),
                                        strict=True):
                chunk, position = divmod(host_page, bpc)
                for kv, host in pages:
                    if direction == "store":
                        host[chunk, position].copy_(kv[block], non_blocking=True)
                    else:
                        kv[block].copy_(host[chunk, position], non_blocking=True)
