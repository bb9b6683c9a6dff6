"""Pure byte arithmetic of a job: where each page lives on the GPU and in the host region.

No torch and no CUDA: the backends execute the addresses these rules give (the Triton kernel
recomputes them on the GPU from the same per-tensor table), so the placement rules (plan.py:
tensor-major slots, one row per chunk) are tested exhaustively on any host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from offload import integrity
from offload.control.plan import Plan
from offload.errors import MalformedJob, OffloadError

IndexArray = np.ndarray[Any, np.dtype[np.int64]]
# what a job's index fields accept: numpy integer arrays need no conversion per job
Indices = Sequence[int] | np.ndarray[Any, np.dtype[np.integer[Any]]]


@dataclass(frozen=True)
class SlotLayout:
    """One rank's view of its region: rows of ``row_stride`` bytes (one per chunk); its slot
    starts ``slot_offset`` bytes into each row; inside the slot KV tensor ``t`` holds
    ``blocks_per_chunk`` pages of ``page_bytes[t]`` bytes back to back from
    ``tensor_offsets[t]``; with ``trailer_offset`` set, the slot's page checksums follow at
    that offset in the slot (`offload.integrity`), mixed with ``seed``.  ``cuts``: row-relative
    offsets where a host registration begins inside a row (background set-up registers rows
    in pieces, `offload.region.geometry.registration_cuts`); a batched copy whose host range spans
    two registrations fails, so the copy paths split every copy there (`piece_of`)."""

    row_stride: int
    slot_offset: int
    blocks_per_chunk: int
    page_bytes: tuple[int, ...]
    tensor_offsets: tuple[int, ...]
    trailer_offset: int | None = None
    seed: int = 0
    cuts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.page_bytes) != len(self.tensor_offsets) or not self.page_bytes:
            raise OffloadError(
                f"slot layout has {len(self.page_bytes)} page sizes and "
                f"{len(self.tensor_offsets)} tensor offsets; give one of each per KV tensor"
            )
        if self.blocks_per_chunk <= 0 or min(self.page_bytes) <= 0:
            raise OffloadError(
                f"slot layout needs positive blocks_per_chunk and page sizes, got "
                f"{self.blocks_per_chunk} and {list(self.page_bytes)}"
            )
        end = self.slot_offset + max(
            o + self.blocks_per_chunk * p
            for o, p in zip(self.tensor_offsets, self.page_bytes, strict=True)
        )
        if self.trailer_offset is not None:
            if self.trailer_offset % integrity.WORD or self.trailer_offset + self.slot_offset < end:
                raise OffloadError(
                    f"checksum trailer at slot byte {self.trailer_offset} overlaps the pages or "
                    f"is not {integrity.WORD}-byte aligned; rebuild the plan")
            end = (self.slot_offset + self.trailer_offset
                   + integrity.trailer_bytes(self.page_bytes, self.blocks_per_chunk))
        if self.slot_offset < 0 or min(self.tensor_offsets) < 0 or end > self.row_stride:
            raise OffloadError(
                f"slot layout spans bytes {self.slot_offset}..{end} of a {self.row_stride}-byte "
                "row; the slot must lie inside its row (rebuild the plan)"
            )
        inside = (0, *self.cuts, self.row_stride)
        if any(a >= b for a, b in pairwise(inside)):
            raise OffloadError(
                f"registration cuts {list(self.cuts)} are not increasing offsets inside a "
                f"{self.row_stride}-byte row; take them from the region (`HostRegion.cuts`)")

    @classmethod
    def from_plan(cls, plan: Plan, rank: int) -> SlotLayout:
        slot = plan.slots[rank]
        return cls(plan.row_stride(rank), slot.slot_offset, plan.blocks_per_chunk,
                   slot.page_bytes, slot.tensor_offsets, slot.trailer_offset,
                   slot.integrity_seed)

    @property
    def num_tensors(self) -> int:
        return len(self.page_bytes)

    @property
    def integrity(self) -> bool:
        """Whether the slot carries page checksums."""
        return self.trailer_offset is not None

    @property
    def units(self) -> tuple[int, ...]:
        """Per tensor, the checksum units of one page."""
        return tuple(integrity.units(p) for p in self.page_bytes)

    def trailer_offsets(self) -> IndexArray:
        """Per tensor, the byte offset in the region of its sum of (chunk 0, position 0,
        unit 0); tensor ``t``'s sum of (chunk, position, unit) is ``8 * (position *
        units[t] + unit)`` bytes further, plus ``chunk * row_stride``."""
        if self.trailer_offset is None:
            raise OffloadError("this slot layout has no checksum trailer (integrity is off)")
        starts = np.asarray(integrity.unit_offsets(self.page_bytes), dtype=np.int64)
        return (self.slot_offset + self.trailer_offset
                + integrity.WORD * self.blocks_per_chunk * starts)

    def tensor_keys(self) -> list[int]:
        """Per tensor, the first stage of its units' identities (`integrity.tensor_key`)."""
        return [integrity.tensor_key(self.seed, t) for t in range(self.num_tensors)]

    def region_bytes(self, chunk_count: int) -> int:
        """Bytes a region must span to hold ``chunk_count`` rows."""
        return chunk_count * self.row_stride

    def piece_of(self, offsets: IndexArray) -> IndexArray:
        """For row-relative byte ``offsets``, the registration piece of the row each lies
        in (0 .. len(cuts)): copies join or stay whole only within one piece."""
        return np.searchsorted(np.asarray(self.cuts, dtype=np.int64), offsets, side="right")

    def host_page_offsets(self) -> IndexArray:
        """Per tensor, the byte offset of its page at (chunk 0, position 0) in the region."""
        return self.slot_offset + np.asarray(self.tensor_offsets, dtype=np.int64)


