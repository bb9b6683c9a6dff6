"""The capacity plan: pure geometry, no torch.distributed and no syscalls.

Every rank describes itself (`RankDescriptor`); rank 0 checks that they agree and computes one
`Plan` that every rank installs.  The rules (DESIGN.md section 4):

* a rank's *payload* is the sum of its KV tensors' bytes per block; its *slot* holds
  ``blocks_per_chunk`` blocks, rounded up to the page so no page is shared by two ranks;
* a node's *row* is the sum of its ranks' slots (``replicated``: one slot per pipeline stage
  present on the node, shared by that stage's ranks, whose data is identical);
* ``chunk_count = min over nodes floor(cpu_bytes_per_node / row_bytes(node))`` so every rank gets
  the same number of chunks and no node exceeds its budget.

Within a slot the tensors are laid out tensor-major: tensor ``t`` holds its ``blocks_per_chunk``
pages back to back starting at ``tensor_offsets[t]``, so a per-tensor, per-chunk view is a plain
``[blocks_per_chunk, page_bytes[t]]`` array.  With ``TierConfig.integrity`` the pages are followed,
at ``trailer_offset`` (8-byte aligned), by the slot's page checksums (`offload.integrity`): a slot
is ``round_up(trailer_offset + trailer_bytes, page_size)`` bytes, and the sums travel wherever
the slot's bytes go (a replicated stage's shared slot, the file tier's whole-slot files).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from offload.config import TierConfig
from offload.errors import OffloadError
from offload.integrity import WORD, trailer_bytes
from offload.sizes import format_size, round_up


@dataclass(frozen=True)
class RankDescriptor:
    """What one rank tells rank 0 about itself before the plan exists."""

    rank: int
    node_id: str
    local_rank: int
    local_world_size: int
    tp_rank: int
    pp_rank: int
    page_bytes: tuple[int, ...]
    config: TierConfig
    numa_node: int | None = None  # its GPU's NUMA node (None: no GPU, no NUMA, or numa off)

    @property
    def payload(self) -> int:
        return sum(self.page_bytes)


@dataclass(frozen=True)
class RankSlot:
    """Where one rank's bytes live in its region's rows."""

    rank: int
    node_id: str
    slot: int
    slot_offset: int
    slot_bytes: int
    page_bytes: tuple[int, ...]
    tensor_offsets: tuple[int, ...]
    trailer_offset: int | None = None
    """Where the slot's checksum trailer starts in the slot; None with integrity off."""
    integrity_seed: int = 0
    """The tier seed mixed into every checksum of this slot (`integrity_seed`)."""
    numa_node: int | None = None
    """The NUMA node this slot's pages are placed on: its rank's GPU's (replicated: the
    stage writer's, whose copy the stage shares); None: no placement."""


