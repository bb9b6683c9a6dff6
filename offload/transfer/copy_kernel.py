# SPDX-License-Identifier: Apache-2.0
"""The copy kernel's Triton source: `copy_pages` and the device functions it calls.

Kept apart from the engine that launches it (`offload.transfer.kernel`) so that the kernel
cache (`offload.transfer.kernel_cache`), which compiles it in a child process and keys its
cubins by this file's bytes, needs nothing of the engine: an edit to the engine's host code
does not invalidate a cubin, and neither module imports the other back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# runtime arguments, in order (the bound launch's parameter cells)
PARAMETERS = ("anchor", "table", "job", "n", "items", "num_tensors", "row_stride", "bpc", "sums",
              "first_entry", "first_tensor", "all_tensors", "stage", "stage_sums")
# integers compiled once whatever their value, and the staged pointers, whose alignment varies
_SCALARS = (*PARAMETERS[3:8], *PARAMETERS[9:])
SPECIALISED = tuple(i for i, name in enumerate(PARAMETERS) if name not in _SCALARS)


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
        # word w of a unit is elements [w * PER, (w + 1) * PER) of its piece; its term is
        # mix(word ^ word_key(w)) (`offload.integrity.raw_sums`)
        PER: tl.constexpr = 8 // ELEMENT
        WORDS: tl.constexpr = TILE // PER
        word = tl.arange(0, WORDS)[None, :]
        word_key = (word + 1).to(tl.uint64) * 0x9E3779B97F4A7C15  # integrity.GOLDEN
        shift = ((cols.to(tl.int64) * ELEMENT & 7) * 8).to(tl.uint64)  # the element's place
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
            wide = _unsigned(data, ELEMENT)
            if PER > 1:  # narrower elements: assemble each word from its PER elements
                wide = tl.sum(tl.reshape(wide << shift, [ROWS, WORDS, PER]), axis=2)
            inside = word * PER < count[:, None]  # the unit's own words: no padding terms
            total = tl.sum(tl.where(inside, _mix(wide ^ word_key), 0), axis=1)
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


class Address:
    """A raw GPU address as Triton's JIT takes a pointer argument (``data_ptr`` and
    ``dtype``): every pointer argument of a launch Triton compiles in this process (the
    buffers' owners keep them alive), and the stand-ins the kernel cache's child compiles
    with, so both compile from the same argument types."""

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self._address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self._address
