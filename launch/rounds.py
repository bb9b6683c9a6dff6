"""Verified store/load rounds of the main job, driven from rank 0.

Each round: every rank fills its synthetic KV cache with round-specific data; rank 0's chunk
manager places every chunk of blocks (evicting least-recently-used chunks when the working set is
larger than the tier); every rank's actor stores its share and the quorum confirms it; the GPU
copy is poisoned; whatever the tier still holds is loaded back and every rank checks it byte for
byte against the seeded contents.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from launch import synthetic
from offload.actor import CopyJob, RankActor
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
            "evictions": self.evictions, "checked_blocks": self.checked_blocks,
            "mismatched_blocks": self.mismatched_blocks,
            "verified": self.mismatched_blocks == 0 and self.checked_blocks > 0,
            "per_round": self.per_round,
        }


# ---------------------------------------------------------------- run on every rank's actor
def _seed(actor: RankActor, round_index: int) -> int:
    t = actor.topology
    return synthetic.round_seed(round_index, t.pp_rank, t.tp_rank,
                                actor.config.layout == "replicated")


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
    load_bytes = sum(per_rank)
    n_chunks = -(-num_blocks // bpc)
    stats = RoundStats()
    for r in range(rounds):
        tier.call(_fill, r)
        keys: list[Key] = [(r, c) for c in range(n_chunks)]
        evicted_before = manager.stats().evictions
        stored_before = stats.stored_chunks
        for start in range(0, n_chunks, tier.plan.chunk_count):
            batch = keys[start:start + tier.plan.chunk_count]
            job = manager.prepare_store(batch)
            if not job.chunks:
                continue
            copy = _copy_job(job.job_id, "store", job.chunks, bpc, num_blocks, replicated)
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
        held = [k for k in keys if manager.lookup_prefix([k]) == 1]
        load = manager.prepare_load(held)
        copy = _copy_job(load.job_id, "load", load.chunks, bpc, num_blocks, False)
        began = time.perf_counter()
        try:
            tier.run(copy)
        except BaseException:  # a late rank may still read them: holds kept
            manager.complete_load(load.job_id, fence=tier.submitted)
            raise
        manager.complete_load(load.job_id)
        stats.load_s += time.perf_counter() - began
        stats.loaded_bytes += len(copy.blocks) * load_bytes
        stats.loaded_chunks += len(load.chunks)
        bad = sum(tier.call(_verify, r, list(copy.blocks)))
        stats.mismatched_blocks += bad
        stats.checked_blocks += len(copy.blocks) * tier.topology.world_size
        evicted = manager.stats().evictions - evicted_before
        stats.evictions += evicted
        stats.per_round.append({"round": r, "stored_chunks": stats.stored_chunks - stored_before,
                                "loaded_chunks": len(load.chunks), "evicted": evicted,
                                "mismatched_blocks": bad})
        stats.rounds += 1
    return stats


def _copy_job(job_id: int, direction: Direction, pairs: Sequence[tuple[Hashable, int]], bpc: int,
              num_blocks: int, writer_only: bool) -> CopyJob:
    """Expand (key, chunk id) pairs to the blocks of each key's chunk of the synthetic cache."""
    blocks, chunks, positions = [], [], []
    for key, chunk in pairs:
        _, index = cast(Key, key)
        for pos, block in enumerate(range(index * bpc, min(num_blocks, (index + 1) * bpc))):
            blocks.append(block)
            chunks.append(chunk)
            positions.append(pos)
    return CopyJob(job_id, direction, tuple(blocks), tuple(chunks), tuple(positions),
                   writer_only=writer_only)
