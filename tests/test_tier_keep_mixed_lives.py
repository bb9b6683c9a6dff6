# SPDX-License-Identifier: Apache-2.0
"""Adoption across two nodes must never pair one life's index with another life's region.

Life 1 (nodes A, B) stores keys 0-2 and is kept.  Life 2 starts while node B's keeper is still
claimed by someone else (a rank of life 1 still exiting, say): node B keeps nothing, so life 2
starts fresh -- node A's keeper is reset and gets life 2's index, but node B's keeper still
holds life 1's region, untouched.  Life 2 stores keys 3-5 into the same chunks, with the same
generations (a fresh index starts at epoch 0 again, and job sequence numbers start at 0 in every
life).  Life 3 then finds both keepers of its plan and adopts: node A's index names keys 3-5,
node B's region holds keys 0-2 under the very same (chunk, position, generation), so node B's
page checksums pass and its rank loads key 0's bytes as key 3's."""

from __future__ import annotations

import os
import uuid
from typing import Any

from offload.config import TierConfig
from offload.region import kept
from offload.region.keeper import KeeperLink, keeper_name
from tests.harness import run_group
from tests.region.test_keeper import wait_gone
from tests.test_tier_keep import BPC, PAGE, _keepers

ROW = BPC * PAGE + PAGE  # one rank per node: its slot and its checksum trailer page


def body(rank: int, steps: str, keep_s: float, namespace: str) -> list[str]:
    """Run ``steps`` (``s<k>`` store key k, decided; ``l<k>`` load it) and return this rank's
    log: per load "hit", "miss" or "WRONG BYTES" (loaded, verified, but not key k's bytes)."""
    import torch
    import torch.distributed as dist

    from offload import CopyJob, HostTier
    from offload.errors import OffloadError

    gen = torch.Generator().manual_seed(7 + rank)
    kv = [torch.randint(0, 256, (8 * BPC, PAGE), generator=gen, dtype=torch.uint8)]
    original = kv[0].clone()
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=4 * ROW, layout="private",
                                          blocks_per_chunk=BPC, tp=2, timeout_s=30,
                                          keep_s=keep_s, fs_namespace=namespace))
    manager = tier.manager
    ids = iter(range(1000))
    log: list[str] = []

    def decided(make: Any) -> Any:
        box = [make() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def copy(direction: str, pairs: Any) -> bool:
        blocks, chunk_ids, positions = [], [], []
        for key, chunk in pairs:
            blocks += [key * BPC + p for p in range(BPC)]
            chunk_ids += [chunk] * BPC
            positions += list(range(BPC))
        job_id = next(ids)
        tier.submit(CopyJob(job_id, direction, blocks, chunk_ids, positions))
        try:
            tier.wait([job_id])
        except OffloadError:
            return False
        return True

    for step in steps.split():
        op, key = step[0], int(step[1:])
        if op == "s":
            job = decided(lambda k=key: manager.prepare_store([k]))  # type: ignore[union-attr]
            ok = copy("store", job.chunks)
            if rank == 0:
                manager.complete_store(job.job_id, ok=ok)  # type: ignore[union-attr]
            continue
        if not decided(lambda k=key: manager.residence(k) == "host"):  # type: ignore
            log.append("miss")
            continue
        job = decided(lambda k=key: manager.prepare_load([k]))  # type: ignore[union-attr]
        kv[0][key * BPC:(key + 1) * BPC] = 0
        ok = copy("load", job.chunks)
        same = bool(torch.equal(kv[0][key * BPC:(key + 1) * BPC],
                                original[key * BPC:(key + 1) * BPC]))
        if rank == 0:
            manager.complete_load(job.job_id, damaged=() if ok else [key])  # type: ignore
        log.append("hit" if ok and same else "miss" if not ok else "WRONG BYTES")
    dist.barrier()
    tier.close()
    return log


def _run(nodes: list[str], *args: Any) -> list[list[str]]:
    out = run_group(body, 2, args=args, nodes=nodes, timeout=60)
    errors = [o.error for o in out if o.error]
    assert not errors, errors
    return [o.value for o in out]


def test_a_node_kept_from_an_older_life_is_never_adopted_with_a_newer_index() -> None:
    tag = uuid.uuid4().hex[:10]
    nodes, ns = [f"keep-a-{tag}", f"keep-b-{tag}"], "model-m"
    try:
        _run(nodes, "s0 s1 s2", 30, ns)  # life 1: both nodes keep
        # node B's keeper is still claimed by another tier while life 2 starts
        other = KeeperLink.connect(keeper_name(os.geteuid(), nodes[1], ns), 5)
        assert other is not None
        other.request("claim", owner="a-tier-still-exiting")
        try:
            _run(nodes, "s3 s4 s5", 30, ns)  # life 2: node B keeps nothing, A starts anew
        finally:
            other.close()
        logs = _run(nodes, "l3 l4 l5", 1.5, ns)  # life 3: two lives kept, none adopted
        assert logs == [["miss"] * 3] * 2, logs
    finally:
        for node in nodes:
            for name, info in _keepers(node).items():
                kept.drop(name)
                wait_gone(info["pid"], timeout_s=15)
