# SPDX-License-Identifier: Apache-2.0
"""The staged path on CUDA: whole chunks gathered or scattered on the GPU, moved by DMA.

`offload.transfer.staging` says where every byte goes; this module issues it.  Two streams:
the engine's stream runs the kernel's staged passes (`KernelCopier.launch_rows`, checksums
included) and a DMA stream runs one ``cuMemcpyBatchAsync`` per slice.  Jobs take the ring's
slots in turn; per slice ``s`` in ring slot ``r``, with two events per slot (*staged*: its rows
are in staging; *free*: their last reader or writer is done):

* store: the engine stream waits until the job's own slice ``s - slots`` freed slot ``r`` (an
  earlier job's use of it is already behind: the engine stream waited for its last DMA),
  gathers into it and records *staged*; the DMA stream waits for *staged*, copies the rows to
  the region and records *free*.  The engine stream finally waits for the last DMA, so the
  job's completion event (recorded there) covers every byte.
* load: the DMA stream waits for *free* of slot ``r`` (its last use, in this job or an earlier
  one), copies the rows from the region and records *staged*; the engine stream waits for it,
  scatters (checking the sums) and records *free*.  Host rows are written only by the DMA
  stream itself (staged stores, in order) or by the engine stream (kernel and copy-engine
  jobs): after such a job, a load's DMAs first wait for the engine stream's work so far.

So a load's DMAs run ahead while earlier scatters wait for SMs behind a forward pass, the
copy engines stay busy, and no event is waited on the host: ``submit`` never blocks.  The
whole issue is one native call (``offload_issue_staged`` in issue.c), or the same driver calls
from Python before the staged passes are compiled and bound.

A layer-wise load (`StagedCopier.launch_layers`) moves the job layer group by layer group
(`offload.transfer.staging.layer_plan`); after a group's last slice the engine stream follows
that group's scatters and records the group's event, which a forward pass waits on.
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import torch

from offload.cuda_driver import bound_function, check
from offload.transfer.base import Direction
from offload.transfer.batch_copy import BatchCopier
from offload.transfer.kernel import STAGED_CELLS, KernelCopier, StagingSlot
from offload.transfer.layout import IndexArray, Job, SlotLayout
from offload.transfer.native import SLICE_FIELDS, StagedIssuer, library, staged_entry_points
from offload.transfer.staging import (
    JobSlices,
    LayerPlan,
    StagePlan,
    TensorGroup,
    check_layer_ends,
    job_slices,
    layer_ends,
    layer_plan,
    layer_runs,
)

KEPT_SHAPES = 64  # job shapes (chunks, first ring slot, layer groups) whose slices are kept
Ranges = tuple[tuple[int, int], ...]  # a layer-wise load's layer groups: (first tensor, count)


class StagedCopier:
    """The staging ring (GPU memory, zeroed once), the DMA stream and the ring's events over
    ``kernel``'s stream; `launch` issues one whole-chunk job."""

    def __init__(self, kernel: KernelCopier, plan: StagePlan, layout: SlotLayout,
                 region_address: int, stream: torch.cuda.Stream, priority: int = 0) -> None:
        self.plan = plan
        self._kernel = kernel
        self._layout = layout
        self._region = region_address
        self._stream = stream
        device = stream.device
        with torch.cuda.stream(stream):  # the engine stream owns it in torch's allocator
            # no fill: every byte a job reads from a staged row, a pass or a DMA of that job
            # wrote first (padding between pages and sums is never copied)
            self.staging = torch.empty(plan.ring_bytes, dtype=torch.uint8, device=device)
        self._base = self.staging.data_ptr()
        self.dma_stream = torch.cuda.Stream(device, priority=priority)
        self._batch = BatchCopier(self.dma_stream)
        self._events = [(torch.cuda.Event(), torch.cuda.Event()) for _ in range(plan.slots)]
        self._start = torch.cuda.Event()
        for staged, free in self._events:  # created now, so their handles exist
            staged.record(stream)
            free.record(stream)
        self._start.record(stream)
        self._record = bound_function("cuEventRecord", ctypes.c_void_p, ctypes.c_void_p)
        self._wait = bound_function("cuStreamWaitEvent", ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_uint)
        self._handles = [(s.cuda_event, f.cuda_event) for s, f in self._events]
        self._raw = (stream.cuda_stream, self.dma_stream.cuda_stream)
        # a load's scatters run on one stream per ring slot: when SMs free up behind a forward
        # pass, every slice whose DMA is done can be scattered at once, not one after another
        self._pass_streams = [torch.cuda.Stream(device, priority=priority)
                              for _ in range(plan.slots)]
        self._passes = [p.cuda_stream for p in self._pass_streams]
        self._shapes: dict[tuple[int, int, Ranges], _Slices] = {}
        self._layer_plans: dict[Ranges, LayerPlan] = {}
        self._runs: dict[tuple[int, Ranges, int], int] = {}
        self._next_slot = 0  # where the next job's first slice goes
        self._engine_wrote = True  # until a load followed it: see `engine_wrote`
        self._native: dict[bool, StagedIssuer | None] = {}  # by direction (load)
        self.issued = {"native": 0, "python": 0}  # jobs per issue path

    def _record_on(self, event: int, stream: int) -> None:
        check(self._record(event, stream), "cuEventRecord")

    def _wait_on(self, stream: int, event: int) -> None:
        check(self._wait(stream, event, 0), "cuStreamWaitEvent")

    def launch(self, direction: Direction, job: Job, chunks: IndexArray,
               caller: int | None) -> tuple[StagingSlot, tuple[np.ndarray, ...]]:
        """Issue whole-chunk ``job`` (``chunks``: the chunk of each run of ``bpc`` entries),
        first ordered after the raw stream ``caller`` when given; returns what the job holds
        until it completes (its index slot, the DMA arrays)."""
        return self._launch(direction, job, chunks, caller, (), [])

    def launch_layers(self, job: Job, chunks: IndexArray, ranges: list[tuple[int, int]],
                      caller: int | None
                      ) -> tuple[tuple[StagingSlot, tuple[np.ndarray, ...]],
                                 list[torch.cuda.Event | None]]:
        """Load whole-chunk ``job`` layer group by layer group (``ranges``: first tensor and
        count, in order); returns what the job holds and one event per group, recorded on
        the engine stream once every page of the group is scattered."""
        events = [torch.cuda.Event() for _ in ranges]
        for event in events:  # created now, so their handles exist; recorded again in order
            event.record(self._stream)
        held = self._launch("load", job, chunks, caller, tuple(ranges), events)
        return held, list(events)

    def _launch(self, direction: Direction, job: Job, chunks: IndexArray, caller: int | None,
                ranges: Ranges, events: list[torch.cuda.Event]
                ) -> tuple[StagingSlot, tuple[np.ndarray, ...]]:
        """Issue ``job`` through the ring's plan, or a layer-wise load's through its layer
        plan with ``events`` (one per range) recorded as each layer group is back."""
        layout = self._layout
        plan = self._layer_plan(ranges).plan if ranges else self.plan
        first = self._next_slot
        parts = self._slices(int(chunks.size), first, ranges)
        host = (parts.host_offsets(chunks, layout.row_stride) + self._region).astype(np.uint64)
        load = direction == "load"
        src, dst = (host, parts.stage) if load else (parts.stage, host)
        after_engine = load and self._engine_wrote
        marks = None
        if ranges:
            marks = (parts.ends, np.array([e.cuda_event for e in events], dtype=np.uint64))
        slot = self._kernel.upload(direction, job, caller)
        try:
            issuer = self._issuer(load, plan)
            if issuer is not None and issuer.issue(load, after_engine, first, len(job),
                                                   parts.table, src, dst, parts.size, marks):
                self.issued["native"] += 1
            else:
                self._issue_here(load, after_engine, first, len(job), parts, src, dst, plan,
                                 events)
                self.issued["python"] += 1
        except BaseException:
            self._fence(slot)
            raise
        if load:
            self._engine_wrote = False
        self._next_slot = (first + len(parts.first_entry)) % self.plan.slots
        return slot, (host, parts.stage, parts.size)  # the DMA arrays, kept to the end

    def layer_runs(self, chunks: int, ranges: list[tuple[int, int]], max_copies: int) -> int:
        """`offload.transfer.staging.layer_runs` for this ring, kept per shape."""
        key = (chunks, tuple(ranges), max_copies)
        runs = self._runs.get(key)
        if runs is None:
            runs = layer_runs(self.plan, self._layout, ranges, chunks, max_copies,
                              lambda merged: self._layer_plan(tuple(merged)))
            if len(self._runs) >= KEPT_SHAPES:
                self._runs.clear()
            self._runs[key] = runs
        return runs

    def _layer_plan(self, ranges: Ranges) -> LayerPlan:
        layered = self._layer_plans.get(ranges)
        if layered is None:
            layered = self._layer_plans[ranges] = layer_plan(self.plan, self._layout,
                                                             list(ranges))
        return layered

    def _fence(self, slot: StagingSlot) -> None:
        """A job failed part-way: whatever it issued must not outlive it.  The engine stream
        waits for the DMA and scatter streams (so every later job, and its completion event,
        follows the stray work), the host waits for that, and the next load's DMAs follow the
        engine stream again; only then is the job's index slot reused."""
        with contextlib.suppress(Exception):  # a broken context: the original error matters
            for other in (self.dma_stream, *self._pass_streams):
                self._stream.wait_stream(other)
            self._stream.synchronize()
            slot.release()
        self._engine_wrote = True

    def engine_wrote(self) -> None:
        """The engine stream was given a job that writes host rows (a kernel or copy-engine
        store, or anything else not staged): the next staged load's DMAs follow it."""
        self._engine_wrote = True

    def _issue_here(self, load: bool, after_engine: bool, first_slot: int, n: int,
                    parts: _Slices, src: np.ndarray, dst: np.ndarray, plan: StagePlan,
                    events: list[torch.cuda.Event]) -> None:
        """What ``offload_issue_staged`` does, from Python: before the staged passes are
        compiled and bound, or without the native library."""
        main, dma = self._raw
        slots, bounds = plan.slots, parts.bounds
        starts, counts = parts.first_entry, parts.entries
        groups = [plan.groups[g] for g in parts.group]
        start = self._start.cuda_event
        if load:  # the scatters follow the engine stream's work so far (the caller's too)
            self._record_on(start, main)
            if after_engine:
                self._wait_on(dma, start)
            for s in range(min(len(groups), slots)):
                self._wait_on(self._passes[(first_slot + s) % slots], start)
        marked, after = -1, -1  # the last mark recorded, and the slice it followed
        for s, group in enumerate(groups):
            r = (first_slot + s) % slots
            staged, free = self._handles[r]
            base = self._base + r * plan.slice_bytes
            first, count = bounds[s], bounds[s + 1] - bounds[s]
            if load:  # the slot's last use, by this job or an earlier one
                self._wait_on(dma, free)
                self._batch.launch_part(src, dst, parts.size, first, count)
                self._record_on(staged, dma)
                self._wait_on(self._passes[r], staged)
                self._rows(True, n, starts[s], counts[s], group, plan.row_bytes, base,
                           self._pass_streams[r])
                self._record_on(free, self._passes[r])
                if marked + 1 < len(events) and parts.ends[marked + 1] == s:
                    self._follow_scatters(first_slot, range(after + 1, s + 1))
                    self._record_on(events[marked + 1].cuda_event, main)
                    marked, after = marked + 1, s
            else:
                if s >= slots:
                    self._wait_on(main, free)
                self._rows(False, n, starts[s], counts[s], group, plan.row_bytes, base,
                           self._stream)
                self._record_on(staged, main)
                self._wait_on(dma, staged)
                self._batch.launch_part(src, dst, parts.size, first, count)
                self._record_on(free, dma)
        # the job's completion event, recorded on the engine stream, follows every scatter of
        # a load (those before the last mark already) and every copy of a store
        if load:
            self._follow_scatters(first_slot, range(after + 1, len(groups)))
        elif groups:
            self._wait_on(main, self._handles[(first_slot + len(groups) - 1) % slots][1])

    def _follow_scatters(self, first_slot: int, slices: range) -> None:
        """The engine stream waits for every scatter of a load's ``slices``: each ring
        slot's last use among them (a slot's scatters run in order on its own stream)."""
        slots = self.plan.slots
        for s in reversed(slices[-slots:]):
            self._wait_on(self._raw[0], self._handles[(first_slot + s) % slots][1])

    def _issuer(self, load: bool, plan: StagePlan) -> StagedIssuer | None:
        """The native staged issue of one direction over its pass as bound now, its row
        stride set for ``plan``; None before the pass is bound, while a profiler watches
        Triton's launches, or without the native library.  Made again if the pass was bound
        again (the issuer holds its cells)."""
        kernel = self._kernel.staged_kernel(load, plan.row_bytes)
        if kernel is None:
            return None  # not compiled yet (its first job compiles it), or a profiler watches
        cached = self._native.get(load)
        if cached is not None and cached.kernel is kernel:
            return cached
        if load in self._native and cached is None:
            return None  # no native library: known since the first try
        lib, driver = library(), staged_entry_points()
        issuer = None
        if lib is not None and driver is not None:
            issuer = StagedIssuer(lib, driver, kernel, STAGED_CELLS, self._raw,
                                  self._start.cuda_event, self._passes, self._handles,
                                  self._kernel.shape, self._batch.attributes)
        self._native[load] = issuer
        return issuer

    def _slices(self, count: int, first_slot: int, ranges: Ranges) -> _Slices:
        """The slices of a job of ``count`` chunks from ring slot ``first_slot`` on (a
        layer-wise load's in layer groups ``ranges``), with absolute staging addresses, kept
        per shape (the most recent `KEPT_SHAPES`): the same for every such job."""
        key = (count, first_slot, ranges)
        parts = self._shapes.pop(key, None)
        if parts is None:
            layered = self._layer_plan(ranges) if ranges else None
            plan = layered.plan if layered is not None else self.plan
            parts = _Slices(job_slices(plan, self._layout, count, first_slot), plan,
                            first_slot, self._base, layered, len(ranges))
            if len(self._shapes) >= KEPT_SHAPES:
                del self._shapes[next(iter(self._shapes))]
        self._shapes[key] = parts  # newest last
        return parts

    def _rows(self, load: bool, n: int, first: int, count: int, group: TensorGroup,
              row_bytes: int, base: int, stream: torch.cuda.Stream) -> None:
        self._kernel.launch_rows(load, n, first, count, group.first, group.count, row_bytes,
                                 base, base + group.stage_trailer, stream)


