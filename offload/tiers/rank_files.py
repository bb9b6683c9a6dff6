"""One rank's side of the file tier: its `FileTier` over its own slot of every host row.

The chunk manager (rank 0, pure bookkeeping) decides *what* moves between host memory and disk
and hands back work items; every rank executes the same items in the same order here, so the
ranks' `FileTier` LRUs take the same decisions (DESIGN.md section 6, "File tier"):

* **spill** ``(key, chunk)``: write the rank's slot of host row ``chunk`` to the file of
  ``key``.  The write reads the row asynchronously; `wait_rows` blocks until every spill of the
  named chunks has released its row, and the caller calls it before anything is copied into
  those chunks (a store, or a promotion's read), so a row is never overwritten while it is
  being written out;
* **promote** ``(key, chunk)``: read ``key``'s file into the rank's slot of row ``chunk``;
  True when the bytes are verified.  The key is readable in host memory only when every rank
  says True (the caller's decision), otherwise every rank `discard`s it.  A read that fails or
  passes its deadline (``io_timeout_s``) is False, never an exception; a read that timed out
  may still write into its row, so the row is *busy* (`busy_rows`) until it returns: the chunk
  manager keeps it quarantined and `wait_rows` refuses to hand it out;
* **discard** ``key``: forget it and remove its file.

Page checksums (`offload.integrity`) live in a trailer of the slot and mix in the chunk id and
each page's generation, so a file must not depend on the row it was spilled from: a spill
re-mixes the row's trailer to `FILE_CHUNK` and generation 0 before writing it (the row is being
evicted, nothing reads it any more), and a promotion renews its rows' pages (on every rank,
with or without files) and re-mixes each verified row to its chunk and that generation before
the key becomes readable.  The raw sums are kept all the way, so a page damaged on disk or in memory
still fails its check.

Who writes: in the private and shared layouts every rank owns its slot and keeps its own files;
in the replicated layout a pipeline stage's ranks share one slot of the node's rows and only
the stage writer (`Topology.is_stage_writer`) keeps files; the other ranks hold no tier and
answer every item as done.  Every writer gets the same file capacity (`file_capacity`), so
their LRUs stay in step.
"""

from __future__ import annotations

import errno
import math
import time
from collections.abc import Collection, Hashable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from offload.bounds import bounded_wait
from offload.control.plan import Plan
from offload.control.topology import Topology
from offload.errors import MalformedJob
from offload.integrity import move_sums, trailer_bytes
from offload.tiers.file_format import key_bytes, max_key_bytes
from offload.tiers.file_tier import DEFAULT_IO_TIMEOUT_S, FileTier, Spill, host_view
from offload.tiers.fs_io import FileIO
from offload.tiers.plan_files import file_capacity, rank_budget, rank_geometry
from offload.transfer.layout import SlotLayout, show_value

WorkItem = tuple[Hashable, int]  # (chunk key, chunk id)
FILE_CHUNK = -1  # the chunk id a file's checksums are mixed with: no row's


def check_work_items(items: object, field: str, rows: int, page_size: int, owner: str
                     ) -> tuple[WorkItem, ...]:
    """``items`` as (key, chunk) pairs, each chunk a row of the region (0 .. ``rows`` - 1, as a
    plain int) and each key one a file header holds (its repr fits a ``page_size`` header).
    Anything else is refused as `MalformedJob`, naming ``owner`` (the job), the ``field``, the
    entry, the value and the range: the plan alone decides, so every rank refuses alike, and
    before any item runs (a spill of chunk -2 would re-mix a trailer before the region)."""
    try:
        entries = list(items)  # type: ignore[call-overload]
    except TypeError:
        raise MalformedJob(f"{owner}: {field} is {show_value(items)}; pass a sequence of "
                           "(key, chunk) pairs (the chunk manager's job has them)") from None
    checked = []
    for i, item in enumerate(entries):
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise MalformedJob(f"{owner}: {field}[{i}] is {show_value(item)}, not a (key, "
                               "chunk) pair; take them from the chunk manager's job")
        key, chunk = item
        if type(chunk) is not int and not isinstance(chunk, np.integer):
            raise MalformedJob(f"{owner}: {field}[{i}] has chunk {show_value(chunk)}, not an "
                               f"integer; valid chunks are 0..{rows - 1}")
        if not 0 <= chunk < rows:
            raise MalformedJob(f"{owner}: {field}[{i}] has chunk {show_value(int(chunk))}, out "
                               f"of range: the region has {rows} chunks, valid chunks are "
                               f"0..{rows - 1}")
        try:
            size = len(key_bytes(key))
        except Exception:  # a repr that raises: no file could be named for it
            raise MalformedJob(f"{owner}: {field}[{i}] has a key of type "
                               f"{type(key).__name__} without a repr; use ints, bytes, "
                               "strings or tuples of them") from None
        if size > max_key_bytes(page_size):
            raise MalformedJob(f"{owner}: {field}[{i}] has a key whose repr is {size} bytes, "
                               f"past the {max_key_bytes(page_size)} a file header holds; use "
                               "shorter keys (e.g. a hash of the prefix)")
        checked.append((key, int(chunk)))
    return tuple(checked)


