"""The fast backend: one Triton launch per job over every KV tensor, addresses computed on the GPU.

At engine start one small table goes to the GPU: per KV tensor its base, block stride, page size
and the host offset of its (chunk 0, position 0) page, all in elements of the widest access
every one of them allows, up to ``MAX_WORD`` (8 bytes, else 4/2/1; chosen once).
Per job only its index arrays travel -- GPU block ids and host pages (chunk x blocks_per_chunk +
position), with integrity each host page's generation, int32 words where they fit
(`layout.index_sections`) -- written into a reused pinned staging slot and copied with one
asynchronous upload into a reused device buffer.  The kernel maps work item ``w`` to (entry,
tensor, piece of page) and derives both addresses, so the host does no work per page or per
tensor and allocates nothing per job (the buffers grow only for a job larger than any before,
and a staging slot is added only while every slot is still held by a job in flight).

Programs are persistent and bounded per direction (``DEFAULT_COPY_PROGRAMS``): each keeps
``STEP_BYTES`` in flight per step, enough programs cover PCIe latency, and few enough leave the
SMs to concurrent compute.  Issuing a job skips Triton's Python launch path after the first one:
one native call (`offload.transfer.native`) orders the job after the caller's stream, uploads
its indices and launches the compiled kernel with ``cuLaunchKernel`` over a parameter block
built once (`offload.transfer.launcher`); without the native library the same calls are made
from Python, and where the launch cannot be reproduced exactly, the compiled kernel's own
launcher runs.

Integrity (a layout with a checksum trailer, `offload.integrity`): the same pass sums every work
item it copies -- a work item is one checksum unit -- and, on a store, writes the sum into the
slot's trailer in host memory (the region is registered, so the kernel reaches it directly);
on a load it compares the sum of the bytes it read with the trailer and, on a mismatch, writes
the failing work item into the job's pinned result word (`StagingSlot.failed`), which the
engine reads when it finds the job complete.  Each item's identity includes its host page's
store generation (`TransferEngine.generations`), which travels in the job's upload as it was
when the job was issued: no pass reads host memory for it, and a later store's renewal of a
page cannot fail a load still queued.  The copy engines' jobs get the same kernel in sum-only
mode (``COPY`` off: it reads the GPU pages at HBM speed and moves nothing): before their DMA on
a store, after it on a load.  The result
word's address travels with the job's indices (two words after them), so the native and bound
launch paths pass no new argument per job.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from offload.cuda_driver import bound_function, check
from offload.errors import OffloadError
from offload.integrity import UNIT_BYTES
from offload.transfer import kernel_cache
from offload.transfer.base import DIRECTIONS, Direction
from offload.transfer.cuda import DEFAULT_COPY_PROGRAMS, Lease, StreamEngine
from offload.transfer.kernel_cache import Variant
from offload.transfer.launcher import BoundKernel, bind, bind_function, hooks_active
from offload.transfer.layout import (
    Job,
    SlotLayout,
    common_alignment,
    index_sections,
    index_words,
    pack_generations,
)
from offload.transfer.native import NativeIssuer, driver_entry_points, library

STEP_BYTES = 32 << 10  # per program and step in flight
MAX_TILE_BYTES = UNIT_BYTES  # one work item: a page, or a piece of a larger one (a checksum unit)
NUM_WARPS = 4
# Widest access in bytes.  16 (two int64 lanes, vectorised) copies no faster than 8 on whole
# 16 KiB pages, and stores of pages split into several pieces (64 KiB, 1 MiB) fall to a third of
# the rate with it (docs/BENCHMARKS.md, "Figures moved from code comments"): 8 until that is
# understood; ``max_word=16`` keeps the option.
MAX_WORD = 8
STAGING_SLOTS = 4  # pinned staging buffers made at first; more only while all are in flight
# Programs of a sum-only pass: it reads GPU memory only, so it is short with many programs.
SUM_PROGRAMS = 264
_ELEMENTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# runtime arguments, in order (the bound launch's parameter cells)
PARAMETERS = ("anchor", "table", "job", "n", "items", "num_tensors", "row_stride", "bpc", "sums",
              "first_entry", "first_tensor", "all_tensors", "stage", "stage_sums")
# integers compiled once whatever their value, and the staged pointers, whose alignment varies
_SCALARS = (*PARAMETERS[3:8], *PARAMETERS[9:])
SPECIALISED = tuple(i for i, name in enumerate(PARAMETERS) if name not in _SCALARS)
VARYING = (3, 4, 5, 6, 9, 10, 12, 13)  # the cells a launch may change
STAGED_CELLS = (3, 4, 5, 9, 10, 12, 13)  # the cells a staged slice changes (issue.c's order)
# Programs of a staged pass: HBM to HBM, so short with many programs.  Two per SM of an H200
# let loads beside a concurrent matmul copy faster than one per SM (a pass waits for SMs behind
# the matmul, then finishes sooner) and cost the matmul no more; a quarter per SM cost it more
# (docs/BENCHMARKS.md, "Copies beside compute").
STAGE_PROGRAMS = 264
TABLE_COLUMNS = 8
# A kernel needing more shared memory than this must opt in (``cuFuncSetAttribute``), which
# only Triton's loader does: such a variant from the kernel cache is compiled by Triton instead.
MAX_STATIC_SHARED = 48 << 10


@triton.jit
def _mix(z):
    """splitmix64's finaliser (`offload.integrity.mix`) over uint64."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9  # the constants of offload.integrity.mix
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _unsigned(data, ELEMENT: tl.constexpr):
    """Elements read as signed integers of ``ELEMENT`` bytes, zero-extended to uint64."""
    if ELEMENT == 8:
        wide = data.to(tl.uint64, bitcast=True)
    elif ELEMENT == 4:
        wide = data.to(tl.uint32, bitcast=True).to(tl.uint64)
    elif ELEMENT == 2:
        wide = data.to(tl.uint16, bitcast=True).to(tl.uint64)
    else:
        wide = data.to(tl.uint64)
    return wide


