# SPDX-License-Identifier: Apache-2.0
"""Retention of the host tier across lives (`TierConfig.keep_s`, docs/KEEP.md), with real
process groups: a tier that ends (cleanly, or with every rank SIGKILLed) leaves its regions and
index with a keeper; the next tier of the same geometry and namespace adopts them and loads
verified bytes; decided stores survive a kill, in-flight ones are misses; after ``keep_s``
nothing is left; another geometry or namespace starts fresh and frees what was kept."""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any

import pytest

from offload.config import TierConfig
from offload.errors import OffloadError
from offload.region import kept
from offload.region.keeper import keeper_name
from tests.harness import run_group
from tests.other_user import as_root, listener, other_process
from tests.region.test_keeper import wait_gone

KiB = 1 << 10
# A first life keeps for 30 s (longer than starting the next group takes on a busy host); the
# last life's claim sets 1.5 s, so the keeper is gone soon after the test.
BPC = 2
PAGE = 4 * KiB
ROW = 2 * BPC * PAGE + 2 * PAGE  # two ranks' slots, each with its checksum trailer page


def tier_body(rank: int, steps: str, keep_s: float, namespace: str, chunks: int = 3,
              layout: str = "private", kill: bool = False) -> Any:
    """Run ``steps`` on a fresh tier: ``s<k>`` stores key k (decided), ``i<k>`` stores key k
    without deciding it, ``l<k>`` loads key k (verified against the original block) or reports a
    miss.  Returns this rank's account: adopted chunks and the adoption gauges (rank 0's), per
    load "hit", "miss" or "WRONG BYTES" (verified, but another key's bytes)."""
    import torch
    import torch.distributed as dist

    from offload import CopyJob, HostTier

    gen = torch.Generator().manual_seed(7 + rank)
    kv = [torch.randint(0, 256, (8 * BPC, PAGE), generator=gen, dtype=torch.uint8)]
    original = kv[0].clone()
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=chunks * ROW, layout=layout,
                                          blocks_per_chunk=BPC, tp=2, timeout_s=30,
                                          keep_s=keep_s, fs_namespace=namespace or None))
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
        if op in "si":
            job = decided(lambda k=key: manager.prepare_store([k]))  # type: ignore[union-attr]
            ok = copy("store", job.chunks)
            if rank == 0 and op == "s":
                manager.complete_store(job.job_id, ok=ok)  # type: ignore[union-attr]
        else:
            readable = decided(lambda k=key: manager.residence(k) == "host")  # type: ignore
            if not readable:
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
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    adopted = getattr(manager, "adopted_chunks", None)
    gauges = _adoption_gauges(tier) if rank == 0 else {}
    tier.close()
    return (adopted, log, gauges) if rank == 0 else (None, log, {})


def _adoption_gauges(tier: Any) -> dict[str, float]:
    """The adoption families of a scrape of this rank's metrics (`TierCollector`)."""
    from offload.observe.metrics import TierCollector

    collector = TierCollector()
    collector.tier = tier
    return {family.name: family.samples[0].value for family in collector.collect()
            if family.name.startswith(("offload_adopted", "offload_first_adopted"))}


def _node() -> str:
    return f"keep-{uuid.uuid4().hex[:12]}"


def _run(node: str, *args: Any) -> Any:
    out = run_group(tier_body, 2, args=args, nodes=[node, node], timeout=60)
    errors = [o.error for o in out if o.error]
    assert not errors, errors
    return out[0].value


def _keepers(node: str) -> dict[str, dict[str, Any]]:
    return dict(kept.keepers(node))


def _wait_all_gone(node: str, timeout_s: float = 15) -> None:
    for info in _keepers(node).values():
        wait_gone(info["pid"], timeout_s)


