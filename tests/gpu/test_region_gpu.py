"""Multi-segment regions, audit mode and several GPUs, on CUDA across real ranks.

A region split into several memory files is one address range: registrations may cross a file
seam and the copy engines and kernel must land every page in the right file.  Audit mode hashes
every block before store and after load on the GPU and must count zero mismatches.
"""

from __future__ import annotations

import pytest
import torch

from offload.config import TierConfig
from tests.harness import run_group, store_drop_load

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
KiB, MiB = 1 << 10, 1 << 20


def _round_trip(rank: int, layout: str, backend: str, gpus: int, memory: str = "memfd"
                ) -> tuple[object, ...]:
    import torch

    from offload import HostTier

    torch.cuda.set_device(rank % gpus)
    gen = torch.Generator(device="cuda").manual_seed(11 if layout == "replicated" else rank)
    kv = [torch.randint(0, 256, (96, page), generator=gen, dtype=torch.uint8, device="cuda")
          for page in (16 * KiB, 4 * KiB, 12 * KiB)]
    original = [t.clone() for t in kv]
    config = TierConfig(cpu_bytes_per_node=24 * MiB, layout=layout, blocks_per_chunk=4, tp=2,
                        timeout_s=60, segment_threshold=2 * MiB, min_segment_bytes=1 * MiB,
                        max_segments=8, private_memory=memory)
    tier = HostTier.create(kv, config, backend=backend, audit=True)
    row = tier.actor.report()
    blocks = tuple(range(96))
    chunks = tuple((5 * (b // 4)) % tier.plan.chunk_count for b in blocks)
    positions = tuple(b % 4 for b in blocks)
    store_drop_load(tier, kv, blocks, chunks, positions)
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(kv, original, strict=True))
    audit = tier.actor.auditor.to_json() if tier.actor.auditor else {}
    tier.close()
    return same, row["segments"], row["pinned"], row["engine"], audit, row["memory"]


@pytest.mark.parametrize(("layout", "memory"), [("private", "memfd"), ("private", "anonymous"),
                                                 ("shared", "memfd")])
@pytest.mark.parametrize("backend", ["auto", "copy_engine", "triton"])
def test_multi_segment_regions_round_trip_pinned_with_audit(layout: str, memory: str,
                                                            backend: str) -> None:
    """Multi-file regions, and the private default (one anonymous huge-page mapping)."""
    gpus = torch.cuda.device_count()
    out = run_group(_round_trip, 2, args=(layout, backend, gpus, memory), timeout=180,
                    pg_timeout=90)
    assert all(o.ok for o in out), [o.error for o in out]
    for same, segments, pinned, engine, audit, kind in (o.value for o in out):
        assert same and pinned and kind == memory
        assert segments > 1 if memory == "memfd" else segments == 1
        assert backend == "auto" or engine == backend
        assert audit["checked_blocks"] == 96 and audit["mismatched_blocks"] == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("layout", ["private", "shared", "replicated"])
def test_two_gpus_at_once(layout: str) -> None:
    out = run_group(_round_trip, 2, args=(layout, "auto", 2), timeout=180, pg_timeout=90)
    assert all(o.ok for o in out), [o.error for o in out]
    for same, _, pinned, _, audit, _ in (o.value for o in out):
        assert same and pinned and audit["mismatched_blocks"] == 0
