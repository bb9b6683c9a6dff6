"""What the plan means for the file tier: each rank's file geometry and one capacity for all.

Pure arithmetic on an installed `Plan`, no I/O.  Every writing rank keeps its own `FileTier`
over its own slot of each row (``row_bytes`` = its slot bytes, the view at ``slot_offset`` in
the row), so all ranks must hold the *same number* of files: otherwise their LRUs would evict
different keys and a chunk could be on disk on one rank and gone on another.  The capacity is
therefore sized like the host tier's chunk count: per node, the node's budget over the bytes
one chunk costs on that node's disk (each writer's slot plus its header page), and the minimum
over nodes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from offload.errors import OffloadError
from offload.plan import Plan
from offload.sizes import format_size
from offload.tiers.file_format import chunk_file_bytes


def rank_geometry(plan: Plan, rank: int, extra: Mapping[str, object]) -> dict[str, object]:
    """The fingerprint input of ``rank``'s files: every plan value the bytes of its slot depend
    on, plus the caller's ``extra`` (e.g. the KV dtype, the model).  The chunk count and the
    host budget are left out on purpose: a restart with another ``--cpu-bytes`` still finds
    the files."""
    slot = plan.slots[rank]
    return {"layout": plan.layout, "blocks_per_chunk": plan.blocks_per_chunk,
            "page_size": plan.page_size, "rank": rank, "slot": slot.slot,
            "slot_bytes": slot.slot_bytes, "page_bytes": list(slot.page_bytes),
            "tensor_offsets": list(slot.tensor_offsets),
            "trailer_offset": slot.trailer_offset, "integrity_seed": slot.integrity_seed,
            "extra": dict(extra)}


def file_capacity(plan: Plan, fs_bytes_per_node: int, writers: Collection[int]) -> int:
    """Files per writing rank: ``min over nodes floor(fs_bytes_per_node / sum of the file
    bytes of the node's writers)``; a one-line OffloadError when a node's budget holds no
    chunk."""
    per_node: dict[str, int] = {}
    for rank in writers:
        slot = plan.slots[rank]
        per_node[slot.node_id] = (per_node.get(slot.node_id, 0)
                                  + chunk_file_bytes(slot.slot_bytes, plan.page_size))
    if not per_node:
        raise OffloadError("no rank writes the file tier; name at least one writer rank")
    node_id, need = max(per_node.items(), key=lambda item: item[1])
    if fs_bytes_per_node < need:
        raise OffloadError(
            f"file tier budget fs_bytes = {fs_bytes_per_node} B ({format_size(fs_bytes_per_node)})"
            f" per node holds no chunk: one chunk needs {need} B ({format_size(need)}) of files "
            f"on node {node_id}; give at least {need} B")
    return min(fs_bytes_per_node // b for b in per_node.values())


def rank_budget(plan: Plan, rank: int, capacity: int) -> int:
    """The ``budget_bytes`` to give ``rank``'s `FileTier` so it holds exactly ``capacity``
    files."""
    return capacity * chunk_file_bytes(plan.slots[rank].slot_bytes, plan.page_size)