@dataclass(frozen=True)
class Job:
    """A checked job: entry ``i`` moves GPU block ``blocks[i]`` to or from host page
    ``host_pages[i]`` = chunk x ``blocks_per_chunk`` + position (one index per block of every
    tensor, so per-job data does not grow with the tensor count).  ``packed``, when the check
    wrote them so (`offload.transfer.fast_check`), holds both back to back -- ``blocks`` and
    ``host_pages`` are its halves -- and the kernel stages it in one copy, or none when it lies
    in the kernel's staging buffer ``staged_in`` already."""

    blocks: IndexArray
    host_pages: IndexArray
    packed: IndexArray | None = None
    staged_in: object = None

    def __len__(self) -> int:
        return int(self.blocks.size)


def index_sections(integrity: bool) -> int:
    """Runs of one word per entry in a job's index upload (`offload.transfer.kernel`): GPU
    blocks and host pages; with integrity also each host page's generation, as two words (the
    words are int32 wherever the indices fit)."""
    return 4 if integrity else 2


def index_words(entries: int, integrity: bool) -> int:
    """Words a job of ``entries`` entries uploads at most: its sections, then two words that
    locate a checked load's result word."""
    return index_sections(integrity) * entries + 2


def pack_generations(words: np.ndarray, entries: int, host_pages: np.ndarray,
                     generations: np.ndarray) -> None:
    """Write the generation of each entry's host page, as it is now, after a job's blocks and
    host pages in ``words``: entry ``i``'s low 32 bits at ``words[2n + 2i]`` and the rest at
    ``words[2n + 2i + 1]``, which the kernel joins as ``(low & 0xFFFFFFFF) | high << 32``.
    A job so carries the generations it was issued under: a later store's renewal of the same
    pages cannot change what a queued job writes or checks.

    With int32 words the pair is the little-endian int64 itself (CUDA hosts are little-endian),
    so one gather writes it; int64 words (indices past 2^31) hold the whole value in the low
    word, which the join leaves whole."""
    n = entries
    pairs = words[2 * n:4 * n]
    if words.itemsize == 4:  # pages are checked: "clip" only spares numpy a buffered copy
        np.take(generations, host_pages, out=pairs.view(np.int64), mode="clip")
        return
    current = generations[host_pages]
    pairs[0::2] = current
    pairs[1::2] = current >> 32


def as_index_array(values: object, what: str, limit: int | None = None) -> IndexArray:
    """A 1-D integer array of a job (list, tuple, numpy array or CPU torch tensor), without a
    copy when it already is one.  A CUDA tensor is refused: reading it would hide a device
    synchronisation in ``submit``.  Anything else is refused as `MalformedJob` (the same on
    every rank); ``limit`` is the field's range, named when an entry is past any index."""
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype.kind in "iu":
        return values  # the engine's usual case, with no further checks
    if hasattr(values, "detach"):  # a torch tensor, kept free of a torch import here
        if getattr(values, "is_cuda", False):
            raise MalformedJob(f"{what} is a CUDA tensor; pass job indices in host memory "
                               "(a list, numpy array or CPU tensor)")
        values = values.detach().numpy()
    array = np.asarray(values)
    if array.size == 0 and array.ndim == 1:  # [] is float64 to numpy
        return np.zeros(0, dtype=np.int64)
    if array.ndim == 1 and array.dtype == object:
        _refuse_huge(array, what, limit)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise MalformedJob(
            f"{what} must be a 1-D array of integers, got shape {array.shape} of {array.dtype}"
        )
    return array


