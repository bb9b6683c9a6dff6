"""The CPU backend: KV tensors in host memory (CI, CPU-only runs); jobs finish inside submit.

With a checksum trailer in the layout (`offload.integrity`), every job sums the pages it copied
-- the gathered KV pages of a store, the gathered host pages of a load -- one whole-array numpy
pass per tensor, then mixes in the identities of all tensors' units at once.  A store writes
the sums into the trailer; a load compares them with it: a mismatch is recorded (`job_error`)
and the job still reports finished.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from offload.integrity import UNIT_BYTES, identity, raw_sums
from offload.transfer.base import After, Direction, EngineBase
from offload.transfer.layout import Job, SlotLayout

# Jobs of at most this many entries copy page by page: torch's vectorised index_put into the
# region's [chunks, positions, page] view wakes its thread pool, which on a busy small host costs
# far more than a few single-page copies (docs/BENCHMARKS.md, "Figures moved from code
# comments").
SMALL_JOB = 16


class HostEngine(EngineBase):
    """One gather and one scatter per tensor over ``[blocks, page]`` views of the KV tensors
    (any block stride) and ``[chunks, positions, page]`` views of the region; each job is done
    when ``submit`` returns."""

    name = "host"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count)
        self._pages = self._page_views()
        self._done: list[int] = []
        if layout.integrity:
            starts = layout.trailer_offsets() - int(layout.trailer_offsets()[0])
            self._keys = np.array(layout.tensor_keys(), dtype=np.uint64)
            self._starts = starts // 8  # each tensor's first trailer word in a row
            self._units = np.array(layout.units, dtype=np.int64)
            self._numpy = [(kv.numpy(), host.numpy()) for kv, host in self._pages]

    def _issue(self, job_id: int, direction: Direction, job: Job, after: After) -> None:
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
        self._done.append(job_id)
        return None

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