@dataclass(frozen=True)
class Plan:
    """The agreed geometry.  ``slots[r]`` describes rank ``r``."""

    layout: str
    chunk_count: int
    blocks_per_chunk: int
    cpu_bytes_per_node: int
    page_size: int
    slots: tuple[RankSlot, ...]
    row_bytes: tuple[tuple[str, int], ...]

    def node_row_bytes(self, node_id: str) -> int:
        return dict(self.row_bytes)[node_id]

    def row_stride(self, rank: int) -> int:
        """Bytes from one chunk's row to the next in ``rank``'s region."""
        slot = self.slots[rank]
        if self.layout == "private":
            return slot.slot_bytes
        return self.node_row_bytes(slot.node_id)

    def region_bytes(self, rank: int) -> int:
        return self.chunk_count * self.row_stride(rank)

    def to_json(self) -> dict[str, object]:
        """The report's ``plan`` section (string keys, as JSON needs)."""
        return {
            "layout": self.layout,
            "chunk_count": self.chunk_count,
            "blocks_per_chunk": self.blocks_per_chunk,
            "cpu_bytes_per_node": self.cpu_bytes_per_node,
            "page_size": self.page_size,
            "slot_bytes": {str(s.rank): s.slot_bytes for s in self.slots},
            "row_bytes": dict(self.row_bytes),
            "slots": [asdict(s) for s in self.slots],
        }

    def digest(self) -> str:
        """A hash every rank computes over the plan it installed; equal digests = same plan."""
        text = json.dumps(self.to_json(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_agreement(descriptors: Sequence[RankDescriptor]) -> None:
    """Raise a one-line error naming the field and the ranks whose configuration differs from
    rank 0's."""
    reference = descriptors[0].config.as_dict()
    for field, expected in reference.items():
        differ = [d.rank for d in descriptors if d.config.as_dict()[field] != expected]
        if differ:
            values = sorted({repr(descriptors[r].config.as_dict()[field]) for r in differ})
            raise OffloadError(
                f"ranks {_ranks(differ)} run with {field} = {', '.join(values)} but rank 0 with "
                f"{expected!r}; start every rank with the same settings"
            )
    for d in descriptors:
        if not d.page_bytes or any(p <= 0 for p in d.page_bytes):
            raise OffloadError(
                f"rank {d.rank} has KV page sizes {list(d.page_bytes)}; every KV tensor needs a "
                "positive number of bytes per block"
            )


def check_layout_fits(descriptors: Sequence[RankDescriptor]) -> None:
    """The replicated layout stores one copy per pipeline stage, so a stage's payloads must be
    equal (different stages may differ)."""
    if descriptors[0].config.layout != "replicated":
        return
    stages: dict[int, list[RankDescriptor]] = {}
    for d in descriptors:
        stages.setdefault(d.pp_rank, []).append(d)
    for stage, members in sorted(stages.items()):
        first = members[0]
        differ = [d.rank for d in members if d.page_bytes != first.page_bytes]
        if differ:
            other = next(d for d in members if d.rank == differ[0])
            raise OffloadError(
                f"layout 'replicated' needs equal KV payloads within pipeline stage {stage} "
                f"but ranks {_ranks(differ)} have {_payload(other)} per block against rank "
                f"{first.rank}'s {_payload(first)}; use layout 'private'"
            )


def slot_index(d: RankDescriptor, layout: str, tp: int, stages: Sequence[int]) -> int:
    """A rank's slot in its node's rows.  Shared: its model-parallel rank modulo the node's
    local world size (never its CUDA ordinal).  Replicated: its pipeline stage's index among
    ``stages``, the sorted stages present on its node (a stage's ranks share one slot).
    Private: 0."""
    if layout == "shared":
        return (d.pp_rank * tp + d.tp_rank) % d.local_world_size
    if layout == "replicated":
        return stages.index(d.pp_rank)
    return 0


def compute_plan(descriptors: Sequence[RankDescriptor]) -> Plan:
    """Rank 0's computation: check agreement, place slots and size the chunk count."""
    if not descriptors:
        raise OffloadError("no rank descriptors to plan from; every rank must describe itself")
    descriptors = sorted(descriptors, key=lambda d: d.rank)
    if [d.rank for d in descriptors] != list(range(len(descriptors))):
        raise OffloadError(f"descriptors cover ranks {[d.rank for d in descriptors]}, not 0..n-1")
    check_agreement(descriptors)
    check_layout_fits(descriptors)
    config = descriptors[0].config
    bpc, page = config.blocks_per_chunk, config.page_size

    nodes: dict[str, list[RankDescriptor]] = {}
    for d in descriptors:
        nodes.setdefault(d.node_id, []).append(d)

    slots: list[RankSlot] = []
    row_bytes: dict[str, int] = {}
    tp = config.tp or len(descriptors) // config.pp
    for node_id, members in nodes.items():
        stages = sorted({d.pp_rank for d in members})
        index = {d.rank: slot_index(d, config.layout, tp, stages) for d in members}
        if config.layout == "shared":
            _check_unique_slots(node_id, index)
        trailers = {d.rank: round_up(bpc * d.payload, WORD) if config.integrity else None
                    for d in members}
        sizes = {d.rank: round_up(_slot_end(d, bpc, trailers[d.rank]), page) for d in members}
        offsets, row_bytes[node_id] = _place(config.layout, members, index, sizes)
        # a replicated stage's ranks share their writer's copy: it goes on the writer's node
        writer = {index[m.rank]: m for m in sorted(members, key=lambda m: -m.rank)}
        placed = {d.rank: (writer[index[d.rank]] if config.layout == "replicated" else d)
                  .numa_node for d in members}
        for d in members:
            tensor_offsets = tuple(
                bpc * sum(d.page_bytes[:t]) for t in range(len(d.page_bytes))
            )
            owner = min(m.rank for m in members if index[m.rank] == index[d.rank])
            seed = integrity_seed(config.layout, d.rank if config.layout == "private" else owner,
                                  bpc, d.page_bytes)
            slots.append(RankSlot(d.rank, node_id, index[d.rank], offsets[d.rank],
                                  sizes[d.rank], d.page_bytes, tensor_offsets,
                                  trailers[d.rank], seed, placed[d.rank]))

    budget = config.cpu_bytes_per_node
    chunk_count = min(budget // row for row in row_bytes.values())
    if chunk_count == 0:
        node_id, row = max(row_bytes.items(), key=lambda item: item[1])
        raise OffloadError(
            f"cpu budget {format_size(budget)} ({budget} B) per node holds no chunk: one chunk "
            f"needs {row} B ({format_size(row)}) on node {node_id}; raise --cpu-bytes to at "
            f"least {row} or lower --blocks-per-chunk"
        )
    slots.sort(key=lambda s: s.rank)
    return Plan(config.layout, chunk_count, bpc, budget, page, tuple(slots),
                tuple(sorted(row_bytes.items())))


def integrity_seed(layout: str, owner: int, blocks_per_chunk: int,
                   page_bytes: Sequence[int]) -> int:
    """The tier seed of a slot's checksums: a hash of the layout, the slot's owner (the rank;
    in the shared and replicated layouts the lowest rank on its node with that slot, so a
    replicated stage's ranks share it) and the slot's geometry.  A restart with the same
    geometry gets the same seed (the file tier's files stay valid); two slots differ."""
    text = json.dumps([layout, owner, blocks_per_chunk, list(page_bytes)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _slot_end(d: RankDescriptor, bpc: int, trailer: int | None) -> int:
    """Bytes a slot needs before page rounding: its pages, then its trailer when it has one."""
    if trailer is None:
        return bpc * d.payload
    return trailer + trailer_bytes(d.page_bytes, bpc)


def _place(layout: str, members: Sequence[RankDescriptor], index: dict[int, int],
           sizes: dict[int, int]) -> tuple[dict[int, int], int]:
    """Each member's slot offset in its rows, and the node's row bytes.

    Private: every rank's region is its own row (offset 0) and the node maps all of them.
    Shared and replicated: the slots lie back to back in slot-index order; ranks with one index
    (a replicated stage's ranks, whose payloads are equal) share one slot."""
    if layout == "private":
        return {d.rank: 0 for d in members}, sum(sizes.values())
    slot_bytes = {index[d.rank]: sizes[d.rank] for d in members}
    starts: dict[int, int] = {}
    offset = 0
    for i in sorted(slot_bytes):
        starts[i] = offset
        offset += slot_bytes[i]
    return {d.rank: starts[index[d.rank]] for d in members}, offset


def _check_unique_slots(node_id: str, index: dict[int, int]) -> None:
    seen: dict[int, int] = {}
    for rank, slot in sorted(index.items()):
        if slot in seen:
            raise OffloadError(
                f"ranks {seen[slot]} and {rank} on node {node_id} both map to shared slot {slot}; "
                "place consecutive model-parallel ranks on one node or use layout 'private'"
            )
        seen[slot] = rank


def _payload(d: RankDescriptor) -> str:
    """A payload as the user configured it: its total, and its KV page sizes when there are
    several tensors (two payloads of equal total but different tensors still differ)."""
    pages = f" (KV pages {list(d.page_bytes)} B)" if len(d.page_bytes) > 1 else ""
    return f"{format_size(d.payload)}{pages}"


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" (+{len(ranks) - 8} more)" if len(ranks) > 8 else "")
