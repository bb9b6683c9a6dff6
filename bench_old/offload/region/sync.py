"""Node-wide status exchange: the barrier that cannot leave peers hanging.

A plain barrier only says "everyone arrived"; a rank that failed before it would never arrive
and its peers would wait for the whole process-group timeout, then fail with an unrelated
message.  Here every rank runs its step, then all ranks of the node exchange ``None`` or a
one-line error with ``all_gather_object``.  The failing rank re-raises its own error; every
other rank raises ``PeerError`` naming it.  A rank that died makes the collective itself fail
(connection reset, or the group's timeout), which becomes a ``PeerError`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch.distributed as dist

from offload.errors import PeerError, one_line
from offload.topology import Topology

T = TypeVar("T")


class NodeSync:
    """Status exchanges among this rank's node.  They run over the node group where the
    topology has one, else over the tier's whole group (one node; or a tier on a caller's
    group, which has no node groups): every rank of the tier takes every step, so the
    exchange is collective there, and each rank reads only its own node's statuses."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def step(self, what: str, action: Callable[[], T] | None = None, share: bool = False
             ) -> T | None:
        """Run ``action`` (None: nothing to do on this rank), then agree on the outcome.  A
        rank alone on its node has no one to agree with: it just runs the action.  With
        ``share``, every rank of the node returns what the node leader's action returned (a
        small picklable value, e.g. the name of a socket it bound), carried by the same
        exchange over the process group."""
        result, values = self._agree(what, action, carry=share)
        if share and values is not None:
            return values[self.topology.node.ranks.index(self.topology.node.leader_rank)]
        return result

    def gather(self, what: str, action: Callable[[], T]) -> list[T]:
        """Run ``action`` on every rank of the node and return all of their results (small,
        picklable), in the node's rank order; agreed like `step`: a rank whose action failed
        fails its peers at once, naming it.  A rank alone gets its own."""
        result, values = self._agree(what, action, carry=True)
        return [cast(T, result)] if values is None else values

    def _agree(self, what: str, action: Callable[[], T] | None, carry: bool
               ) -> tuple[T | None, list[Any] | None]:
        """Run ``action``, exchange its outcome over the node (with ``carry``, its value too)
        and raise this rank's error or a `PeerError` naming the first rank that failed; this
        rank's result and, unless it is alone, the node's carried values in rank order."""
        t = self.topology
        group, mine = ((t.node_group, range(t.local_world_size)) if t.node_group is not None
                       else (t.group, t.node.ranks))
        size = t.local_world_size if t.node_group is not None else t.world_size
        if size == 1:
            return (action() if action is not None else None), None
        error: Exception | None = None
        result = None
        try:
            result = action() if action is not None else None
        except Exception as exc:
            error = exc
        outcomes: list[Any] = [None] * size
        try:
            dist.all_gather_object(outcomes, (None, result if carry else None)
                                   if error is None else (one_line(error), None), group=group)
        except Exception as exc:
            if error is not None:
                raise error from None
            peers = (f"on node {t.node_id}" if size == t.local_world_size
                     else f"of node {t.node_id}'s tier group")
            raise PeerError(
                f"rank {t.rank}: peers {peers} stopped answering while {what} (a rank died "
                f"or timed out): {one_line(exc)}"
            ) from exc
        if error is not None:
            raise error
        failed = [(r, outcomes[i][0]) for i, r in zip(mine, t.node.ranks, strict=True)
                  if outcomes[i][0]]
        if failed:
            rank, msg = failed[0]
            others = f" (ranks {[r for r, _ in failed[1:]]} failed too)" if failed[1:] else ""
            raise PeerError(f"rank {rank} failed while {what}: {msg}{others}")
        return result, [outcomes[i][1] for i in mine]