@triton.jit
def _sum_slot(entry, valid, host_page, chunk, row, row_words, trailer0, piece, bpc):
    """Where a work item's checksum lives (its word from the launch's sums pointer) and the
    tensor's identity key, from the integrity half of its table entry.  ``row`` is the row
    holding the slot (the chunk in the region, the staged row in staging), ``row_words`` that
    row's stride in words and ``trailer0`` the trailer word the sums pointer stands for."""
    units = tl.load(entry + 4, mask=valid, other=0)
    trailer = tl.load(entry + 5, mask=valid, other=0)
    key = tl.load(entry + 6, mask=valid, other=0).to(tl.uint64, bitcast=True)
    position = host_page - chunk * bpc
    return trailer - trailer0 + row * row_words + position * units + piece, key, position


@triton.jit(do_not_specialize=_SCALARS)  # one compilation whatever the job's size
def copy_pages(anchor, table, job, n, items, num_tensors, row_stride, bpc, sums, first_entry,
                first_tensor, all_tensors, stage, stage_sums,
                LOAD: tl.constexpr, PIECES: tl.constexpr, ROWS: tl.constexpr,
                TILE: tl.constexpr, VEC: tl.constexpr, COPY: tl.constexpr,
                INTEGRITY: tl.constexpr, ELEMENT: tl.constexpr, STAGED: tl.constexpr):
    """Addresses are element offsets from ``anchor``.  ``table`` is [all_tensors, 8]: KV base,
    block stride, page, host base (elements); then, for integrity, units per page, the trailer
    word of (chunk 0, position 0, unit 0) counted from ``sums`` (``anchor`` as 64-bit words),
    the tensor's identity key and the row stride in words.  ``job`` is [2, n]: block ids, then
    host pages; with ``INTEGRITY`` [4, n], each host page's generation following as two words,
    its low and high 32 bits (`layout.pack_generations`), and for a checked load the result
    word's offset from ``sums`` as two 32-bit halves after them.  A launch covers entries
    ``first_entry`` on and tensors ``first_tensor`` on: work item ``w`` = (entry, tensor,
    piece) of that range in row-major order; a program handles ROWS items per step.  ``COPY``
    off: only sum the GPU pages (copy-engine jobs).

    ``STAGED``: the host side is a staging buffer in GPU memory instead of the region -- row
    ``(entry - first_entry) // bpc`` of ``row_stride`` elements from ``stage`` holds the slot
    bytes of tensors ``first_tensor`` on, laid out as in the region, and its sums from
    ``stage_sums`` (the copy engines move those rows to and from the region)."""
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, TILE)[None, :]
    if STAGED:
        head = table + first_tensor * 8  # TABLE_COLUMNS
        host0 = tl.load(head + 3)
        if INTEGRITY:
            trailer0 = tl.load(head + 5)
        host = stage
        check = stage_sums
        row_words = row_stride * ELEMENT // 8
    else:
        host0 = 0
        trailer0 = 0
        host = anchor
        check = sums
    if INTEGRITY:
        byte = cols.to(tl.int64) * ELEMENT
        weight = ((byte >> 3) * 2 + 1).to(tl.uint64)  # word i of the unit weighs 2i + 1
        shift = ((byte & 7) * 8).to(tl.uint64)  # the element's place in its word
        if LOAD:
            low = tl.load(job + 4 * n).to(tl.int64) & 0xFFFFFFFF
            failed = low + (tl.load(job + 4 * n + 1).to(tl.int64) << 32)
    first = tl.program_id(0).to(tl.int64) * ROWS
    step = tl.num_programs(0).to(tl.int64) * ROWS
    for start in range(first, items, step):
        item = start + rows
        valid = item < items
        piece = item % PIECES
        rest = item // PIECES
        local = rest // num_tensors
        t = first_tensor + rest % num_tensors
        i = first_entry + local
        block = tl.load(job + i, mask=valid, other=0).to(tl.int64)
        host_page = tl.load(job + n + i, mask=valid, other=0).to(tl.int64)
        entry = table + t * 8  # TABLE_COLUMNS
        kv_base = tl.load(entry, mask=valid, other=0)
        stride = tl.load(entry + 1, mask=valid, other=0)
        page = tl.load(entry + 2, mask=valid, other=0)
        host_base = tl.load(entry + 3, mask=valid, other=0)
        chunk = host_page // bpc
        row = local // bpc if STAGED else chunk  # a constexpr choice
        skip = piece * TILE
        kv = kv_base + block * stride + skip
        at = host_base - host0 + row * row_stride + (host_page - chunk * bpc) * page + skip
        count = tl.where(valid, page - skip, 0)
        if INTEGRITY:
            has = count > 0
            # the page's generation as the job was issued (`layout.pack_generations`)
            gen_low = tl.load(job + 2 * n + 2 * i, mask=valid, other=0).to(tl.int64) & 0xFFFFFFFF
            gen_high = tl.load(job + 2 * n + 2 * i + 1, mask=valid, other=0).to(tl.int64)
            generation = (gen_low | (gen_high << 32)).to(tl.uint64, bitcast=True)
            if not STAGED:
                row_words = tl.load(entry + 7, mask=valid, other=0)
            if LOAD:  # the stored sum is read before the page, so the two reads overlap
                where, key, position = _sum_slot(entry, valid, host_page, chunk, row,
                                                 row_words, trailer0, piece, bpc)
                expect = tl.load(check + where, mask=has, other=0)
        kv_at = anchor + tl.multiple_of(kv, VEC)[:, None] + cols
        host_at = host + tl.multiple_of(at, VEC)[:, None] + cols
        mask = cols < count[:, None]
        if COPY:
            if LOAD:
                data = tl.load(host_at, mask=mask, other=0)
                tl.store(kv_at, data, mask=mask)
            else:
                data = tl.load(kv_at, mask=mask, other=0)
                tl.store(host_at, data, mask=mask)
        else:
            data = tl.load(kv_at, mask=mask, other=0)
        if INTEGRITY:
            if not LOAD:  # after the page's copy: this order keeps stores at copy speed
                where, key, position = _sum_slot(entry, valid, host_page, chunk, row,
                                                 row_words, trailer0, piece, bpc)
            total = tl.sum((_unsigned(data, ELEMENT) << shift) * weight, axis=1)
            ident = _mix(_mix(_mix(_mix(key ^ chunk.to(tl.uint64)) ^ generation)
                              ^ position.to(tl.uint64)) ^ piece.to(tl.uint64))
            stored = (total + ident).to(tl.int64, bitcast=True)
            if LOAD:
                bad = has & (expect != stored)
                code = (i * all_tensors + t) * PIECES + piece  # the job's own work item number
                tl.store(sums + failed + rows * 0, code, mask=bad)
                # the failed piece's copy becomes poison (all-ones bytes: NaN in fp16 to fp64),
                # so a reader ahead of the verdict never gets unverified bytes
                tl.store(kv_at, ~(data ^ data), mask=mask & bad[:, None])
            else:
                tl.store(check + where, stored, mask=has)


