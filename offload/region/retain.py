# SPDX-License-Identifier: Apache-2.0
"""A tier's side of retention (docs/KEEP.md): find or start the node's keeper, claim it, and
decide whether what it keeps can be adopted.

The node leader claims the keeper of (this user, this node, ``fs_namespace``) for the tier's
whole life: the claim is what keeps the kept memory from counting down, and what refuses it to
any other live tier.  Idle keepers of this user on the node for another namespace are dropped
first, so their memory is free before the node's memory check.  Anything that goes wrong here
-- another user holding the name, the keeper in use by a live tier -- costs only retention on
this node, with a warning: the tier starts fresh, and its chunks are not kept.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from offload.config import TierConfig
from offload.control.plan import Plan
from offload.control.topology import Topology
from offload.errors import OffloadError
from offload.region import kept
from offload.region.geometry import region_geometry, segment_ranges
from offload.region.keeper import KeeperError, KeeperLink, keeper_name, start_keeper
from offload.system.nameless import check_sizes
from offload.system.shm import close_fds

log = logging.getLogger(__name__)


@dataclass
class Retention:
    """One rank's claimed link to its node's keeper, and whether this life adopts."""

    link: KeeperLink
    adopt: bool = False
    extra: list[KeeperLink] = field(default_factory=list)

    def fetch(self, tag: str, lengths: Sequence[int]) -> list[int]:
        """The kept descriptors of part ``tag``, checked: sealed memfds of this user of
        exactly ``lengths``."""
        _, fds = self.link.request("get", tag=tag)
        try:
            check_sizes(fds, lengths, f"keeper part {tag}")
        except BaseException:
            close_fds(fds)
            raise
        return fds

    def deposit(self, tag: str, fds: Sequence[int], lengths: Sequence[int]) -> None:
        """Hand duplicates of ``fds`` to the keeper as part ``tag``."""
        self.link.request("put", list(fds), tag=tag, sizes=list(lengths))

    def close(self) -> None:
        """Detach: the keeper's countdown starts once every link of the tier is closed."""
        self.link.close()
        for link in self.extra:
            link.close()


def region_tag(plan: Plan, topology: Topology, rank: int) -> str:
    """The keeper part of a rank's region: the node's (``L<leader>``) or a private rank's."""
    return f"L{topology.node.leader_rank}" if plan.layout != "private" else f"r{rank}"


def node_parts(plan: Plan, topology: Topology, config: TierConfig,
               index_bytes: int | None) -> dict[str, list[int]]:
    """Every part this node's keeper must hold for this plan (tag -> segment sizes)."""
    ranks = (topology.node.ranks if plan.layout == "private"
             else (topology.node.leader_rank,))
    parts = {region_tag(plan, topology, r): [s.length for s in segment_ranges(
        region_geometry(plan, r), config)] for r in ranks}
    if index_bytes is not None:
        parts["index"] = [index_bytes]
    return parts


def claim_node_keeper(topology: Topology, config: TierConfig, tier_id: str, plan: Plan,
                      parts: dict[str, list[int]]) -> tuple[Retention | None, str | None]:
    """The node leader: claim this node's keeper (started if there is none) and, where it
    holds exactly ``parts`` of this plan, return the life that made them (every node must
    name the same one to adopt: parts of two lives, each with its own generations, would pass
    each other's checksums).  (None, None) where this node cannot keep."""
    assert config.fs_namespace is not None  # TierConfig requires it with keep_s
    name = keeper_name(os.geteuid(), topology.node.node_id, config.fs_namespace)
    try:
        dropped = kept.drop_idle(topology.node.node_id, spare=name)
        if dropped:
            log.info("rank %d: dropped %d idle kept tier(s) of other namespaces: %s",
                     topology.rank, len(dropped), dropped)
        link = KeeperLink.connect(name, config.timeout_s)
        if link is None:
            link = start_keeper(name, config.keep_s, topology.node.node_id,
                                config.fs_namespace, config.timeout_s)
        if link is None:  # started by someone else in between
            link = KeeperLink.connect(name, config.timeout_s)
        if link is None:
            raise KeeperError(f"keeper {name!r} came and went")
    except (KeeperError, OSError) as exc:  # another user's listener, no process to start, ...
        log.warning("rank %d: node %s keeps nothing this run: %s", topology.rank,
                    topology.node.node_id, exc)
        return None, None
    try:
        info, fds = link.request("claim", owner=tier_id, keep_s=config.keep_s)
        close_fds(fds)  # a claim carries none; a keeper that sends some keeps them
    except KeeperError as exc:
        link.close()
        log.warning("rank %d: node %s keeps nothing this run: %s", topology.rank,
                    topology.node.node_id, exc)
        return None, None
    same = info.get("geometry") == plan.digest() and info.get("parts") == parts
    life = info.get("life")
    return Retention(link), (life if same and isinstance(life, str) and life else None)


def attach(name: str, tier_id: str, timeout_s: float) -> Retention:
    """A private rank's own claim of its node's keeper (its leader claimed it first)."""
    try:
        link = KeeperLink.connect(name, timeout_s)
        if link is None:
            raise KeeperError("it is gone")
        link.request("claim", owner=tier_id)
    except KeeperError as exc:
        raise OffloadError(f"the node's keeper {name!r} could not be joined ({exc}); run "
                           "without --keep or `python -m offload.keep list`") from None
    return Retention(link)
