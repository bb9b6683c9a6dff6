"""Verified store/load rounds of the main job, driven from rank 0.

Each round: every rank fills its synthetic KV cache with round-specific data; rank 0's chunk
manager places every chunk of blocks (evicting least-recently-used chunks when the working set is
larger than the tier); every rank's actor stores its share and the quorum confirms it; the GPU
copy is poisoned; whatever the tier still holds is loaded back and every rank checks it byte for
byte against the seeded contents.

With a file tier (``--fs-tier``) a round larger than host memory spills the chunks it evicts,
and the load phase loads *every* chunk of the round that is cached anywhere: host hits
directly, disk hits promoted into host memory first (in batches of at most the chunk count).
A chunk on no tier (the disk's own LRU dropped it, or its file was damaged: a failed
promotion) is a miss: it is not loaded, so it is not verified, and ``missed_chunks`` counts it.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from launch import synthetic
from offload.actor import CopyJob, RankActor
from offload.errors import JobFailed
from offload.manager import ChunkManager
from offload.tier import HostTier
from offload.transfer.base import Direction

Key = tuple[int, int]  # (round, chunk index of the synthetic cache)


@dataclass
class RoundStats:
    rounds: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    store_s: float = 0.0
    load_s: float = 0.0
    stored_chunks: int = 0
    loaded_chunks: int = 0
    evictions: int = 0
    spilled_chunks: int = 0
    promoted_chunks: int = 0
    missed_chunks: int = 0
    promote_s: float = 0.0
    mismatched_blocks: int = 0
    checked_blocks: int = 0
    per_round: list[dict[str, int]] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        def gbps(b, s):
            return (round(b / s / 1e9, 3) if s > 0 else 0.0)
        return {
            "rounds": self.rounds, "stored_bytes": self.stored_bytes,
            "loaded_bytes": self.loaded_bytes,
            "store_GBps": gbps(self.stored_bytes, self.store_s),
            "load_GBps": gbps(self.loaded_bytes, self.load_s),
            "stored_chunks": self.stored_chunks, "loaded_chunks": self.loaded_chunks,
            "evictions": self.evictions, "spilled_chunks": self.spilled_chunks,
            "promoted_chunks": self.promoted_chunks, "missed_chunks": self.missed_chunks,
            "promote_s": round(self.promote_s, 6), "checked_blocks": self.checked_blocks,
            "mismatched_blocks": self.mismatched_blocks,
            "verified": self.mismatched_blocks == 0 and self.checked_blocks > 0,
            "per_round": self.per_round,
        }


# ---------------------------------------------------------------- run on every rank's actor
def _seed(actor: RankActor, round_index: int) -> int:
    t = actor.topology
    replica = t.global_rank(t.rank) // t.world_size  # the main job's DP replicas are contiguous
    return synthetic.round_seed(round_index, t.pp_rank, t.tp_rank,
                                actor.config.layout == "replicated", replica)


def _fill(actor: RankActor, round_index: int) -> None:
    synthetic.fill(actor.kv_tensors, _seed(actor, round_index))
    _sync(actor)


def _poison(actor: RankActor) -> None:
    synthetic.poison(actor.kv_tensors)
    _sync(actor)


def _verify(actor: RankActor, round_index: int, blocks: list[int]) -> int:
    actor.drain()
    _sync(actor)
    return synthetic.count_mismatches(actor.kv_tensors, _seed(actor, round_index), blocks)


def _sync(actor: RankActor) -> None:
    if actor.kv_tensors[0].is_cuda:
        torch.cuda.synchronize(actor.kv_tensors[0].device)


# ---------------------------------------------------------------- rank 0 drives
def run_rounds(tier: HostTier, rounds: int, num_blocks: int) -> RoundStats:
    manager = tier.manager
    assert manager is not None, "rounds are driven from rank 0"
    bpc = tier.plan.blocks_per_chunk
    replicated = tier.plan.layout == "replicated"
    per_rank = [sum(slot.page_bytes) for slot in tier.plan.slots]  # bytes one block moves
    # replicated stores copy once per (node, stage): only the stage writers move bytes
    writers = sum(per_rank[w] for w in tier.topology.stage_writers)
    block_bytes = writers if replicated else sum(per_rank)
    n_chunks = -(-num_blocks // bpc)
    stats = RoundStats()
    for r in range(rounds):
        tier.call(_fill, r)
        keys: list[Key] = [(r, c) for c in range(n_chunks)]
        before = manager.stats()
        stored_before = stats.stored_chunks
        # with background set-up: wait for a first row, then rows that came online since the
        # last job join the free chunks
        ready_rows = tier.wait_ready(rows=1).rows
        for start in range(0, n_chunks, tier.plan.chunk_count):
            batch = keys[start:start + tier.plan.chunk_count]
            job = manager.prepare_store(batch)
            if not job.chunks:
                continue
            copy = _copy_job(job.job_id, "store", job.chunks, bpc, num_blocks, replicated,
                             job.spills)
            began = time.perf_counter()
            try:
                tier.run(copy)
            except BaseException:  # a late rank may still write them: quarantined
                manager.complete_store(job.job_id, ok=False, fence=tier.submitted)
                raise
            stats.store_s += time.perf_counter() - began
            manager.complete_store(job.job_id, ok=True)
            stats.stored_bytes += len(copy.blocks) * block_bytes
            stats.stored_chunks += len(job.chunks)
        tier.call(_poison)
        chunks_before = stats.loaded_chunks
        loaded = _load_round(tier, manager, keys, stats, num_blocks)
        loaded_chunks = stats.loaded_chunks - chunks_before
        bad = sum(tier.call(_verify, r, loaded))
        stats.mismatched_blocks += bad
        stats.checked_blocks += len(loaded) * tier.topology.world_size
        after = manager.stats()
        evicted = after.evictions - before.evictions
        stats.evictions += evicted
        stats.spilled_chunks += after.spilled - before.spilled
        stats.promoted_chunks += after.promoted - before.promoted
        stats.missed_chunks += n_chunks - loaded_chunks
        stats.per_round.append({"round": r, "stored_chunks": stats.stored_chunks - stored_before,
                                "loaded_chunks": loaded_chunks, "evicted": evicted,
                                "spilled_chunks": after.spilled - before.spilled,
                                "promoted_chunks": after.promoted - before.promoted,
                                "missed_chunks": n_chunks - loaded_chunks,
                                "ready_rows": ready_rows,
                                "mismatched_blocks": bad})
        stats.rounds += 1
    return stats


def _load_round(tier: HostTier, manager: ChunkManager, keys: list[Key], stats: RoundStats,
                num_blocks: int) -> list[int]:
    """Load every key of the round that some tier holds; return the blocks loaded.  Host hits
    go first in one job (their chunks are then free to be evicted by the promotions), then the
    disk hits, promoted and loaded in batches of at most the chunk count."""
    loaded = _load(tier, manager, [k for k in keys if manager.residence(k) in ("host", "both")],
                   stats, num_blocks)
    on_disk = [k for k in keys if manager.residence(k) == "disk"]
    for start in range(0, len(on_disk), tier.plan.chunk_count):
        # a key a previous batch's spills pushed off the disk is a miss now
        batch = [k for k in on_disk[start:start + tier.plan.chunk_count]
                 if manager.residence(k) == "disk"]
        if not batch:
            continue
        began = time.perf_counter()
        job, failed = tier.promote(batch)
        stats.promote_s += time.perf_counter() - began
        ready = [cast(Key, k) for k, _ in job.chunks if k not in failed]
        loaded += _load(tier, manager, ready, stats, num_blocks)
    return loaded


def _load(tier: HostTier, manager: ChunkManager, keys: list[Key], stats: RoundStats,
          num_blocks: int) -> list[int]:
    """One load job of readable ``keys``; return its blocks."""
    load = manager.prepare_load(keys)
    copy = _copy_job(load.job_id, "load", load.chunks, tier.plan.blocks_per_chunk, num_blocks,
                     False)
    began = time.perf_counter()
    try:
        tier.run(copy)
    except JobFailed as exc:  # a late rank may still read them: holds kept
        manager.complete_load(load.job_id, fence=tier.submitted,
                              damaged=keys if exc.damaged else ())
        raise
    except BaseException:
        manager.complete_load(load.job_id, fence=tier.submitted)
        raise
    manager.complete_load(load.job_id)
    stats.load_s += time.perf_counter() - began
    stats.loaded_bytes += len(copy.blocks) * sum(sum(s.page_bytes) for s in tier.plan.slots)
    stats.loaded_chunks += len(load.chunks)
    return list(copy.blocks)


def _copy_job(job_id: int, direction: Direction, pairs: Sequence[tuple[Hashable, int]], bpc: int,
              num_blocks: int, writer_only: bool,
              spills: tuple[tuple[Hashable, int], ...] = ()) -> CopyJob:
    """Expand (key, chunk id) pairs to the blocks of each key's chunk of the synthetic cache;
    ``spills`` (the store's evicted chunks to write to disk first) travel with the job."""
    blocks, chunks, positions = [], [], []
    for key, chunk in pairs:
        _, index = cast(Key, key)
        for pos, block in enumerate(range(index * bpc, min(num_blocks, (index + 1) * bpc))):
            blocks.append(block)
            chunks.append(chunk)
            positions.append(pos)
    return CopyJob(job_id, direction, tuple(blocks), tuple(chunks), tuple(positions),
                   writer_only=writer_only, spills=spills)
