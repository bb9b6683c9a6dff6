"""Tiers on a caller's process group: two tiers on disjoint subgroups of one world (DP
replicas) stay apart, their ranks are the group's, nodes are found within the group, and a
rank outside the group it passes gets one clear error."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from offload.config import TierConfig
from tests.harness import run_group

MiB = 1 << 20
GROUPS = ((0, 2), (1, 3))  # interleaved: group ranks differ from world ranks


def replica_body(rank: int, layout: str, shm_dir: str | None, backend: str = "gloo"
                 ) -> object:
    """Every world rank creates both groups (in order: `new_group` is collective), then a tier
    on its own: with gloo groups the first group's tier is up before the second's starts, whose
    driver publishes its tier id a second late (after discovery, which its follower passes
    with it): a follower that read the first tier's key would join the wrong tier.
    Both tiers store into the very same chunk indices with data distinct per world rank, wait
    for each other (so both hold their blocks at once), zero their KV and load back."""

    import torch
    import torch.distributed as dist

    from offload import CopyJob, HostTier

    groups = [dist.new_group(list(g), backend=backend) for g in GROUPS]
    mine = next(i for i, g in enumerate(GROUPS) if rank in g)
    gen = torch.Generator().manual_seed(1000 + rank)
    kv = [torch.randint(0, 256, (8, 4096), generator=gen, dtype=torch.uint8)]
    original = kv[0].clone()
    config = TierConfig(cpu_bytes_per_node=2 * MiB, layout=layout, blocks_per_chunk=4, tp=2,
                        timeout_s=20, shm_dir=shm_dir)
    staggered = backend == "gloo"  # twins of other backends are made by every process at once
    if staggered and mine == 1:
        dist.barrier()
        if rank == GROUPS[1][0]:
            late_tier_id(1.0)
    tier = HostTier.create(kv, config, group=groups[mine])
    if staggered and mine == 0:
        dist.barrier()
    blocks, chunks, positions = tuple(range(8)), tuple(b // 4 for b in range(8)), (0, 1, 2, 3) * 2
    tier.submit(CopyJob(1, "store", blocks, chunks, positions))
    tier.wait([1])
    dist.barrier()  # the whole world: both tiers hold their blocks now
    kv[0].zero_()
    tier.submit(CopyJob(2, "load", blocks, chunks, positions))
    tier.wait([2])
    t = tier.topology
    out = (torch.equal(kv[0], original), tier.actor.tier_id, t.rank, t.world_size,
           [n.ranks for n in t.nodes], t.group is groups[mine], dist.get_backend(t.group))
    tier.close()
    return out


def late_tier_id(seconds: float) -> None:
    """Make this process's next tier id appear ``seconds`` late (it is drawn right before it
    is published)."""
    import time
    import uuid

    import offload.tier as tier_module

    class LateUuid:
        @staticmethod
        def uuid4() -> uuid.UUID:
            time.sleep(seconds)
            return uuid.uuid4()

    tier_module.uuid = LateUuid  # type: ignore[assignment]


def check_replicas(out: Sequence[object]) -> list[object]:
    values: list[object] = []
    for o in out:
        assert o.ok, [x.error for x in out]  # type: ignore[attr-defined]
        values.append(o.value)  # type: ignore[attr-defined]
    for g in GROUPS:
        for group_rank, world_rank in enumerate(g):
            same, _, rank, size, *_ = values[world_rank]  # type: ignore[misc]
            assert same and (rank, size) == (group_rank, 2)
    ids = {g: {values[r][1] for r in g} for g in GROUPS}  # type: ignore[index]
    assert all(len(v) == 1 for v in ids.values()) and ids[GROUPS[0]] != ids[GROUPS[1]]
    return values


@pytest.mark.parametrize("layout", ["private", "shared"])
def test_tiers_on_disjoint_subgroups_keep_their_own_blocks(layout: str, shm_dir: str) -> None:
    values = check_replicas(run_group(replica_body, 4, args=(layout, shm_dir)))
    assert all(v[4] == [(0, 1)] and v[5] for v in values)  # type: ignore[index]


def test_groups_of_another_backend_get_one_gloo_twin_per_replica(shm_dir: str) -> None:
    """``cpu:gloo`` stands in for NCCL (it does not read as plain gloo): every process makes
    the twins of both replicas' groups in one order, so the two replicas' twins are distinct
    groups and each tier's control plane runs on its own."""
    values = check_replicas(run_group(replica_body, 4, args=("shared", shm_dir, "cpu:gloo")))
    assert all(not v[5] and v[6] == "gloo" for v in values)  # type: ignore[index]


def test_each_replica_finds_its_nodes_within_its_group() -> None:
    """Replicas spanning two simulated nodes: node exchanges run over the replica's group
    (shared layout: create, hand over, pre-fault, pin), ranks and nodes are the group's."""
    values = check_replicas(run_group(replica_body, 4, args=("shared", None),
                                      nodes=["a", "a", "b", "b"]))
    assert all(v[4] == [(0,), (1,)] for v in values)  # type: ignore[index]


def test_a_rank_outside_the_group_it_passes_gets_one_clear_error() -> None:
    def body(rank: int) -> object:
        import torch
        import torch.distributed as dist

        from offload import HostTier
        from offload.errors import OffloadError

        group = dist.new_group([0])
        kv = [torch.zeros((4, 64), dtype=torch.uint8)]
        try:
            HostTier.create(kv, TierConfig(cpu_bytes_per_node=MiB, timeout_s=10), group=group)
        except OffloadError as exc:
            return str(exc)
        return None

    out = run_group(body, 2)
    assert out[1].ok and out[1].value == (
        "rank 1 is not a member of the group given to HostTier.create; call it with the group "
        "this rank belongs to")


def test_unequal_nodes_share_their_rows_by_their_own_ranks(shm_dir: str) -> None:
    """3 + 1 ranks on two nodes, shared layout: each node's row holds its own ranks' slots and
    every rank gets its bytes back."""
    def body(rank: int) -> object:
        import torch

        from offload import HostTier
        from tests.harness import store_drop_load

        gen = torch.Generator().manual_seed(rank)
        kv = [torch.randint(0, 256, (8, 4096), generator=gen, dtype=torch.uint8)]
        original = kv[0].clone()
        tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=2 * MiB, layout="shared",
                                              blocks_per_chunk=4, timeout_s=20, shm_dir=shm_dir))
        store_drop_load(tier, kv, tuple(range(8)), tuple(b // 4 for b in range(8)),
                        (0, 1, 2, 3) * 2)
        out = (torch.equal(kv[0], original), tier.plan.to_json()["row_bytes"],
               tier.plan.chunk_count)
        tier.close()
        return out

    out = run_group(body, 4, nodes=["a", "a", "a", "b"])
    assert all(o.ok for o in out), [o.error for o in out]
    assert all(o.value[0] for o in out)
    rows = out[0].value[1]
    slot = 4 * 4096 + 4096  # four pages, then their checksums' trailer (one more page)
    assert rows == {"a": 3 * slot, "b": slot}
    assert out[0].value[2] == (2 * MiB) // (3 * slot)  # the fuller node bounds the chunk count
