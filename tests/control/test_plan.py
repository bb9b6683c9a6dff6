"""compute_plan against the rules of DESIGN.md sections 2 and 4, on random TP × PP grids."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import defaultdict
from collections.abc import Sequence
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.config import LAYOUTS, TierConfig
from offload.control.plan import Plan, RankDescriptor, compute_plan
from offload.errors import OffloadError
from offload.integrity import UNIT_BYTES
from offload.sizes import round_up

PAGES = (512, 4096, 65536)


def build_descriptors(config: TierConfig, node_sizes: Sequence[int],
                      stage_pages: Sequence[tuple[int, ...]]) -> list[RankDescriptor]:
    """Ranks ``pp_rank * tp + tp_rank``, placed on nodes of ``node_sizes`` consecutive ranks
    (as torchrun places them); pipeline stage ``s`` has KV page sizes ``stage_pages[s]``."""
    out = []
    rank = 0
    for n, size in enumerate(node_sizes):
        for local in range(size):
            pp_rank, tp_rank = divmod(rank, config.tp)
            out.append(RankDescriptor(rank, f"node{n}", local, size, tp_rank, pp_rank,
                                      stage_pages[pp_rank], config))
            rank += 1
    return out


@st.composite
def node_split(draw: st.DrawFn, world: int) -> list[int]:
    """Sizes of consecutive-rank nodes summing to ``world``."""
    cuts = sorted(draw(st.sets(st.integers(1, world - 1), max_size=3))) if world > 1 else []
    bounds = [0, *cuts, world]
    return [b - a for a, b in pairwise(bounds)]


@st.composite
def grids(draw: st.DrawFn, layout: str | None = None, feasible: bool = True
          ) -> list[RankDescriptor]:
    """Descriptors of a random job; ``feasible`` keeps the budget at one chunk or more."""
    layout = layout or draw(st.sampled_from(LAYOUTS))
    tp, pp = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    page = draw(st.sampled_from(PAGES))
    bpc = draw(st.integers(1, 16))
    tensors = draw(st.integers(1, 3))
    pages = st.tuples(*[st.integers(1, 70_000)] * tensors)
    stage_pages = [draw(pages) for _ in range(pp)]  # stages differ; a stage's ranks agree
    nodes = draw(node_split(tp * pp))
    integrity = draw(st.booleans())
    worst_row = max(_reference_rows(layout, nodes, tp, stage_pages, bpc, page,
                                    integrity).values())
    low = worst_row if feasible else 1
    high = worst_row * 40 if feasible else max(1, worst_row - 1)
    config = TierConfig(cpu_bytes_per_node=draw(st.integers(low, high)), layout=layout,
                        blocks_per_chunk=bpc, tp=tp, pp=pp, page_size=page,
                        integrity=integrity)
    return build_descriptors(config, nodes, stage_pages)


def reference_slot(pages: Sequence[int], bpc: int, page: int, integrity: bool) -> int:
    """Slot bytes from the definition: the chunk's pages, then (integrity) an 8-byte aligned
    trailer of one 8-byte sum per 16 KiB unit of every page, rounded up to the page."""
    payload = bpc * sum(pages)
    if not integrity:
        return round_up(payload, page)
    units = sum(-(-p // UNIT_BYTES) for p in pages)
    return round_up(round_up(payload, 8) + 8 * bpc * units, page)


def _reference_rows(layout: str, nodes: Sequence[int], tp: int,
                    stage_pages: Sequence[tuple[int, ...]], bpc: int, page: int,
                    integrity: bool) -> dict[str, int]:
    """Row bytes per node, straight from the definition in DESIGN.md section 2: the node's
    ranks' slots, or (replicated) one slot per pipeline stage present on the node."""
    rows: dict[str, int] = {}
    rank = 0
    for n, size in enumerate(nodes):
        stages = [(rank + i) // tp for i in range(size)]
        if layout == "replicated":
            stages = sorted(set(stages))
        rows[f"node{n}"] = sum(reference_slot(stage_pages[s], bpc, page, integrity)
                               for s in stages)
        rank += size
    return rows


def by_node(descriptors: Sequence[RankDescriptor]) -> dict[str, list[RankDescriptor]]:
    nodes: dict[str, list[RankDescriptor]] = defaultdict(list)
    for d in descriptors:
        nodes[d.node_id].append(d)
    return nodes


def node_bytes(plan: Plan, members: Sequence[RankDescriptor]) -> int:
    """Host bytes one node maps: private regions add up; a shared or replicated region is one
    mapping however many ranks map it."""
    if plan.layout == "private":
        return sum(plan.region_bytes(d.rank) for d in members)
    sizes = {plan.region_bytes(d.rank) for d in members}
    assert len(sizes) == 1
    return sizes.pop()


@settings(max_examples=300, deadline=None)
@given(grids())
def test_budget_and_chunk_count(descriptors: list[RankDescriptor]) -> None:
    plan = compute_plan(descriptors)
    config = descriptors[0].config
    rows = {node: plan.node_row_bytes(node) for node in by_node(descriptors)}
    assert plan.chunk_count == min(config.cpu_bytes_per_node // r for r in rows.values()) >= 1
    for node, members in by_node(descriptors).items():
        used = node_bytes(plan, members)
        assert used == plan.chunk_count * rows[node] <= config.cpu_bytes_per_node
    assert json.loads(json.dumps(plan.to_json()))["chunk_count"] == plan.chunk_count


@settings(max_examples=300, deadline=None)
@given(grids())
def test_slots(descriptors: list[RankDescriptor]) -> None:
    plan = compute_plan(descriptors)
    config = descriptors[0].config
    bpc, page = config.blocks_per_chunk, config.page_size
    for d in descriptors:
        slot = plan.slots[d.rank]
        assert (slot.rank, slot.node_id, slot.page_bytes) == (d.rank, d.node_id, d.page_bytes)
        assert slot.slot_bytes % page == 0
        assert slot.slot_bytes == reference_slot(d.page_bytes, bpc, page, config.integrity)
        if config.integrity:
            units = sum(-(-p // UNIT_BYTES) for p in d.page_bytes)
            assert slot.trailer_offset == round_up(bpc * d.payload, 8)
            assert slot.trailer_offset + 8 * bpc * units <= slot.slot_bytes
        else:
            assert slot.trailer_offset is None
            assert bpc * d.payload <= slot.slot_bytes < bpc * d.payload + page
        assert slot.tensor_offsets == tuple(bpc * sum(d.page_bytes[:t])
                                            for t in range(len(d.page_bytes)))
        assert slot.tensor_offsets[-1] + bpc * d.page_bytes[-1] == bpc * d.payload
        assert slot.slot_offset % page == 0
        assert slot.slot_offset + slot.slot_bytes <= plan.row_stride(d.rank)
        if plan.layout == "private":
            assert (slot.slot, slot.slot_offset) == (0, 0)
            assert plan.row_stride(d.rank) == slot.slot_bytes
        if plan.layout == "replicated":
            stages = sorted({m.pp_rank for m in by_node(descriptors)[d.node_id]})
            assert slot.slot == stages.index(d.pp_rank)
            assert plan.row_stride(d.rank) == plan.node_row_bytes(d.node_id)


@settings(max_examples=300, deadline=None)
@given(grids(layout="shared"))
def test_shared_slots_are_disjoint_and_indexed_by_model_parallel_rank(
        descriptors: list[RankDescriptor]) -> None:
    plan = compute_plan(descriptors)
    tp = descriptors[0].config.tp
    for node, members in by_node(descriptors).items():
        slots = sorted((plan.slots[d.rank] for d in members), key=lambda s: s.slot_offset)
        for d in members:
            assert plan.slots[d.rank].slot == (d.pp_rank * tp + d.tp_rank) % d.local_world_size
        assert sorted(s.slot for s in slots) == list(range(len(members)))
        assert [s.slot for s in slots] == sorted(s.slot for s in slots)
        assert slots[0].slot_offset == 0
        for a, b in pairwise(slots):
            assert a.slot_offset + a.slot_bytes == b.slot_offset
        assert slots[-1].slot_offset + slots[-1].slot_bytes == plan.node_row_bytes(node)


@settings(max_examples=300, deadline=None)
@given(grids(layout="replicated"))
def test_replicated_rows_hold_one_slot_per_stage_on_the_node(
        descriptors: list[RankDescriptor]) -> None:
    """A stage's ranks on a node share one slot; the node's stages have disjoint, page-aligned
    slots back to back in stage order; the row is their sum."""
    plan = compute_plan(descriptors)
    for node, members in by_node(descriptors).items():
        stage_slots: dict[int, set[tuple[int, int, int]]] = defaultdict(set)
        for d in members:
            s = plan.slots[d.rank]
            stage_slots[d.pp_rank].add((s.slot, s.slot_offset, s.slot_bytes))
        assert all(len(shared) == 1 for shared in stage_slots.values())
        placed = [stage_slots[stage].pop() for stage in sorted(stage_slots)]
        assert [index for index, _, _ in placed] == list(range(len(placed)))
        assert placed[0][1] == 0
        for (_, offset, size), (_, following, _) in pairwise(placed):
            assert offset + size == following
        assert placed[-1][1] + placed[-1][2] == plan.node_row_bytes(node)
        assert node_bytes(plan, members) <= descriptors[0].config.cpu_bytes_per_node


@pytest.mark.parametrize(("tp", "pp", "nodes", "slots", "rows"), [
    # TP1 x PP2 on one node: two stage slots of different sizes
    (1, 2, [2], [(0, 0), (1, 64)], {"node0": 64 + 16}),
    # TP2 x PP2 on one node: a stage's TP ranks share their stage's slot
    (2, 2, [4], [(0, 0), (0, 0), (1, 64), (1, 64)], {"node0": 64 + 16}),
    # TP1 x PP4 on one node
    (1, 4, [4], [(0, 0), (1, 64), (2, 80), (3, 112)], {"node0": 64 + 16 + 32 + 8}),
    # TP1 x PP4 on two nodes: each node's slots restart at 0
    (1, 4, [2, 2], [(0, 0), (1, 64), (0, 0), (1, 32)], {"node0": 80, "node1": 40}),
    # TP2 x PP2 on two nodes of two: one stage per node, the row is that stage's slot
    (2, 2, [2, 2], [(0, 0)] * 4, {"node0": 64, "node1": 16}),
    # TP2 x PP2 on nodes of 3 and 1: node0 holds stage 0 and half of stage 1
    (2, 2, [3, 1], [(0, 0), (0, 0), (1, 64), (0, 0)], {"node0": 80, "node1": 16}),
])
def test_replicated_stage_slots(tp: int, pp: int, nodes: list[int],
                                slots: list[tuple[int, int]], rows: dict[str, int]) -> None:
    """Stages with unequal payloads (64, 16, 32, 8 KiB a chunk) get their own slots."""
    KiB = 1 << 10
    config = TierConfig(cpu_bytes_per_node=1 << 20, layout="replicated", tp=tp, pp=pp,
                        blocks_per_chunk=4, integrity=False)
    stage_pages = [(8 * KiB, 8 * KiB), (4 * KiB,), (8 * KiB,), (2 * KiB,)][:pp]
    plan = compute_plan(build_descriptors(config, nodes, stage_pages))
    assert [(s.slot, s.slot_offset // KiB) for s in plan.slots] == slots
    assert {n: b // KiB for n, b in plan.row_bytes} == rows
    assert plan.chunk_count == (1 << 20) // (max(rows.values()) * KiB)


def test_heterogeneous_stages_share_one_chunk_count_limited_by_the_heaviest_node() -> None:
    config = TierConfig(cpu_bytes_per_node=10 << 20, tp=2, pp=2, blocks_per_chunk=4,
                        integrity=False)
    stage_pages = [(16384, 16384), (4096,)]  # stage 0: 128 KiB a chunk, stage 1: 16 KiB
    plan = compute_plan(build_descriptors(config, [2, 2], stage_pages))
    assert [s.slot_bytes for s in plan.slots] == [128 << 10] * 2 + [16 << 10] * 2
    assert dict(plan.row_bytes) == {"node0": 256 << 10, "node1": 32 << 10}
    assert plan.chunk_count == (10 << 20) // (256 << 10) == 40


def test_integrity_trailer_follows_the_pages_and_may_add_a_page() -> None:
    """The same stages with integrity on: stage 0's 128 KiB of pages fill whole pages, so its
    trailer (4 blocks x 2 pages x 8 B) needs one more 4 KiB page; stage 1's 16 KiB likewise.
    A page of 40,000 B is three units, so its trailer holds 3 sums per block."""
    config = TierConfig(cpu_bytes_per_node=10 << 20, tp=2, pp=2, blocks_per_chunk=4)
    plan = compute_plan(build_descriptors(config, [2, 2], [(16384, 16384), (4096,)]))
    assert [s.slot_bytes for s in plan.slots] == [132 << 10] * 2 + [20 << 10] * 2
    assert [s.trailer_offset for s in plan.slots] == [128 << 10] * 2 + [16 << 10] * 2
    config = TierConfig(cpu_bytes_per_node=10 << 20, tp=1, blocks_per_chunk=3)
    slot = compute_plan(build_descriptors(config, [1], [(40_000, 1)])).slots[0]
    assert slot.trailer_offset == round_up(3 * 40_001, 8) == 120_008
    assert slot.slot_bytes == round_up(120_008 + 3 * (3 + 1) * 8, 4096)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_integrity_seeds_tell_slots_apart_and_survive_a_restart(layout: str) -> None:
    """TP2 x PP2 on one node: every slot has its own seed, the ranks of a replicated stage
    (who share a slot) share it, and planning again (a restart) gives the same seeds."""
    config = TierConfig(cpu_bytes_per_node=64 << 20, layout=layout, tp=2, pp=2)
    descriptors = build_descriptors(config, [4], [(4096,), (4096,)])
    seeds = [s.integrity_seed for s in compute_plan(descriptors).slots]
    assert seeds == [s.integrity_seed for s in compute_plan(descriptors[::-1]).slots]
    expected = 2 if layout == "replicated" else 4
    assert len(set(seeds)) == expected and all(0 <= s < 1 << 63 for s in seeds)
    if layout == "replicated":
        assert seeds[0] == seeds[1] != seeds[2] == seeds[3]


def test_shared_rows_count_local_ranks_not_the_world() -> None:
    config = TierConfig(cpu_bytes_per_node=1 << 20, layout="shared", tp=8, blocks_per_chunk=1,
                        integrity=False)
    plan = compute_plan(build_descriptors(config, [4, 4], [(4096,)]))
    assert dict(plan.row_bytes) == {"node0": 4 * 4096, "node1": 4 * 4096}
    assert [s.slot for s in plan.slots] == [0, 1, 2, 3] * 2


def test_page_rounding_never_exceeds_the_budget() -> None:
    # 3 × 1000 B rounds to one 4 KiB page; a budget of 3 pages minus one byte holds 2 chunks
    config = TierConfig(cpu_bytes_per_node=3 * 4096 - 1, blocks_per_chunk=3, tp=1,
                        integrity=False)
    plan = compute_plan(build_descriptors(config, [1], [(1000,)]))
    assert plan.slots[0].slot_bytes == 4096 and plan.chunk_count == 2


@settings(max_examples=200, deadline=None)
@given(grids(feasible=False))
def test_zero_chunks_names_the_bytes_one_chunk_needs(descriptors: list[RankDescriptor]) -> None:
    config = descriptors[0].config
    rows = _reference_rows(config.layout, [len(m) for m in by_node(descriptors).values()],
                           config.tp, [d.page_bytes for d in descriptors[::config.tp]],
                           config.blocks_per_chunk, config.page_size, config.integrity)
    worst_node, worst = max(rows.items(), key=lambda item: item[1])
    with pytest.raises(OffloadError) as info:
        compute_plan(descriptors)
    message = str(info.value)
    assert f"needs {worst} B" in message and worst_node in message
    assert str(config.cpu_bytes_per_node) in message and "\n" not in message


@pytest.mark.parametrize(("field", "value"), [
    ("blocks_per_chunk", 8), ("layout", "shared"), ("page_size", 8192),
    ("cpu_bytes_per_node", 1 << 30), ("timeout_s", 5.0),
])
def test_disagreeing_ranks_are_named_with_the_field(field: str, value: object) -> None:
    config = TierConfig(cpu_bytes_per_node=64 << 20, tp=4, pp=2)
    other = dataclasses.replace(config, **{field: value})  # type: ignore[arg-type]
    descriptors = build_descriptors(config, [4, 4], [(4096,), (4096,)])
    descriptors[3] = dataclasses.replace(descriptors[3], config=other)
    descriptors[6] = dataclasses.replace(descriptors[6], config=other)
    random.Random(0).shuffle(descriptors)  # gathered order must not matter
    with pytest.raises(OffloadError) as info:
        compute_plan(descriptors)
    message = str(info.value)
    assert message.startswith("ranks 3, 6 ") and field in message and repr(value) in message


def test_replicated_with_unequal_payloads_within_a_stage_is_an_error() -> None:
    config = TierConfig(cpu_bytes_per_node=64 << 20, layout="replicated", tp=3, pp=2)
    descriptors = build_descriptors(config, [3, 3], [(4096,), (8192,)])  # stages may differ
    descriptors[4] = dataclasses.replace(descriptors[4], page_bytes=(2048,))
    descriptors[5] = dataclasses.replace(descriptors[5], page_bytes=(2048,))
    with pytest.raises(OffloadError) as info:
        compute_plan(descriptors)
    assert str(info.value) == (
        "layout 'replicated' needs equal KV payloads within pipeline stage 1 but ranks 4, 5 "
        "have 2.00 KiB per block against rank 3's 8.00 KiB; use layout 'private'")


def test_replicated_with_equal_totals_but_different_tensors_says_why() -> None:
    config = TierConfig(cpu_bytes_per_node=64 << 20, layout="replicated", tp=2)
    descriptors = build_descriptors(config, [2], [(1024, 2048)])
    descriptors[1] = dataclasses.replace(descriptors[1], page_bytes=(2048, 1024))
    with pytest.raises(OffloadError, match=r"ranks 1 have .*\[2048, 1024\].*\[1024, 2048\]"):
        compute_plan(descriptors)


@pytest.mark.parametrize("pages", [(), (4096, 0), (-1,)])
def test_empty_or_non_positive_pages_are_an_error(pages: tuple[int, ...]) -> None:
    config = TierConfig(cpu_bytes_per_node=64 << 20, tp=2)
    descriptors = build_descriptors(config, [2], [(4096,)])
    descriptors[1] = dataclasses.replace(descriptors[1], page_bytes=pages)
    with pytest.raises(OffloadError, match="rank 1 has KV page sizes"):
        compute_plan(descriptors)


def test_missing_rank_is_an_error() -> None:
    config = TierConfig(cpu_bytes_per_node=64 << 20, tp=3)
    descriptors = build_descriptors(config, [3], [(4096,)])
    with pytest.raises(OffloadError, match=r"\[0, 2\]"):
        compute_plan([descriptors[0], descriptors[2]])


def test_no_descriptors_is_an_error() -> None:
    with pytest.raises(OffloadError, match="no rank"):
        compute_plan([])


def test_shared_slot_collision_is_an_error() -> None:
    # ranks 0 and 2 alone on a node: model-parallel ranks 0 and 2 modulo 2 collide
    config = TierConfig(cpu_bytes_per_node=64 << 20, layout="shared", tp=4)
    descriptors = [RankDescriptor(r, "a" if r % 2 == 0 else "b", r // 2, 2, r, 0, (4096,),
                                  config) for r in range(4)]
    with pytest.raises(OffloadError, match="ranks 0 and 2 on node a both map to shared slot 0"):
        compute_plan(descriptors)


@settings(max_examples=100, deadline=None)
@given(grids(), st.randoms(use_true_random=False))
def test_digest_is_a_function_of_the_plan(descriptors: list[RankDescriptor],
                                          rnd: random.Random) -> None:
    plan = compute_plan(descriptors)
    shuffled = list(descriptors)
    rnd.shuffle(shuffled)
    again = compute_plan(shuffled)
    assert again == plan and again.digest() == plan.digest()
    config = descriptors[0].config
    bigger = dataclasses.replace(config, cpu_bytes_per_node=config.cpu_bytes_per_node + 1)
    other = compute_plan([dataclasses.replace(d, config=bigger) for d in descriptors])
    assert other != plan and other.digest() != plan.digest()


@settings(max_examples=100, deadline=None)
@given(grids(), grids())
def test_digests_differ_exactly_when_plans_differ(a: list[RankDescriptor],
                                                  b: list[RankDescriptor]) -> None:
    plan_a, plan_b = compute_plan(a), compute_plan(b)
    assert (plan_a.digest() == plan_b.digest()) == (plan_a == plan_b)
