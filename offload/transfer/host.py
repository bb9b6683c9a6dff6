# SPDX-License-Identifier: Apache-2.0
"""The CPU backend: KV tensors in host memory (CI, CPU-only runs); jobs finish inside submit.

With a checksum trailer in the layout (`offload.integrity`), every job sums the pages it copied
-- the KV pages of a store, the host pages of a load -- and mixes in each unit's identity.  A
store writes the sums into the trailer; a load compares them with it: a mismatch is recorded
(`job_error`), the failed units are poisoned, and the job still reports finished.

Two implementations of one job, the same bytes and sums:

* native (``page_sums.c``, built once per host by `offload.system.build_cache`): one call per job
  copies every page of every tensor and sums each unit while it is in cache.  The numpy form
  costs a dozen whole-array calls per tensor and job, a fixed cost several times a small job's
  copy (docs/BENCHMARKS.md, "Integrity: checksum cost").
* numpy (no compiler, ``OFFLOAD_NATIVE=0``): gathers and scatters per tensor, the sums by
  `offload.integrity.raw_sums`, the reference the tests hold the native code to.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache

import numpy as np
import torch

from offload.integrity import UNIT_BYTES, identity, raw_sums
from offload.system.build_cache import SOURCES, load
from offload.transfer.base import After, Direction, EngineBase
from offload.transfer.layout import Job, SlotLayout

# Jobs of at most this many entries copy page by page: torch's vectorised index_put into the
# region's [chunks, positions, page] view wakes its thread pool, which on a busy small host costs
# far more than a few single-page copies (docs/BENCHMARKS.md, "Figures moved from code
# comments").
SMALL_JOB = 16
_I64 = ctypes.c_int64
_POINTER = ctypes.c_void_p


@cache
def page_sums_library() -> ctypes.CDLL | None:
    """``page_sums.c`` built and loaded (once per process), or None where it cannot be."""
    lib = load(SOURCES["page_sums"], "host copies with checksums", "offload_host_job",
               flags=("-O3",))
    if lib is not None:
        lib.offload_host_job.restype = _I64
        lib.offload_host_job.argtypes = [_POINTER, _I64, _I64, _I64, _POINTER, _POINTER, _I64,
                                         _POINTER, ctypes.c_int32, ctypes.c_int32, _POINTER]
        lib.offload_raw_sum.restype = ctypes.c_uint64
        lib.offload_raw_sum.argtypes = [_POINTER, _I64]
        lib.offload_raw_sum_scalar.restype = ctypes.c_uint64
        lib.offload_raw_sum_scalar.argtypes = [_POINTER, _I64]
        lib.offload_vector_path.restype = ctypes.c_int32
        lib.offload_vector_path.argtypes = []
    return lib


class HostEngine(EngineBase):
    """Each job in one native call over every tensor (module docstring), or numpy gathers and
    scatters over ``[blocks, page]`` views of the KV tensors (any block stride) and ``[chunks,
    positions, page]`` views of the region; each job is done when ``submit`` returns."""

    name = "host"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count)
        self._pages = self._page_views()
        self._done: list[int] = []
        self._native = page_sums_library()
        self._table = self._native_table()
        self._bad = np.zeros(3, dtype=np.int64)  # the native call's first mismatch
        # the addresses the native call takes on every job (`renew` writes generations in
        # place, so the array never moves)
        self._addresses = (self._table.ctypes.data, self.generations.ctypes.data,
                           self._bad.ctypes.data)
        if layout.integrity:
            starts = layout.trailer_offsets() - int(layout.trailer_offsets()[0])
            self._keys = np.array(layout.tensor_keys(), dtype=np.uint64)
            self._starts = starts // 8  # each tensor's first trailer word in a row
            self._units = np.array(layout.units, dtype=np.int64)
            self._numpy = [(kv.numpy(), host.numpy()) for kv, host in self._pages]

    def _native_table(self) -> np.ndarray:
        """``page_sums.c``'s per-tensor table: KV base, block stride, page, host base (chunk 0,
        position 0), trailer base (its sum of unit 0), units per page, identity key."""
        layout, base = self._layout, self._region.data_ptr()
        count = layout.num_tensors
        trailers = (layout.trailer_offsets() if layout.integrity
                    else np.zeros(count, dtype=np.int64))
        units = layout.units if layout.integrity else (0,) * count
        keys = (np.array(layout.tensor_keys(), dtype=np.uint64).view(np.int64)
                if layout.integrity else np.zeros(count, dtype=np.int64))
        return np.ascontiguousarray(np.stack([
            self._kv_bases, self._block_strides, np.asarray(self._geometry.page_bytes),
            base + layout.host_page_offsets(), base + trailers, np.asarray(units), keys,
        ], axis=1).astype(np.int64))

    def _issue(self, job_id: int, direction: Direction, job: Job, after: After) -> None:
        if self._native is not None:
            self._issue_native(job_id, direction, job)
        else:
            self._issue_numpy(job_id, direction, job)
        self._done.append(job_id)
        return None

    def _issue_native(self, job_id: int, direction: Direction, job: Job) -> None:
        """One native call moves (and sums) the whole job; the failed units come back
        poisoned, the first named in ``_bad``."""
        n = len(job)
        if not n:
            return
        # an array's .ctypes costs ~1.5 us, several times the call itself: the engine's own
        # arrays' addresses are taken once (`_addresses`), the job's once (both halves of
        # `Job.packed`, which the native check writes)
        packed = job.packed
        if (packed is None or packed.dtype != np.int64 or packed.size != 2 * n
                or not packed.flags.c_contiguous):  # not as the check writes it: repack
            packed = np.concatenate([job.blocks, job.host_pages]).astype(np.int64)
        blocks = packed.ctypes.data  # ``packed`` holds the memory until the call returns
        pages = blocks + n * packed.itemsize
        table, generations, first_bad = self._addresses
        assert self._native is not None
        bad = self._native.offload_host_job(
            table, self._layout.num_tensors, self._layout.row_stride,
            self._layout.blocks_per_chunk, blocks, pages, n, generations,
            direction == "load", self.integrity, first_bad)
        if bad:
            tensor, entry, unit = (int(v) for v in self._bad)
            self._mismatch(job_id, tensor, int(job.host_pages[entry]), unit)

    def _issue_numpy(self, job_id: int, direction: Direction, job: Job) -> None:
        chunks, positions = divmod(job.host_pages, self._layout.blocks_per_chunk)
        sums: list[np.ndarray] = []
        checked = self.integrity and len(job) > 0
        if checked and len(job) <= SMALL_JOB:
            # numpy gathers and scatters (no thread pool to wake): each page is read once,
            # for its copy and its sum
            for kv_pages, host_pages in self._numpy:
                if direction == "store":
                    copied = kv_pages[job.blocks]
                    host_pages[chunks, positions] = copied
                else:
                    copied = host_pages[chunks, positions]
                    kv_pages[job.blocks] = copied
                sums.append(raw_sums(copied))
        elif 0 < len(job) <= SMALL_JOB:
            entries = list(zip(job.blocks.tolist(), chunks.tolist(), positions.tolist(),
                               strict=True))
            for kv, host in self._pages:
                for block, chunk, position in entries:
                    if direction == "store":
                        host[chunk, position].copy_(kv[block])
                    else:
                        kv[block].copy_(host[chunk, position])
        elif len(job):
            blocks = torch.from_numpy(job.blocks)
            chunk, position = torch.from_numpy(chunks), torch.from_numpy(positions)
            for kv, host in self._pages:
                if direction == "store":
                    pages = kv[blocks]
                    host[chunk, position] = pages
                else:
                    pages = host[chunk, position]
                    kv[blocks] = pages
                if checked:
                    sums.append(raw_sums(pages.numpy()))
        if checked:
            self._finish_sums(job_id, direction, job, chunks, positions, sums)

    def _finish_sums(self, job_id: int, direction: Direction, job: Job, chunks: np.ndarray,
                     positions: np.ndarray, raw: list[np.ndarray]) -> None:
        """Mix the identities into the copied pages' raw sums (one pass over every tensor's
        units); a store writes them to the trailer, a load compares."""
        units = int(self._units.max())
        ident = identity(self._keys[:, None, None], chunks[None, :, None],
                         self.generations[job.host_pages][None, :, None],
                         positions[None, :, None],
                         np.arange(units)[None, None, :])
        trailers = self._trailers()
        if units == 1:  # every page one unit (the usual case): all tensors at once
            with np.errstate(over="ignore"):
                stored = np.stack(raw)[:, :, 0] + ident[:, :, 0]
            where = self._starts[:, None] + positions[None, :]
            if direction == "store":
                trailers[chunks[None, :], where] = stored
                return
            bad = trailers[chunks[None, :], where] != stored
            if bad.any():
                tensor, i = np.unravel_index(int(np.argmax(bad)), bad.shape)
                self._mismatch(job_id, int(tensor), int(job.host_pages[i]), 0)
                for failed in np.flatnonzero(bad.any(axis=1)):
                    self._poison(int(failed), job.blocks[bad[failed]], 0)
            return
        rows = chunks[:, None]
        found = False
        for t, sums in enumerate(raw):
            count = sums.shape[1]
            with np.errstate(over="ignore"):
                stored = sums + ident[t, :, :count]
            where = self._starts[t] + positions[:, None] * count + np.arange(count)[None, :]
            if direction == "store":
                trailers[rows, where] = stored
                continue
            bad = trailers[rows, where] != stored
            if bad.any():
                if not found:
                    i, unit = np.unravel_index(int(np.argmax(bad)), bad.shape)
                    self._mismatch(job_id, t, int(job.host_pages[i]), int(unit))
                    found = True
                for failed in np.flatnonzero(bad.any(axis=0)):
                    self._poison(t, job.blocks[bad[:, failed]], int(failed))

    def _poison(self, tensor: int, blocks: np.ndarray, unit: int) -> None:
        """Overwrite unit ``unit`` of these loaded blocks of one tensor, which failed their
        check, with all-ones bytes (NaN in fp16 to fp64): the job fails, and whatever reads a
        block before learning that sees no bytes other than those stored, only poison."""
        start = unit * UNIT_BYTES
        self._numpy[tensor][0][blocks, start:start + UNIT_BYTES] = 0xFF

    def poll(self) -> list[int]:
        done, self._done = self._done, []
        return done

    def wait_all(self) -> list[int]:
        return self.poll()