def test_a_kept_tier_is_adopted_and_loads_verified_then_expires() -> None:
    node, ns = _node(), "model-a"
    adopted, log, gauges = _run(node, "s0 s1 s2", 30, ns)  # longer than a start of the group
    assert adopted == 0 and log == []
    assert gauges == {"offload_adopted_chunks": 0, "offload_adopted_bytes": 0}
    (info,) = _keepers(node).values()
    assert info["attached"] == 0 and info["bytes"] > 3 * ROW  # two regions and the index
    adopted, log, gauges = _run(node, "l0 l1 l2", 1.5, ns)
    assert adopted == 3 and log == ["hit", "hit", "hit"]
    assert gauges["offload_adopted_chunks"] == 3 and gauges["offload_adopted_bytes"] == 3 * ROW
    assert 0 < gauges["offload_first_adopted_hit_seconds"] < 30
    (again,) = _keepers(node).values()
    assert again["pid"] == info["pid"]  # the same keeper, kept on
    waited = wait_gone(info["pid"], timeout_s=15)  # expiry: keep_s after the last tier
    assert waited < 10
    assert _keepers(node) == {}
    assert not [f for f in os.listdir("/dev/shm") if info["geometry"] in f]


def test_without_keep_nothing_is_kept() -> None:
    node = _node()
    adopted, _, gauges = _run(node, "s0", 0, "")
    assert gauges == {}  # no retention: no adoption families
    assert adopted is None and _keepers(node) == {}


def test_shared_layout_is_kept_and_adopted() -> None:
    node, ns = _node(), "model-s"
    _run(node, "s0 s1", 30, ns, 3, "shared")
    adopted, log, _ = _run(node, "l0 l1 l2", 1.5, ns, 3, "shared")
    assert adopted == 2 and log == ["hit", "hit", "miss"]
    _wait_all_gone(node)


def test_sigkill_of_every_rank_keeps_decided_chunks_only() -> None:
    """Three chunks hold keys 0-2 (decided); key 3's store evicts key 0 and copies, but is
    never decided, when every rank is SIGKILLed.  The restart adopts keys 1 and 2; keys 0 and 3
    are misses, and nothing reads the overwritten chunk as key 0."""
    node, ns = _node(), "model-k"
    out = run_group(tier_body, 2, args=("s0 s1 s2 i3", 30, ns, 3, "private", True),
                    nodes=[node, node], timeout=60)
    assert all(o.error for o in out), out  # every rank died
    adopted, log, _ = _run(node, "l1 l2 l0 l3", 1.5, ns)
    assert adopted == 2 and log == ["hit", "hit", "miss", "miss"]
    _wait_all_gone(node)


def test_changed_geometry_starts_fresh_and_frees_the_kept_regions() -> None:
    node, ns = _node(), "model-g"
    _run(node, "s0 s1", 30, ns)
    (before,) = _keepers(node).values()
    adopted, log, _ = _run(node, "l0 l1", 1.5, ns, 4)  # one more chunk: another plan
    assert adopted == 0 and log == ["miss", "miss"]
    (after,) = _keepers(node).values()
    assert after["geometry"] != before["geometry"] and after["bytes"] > before["bytes"]
    _wait_all_gone(node)


def test_changed_namespace_starts_fresh_and_drops_the_idle_keeper() -> None:
    node = _node()
    _run(node, "s0 s1", 30, "model-old")  # would live 30 s
    (old,) = _keepers(node).values()
    adopted, log, _ = _run(node, "l0", 1.5, "model-new")
    assert adopted == 0 and log == ["miss"]
    assert wait_gone(old["pid"], timeout_s=5) < 2  # dropped, not left to expire
    assert [i["namespace"] for i in _keepers(node).values()] == ["model-new"]
    _wait_all_gone(node)


@as_root
def test_a_keeper_name_held_by_another_user_means_no_retention() -> None:
    node, ns = _node(), "model-u"
    name = keeper_name(os.geteuid(), node, ns)

    with other_process(listener(name.encode()), timeout_s=1) as child:
        assert child.read() == b"r"
        adopted, log, _ = _run(node, "s0 l0", 1.5, ns)
        assert adopted is None and log == ["hit"]  # served, unkept
        os.kill(child.pid, signal.SIGKILL)
    assert _keepers(node) == {}


def test_keep_settings_are_checked() -> None:
    with pytest.raises(OffloadError, match="keep_s .--keep. = 5 needs fs_namespace"):
        TierConfig(cpu_bytes_per_node=1 << 20, keep_s=5)
    with pytest.raises(OffloadError, match="cannot keep named regions"):
        TierConfig(cpu_bytes_per_node=1 << 20, keep_s=5, fs_namespace="m", shm_dir="/dev/shm")
    with pytest.raises(OffloadError, match="must be positive"):
        TierConfig(cpu_bytes_per_node=1 << 20, keep_s=-1, fs_namespace="m")