def file_writers(plan: Plan, topology: Topology) -> tuple[int, ...]:
    """The ranks that keep files: every rank, or the stage writers in the replicated layout
    (a stage's ranks share one slot, so one copy per node and stage is written)."""
    if plan.layout == "replicated":
        return topology.stage_writers
    return tuple(range(topology.world_size))


def disk_capacity(plan: Plan, topology: Topology, fs_bytes_per_node: int) -> int:
    """Files per writing rank: the chunk manager's disk capacity (pure; a one-line
    OffloadError when a node's budget holds no chunk)."""
    return file_capacity(plan, fs_bytes_per_node, file_writers(plan, topology))


class RankFiles:
    """This rank's file tier, addressed by chunk id: the slot of chunk ``c`` lies at
    ``base + c * row_stride + slot_offset`` and spans ``slot_bytes``."""

    def __init__(self, tier: FileTier | None, base: int, row_stride: int, slot_offset: int,
                 slot_bytes: int, sums: SlotLayout | None = None,
                 generations: np.ndarray | None = None, rows: int | None = None) -> None:
        self.tier = tier
        self._rows = rows  # the region's rows: no item addresses memory past them
        self._base, self._stride = base, row_stride
        self._offset, self._bytes = slot_offset, slot_bytes
        self._sums = sums  # this rank's slot layout, where its slots carry checksums
        # the engine's page generations (`TransferEngine.generations`): read by spills,
        # renewed by promotions; required where the slots carry checksums
        if sums is not None and sums.integrity and generations is None:
            raise ValueError("a file tier over checksummed slots needs the engine's "
                             "generations")
        self._generations = generations
        self._releasing: dict[int, list[Spill]] = {}  # chunk -> spills reading it
        self._reading: dict[int, Future[bool]] = {}  # chunk -> a read past its deadline

    @classmethod
    def open(cls, plan: Plan, topology: Topology, directory: str, fs_bytes_per_node: int,
             region_address: int, extra: dict[str, object], generations: np.ndarray,
             io_threads: int = 8, io_timeout_s: float = DEFAULT_IO_TIMEOUT_S,
             io: FileIO | None = None) -> RankFiles:
        """Open this rank's tier under ``directory`` (none for a replicated non-writer).
        ``extra`` joins the geometry fingerprint (e.g. the KV dtypes, tp and pp, and what
        tells apart tiers of one node with equal geometry, such as DP replicas);
        ``generations`` are the rank's engine's (`TransferEngine.generations`)."""
        rank = topology.rank
        slot = plan.slots[rank]
        tier = None
        if rank in file_writers(plan, topology):
            capacity = disk_capacity(plan, topology, fs_bytes_per_node)
            tier = FileTier(directory, rank_budget(plan, rank, capacity),
                            rank_geometry(plan, rank, extra), slot.slot_bytes,
                            io_threads=io_threads, page_size=plan.page_size,
                            io_timeout_s=io_timeout_s, io=io)
        layout = SlotLayout.from_plan(plan, rank)
        return cls(tier, region_address, plan.row_stride(rank), slot.slot_offset,
                   slot.slot_bytes, layout if layout.integrity else None, generations,
                   plan.chunk_count)

    def row(self, chunk: int) -> memoryview:
        """This rank's slot of host row ``chunk`` (page-aligned: rows and slots are page
        multiples of a page-aligned mapping)."""
        self._inside([chunk])
        return host_view(self._base + chunk * self._stride + self._offset, self._bytes)

    def _inside(self, chunks: Iterable[int]) -> None:
        """The last guard against an address outside the region: callers check their items
        first (`check_work_items`), so a chunk past the rows here is a bug."""
        if self._rows is not None:
            bad = [c for c in chunks if not 0 <= c < self._rows]
            if bad:
                raise ValueError(f"chunk {bad[0]} is not a row of this {self._rows}-row region")

    # ------------------------------------------------------------------ work items
    def spill(self, items: Sequence[WorkItem]) -> None:
        """Start writing each chunk's slot to its key's file; returns at once.  The rows stay
        busy until `wait_rows` says they were released."""
        if self.tier is None:
            return
        self._inside(chunk for _, chunk in items)  # all of them before the first re-mix
        for key, chunk in items:
            # NOTE: the row is being evicted: the manager never hands its key back to host
            # memory without a promotion (which re-mixes the sums again), so re-mixing here,
            # even for a store that is then refused, never leaves a readable row unreadable.
            self._move_sums(chunk, to_file=True)
            spill = self.tier.put(key, self.row(chunk))
            self._releasing.setdefault(chunk, []).append(spill)

    def wait_rows(self, chunks: Iterable[int]) -> None:
        """Block until no spill reads any of ``chunks`` any more (call before writing them).
        A spill past its deadline is abandoned (its key a miss) and the row is free.  Raises
        OSError (ETIMEDOUT) when a read that timed out earlier still fills one of the rows
        after one more deadline: nothing may be copied into it yet."""
        wanted = set(chunks)
        spills = [(chunk, self._releasing.pop(chunk, [])) for chunk in wanted]
        if self.tier is None or not (any(s for _, s in spills) or wanted & set(self._reading)):
            return
        # one deadline for the call, as for a promotion's reads: spills queued behind each
        # other on the I/O threads get their turn, and k stalled ones cost one timeout, not k
        count = sum(len(s) for _, s in spills) + len(wanted & set(self._reading))
        deadline = time.monotonic() + bounded_wait(self.tier.io_timeout_s * math.ceil(
            count / self.tier.io_threads))
        for _, released in spills:
            for spill in released:
                self.tier.release(spill, max(0.0, deadline - time.monotonic()))
        for chunk in wanted:
            read = self._reading.get(chunk)
            if read is None:
                continue
            try:
                read.exception(max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise OSError(errno.ETIMEDOUT, f"host row {chunk} is still being filled by a "
                              "file-tier read that passed its deadline") from None
            del self._reading[chunk]

    def busy_rows(self) -> list[int]:
        """Chunks whose row a timed-out read may still write into (the chunk manager keeps
        them quarantined until a later call no longer lists them)."""
        for chunk in [c for c, read in self._reading.items() if read.done()]:
            del self._reading[chunk]
        return sorted(self._reading)

    def promote(self, items: Sequence[WorkItem], generation: int,
                spills: Sequence[WorkItem] = ()) -> list[bool]:
        """Read each key's file into its chunk's slot; per item, True when this rank's bytes
        are verified (always True without a tier: the stage writer reads the shared slot).
        The pages of the items' rows get ``generation``
        (`offload.integrity.promotion_generation`, the same on every rank), after the spills
        re-mixed the rows they leave.

        ``spills`` are the rows the promotion evicted from host memory: the keys to read are
        made most recently used first (so the spills' disk evictions never pick them), then
        the spills start, then each read waits until its row is released.  The chunk manager
        replays the same order (`DiskIndex`)."""
        self._inside(chunk for _, chunk in (*items, *spills))
        if self.tier is not None:
            for key, _ in items:
                self.tier.touch(key)
            self.spill(spills)
        if self._generations is not None and self._sums is not None:
            bpc = self._sums.blocks_per_chunk  # renewed like a store's (`EngineBase.renew`)
            for _, chunk in items:
                self._generations[chunk * bpc:(chunk + 1) * bpc] = generation
        if self.tier is None:
            return [True] * len(items)
        self.wait_rows(chunk for _, chunk in items)
        reads = [self.tier.get(key, self.row(chunk)) for key, chunk in items]
        # every read has its deadline; queued behind others it waits its turn on the threads
        deadline = time.monotonic() + bounded_wait(self.tier.io_timeout_s * math.ceil(
            max(1, len(reads)) / self.tier.io_threads))
        verified = []
        for (_, chunk), read in zip(items, reads, strict=True):
            ok = self.tier.wait_read(read, deadline)
            if not read.done():
                self._reading[chunk] = read
            elif ok:
                self._move_sums(chunk, to_file=False)
            verified.append(ok)
        return verified

    def _move_sums(self, chunk: int, to_file: bool) -> None:
        """Re-mix the checksum trailer of this rank's slot of row ``chunk`` from the row's
        identity (its chunk and its pages' generations) to the file's (`FILE_CHUNK`,
        generation 0), or back."""
        s = self._sums
        if s is not None and s.trailer_offset is not None:
            assert self._generations is not None  # __init__ requires them with checksums
            self._inside([chunk])
            view = host_view(self._base + chunk * self._stride + self._offset + s.trailer_offset,
                             trailer_bytes(s.page_bytes, s.blocks_per_chunk))
            bpc = s.blocks_per_chunk
            row = (chunk, self._generations[chunk * bpc:(chunk + 1) * bpc].copy())
            file = (FILE_CHUNK, 0)
            move_sums(np.frombuffer(view, dtype=np.uint64), s.page_bytes, s.blocks_per_chunk,
                      s.seed, *((row, file) if to_file else (file, row)))

    def discard(self, keys: Sequence[Hashable]) -> None:
        """Forget ``keys`` (a promotion failed on some rank) and remove their files."""
        if self.tier is not None:
            for key in keys:
                self.tier.discard(key)

    # ------------------------------------------------------------------ restart agreement
    def stored_names(self) -> frozenset[str] | None:
        """File names of readable keys; None for a rank without files (no vote)."""
        return None if self.tier is None else self.tier.stored_names()

    def keep_only(self, names: Collection[str]) -> None:
        """Keep only the agreed files: the others are forgotten at once and removed by the
        pool, waited for while removals make progress (`FileTier.flush`)."""
        if self.tier is not None:
            self.tier.keep_only(names)
            self.tier.flush()

    def ordered_names(self) -> list[str] | None:
        """Held file names, least recently used first; None for a rank without files."""
        return None if self.tier is None else self.tier.ordered_names()

    def adopt_order(self, names: Sequence[str]) -> None:
        if self.tier is not None:
            self.tier.adopt_order(names)

    def stored_keys(self) -> list[bytes]:
        """Stored key bytes, least recently used first (what the chunk manager is seeded with
        after a restart, once `keep_only` made every writer's set equal)."""
        return [] if self.tier is None else self.tier.stored_keys()

    # ------------------------------------------------------------------ report and close
    def to_json(self) -> dict[str, Any] | None:
        if self.tier is None:
            return None
        self.tier.flush()  # written_bytes and write_GBps include spills still in flight
        return self.tier.to_json()

    def close(self) -> bool:
        """Finish every write and read (before the region is unmapped), waiting at most the
        I/O deadline for stalled ones.  Returns False when some were still stalled: a read
        may then still write into its row, so the region must stay mapped until `wait_idle`
        returns.  Idempotent."""
        self._releasing.clear()
        self._reading.clear()
        return self.tier.close() if self.tier is not None else True

    def wait_idle(self) -> None:
        """Block until every file operation has returned, stalled ones included."""
        if self.tier is not None:
            self.tier.wait_idle()


def agree_on_files(names: Sequence[frozenset[str] | None]) -> frozenset[str]:
    """The names every writer holds (each rank's `stored_names`; None = no files to vote)."""
    votes = [n for n in names if n is not None]
    return frozenset.intersection(*votes) if votes else frozenset()


_SUMMED = ("files", "written_bytes", "read_bytes", "hits", "misses", "corrupt", "evicted",
           "write_errors", "read_errors", "timeouts")


def combine_reports(directory: str, per_rank: Sequence[dict[str, Any] | None]
                    ) -> dict[str, Any]:
    """The report's ``fs_tier``: counters summed over the writing ranks (a chunk promoted on
    two writers counts two hits), ``o_direct`` only when every writer uses it, GB/s = summed
    bytes over the longest writer's busy time (the writers run side by side, so this is the
    node's aggregate rate); each writer's own figures under ``per_rank``."""
    writers = [(rank, r) for rank, r in enumerate(per_rank) if r is not None]
    total = {key: sum(r[key] for _, r in writers) for key in _SUMMED}
    write_s = max((r["write_s"] for _, r in writers), default=0.0)
    read_s = max((r["read_s"] for _, r in writers), default=0.0)

    def gbps(nbytes: int, seconds: float) -> float:
        return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0

    return {"dir": directory, "o_direct": all(r["o_direct"] for _, r in writers),
            "aggregate": f"sum over {len(writers)} writer ranks", "writers": len(writers),
            **total, "write_GBps": gbps(total["written_bytes"], write_s),
            "read_GBps": gbps(total["read_bytes"], read_s),
            "per_rank": [{"rank": rank, **r} for rank, r in writers]}