def _refuse_huge(array: np.ndarray, what: str, limit: int | None) -> None:
    """A list of Python ints that numpy holds as objects: some int is past int64.  Name it."""
    for i, value in enumerate(array.tolist()):
        if type(value) is int and not 0 <= value < 2**63:
            valid = f"valid ids are 0..{limit - 1}" if limit is not None else "indices fit int64"
            raise MalformedJob(f"{what} entry {i} is {show_value(value)}, out of range: {valid}")


def show_value(value: object, width: int = 40) -> str:
    """``value`` for an error line: its repr, cut to ``width`` characters (an int of thousands
    of digits has no repr at all past Python's conversion limit)."""
    try:
        text = repr(value)
    except Exception:
        return f"a {type(value).__name__}"
    return text if len(text) <= width else text[:width - 3] + "..."


def check_job(layout: SlotLayout, gpu_blocks: object, chunk_ids: object, positions: object,
              *, num_blocks: int, chunk_count: int, unique: UniqueDestinations | None = None
              ) -> Job:
    """Check a job (block ``gpu_blocks[i]`` goes to page ``positions[i]`` of chunk
    ``chunk_ids[i]``): equal lengths, every index in range and, with ``unique``, no
    destination written twice.  Costs a few whole-array numpy operations, nothing per page or
    per tensor.  Engines check jobs natively first (`offload.transfer.fast_check`); this is the
    one fallback, which also words every error (docs/BENCHMARKS.md, "The job check's numpy
    fallback").

    Raises `MalformedJob` for what the plan and the job alone decide (types, lengths, chunk ids,
    positions, repeats: every rank refuses alike) and plain `OffloadError` for a GPU block past
    this rank's KV cache (ranks may hold KV caches of different sizes)."""
    blocks = as_index_array(gpu_blocks, "gpu_blocks", num_blocks)
    chunks = as_index_array(chunk_ids, "chunk_ids", chunk_count)
    slots = as_index_array(positions, "positions", layout.blocks_per_chunk)
    if not len(blocks) == len(chunks) == len(slots):
        raise MalformedJob(
            f"a job needs equally long arrays, got {len(blocks)} gpu_blocks, {len(chunks)} "
            f"chunk_ids and {len(slots)} positions"
        )
    blocks = _in_range(blocks, num_blocks, "gpu block", "the KV cache has {} blocks",
                       OffloadError)
    chunks = _in_range(chunks, chunk_count, "chunk id", "the region has {} chunks")
    slots = _in_range(slots, layout.blocks_per_chunk, "position", "a chunk holds {} blocks")
    job = Job(blocks, chunks * layout.blocks_per_chunk + slots)
    if unique is not None:
        unique.check(job)
    return job


def _in_range(values: np.ndarray, limit: int, what: str, meaning: str,
              error: type[OffloadError] = MalformedJob) -> IndexArray:
    """``values`` as int64 after one reduction: viewed unsigned, a negative index is huge."""
    wide = values.astype(np.int64, copy=False)
    if wide.size == 0 or wide.view(np.uint64).max() < limit:
        return wide
    i = int(np.flatnonzero((wide < 0) | (wide >= limit))[0])  # named as given (uint64 too)
    raise error(
        f"{what} {int(values[i])} (entry {i} of the job) is out of range: "
        f"{meaning.format(limit)}, valid ids are 0..{limit - 1}"
    )


