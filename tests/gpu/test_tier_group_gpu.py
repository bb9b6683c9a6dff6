"""DP replicas on CUDA: each rank's tier lives on its own NCCL group (DP 2 x TP 1), whose
control plane runs on a gloo twin, and round-trips its CUDA KV blocks byte-exact."""

from __future__ import annotations

import pytest
import torch

from offload.config import TierConfig
from tests.harness import run_group, store_drop_load

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MiB = 1 << 20


def test_dp2_tp1_replicas_on_nccl_groups_round_trip_cuda_blocks(shm_dir: str) -> None:
    def body(rank: int) -> object:
        import torch
        import torch.distributed as dist

        from offload import HostTier

        torch.cuda.set_device(rank % torch.cuda.device_count())
        groups = [dist.new_group([r], backend="nccl") for r in range(2)]
        gen = torch.Generator(device="cuda").manual_seed(rank)
        kv = [torch.randint(0, 256, (16, 16384), generator=gen, dtype=torch.uint8,
                            device="cuda")]
        original = kv[0].clone()
        tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=16 * MiB, layout="shared",
                                              blocks_per_chunk=4, timeout_s=60,
                                              shm_dir=shm_dir), group=groups[rank])
        store_drop_load(tier, kv, tuple(range(16)), tuple(b // 4 for b in range(16)),
                        (0, 1, 2, 3) * 4)
        torch.cuda.synchronize()
        out = (torch.equal(kv[0], original), tier.topology.world_size,
               dist.get_backend(tier.topology.group), tier.actor.tier_id)
        tier.close()
        return out

    out = run_group(body, 2, timeout=120, pg_timeout=60)
    assert all(o.ok for o in out), [o.error for o in out]
    assert all(o.value[:3] == (True, 1, "gloo") for o in out)
    assert out[0].value[3] != out[1].value[3]
