"""Who runs where: grid coordinates, nodes, node leaders and node-local process groups.

Rank order on the TP x PP grid is ``rank = pp_rank * tp + tp_rank`` (TP ranks of one pipeline
stage are consecutive, as torchrun places them on one node), where ``rank`` is the rank in the
tier's group: the default group, or a caller's group such as one DP replica's.  The node id is
the host name unless ``OFFLOAD_NODE_ID`` overrides it, which lets one host simulate several
nodes.  A node's leader is its lowest rank; a *stage writer* is the lowest rank of one pipeline
stage on one node (it stores that stage's copy in the replicated layout).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from offload.errors import OffloadError


@dataclass(frozen=True)
class RankPlace:
    """One rank's published identity.  ``pid`` and ``pid_namespace`` let a node's peers
    check that descriptors are served by the leader's very process (`leader_pid`)."""

    rank: int
    node_id: str
    local_world_size_env: int | None
    pid: int = 0
    pid_namespace: int = 0


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ranks: tuple[int, ...]

    @property
    def leader_rank(self) -> int:
        return self.ranks[0]


@dataclass
class Topology:
    """This rank's view of the tier's ranks.  ``group`` is the gloo group the tier's control
    plane runs on (None: the default group); ``rank`` and every rank number here are ranks *of
    that group*.  ``node_group`` is the torch.distributed group of this rank's node, or None:
    then node exchanges run over ``group`` (one node, or a tier on a caller's group)."""

    rank: int
    world_size: int
    tp: int
    pp: int
    nodes: tuple[NodeInfo, ...]
    node_group: Any = field(default=None, repr=False, compare=False)
    group: Any = field(default=None, repr=False, compare=False)
    processes: tuple[tuple[int, int], ...] = field(default=(), repr=False, compare=False)
    """Per rank: (process id, pid namespace) as that rank published them."""

    def leader_pid(self) -> int | None:
        """The node leader's process id, where this rank shares its pid namespace (elsewhere
        the number would name another process, so None: the uid check alone applies)."""
        if not self.processes:
            return None
        pid, namespace = self.processes[self.node.leader_rank]
        return pid if pid and namespace == pid_namespace() else None

    def global_rank(self, rank: int) -> int:
        """The default-group rank of the tier's ``rank`` (torch's ``dst`` arguments want it)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def node(self) -> NodeInfo:
        return next(n for n in self.nodes if self.rank in n.ranks)

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def local_rank(self) -> int:
        return self.node.ranks.index(self.rank)

    @property
    def local_world_size(self) -> int:
        return len(self.node.ranks)

    @property
    def is_leader(self) -> bool:
        return self.node.leader_rank == self.rank

    def stage_writer_of(self, rank: int) -> int:
        """The lowest global rank on ``rank``'s node in ``rank``'s pipeline stage: in the
        replicated layout the stage's ranks share one slot of the node's rows and this rank
        alone stores into it (``writer_only`` jobs)."""
        node = next(n for n in self.nodes if rank in n.ranks)
        return min(r for r in node.ranks if r // self.tp == rank // self.tp)

    @property
    def stage_peers(self) -> tuple[int, ...]:
        """This rank's pipeline stage on its node, ascending (the writer first): in the
        replicated layout these ranks register the same slot of the node's rows."""
        return tuple(r for r in self.node.ranks if r // self.tp == self.pp_rank)

    @property
    def stage_writers(self) -> tuple[int, ...]:
        """Every (node, pipeline stage)'s writer, ascending."""
        return tuple(sorted({self.stage_writer_of(r) for r in range(self.world_size)}))

    @property
    def is_stage_writer(self) -> bool:
        return self.stage_writer_of(self.rank) == self.rank

    def to_json(self) -> list[dict[str, object]]:
        return [{"node_id": n.node_id, "leader_rank": n.leader_rank, "ranks": list(n.ranks)}
                for n in self.nodes]


NODE_GROUP_MIN_TIMEOUT_S = 1800.0


def pid_namespace() -> int:
    """This process's pid namespace (its inode), 0 where /proc does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def local_node_id() -> str:
    return os.environ.get("OFFLOAD_NODE_ID") or socket.gethostname()


def check_grid(world_size: int, tp: int, pp: int) -> None:
    if tp < 1 or pp < 1 or tp * pp != world_size:
        raise OffloadError(
            f"--tp {tp} x --pp {pp} = {tp * pp} but the world has {world_size} ranks; "
            f"choose tp and pp whose product is {world_size}"
        )


def build_nodes(places: Sequence[RankPlace]) -> tuple[NodeInfo, ...]:
    """Group ranks by node (pure).  Nodes are ordered by leader rank; ranks ascend; and each
    rank's ``LOCAL_WORLD_SIZE`` (where set) must equal what was observed on its node."""
    by_node: dict[str, list[int]] = {}
    for p in sorted(places, key=lambda p: p.rank):
        by_node.setdefault(p.node_id, []).append(p.rank)
    nodes = tuple(sorted((NodeInfo(n, tuple(r)) for n, r in by_node.items()),
                         key=lambda n: n.leader_rank))
    for p in places:
        observed = len(by_node[p.node_id])
        if p.local_world_size_env is not None and p.local_world_size_env != observed:
            raise OffloadError(
                f"rank {p.rank} has LOCAL_WORLD_SIZE={p.local_world_size_env} but {observed} "
                f"ranks report node id {p.node_id!r}; give every node a distinct "
                "OFFLOAD_NODE_ID or fix --nproc-per-node"
            )
    return nodes


def processes_on_node() -> int | None:
    """``LOCAL_WORLD_SIZE`` as the launcher (torchrun) set it: the job's processes on this node,
    those of other groups (other DP replicas) too; None where it is unset or no positive
    integer."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdecimal() and int(value) > 0 else None


def discover(tp: int | None = None, pp: int = 1, timeout_s: float | None = None,
             group: Any = None) -> Topology:
    """Collective over ``group`` (None: the default group): publish places, build nodes, and,
    on the default group only, create node groups.

    Every rank calls ``new_group`` for every node in the same order, as torch.distributed
    requires.  Node groups wait at least 30 minutes (torch's gloo default) or ``timeout_s`` if
    longer: their exchanges follow pre-fault and pinning, which on a large host can take
    minutes for a healthy rank (registration runs at tens of GiB/s host-wide, and a node may
    pin terabytes: docs/BENCHMARKS.md, "Nameless regions: node start-up"), while dead peers
    are caught sooner by the RPC and quorum timeouts (and torchrun).

    A tier on a caller's group creates no node groups: ``new_group`` is collective over the
    whole default group, which the other groups' ranks are not calling here, and group names
    derived locally (``use_local_synchronization``) depend on how many groups each process
    made before.  Its node exchanges run over ``group`` itself (`offload.region.sync`).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tp = world // pp if tp is None else tp
    check_grid(world, tp, pp)
    mine = RankPlace(rank, local_node_id(), processes_on_node() if group is None else None,
                     os.getpid(), pid_namespace())
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    nodes = build_nodes(gathered)
    node_group = None
    timeout = datetime.timedelta(seconds=max(timeout_s or 0.0, NODE_GROUP_MIN_TIMEOUT_S))
    if len(nodes) > 1 and group is None:
        for node in nodes:
            created = dist.new_group(list(node.ranks), timeout=timeout)
            if rank in node.ranks:
                node_group = created
    processes = tuple((p.pid, p.pid_namespace) for p in sorted(gathered, key=lambda p: p.rank))
    return Topology(rank, world, tp, pp, nodes, node_group, group, processes)
