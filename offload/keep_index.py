# SPDX-License-Identifier: Apache-2.0
"""The kept tier's index: which key holds which chunk, with its pages' store generations, in a
memfd the node's keeper holds across lives (docs/KEEP.md).

One fixed-size record per chunk: a state word, the key in its stored form (the file tier's,
`offload.tiers.file_format.key_bytes`), the generations of the chunk's positions and a
checksum of the record.  Rank 0 writes a record only when a store was *decided* successful and
clears it *before* its chunk is handed to another job (a store, a promotion) or its key is
dropped; so after any kill the index names only chunks whose every rank's copy completed, and a
record torn by the kill fails its checksum and is ignored.  Still, the index is not trusted for
bytes: every adopted page is checked on load by its page checksum, which mixes in the chunk,
position and generation, so a stale or damaged page is a miss.

Generations: a new life's stores must never reuse a generation an adopted page carries (a page
whose newest copy went missing would then pass with an older life's bytes).  The header keeps
an *epoch*, raised by one at each adoption, and every engine adds ``epoch << EPOCH_SHIFT`` to
the generations it gives (`TransferEngine.generation_base`).

Lives: the header names the tier that made the index (its *life*), as every keeper names the
life that reset it (`offload.region.retain`); a tier adopts only when all of them name one.

`KeptManager` keeps the index in step with the `ChunkManager`'s decisions (the manager stays
pure bookkeeping).
"""

from __future__ import annotations

import ast
import hashlib
import logging
import mmap
import os
import struct
import time
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from offload.control.plan import Plan
from offload.manager import ChunkManager, LoadJob, PromoteJob, StoreJob
from offload.region.keeper import KeeperLink
from offload.system.nameless import check_sizes, create_memfd
from offload.tiers.file_format import key_bytes, max_key_bytes

log = logging.getLogger(__name__)

INDEX_TAG = "index"
EPOCH_SHIFT = 40  # job sequence numbers stay far below 2**40; epochs below 2**20
MAX_EPOCH = 1 << 20
_MAGIC = 0x4B455031  # "KEP1"
# magic, version, epoch, chunk_count, bpc, plan digest, life (the tier that made the index)
_HEADER = struct.Struct("<IIQQI32s16s")
_HEADER_BYTES = 128
_VERSION = 2
_KEY_BYTES = max_key_bytes(4096)  # the file tier's longest key
_VALID = 1
_STATE = struct.Struct("<II")  # state, key length
_SUM_BYTES = 8


@dataclass(frozen=True)
class Adopted:
    """One chunk a kept index names: its key, chunk and its positions' generations."""

    key: bytes
    chunk: int
    generations: tuple[int, ...]


def record_bytes(blocks_per_chunk: int) -> int:
    return _STATE.size + _KEY_BYTES + 8 * blocks_per_chunk + _SUM_BYTES