class _Slices:
    """`JobSlices` as the driver and ``offload_issue_staged`` take them: staging addresses and
    sizes as uint64 (a job adds its host addresses), and one int64 row of `SLICE_FIELDS` per
    slice -- first entry, entries, first tensor, tensors, its ring slot's staging address and
    that of its sums, first copy, copies; a layer-wise load's ``ends`` (int64: the last slice
    of each of its ``layers`` layer groups, `layer_ends`, checked here once per shape)."""

    def __init__(self, parts: JobSlices, plan: StagePlan, first_slot: int, ring: int,
                 layered: LayerPlan | None = None, layers: int = 0) -> None:
        self.first_entry, self.entries = parts.first_entry, parts.entries
        self.ends = np.array([] if layered is None else layer_ends(
            parts, layered.layer, layers), dtype=np.int64)
        if layered is not None:
            check_layer_ends(self.ends, layers, len(parts))
        self.group, self.bounds = parts.group, parts.bounds
        self.stage = (parts.stage + ring).astype(np.uint64)
        self.size = parts.size.astype(np.uint64)
        self.host_offsets = parts.host_offsets
        base = [ring + ((first_slot + s) % plan.slots) * plan.slice_bytes
                for s in range(len(parts))]
        groups = [plan.groups[g] for g in parts.group]
        self.table = np.array(
            [[first, entries, g.first, g.count, at, at + g.stage_trailer, start, stop - start]
             for first, entries, g, at, start, stop in zip(
                 parts.first_entry, parts.entries, groups, base, parts.bounds,
                 parts.bounds[1:], strict=False)], dtype=np.int64).reshape(-1, SLICE_FIELDS)
