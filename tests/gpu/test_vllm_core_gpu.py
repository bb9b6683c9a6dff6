# SPDX-License-Identifier: Apache-2.0
"""The vLLM integration's core on CUDA, with KV tensors as vLLM hands them to an offloading
spec (``CanonicalKVCaches``): one int8 ``[blocks, page]`` view per layer, strided over one
allocation whose blocks interleave the layers (``stride(0)`` = layers x page), as vLLM's
packed and per-layer layouts give them.

On two ranks: rank 0 decides and its mark reaches rank 1 as vLLM's step metadata would.  A
store of whole chunks, a load of those chunks into other blocks, a load that starts inside its
first chunk (vLLM's ``block_indices``), and a load of a chunk whose host page was damaged on
rank 1: byte-exact where they succeed, the damaged one failed on both ranks with its GPU
blocks reported for recomputation."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_group

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MiB = 1 << 20
LAYERS, PAGE, BLOCKS, BPC = 4, 16384, 64, 4


def _canonical_views(rank: int) -> list:
    """vLLM's canonical per-layer views over one packed CUDA allocation."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(rank)
    packed = torch.randint(-128, 127, (BLOCKS, LAYERS * PAGE), generator=gen,
                           dtype=torch.int8, device="cuda")
    return [packed.as_strided((BLOCKS, PAGE), (LAYERS * PAGE, 1), layer * PAGE)
            for layer in range(LAYERS)]


def _steps(rank: int, layout: str) -> object:
    import time

    import torch
    import torch.distributed as dist

    from offload import HostTier, TierConfig
    from offload.vllm import core

    torch.cuda.set_device(rank % torch.cuda.device_count())
    kv = _canonical_views(rank)
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=64 * MiB, blocks_per_chunk=BPC,
                                          layout=layout, timeout_s=60), decider=0)
    worker = core.TierWorker(tier, BPC)
    seen: list = []

    def step(submit) -> None:
        submit()
        deadline = time.monotonic() + 30
        while True:
            outcomes = worker.finished()
            seen.extend((o.job_id, o.success, o.damaged, o.blocks) for o in outcomes)
            box = [worker.report(outcomes).mark if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            worker.learn(box[0])
            if box[0] is not None and box[0].through >= tier.submitted or \
                    time.monotonic() > deadline:
                return

    def same(dst: list[int], src: list[int]) -> bool:
        torch.cuda.synchronize()
        return all(torch.equal(t[dst], t[src]) for t in kv)

    # whole chunks 3 and 5 from blocks 0..7; loaded back into blocks 16..23
    step(lambda: worker.submit(1, "store", list(range(8)), 0, [3, 5]))
    step(lambda: worker.submit(2, "load", list(range(16, 24)), 0, [3, 5]))
    whole = same(list(range(16, 24)), list(range(8)))
    # a load from request block 6 on: chunk 5's positions 2 and 3 (request blocks 6, 7)
    step(lambda: worker.submit(3, "load", [30, 31], 6, [5]))
    partial = same([30, 31], [6, 7])
    # rank 1's host page of chunk 3 damaged: the load fails on both ranks
    if rank == 1:
        tier.actor.region.tensor_view(2)[3, 1, 4000] ^= 0x01
    step(lambda: worker.submit(4, "load", list(range(40, 44)), 0, [3]))
    worker.close()
    return seen, whole, partial, tier.mark


@pytest.mark.parametrize("layout", ["private", "shared"])
def test_vllm_shaped_jobs_round_trip_on_cuda(layout: str) -> None:
    out = run_group(_steps, 2, args=(layout,), timeout=180, pg_timeout=60)
    assert all(o.ok for o in out), [o.error for o in out]
    decider, other = out[0].value, out[1].value
    assert decider[0] == [(1, True, False, ()), (2, True, False, ()), (3, True, False, ()),
                          (4, False, True, (40, 41, 42, 43))]
    assert other[0] == []
    for _, whole, partial, _ in (decider, other):
        assert whole and partial
    assert decider[3] == other[3]