def index_bytes(plan: Plan) -> int:
    """The index memfd's size for ``plan`` (page-rounded)."""
    raw = _HEADER_BYTES + plan.chunk_count * record_bytes(plan.blocks_per_chunk)
    return -(-raw // mmap.PAGESIZE) * mmap.PAGESIZE


def _digest(record: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(record, digest_size=_SUM_BYTES).digest()


def _life_digest(life: str) -> bytes:
    return hashlib.blake2b(life.encode(), digest_size=16).digest()


class KeepIndex:
    """Rank 0's mapping of the index; `create` (a fresh tier) or `adopt` (a kept one)."""

    def __init__(self, fd: int, plan: Plan, life: str) -> None:
        self.plan = plan
        self.life = life
        self.bpc = plan.blocks_per_chunk
        self.record = record_bytes(self.bpc)
        self._map = mmap.mmap(fd, index_bytes(plan))
        self.epoch = 0

    @classmethod
    def create(cls, link: KeeperLink, plan: Plan, life: str) -> KeepIndex:
        """A zeroed index (no record valid) of ``life`` (this tier's id), handed to the
        keeper."""
        fd = create_memfd("index", index_bytes(plan))
        try:
            index = cls(fd, plan, life)
            index._write_header()
            link.request("put", [fd], tag=INDEX_TAG, sizes=[index_bytes(plan)])
        finally:
            os.close(fd)
        return index

    @classmethod
    def adopt(cls, link: KeeperLink, plan: Plan, life: str
              ) -> tuple[KeepIndex, list[Adopted]]:
        """The kept index of ``life`` and its valid records, the epoch raised; an index of
        another plan or life, or past `MAX_EPOCH`, is started anew (nothing adopted)."""
        _, fds = link.request("get", tag=INDEX_TAG)
        try:
            check_sizes(fds, [index_bytes(plan)], "keeper index")
            index = cls(fds[0], plan, life)
        finally:
            for fd in fds:
                os.close(fd)
        magic, version, epoch, count, bpc, digest, made_by = _HEADER.unpack_from(index._map, 0)
        same = (magic, version, count, bpc, digest.rstrip(b"\0"), made_by) == (
            _MAGIC, _VERSION, plan.chunk_count, plan.blocks_per_chunk, plan.digest().encode(),
            _life_digest(life))
        if not same or epoch + 1 >= MAX_EPOCH:
            index.clear_all()
            return index, []
        adopted = index.valid_records()
        index.epoch = epoch + 1
        index._write_header()
        return index, adopted

    @property
    def generation_base(self) -> int:
        return self.epoch << EPOCH_SHIFT

    def _write_header(self) -> None:
        _HEADER.pack_into(self._map, 0, _MAGIC, _VERSION, self.epoch, self.plan.chunk_count,
                          self.bpc, self.plan.digest().encode(), _life_digest(self.life))

    def _offset(self, chunk: int) -> int:
        return _HEADER_BYTES + chunk * self.record

    def write(self, chunk: int, key: bytes, generations: np.ndarray) -> bool:
        """Record ``key`` in ``chunk`` (its store was decided successful); False for a key too
        long to keep (it is then a miss after a restart)."""
        if len(key) > _KEY_BYTES:
            self.clear(chunk)
            return False
        at = self._offset(chunk)
        body = bytearray(self.record - _SUM_BYTES)
        _STATE.pack_into(body, 0, _VALID, len(key))
        body[_STATE.size:_STATE.size + len(key)] = key
        gens = np.asarray(generations, dtype=np.int64)
        body[_STATE.size + _KEY_BYTES:] = gens.tobytes()
        self.clear(chunk)  # torn by a kill mid-write: the state stays 0 or the sum fails
        self._map[at + 4:at + len(body)] = body[4:]
        self._map[at + len(body):at + self.record] = _digest(body)
        self._map[at:at + 4] = body[:4]
        return True

    def write_decided(self, stored: Iterable[tuple[int, bytes]], generations: np.ndarray) -> None:
        """Write the records of a store decided successful: each (chunk, key in its stored
        form), with the chunk's positions' generations from ``generations`` (the engine's
        page array, `TransferEngine.generations`).  The one way records are written, by
        `KeptManager` and by vLLM's decider (`offload.vllm.core.TierWorker`)."""
        for chunk, key in stored:
            self.write(chunk, key, generations[chunk * self.bpc:(chunk + 1) * self.bpc])

    def clear(self, chunk: int) -> None:
        """``chunk``'s record is not valid any more: before its chunk is reused."""
        at = self._offset(chunk)
        self._map[at:at + 4] = b"\0\0\0\0"

    def clear_all(self) -> None:
        for chunk in range(self.plan.chunk_count):
            self.clear(chunk)
        self.epoch = 0
        self._write_header()

    def valid_records(self) -> list[Adopted]:
        """The records whose state is valid and whose checksum matches."""
        found = []
        for chunk in range(self.plan.chunk_count):
            at = self._offset(chunk)
            body = self._map[at:at + self.record - _SUM_BYTES]
            state, length = _STATE.unpack_from(body, 0)
            if state != _VALID or length > _KEY_BYTES:
                continue
            if self._map[at + len(body):at + self.record] != _digest(body):
                log.warning("kept index: record of chunk %d is torn or damaged; not adopted",
                            chunk)
                continue
            gens = np.frombuffer(body, dtype=np.int64, count=self.bpc,
                                 offset=_STATE.size + _KEY_BYTES)
            found.append(Adopted(bytes(body[_STATE.size:_STATE.size + length]), chunk,
                                 tuple(int(g) for g in gens)))
        return found

    def close(self) -> None:
        self._map.close()


def parse_key(stored: bytes) -> Hashable | None:
    """A key back from its stored form (``repr``: ints, bytes, strings, tuples of them), or
    None for one that is not a literal."""
    try:
        key = ast.literal_eval(stored.decode())
        hash(key)
    except (ValueError, SyntaxError, TypeError, UnicodeDecodeError, MemoryError,
            RecursionError):
        return None
    return key if key_bytes(key) == stored else None


class KeptManager(ChunkManager):
    """A `ChunkManager` whose decisions are mirrored into the kept index (rank 0): records
    cleared before a chunk is handed out or a key dropped, written once a store is decided
    successful.  ``generations`` is rank 0's engine's page generation array (every rank gives
    a store's pages the same generation)."""

    def __init__(self, chunk_count: int, disk_capacity: int, ready: int | None,
                 index: KeepIndex, generations: np.ndarray, created_at: float) -> None:
        super().__init__(chunk_count, disk_capacity, ready)
        self.index = index
        self._generations = generations
        self._created_at = created_at
        self.adopted: set[Hashable] = set()
        self.adopted_pairs: list[tuple[Hashable, int]] = []  # (key, chunk), as seeded
        self.adopted_chunks = 0
        self.first_hit_s: float | None = None

    def seed_kept(self, records: Sequence[Adopted]) -> list[Adopted]:
        """Adopt the kept index's records as readable keys; returns the records adopted (a
        key that is not a literal, or seen twice, is cleared instead)."""
        pairs, taken = [], []
        seen: set[Hashable] = set()
        for record in records:
            key = parse_key(record.key)
            if key is None or key in seen:
                self.index.clear(record.chunk)
                continue
            seen.add(key)
            pairs.append((key, record.chunk))
            taken.append(record)
        self.seed(pairs)
        self.adopted = seen
        self.adopted_pairs = pairs
        self.adopted_chunks = len(pairs)
        return taken

    def _clear(self, chunks: Collection[int]) -> None:
        for chunk in chunks:
            self.index.clear(chunk)

    def prepare_store(self, keys: Sequence[Hashable]) -> StoreJob:
        job = super().prepare_store(keys)
        self._clear([c for _, c in job.chunks])  # before any rank may write them
        return job

    def prepare_promote(self, keys: Sequence[Hashable]) -> PromoteJob:
        job = super().prepare_promote(keys)
        self._clear([c for _, c in job.chunks])
        return job

    def complete_store(self, job_id: int, ok: bool, fence: int | None = None) -> None:
        job = self._store_jobs.get(job_id)
        super().complete_store(job_id, ok, fence)
        if ok and job is not None:
            self.index.write_decided(((c, key_bytes(k)) for k, c in job.chunks), self._generations)

    def complete_load(self, job_id: int, fence: int | None = None,
                      damaged: Collection[Hashable] = ()) -> None:
        job: LoadJob | None = self._load_jobs.get(job_id)
        if job is not None:
            self._clear([c for k, c in job.chunks if k in damaged])
            if (fence is None and not damaged and self.first_hit_s is None
                    and any(k in self.adopted for k, _ in job.chunks)):
                self.first_hit_s = time.perf_counter() - self._created_at
        super().complete_load(job_id, fence, damaged)

    def drop(self, keys: Collection[Hashable] | None = None) -> None:
        chosen = list(self._chunk_of) if keys is None else keys
        self._clear([self._chunk_of[k] for k in chosen
                     if k in self._chunk_of and not self.storing(k)])
        super().drop(keys)