def _ceil_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def kernel_table(kv_bases: Sequence[int], block_strides: Sequence[int], layout: SlotLayout,
                 region_address: int, anchor: int, element: int) -> list[list[int]]:
    """The kernel's per-tensor table (`copy_pages`), ``TABLE_COLUMNS`` int64 values a row;
    the integrity columns are 0 for a layout without a checksum trailer."""
    host_bases = [region_address + o for o in layout.host_page_offsets().tolist()]
    rows = [[(b - anchor) // element, s // element, p // element, (h - anchor) // element]
            for b, s, p, h in zip(kv_bases, block_strides, layout.page_bytes, host_bases,
                                  strict=True)]
    if not layout.integrity:
        return [row + [0] * (TABLE_COLUMNS - 4) for row in rows]
    trailers = [(region_address + o - anchor) // 8 for o in layout.trailer_offsets().tolist()]
    keys = [k - (1 << 64) if k >= 1 << 63 else k for k in layout.tensor_keys()]  # as int64
    return [row + [units, trailer, key, layout.row_stride // 8]
            for row, units, trailer, key in zip(rows, layout.units, trailers, keys,
                                                strict=True)]


def kernel_shape(layout: SlotLayout, element: int, tile_bytes: int, step_bytes: int
                 ) -> tuple[int, int, int]:
    """(tile, pieces, rows): elements of one work item, work items per page of the largest
    tensor, work items per program and step."""
    max_page = max(layout.page_bytes) // element
    tile = min(_ceil_pow2(max_page), tile_bytes // element)
    return tile, -(-max_page // tile), max(1, (step_bytes // element) // tile)


class StagingSlot(Lease):
    """One pinned buffer of job indices, reserved for the next job by `KernelCopier.staging`
    (the job check packs the job into it), held by that job from `KernelCopier.launch` until
    the engine found the job complete (so its upload ran) and called `release`: the slot then
    goes back to its copier's free list.  Replaces an event record and query per job."""

    def __init__(self, owner: KernelCopier, capacity: int, index_type: torch.dtype) -> None:
        # the job's indices, then the result word's offset for a checked load
        self.sections = index_sections(owner.integrity)
        self.pinned = torch.empty(index_words(capacity, owner.integrity), dtype=index_type,
                                  pin_memory=True)
        self.staged = self.pinned.numpy()
        self.address = self.pinned.data_ptr()
        self.item_bytes = self.pinned.element_size()
        self.capacity = capacity
        self._owner = owner
        self._result = torch.full((1,), -1, dtype=torch.int64, pin_memory=True)
        self.result = self._result.numpy()  # the failing work item of a checked load, or -1
        offset = (self._result.data_ptr() - owner.anchor) // 8
        low = offset & 0xFFFFFFFF
        if index_type == torch.int32 and low >= 1 << 31:
            low -= 1 << 32  # the same 32 bits, as the int32 the array holds
        self._marker = (low, offset >> 32)
        self.checked = False

    def arm(self, n: int) -> None:
        """Make this slot's job a checked load of ``n`` entries: clear the result word and
        put its offset after the indices."""
        self.result[0] = -1
        after = self.sections * n
        self.staged[after], self.staged[after + 1] = self._marker
        self.checked = True

    def failure(self) -> tuple[int, int, int] | None:
        """For a completed checked load: (entry, tensor, piece) of a work item whose sum did
        not match, or None."""
        if not self.checked or self.result[0] < 0:
            return None
        return self._owner.work_item(int(self.result[0]))

    def release(self) -> None:
        self.checked = False
        self._owner._free_slot(self)


class KernelCopier:
    """The per-engine state of the kernel: the uploaded table, the staging slots, the device
    index buffer and the compiled launchers.  ``launch`` enqueues one job on ``stream`` and
    returns the `StagingSlot` the job holds until it completes.  A job that must first wait
    for the caller's stream is ordered by ``ordered`` (an event, re-recorded on that stream)
    in the native call, else by ``wait_for`` (the engine's Python ordering)."""

    def __init__(self, kv_bases: Sequence[int], block_strides: Sequence[int],
                 layout: SlotLayout, region_address: int, num_blocks: int, chunk_count: int,
                 stream: torch.cuda.Stream, ordered: torch.cuda.Event,
                 wait_for: Callable[[int], None], generations: np.ndarray,
                 programs: Mapping[Direction, int] | None = None,
                 num_warps: int = NUM_WARPS, step_bytes: int = STEP_BYTES,
                 max_word: int = MAX_WORD, tile_bytes: int = MAX_TILE_BYTES) -> None:
        device = stream.device
        self._stream = stream
        self._ordered = ordered
        self._wait_for = wait_for
        self.integrity = layout.integrity
        if self.integrity and tile_bytes != UNIT_BYTES:
            raise OffloadError(
                f"tile_bytes = {tile_bytes} with integrity on; a work item must be one checksum "
                f"unit, so use {UNIT_BYTES} (or a layout without a checksum trailer)")
        self._anchor = torch.empty(32, dtype=torch.uint8, device=device)
        anchor = self.anchor = self._anchor.data_ptr()
        host_bases = [region_address + o for o in layout.host_page_offsets().tolist()]
        self.word = common_alignment(
            [*kv_bases, *block_strides, *layout.page_bytes, *host_bases, layout.row_stride,
             anchor], cap=max_word)
        element = min(self.word, 8)
        self._element = element
        rows = kernel_table(kv_bases, block_strides, layout, region_address, anchor, element)
        self._generations = generations  # the engine's table, read when a job is staged
        self._table = torch.tensor(rows, dtype=torch.int64).to(device)  # once per engine
        self._tile, self._pieces, self._rows = kernel_shape(layout, element, tile_bytes,
                                                            step_bytes)
        self._vec = self.word // element
        self._num_tensors = len(rows)
        self._row_stride = layout.row_stride // element
        self._bpc = layout.blocks_per_chunk
        self._programs = {**DEFAULT_COPY_PROGRAMS, **(programs or {})}
        self._num_warps = num_warps
        fits = max(num_blocks, chunk_count * layout.blocks_per_chunk) < 2**31
        self._index_type = torch.int32 if fits else torch.int64
        self._capacity = 0
        self._free: list[StagingSlot] = []  # slots of the current capacity no job holds
        self._next: StagingSlot | None = None  # handed to the job check by `staging`
        self.slots_made = 0
        self._device_index = torch.empty(0, dtype=self._index_type, device=device)
        # the pointer arguments' element types, by position: what Triton compiles in this
        # process (`_run`) and what the kernel cache's child compiles (`_variant`) alike
        self._pointers = {0: _ELEMENTS[element], 1: torch.int64, 2: self._index_type,
                          8: torch.int64, 12: _ELEMENTS[element], 13: torch.int64}
        self._compiled: dict[tuple[bool, bool, bool], Any] = {}  # by (load, copy, staged)
        self._bound: dict[tuple[bool, bool, bool], BoundKernel | None] = {}
        self._native: dict[tuple[bool, bool, bool], NativeIssuer] = {}
        self._upload = bound_function("cuMemcpyHtoDAsync_v2", ctypes.c_uint64, ctypes.c_void_p,
                                      ctypes.c_size_t, ctypes.c_void_p)
        self.launches = {"native": 0, "bound": 0, "triton": 0}  # each job's launch path

    def _grow(self, n: int) -> None:
        """Room for ``n`` entries: a larger device buffer and fresh staging slots (rare: only a
        job larger than all before).  Free slots of the old size are dropped (their uploads
        ran: their jobs completed); held ones are dropped when their jobs release them."""
        self._capacity = _ceil_pow2(max(n, 256))
        self._free = [self._new_slot() for _ in range(STAGING_SLOTS)]
        self._next = None
        with torch.cuda.stream(self._stream):  # freed in this stream's order when replaced
            # as long as a staging slot: the whole of any upload fits
            self._device_index = torch.empty(index_words(self._capacity, self.integrity),
                                             dtype=self._index_type, device=self._stream.device)
        for bound in self._bound.values():  # bound launches read the new buffer from now on
            if bound is not None:
                bound.set(2, self._device_index.data_ptr())
        for native in self._native.values():
            native.set_device_index(self._device_index.data_ptr())

    def staging(self, n: int) -> tuple[np.ndarray, StagingSlot]:
        """The staging array (and its slot) the next launch uses, with room for ``n`` entries
        packed: the native job check writes the job there, so `launch` copies nothing."""
        if n > self._capacity:
            self._grow(n)
        if self._next is None:
            self._next = self._take_slot()
        return self._next.staged, self._next

    def _take_slot(self) -> StagingSlot:
        return self._free.pop() if self._free else self._new_slot()  # never waits

    def _new_slot(self) -> StagingSlot:
        self.slots_made += 1
        return StagingSlot(self, self._capacity, self._index_type)

    def _free_slot(self, slot: StagingSlot) -> None:
        if slot.capacity == self._capacity:
            self._free.append(slot)

    def work_item(self, item: int) -> tuple[int, int, int]:
        """Work item ``item`` of a job as (entry, tensor, piece)."""
        rest, piece = divmod(item, self._pieces)
        entry, tensor = divmod(rest, self._num_tensors)
        return entry, tensor, piece

    def _stage_indices(self, direction: Direction, job: Job) -> tuple[StagingSlot, int]:
        """Put ``job``'s indices in a staging slot (packed: [blocks | host pages], with
        integrity the pages' generations as they are now, then the result word's offset for a
        checked load); the slot and the elements to upload."""
        n = len(job)
        if n > self._capacity:
            self._grow(n)
        slot, self._next = self._next or self._take_slot(), None
        if job.staged_in is slot:
            pass  # the check wrote it there
        elif job.packed is not None:
            np.copyto(slot.staged[:2 * n], job.packed, casting="unsafe")
        else:
            np.copyto(slot.staged[:n], job.blocks, casting="unsafe")
            np.copyto(slot.staged[n:2 * n], job.host_pages, casting="unsafe")
        staged = 2 * n
        if self.integrity:
            pack_generations(slot.staged, n, job.host_pages, self._generations)
            staged = slot.sections * n
            if direction == "load":
                slot.arm(n)
                staged += 2
        return slot, staged

    def _upload_slot(self, slot: StagingSlot, staged: int, caller: int | None) -> None:
        if caller is not None:
            self._wait_for(caller)
        check(self._upload(self._device_index.data_ptr(), slot.address,
                           staged * slot.item_bytes, self._stream.cuda_stream),
              "cuMemcpyHtoDAsync_v2")

    def launch(self, direction: Direction, job: Job, caller: int | None = None,
               copy: bool = True) -> StagingSlot:
        """Enqueue ``job``, first ordered after the raw stream ``caller`` when given;
        ``copy`` off: only write (store) or check (load) its checksums over the GPU pages."""
        slot, staged = self._stage_indices(direction, job)
        n = len(job)
        items = n * self._num_tensors * self._pieces
        grid = self._grid(items, self._programs[direction] if copy else SUM_PROGRAMS)
        load = direction == "load"
        native = self._native.get((load, copy, False))
        if (native is not None and not self._hooked()
                and native.issue(caller is not None, caller or 0, slot.address,
                                 staged * slot.item_bytes, n, items, grid)):
            self.launches["native"] += 1
            return slot
        self._upload_slot(slot, staged, caller)
        self._run((load, copy, False), grid, self._values(n, items))
        return slot

    def launch_layers(self, job: Job, ranges: list[tuple[int, int]], caller: int | None
                      ) -> tuple[StagingSlot, list[torch.cuda.Event | None]]:
        """A load of ``job`` as one launch per tensor range in ``ranges`` (first, count), in
        order, each followed by an event on the stream: one upload, one result word for the
        job.  Returns the slot the job holds and the ranges' events."""
        slot = self.upload("load", job, caller)
        n = len(job)
        events: list[torch.cuda.Event | None] = []
        try:
            for first, count in ranges:
                items = n * count * self._pieces
                grid = self._grid(items, self._programs["load"])
                values = self._values(n, items)
                values[5], values[10] = count, first
                self._run((True, True, False), grid, values)
                event = torch.cuda.Event()
                event.record(self._stream)
                events.append(event)
        except BaseException:
            # a launch failed part-way: nothing already queued outlives the job, and its
            # index slot is reused only after its upload ran
            with contextlib.suppress(Exception):
                self._stream.synchronize()
                slot.release()
            raise
        finally:
            bound = self._bound.get((True, True, False))
            if bound is not None:  # the native issue sets only n and items: the whole job
                bound.set(5, self._num_tensors)
                bound.set(10, 0)
        return slot, events

    def upload(self, direction: Direction, job: Job, caller: int | None = None
               ) -> StagingSlot:
        """Put ``job``'s indices on the GPU for `launch_rows` launches, first ordered after
        the raw stream ``caller`` when given; the slot is held until the job completes."""
        slot, staged = self._stage_indices(direction, job)
        self._upload_slot(slot, staged, caller)
        return slot

    def launch_rows(self, load: bool, n: int, first_entry: int, entries: int,
                    first_tensor: int, tensors: int, row_bytes: int, stage: int,
                    stage_sums: int, stream: torch.cuda.Stream | None = None) -> None:
        """One staged pass over the uploaded job of ``n`` entries: entries ``first_entry`` to
        ``first_entry + entries`` (whole chunks) and tensors ``first_tensor`` to
        ``first_tensor + tensors`` between the KV tensors and rows of ``row_bytes`` from GPU
        address ``stage`` (a store gathers the pages into them and writes their sums from
        ``stage_sums``; a load checks those sums and scatters the pages), on ``stream``
        (default: the engine's)."""
        items = entries * tensors * self._pieces
        grid = self._grid(items, STAGE_PROGRAMS)
        values = self._row_values(n, items, first_entry, first_tensor, tensors, row_bytes,
                                  stage, stage_sums)
        self._run((load, True, True), grid, values, stream)

    def _row_values(self, n: int, items: int, first_entry: int, first_tensor: int,
                    tensors: int, row_bytes: int, stage: int, stage_sums: int) -> list[int]:
        """The runtime arguments of a staged pass (`launch_rows`)."""
        values = self._values(n, items)
        values[5], values[6] = tensors, row_bytes // self._element
        values[9], values[10], values[12], values[13] = first_entry, first_tensor, stage, \
            stage_sums
        return values

    def prepare(self, row_bytes: int | None) -> None:
        """Make every variant a tier's jobs launch loadable without compiling in this process
        (`offload.transfer.kernel_cache`): copy in both directions, with integrity the
        sum-only passes, and with ``row_bytes`` (the staged rows of whole chunks) the staged
        passes.  Those missing from the cache are compiled in one child process."""
        if self._capacity == 0:  # the device index buffer, a pointer argument, made now
            self._grow(1)
        launches = [((load, True, False), self._values(1, 1)) for load in (False, True)]
        if self.integrity:
            launches += [((load, False, False), self._values(1, 1)) for load in (False, True)]
        if row_bytes is not None:
            values = self._row_values(1, 1, 0, 0, self._num_tensors, row_bytes, self.anchor,
                                      self.anchor)
            launches += [((load, True, True), values) for load in (False, True)]
        self._build([self._variant(key, values) for key, values in launches])

    def staged_kernel(self, load: bool, row_bytes: int) -> BoundKernel | None:
        """The bound staged pass of one direction, once a launch compiled and bound it, with
        its row stride set for rows of ``row_bytes`` (the one cell the native staged issue,
        `offload.transfer.native.StagedIssuer`, does not set per slice); None while a
        profiler hook asks for Triton's launcher."""
        bound = None if self._hooked() else self._bound.get((load, True, True))
        if bound is not None:
            bound.set(6, row_bytes // self._element)
        return bound

    @property
    def shape(self) -> tuple[int, int, int]:
        """(work items per page of the widest tensor, work items per program and step, the
        staged passes' program budget): how a launch's grid follows from its size."""
        return self._pieces, self._rows, STAGE_PROGRAMS

    def _grid(self, items: int, programs: int) -> int:
        """Programs for a launch of ``items`` work items: enough for ``ROWS`` items each, at
        most ``programs`` (issue.c's staged issue computes the same)."""
        return max(1, min(programs, -(-items // self._rows)))

    def _values(self, n: int, items: int) -> list[int]:
        """The kernel's runtime arguments (`PARAMETERS`) for a launch over the whole job."""
        anchor = self.anchor
        return [anchor, self._table.data_ptr(), self._device_index.data_ptr(), n, items,
                self._num_tensors, self._row_stride, self._bpc, anchor, 0, 0,
                self._num_tensors, anchor, anchor]

    @staticmethod
    def _hooked() -> bool:
        """Whether a profiler installed Triton launch hooks: every launch then goes through
        Triton's launcher, where they run."""
        return hooks_active(_launch_hooks())

    def _run(self, key: tuple[bool, bool, bool], grid: int, values: list[int],
             on: torch.cuda.Stream | None = None) -> None:
        """Launch variant ``key`` (load, copy, staged) over ``values``.  The first launch of a
        variant binds it from the kernel cache (`prepare` filled it), or, where it is not
        there, compiles it through Triton's normal path in this process; later launches go
        through the native issue call (`launch`) or the `BoundKernel` (``cuLaunchKernel``,
        the per-launch values updated in place; `_grow` updates the index buffer's pointer)
        or, where binding was refused or a value outgrew the compiled integer type, the
        compiled kernel's own launcher."""
        on = on or self._stream
        stream = on.cuda_stream
        knobs = _triton_knobs()
        hooks = _launch_hooks()
        if key not in self._bound and not hooks_active(hooks):
            self._bind_built(key, values)
        bound = self._bound.get(key)
        if (bound is not None and all(bound.fits(i, values[i]) for i in VARYING)
                and not hooks_active(hooks)):  # a profiler added later sees every launch
            for i in VARYING:
                bound.set(i, values[i])
            bound.launch(grid, stream)
            self.launches["bound"] += 1
            return
        self.launches["triton"] += 1
        constants = tuple(self._constants(key).values())
        compiled: Any = self._compiled.get(key)
        if compiled is not None and knobs is not None:
            launcher = compiled.run
            meta = compiled.launch_metadata((grid, 1, 1), stream, *values, *constants)
            launcher(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, meta,
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values,
                     *constants)
            return
        args = [Address(v, self._pointers[i]) if i in self._pointers else v
                for i, v in enumerate(values)]
        with torch.cuda.stream(on):
            compiled = copy_pages[(grid,)](*args, **self._constants(key),
                                           num_warps=self._num_warps)
        self._compiled[key] = compiled
        self._install(key, bind(compiled, values, hooks))

    def _constants(self, key: tuple[bool, bool, bool]) -> dict[str, Any]:
        """The kernel's constexprs for variant ``key``, in signature order."""
        load, copy, staged = key
        return {"LOAD": load, "PIECES": self._pieces, "ROWS": self._rows, "TILE": self._tile,
                "VEC": self._vec, "COPY": copy, "INTEGRITY": self.integrity,
                "ELEMENT": self._element, "STAGED": staged}

    def _variant(self, key: tuple[bool, bool, bool], values: list[int]) -> Variant:
        names = {i: str(dtype).removeprefix("torch.") for i, dtype in self._pointers.items()}
        return Variant.of(self._constants(key), self._num_warps, values, names, SPECIALISED)

    def _bind_built(self, key: tuple[bool, bool, bool], values: list[int]) -> None:
        """Bind variant ``key`` from the kernel cache (`prepare` put it there; a variant it
        did not foresee is compiled in a child process now), never compiling in this
        process; where that fails, leave it to Triton."""
        loaded, = self._build([self._variant(key, values)])
        if loaded is not None and loaded.plain and loaded.shared <= MAX_STATIC_SHARED:
            bound = bind_function(loaded.function, loaded.num_warps, loaded.shared, values)
            if bound is not None:
                self._install(key, bound)

    def _build(self, variants: list[Variant]) -> list[kernel_cache.Loaded | None]:
        """`kernel_cache.build` on this engine's device, its context current (a module is
        loaded into the current context)."""
        device = self._stream.device
        with torch.cuda.device(device):
            return kernel_cache.build(variants, device.index or 0,
                                      torch.cuda.get_device_capability(device))

    def _install(self, key: tuple[bool, bool, bool], bound: BoundKernel | None) -> None:
        """Launch variant ``key`` through ``bound`` from now on, and through the native issue
        call where the library loaded (not for staged passes, which `staged_kernel` serves)."""
        self._bound[key] = bound
        lib, entry_points = library(), driver_entry_points()
        if bound is not None and lib is not None and entry_points is not None and not key[2]:
            self._native[key] = NativeIssuer(
                lib, entry_points, bound, 3, self._stream.cuda_stream,
                self._ordered.cuda_event, self._device_index.data_ptr())


class Address:
    """A raw GPU address as Triton's JIT takes a pointer argument (``data_ptr`` and
    ``dtype``): every pointer argument of a launch Triton compiles in this process (the
    buffers' owners keep them alive), and the stand-ins the kernel cache's child compiles
    with, so both compile from the same argument types."""

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self._address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self._address


def _launch_hooks() -> tuple[object, ...]:
    """Triton's launch enter and exit hooks as installed now (none on an older Triton)."""
    knobs = _triton_knobs()
    if knobs is None:
        return ()
    return (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)


@cache
def _triton_knobs() -> Any:
    """``triton.knobs`` (Triton 3.4+), whose launch hooks the direct call passes on; None on an
    older Triton, which then keeps its normal launch path."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs


class TritonEngine(StreamEngine):
    """Requires the region to be registered with CUDA (pinned): the kernel dereferences its
    host addresses directly.  ``programs`` bounds the SMs a copy occupies, per direction."""

    name = "triton"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int,
                 programs: Mapping[Direction, int] | None = None, num_warps: int = NUM_WARPS,
                 priority: int = 0, step_bytes: int = STEP_BYTES,
                 max_word: int = MAX_WORD, tile_bytes: int = MAX_TILE_BYTES) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count, priority)
        self.kernel = kernel_copier(self, programs, num_warps, step_bytes, max_word, tile_bytes)
        self._pack_target = self.kernel.staging

    def _launch(self, direction: Direction, job: Job) -> StagingSlot:
        return self.kernel.launch(direction, job)

    def _launch_after(self, caller: int, direction: Direction, job: Job) -> StagingSlot:
        return self.kernel.launch(direction, job, caller)

    def _launch_layers(self, job: Job, ranges: list[tuple[int, int]], caller: int | None
                       ) -> tuple[object, list[torch.cuda.Event | None]]:
        return self.kernel.launch_layers(job, ranges, caller)

    def compile_all(self) -> None:
        """Compile every variant a tier's jobs will launch -- copy in both directions, with
        checksums the sum-only passes of copy-engine jobs, and the staged passes of whole
        chunks -- in one child process where the kernel cache lacks them
        (`KernelCopier.prepare`), then run each over block 0 and chunk 0 (the caller's
        scratch buffers), so no first job pays for loading or binding them."""
        from offload.transfer.staging import stage_plan  # the staging rules need no Triton

        plan = stage_plan(self._layout)
        self.kernel.prepare(None if isinstance(plan, str) else plan.row_bytes)
        zero = np.zeros(1, dtype=np.int64)
        kept = int(self.generations[0])
        for direction in ("store", "load"):
            self.submit(0, direction, zero, zero, zero)
            if self.kernel.integrity:
                job = self._check(zero, zero, zero, direction)
                self.kernel.launch(direction, job, copy=False)
        self._stream.synchronize()
        self.wait_all()
        self.generations[0] = kept  # the scratch store is nobody's: page 0 keeps its generation
        if isinstance(plan, str):
            return
        bpc, group = self._layout.blocks_per_chunk, plan.groups[0]
        whole = Job(np.zeros(bpc, dtype=np.int64), np.arange(bpc, dtype=np.int64))
        rows = torch.zeros(plan.row_bytes, dtype=torch.uint8, device=self._device)
        base = rows.data_ptr()
        for direction in DIRECTIONS:  # the load checks what the store summed
            slot = self.kernel.upload(direction, whole)
            self.kernel.launch_rows(direction == "load", bpc, 0, bpc, group.first, group.count,
                                    plan.row_bytes, base, base + group.stage_trailer)
            self._stream.synchronize()
            slot.release()


def kernel_copier(engine: StreamEngine, programs: Mapping[Direction, int] | None = None,
                  num_warps: int = NUM_WARPS, step_bytes: int = STEP_BYTES,
                  max_word: int = MAX_WORD, tile_bytes: int = MAX_TILE_BYTES) -> KernelCopier:
    """The kernel over ``engine``'s tensors, region and stream."""
    return KernelCopier(engine._kv_bases.tolist(), engine._block_strides.tolist(),
                        engine.layout, engine._region.data_ptr(), engine._geometry.num_blocks,
                        engine._chunk_count, engine.stream, engine._ordered,
                        engine._wait_for, engine.generations, programs,
                        num_warps, step_bytes, max_word, tile_bytes)
