"""The plan's file tier arithmetic: one capacity for every rank, per-rank fingerprints."""

from __future__ import annotations

import pytest

from offload.config import TierConfig
from offload.control.plan import Plan, RankDescriptor, compute_plan
from offload.errors import OffloadError
from offload.tiers.file_format import geometry_fingerprint
from offload.tiers.plan_files import file_capacity, rank_budget, rank_geometry

KiB = 1 << 10


def _plan(layout: str = "private", pp_pages: tuple[tuple[int, ...], ...] = ((16 * KiB,),),
          cpu_bytes: int = 64 << 20) -> Plan:
    """TP2 × PP len(pp_pages), one node of two ranks per pipeline stage."""
    config = TierConfig(cpu_bytes_per_node=cpu_bytes, layout=layout, tp=2, pp=len(pp_pages),
                        integrity=False)  # slots of pages only: round numbers below
    return compute_plan([RankDescriptor(r, f"node{r // 2}", r % 2, 2, r % 2, r // 2,
                                        pp_pages[r // 2], config)
                         for r in range(2 * len(pp_pages))])


def test_capacity_is_the_minimum_over_nodes_of_the_budget_over_a_chunks_files() -> None:
    # two nodes (one per stage), stage 1's payload twice stage 0's: node1 is the tight one
    plan = _plan(pp_pages=((16 * KiB,), (32 * KiB,)))
    slot0, slot1 = plan.slots[0].slot_bytes, plan.slots[2].slot_bytes
    assert (slot0, slot1) == (16 * 16 * KiB, 16 * 32 * KiB)
    per_chunk_node1 = 2 * (slot1 + 4096)
    budget = 10 * per_chunk_node1 + 123
    capacity = file_capacity(plan, budget, writers=range(4))
    assert capacity == 10
    assert rank_budget(plan, 0, capacity) == 10 * (slot0 + 4096)
    assert rank_budget(plan, 3, capacity) // (slot1 + 4096) == capacity
    with pytest.raises(OffloadError, match=f"one chunk needs {per_chunk_node1} B .* node1"):
        file_capacity(plan, per_chunk_node1 - 1, writers=range(4))
    with pytest.raises(OffloadError, match="no rank writes"):
        file_capacity(plan, budget, writers=[])


def test_fingerprints_differ_per_rank_and_geometry_but_not_per_budget() -> None:
    plan = _plan()
    prints = {geometry_fingerprint(rank_geometry(plan, r, {"dtype": "bf16"})) for r in (0, 1)}
    assert len(prints) == 2
    bigger = _plan(cpu_bytes=128 << 20)
    assert bigger.chunk_count != plan.chunk_count
    assert rank_geometry(bigger, 0, {}) == rank_geometry(plan, 0, {})
    assert rank_geometry(_plan("shared"), 0, {}) != rank_geometry(plan, 0, {})
    assert rank_geometry(plan, 0, {"dtype": "fp8"}) != rank_geometry(plan, 0, {"dtype": "bf16"})