class UniqueDestinations:
    """Refuses a job that writes one destination twice -- the GPU blocks of a load or the host
    pages of a store: two copies to one place race in the kernel and the copy engines.

    One way for index spaces up to ``SCRATCH_LIMIT``: the job scatters its entry numbers over a
    reused int32 scratch array and gathers them back; a repeated destination keeps only one
    writer, so some entry reads another's number.  Beyond the limit (no scratch array that
    large) a sort, which also names the entries of any repeat."""

    SCRATCH_LIMIT = 1 << 22

    def __init__(self, field: str, space: int, bpc: int) -> None:
        self.field, self.space, self._bpc = field, space, bpc
        self._scratch = np.zeros(space if space <= self.SCRATCH_LIMIT else 0, dtype=np.int32)
        self._count = np.arange(0, dtype=np.int32)

    def check(self, job: Job) -> None:
        dest: IndexArray = getattr(job, self.field)
        n = dest.size
        if n < 2:
            return
        if not self._scratch.size:
            self._refuse_repeats(dest)
            return
        if n > self._count.size:
            self._count = np.arange(n, dtype=np.int32)
        count = self._count[:n]
        self._scratch[dest] = count
        if (self._scratch[dest] != count).any():
            self._refuse_repeats(dest)

    def _refuse_repeats(self, dest: IndexArray) -> None:
        """Sort ``dest``; raise naming the first two entries that write the lowest repeated
        destination (the same message whichever way found the repeat)."""
        order = np.argsort(dest, kind="stable")
        ordered = dest[order]
        repeats = np.flatnonzero(ordered[1:] == ordered[:-1])
        if not repeats.size:
            return
        value = int(ordered[repeats[0]])
        first, second = np.flatnonzero(dest == value)[:2].tolist()
        where = (f"GPU block {value}" if self.field == "blocks"
                 else f"chunk {value // self._bpc} position {value % self._bpc}")
        raise MalformedJob(
            f"entries {first} and {second} of the job both write {where}; two copies to one "
            "destination race, so give every destination once per job"
        )


def page_addresses(kv_bases: IndexArray, block_strides: IndexArray, region_base: int,
                   layout: SlotLayout, job: Job) -> tuple[IndexArray, IndexArray]:
    """The reference formula, as [tensors, entries] arrays of byte addresses: block ``b`` of
    tensor ``t`` starts at ``kv_bases[t] + b * block_strides[t]``; host page ``h`` of tensor
    ``t`` (chunk ``h // bpc``, position ``h % bpc``) at ``region_base + chunk * row_stride +
    slot_offset + tensor_offsets[t] + position * page_bytes[t]``."""
    bpc = layout.blocks_per_chunk
    chunk, position = np.divmod(job.host_pages, bpc)
    pages = np.asarray(layout.page_bytes, dtype=np.int64)[:, None]
    kv = kv_bases[:, None] + job.blocks[None, :] * block_strides[:, None]
    host = (region_base + layout.host_page_offsets()[:, None] + chunk[None, :] * layout.row_stride
            + position[None, :] * pages)
    return kv, host


def tensor_ranges(num_tensors: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` runs of consecutive tensors, in order, as (first, count), sizes differing by
    at most one (the earlier ones larger): the layer groups of a layer-wise load, which follow
    the order the KV tensors were given in (an engine's [K0, V0, K1, V1, ...] and
    ``groups`` = layers puts each layer's K and V in one group)."""
    if type(groups) is not int or not 1 <= groups <= num_tensors:
        raise OffloadError(f"layer_groups = {show_value(groups)} for {num_tensors} KV tensors; "
                           f"give 1 to {num_tensors} (one group per layer: the number of "
                           "layers)")
    size, extra = divmod(num_tensors, groups)
    ranges, first = [], 0
    for g in range(groups):
        count = size + (g < extra)
        ranges.append((first, count))
        first += count
    return ranges


def coalesce(src: IndexArray, dst: IndexArray, count: IndexArray,
             row: IndexArray | None = None) -> tuple[IndexArray, IndexArray, IndexArray]:
    """Merge copies that continue each other on both sides into one longer copy.

    Copies are first ordered by source; copy ``i + 1`` joins copy ``i`` when it starts where
    ``i`` ends in both the source and the destination and, when ``row`` is given, has the
    same ``row`` key: the host registration it lies in (a row, or a piece of one,
    `SlotLayout.cuts`) and the device allocation (`offload.transfer.batch_copy.copy_runs`),
    since a batched copy that spans two of either fails (DESIGN.md section 5).  A chunk's
    consecutive blocks going to consecutive positions become one copy per KV tensor (16 blocks
    of 64 KiB -> one 1 MiB copy), which a copy engine moves far faster than sixteen small ones.
    The bytes moved are the same.
    """
    if src.size <= 1:
        return src, dst, count
    order = np.argsort(src, kind="stable")
    src, dst, count = src[order], dst[order], count[order]
    joins = (src[1:] == src[:-1] + count[:-1]) & (dst[1:] == dst[:-1] + count[:-1])
    if row is not None:
        row = row[order]
        joins &= row[1:] == row[:-1]
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(count, starts)


def common_alignment(values: list[int], cap: int) -> int:
    """The largest power of two <= ``cap`` dividing every value: the widest memory access a
    copy between these addresses, strides and sizes may use."""
    acc = cap
    for value in values:
        acc |= value
    return acc & -acc
