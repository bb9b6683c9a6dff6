"""The file tier's steps as every rank runs them, and rank 0's side of setting it up.

Rank 0's chunk manager decides what moves between host memory and disk (pure bookkeeping);
these functions are what every rank executes, in the same order on every rank, through the
collective RPC (``HostTier.call(fn, ...)`` runs ``fn(actor, ...)`` everywhere and gathers the
results).  Spills of a store travel inside its `CopyJob` instead (the actor writes them out
before the store reuses their rows), so SPMD callers get them too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Collection, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from offload.actor import refuse_unready
from offload.config import FS_BYTES_FACTOR
from offload.errors import MalformedJob, OffloadError
from offload.integrity import PROMOTED, promotion_generation
from offload.sizes import format_size
from offload.tiers import disk_room
from offload.tiers.rank_files import (
    RankFiles,
    WorkItem,
    agree_on_files,
    check_work_items,
    disk_capacity,
)
from offload.transfer.layout import show_value

if TYPE_CHECKING:
    from offload.actor import RankActor
    from offload.control.rpc import CollectiveRPC

log = logging.getLogger(__name__)


def node_room(actor: RankActor) -> tuple[str, int] | None:
    """A node leader's measure of the room for the file tier on its node: the disk's free
    space and the folders no live tier holds (`disk_room.scan`); None on the other ranks."""
    if not actor.topology.is_leader:
        return None
    assert actor.config.fs_dir is not None
    root = os.path.abspath(actor.config.fs_dir)
    try:
        return actor.topology.node_id, disk_room.scan(root).total
    except OSError as exc:
        raise OffloadError(f"file tier directory {root} cannot be read ({exc.strerror}); pass "
                           "a directory on a local disk you can read and write") from None


def open_files(actor: RankActor, budget: int | None = None) -> None:
    """Open this rank's file tier over its region (after the region exists), with the node
    budget the ranks agreed on (`agree_budget`; None: the configured one).  The config then
    carries that budget, so the chunk manager's capacity (rank 0) matches the files'."""
    if budget is not None:
        actor.config = dataclasses.replace(actor.config, fs_bytes=budget)
    config, plan, topology = actor.config, actor._installed(), actor.topology
    assert config.fs_dir is not None
    extra: dict[str, object] = {"namespace": config.fs_namespace, "tp": topology.tp,
                                "pp": topology.pp,
                                "dtypes": [str(t.dtype) for t in actor.kv_tensors]}
    if topology.group is not None:
        # NOTE: tiers of one node on different groups (DP replicas) have equal geometry; the
        # world rank of the group's first rank tells them apart (and is the same at restart).
        extra["group_first_rank"] = topology.global_rank(0)
    actor.files = RankFiles.open(plan, topology, config.fs_dir, config.fs_bytes_per_node,
                                 actor._region().address, extra, actor._engine().generations,
                                 io_timeout_s=config.fs_io_timeout_s)


def stored_names(actor: RankActor) -> frozenset[str] | None:
    return _files(actor).stored_names()


def keep_only(actor: RankActor, names: Collection[str]) -> list[str] | None:
    """Keep the agreed files; return their names, least recently used first (None: no
    files on this rank)."""
    files = _files(actor)
    files.keep_only(names)
    return files.ordered_names()


def adopt_order(actor: RankActor, names: Sequence[str]) -> list[bytes]:
    """Take the agreed LRU order; return the stored keys in it (least recently used first)."""
    files = _files(actor)
    files.adopt_order(names)
    return files.stored_keys()


def promote(actor: RankActor, spills: Sequence[WorkItem], reads: Sequence[WorkItem],
            job_id: int) -> tuple[list[bool], list[int]]:
    """Promotion ``job_id`` (the chunk manager's; `RankFiles.promote`).  Returns, per read,
    True when this rank's bytes are verified, and the chunks whose rows a read that passed its
    deadline may still fill (`RankFiles.busy_rows`: the chunk manager keeps them
    quarantined).

    Every item is checked before any runs: a chunk outside the region or a bad key is
    `MalformedJob` (the same on every rank), a row this rank has not set up "not ready"."""
    files = _files(actor)
    plan = actor._installed()
    owner = f"promotion {show_value(job_id)}"
    if type(job_id) is not int or not 0 <= job_id < PROMOTED:  # its rows' generation
        raise MalformedJob(f"{owner}: the job id must be an int in 0..{PROMOTED - 1}; pass "
                           "the chunk manager's PromoteJob")
    reads = check_work_items(reads, "reads", plan.chunk_count, plan.page_size, owner)
    spills = check_work_items(spills, "spills", plan.chunk_count, plan.page_size, owner)
    # the manager hands out ready rows only: a caller named another
    fix = "promote into the chunks the manager hands out"
    refuse_unready([chunk for _, chunk in reads], actor.ready_rows, actor.topology.rank,
                   "a promotion reads into", fix)
    refuse_unready([chunk for _, chunk in spills], actor.ready_rows, actor.topology.rank,
                   "a promotion spills", fix)
    verified = files.promote(reads, actor._engine().generation_base
                            + promotion_generation(job_id), spills)
    return verified, files.busy_rows()


def busy_rows(results: Sequence[tuple[list[bool], list[int]]]) -> list[int]:
    """The union of every rank's busy rows in ``promote`` results."""
    return sorted({chunk for _, busy in results for chunk in busy})


def discard(actor: RankActor, keys: Sequence[Hashable]) -> None:
    _files(actor).discard(keys)


def report(actor: RankActor) -> dict[str, Any] | None:
    return _files(actor).to_json()


def held_bytes(actor: RankActor) -> tuple[str, int]:
    """This rank's node and the bytes its tier's files take (0 for a rank without files)."""
    tier = _files(actor).tier
    return actor.topology.node_id, 0 if tier is None else tier.stats().files * tier.file_bytes


def evict_old_folders(actor: RankActor, budget: int, held: dict[str, int]) -> None:
    """A node leader, once every tier of the job holds its folder: remove the folders of
    earlier runs, oldest first, until what is left fits both beside this job's files in the
    budget and outside the room the budget still needs (module docstring of `disk_room`)."""
    if not actor.topology.is_leader:
        return
    assert actor.config.fs_dir is not None
    root = os.path.abspath(actor.config.fs_dir)
    ours = held.get(actor.topology.node_id, 0)
    try:
        room = disk_room.scan(root)
        limit = max(0, min(budget - ours, room.total + ours - budget))
        removed = disk_room.evict(root, limit)
    except OSError as exc:
        log.warning("file tier %s: folders of earlier runs not looked at (%s)", root,
                    exc.strerror or exc)
        return
    if removed:
        log.warning("file tier %s: removed %d folder(s) of earlier runs (other geometry or "
                    "namespace, or a job gone), %s, oldest first, to keep the disk within the "
                    "budget of %s per node", root, len(removed),
                    format_size(sum(f.bytes for f in removed)), format_size(budget))


def _files(actor: RankActor) -> RankFiles:
    if actor.files is None:
        raise RuntimeError("this rank has no file tier (TierConfig.fs_dir is unset)")
    return actor.files


# ---------------------------------------------------------------------- rank 0


def setup(actor: RankActor, rpc: CollectiveRPC) -> list[bytes]:
    """Rank 0, during set-up: every rank opens its tier; the writers agree on the files all of
    them hold after a restart (a file one rank lost or found damaged is dropped everywhere);
    return the agreed keys in LRU order, for the chunk manager's picture of the disk."""
    budget = agree_budget(actor, rpc)
    rpc.call(open_files, budget, actor=actor)
    agreed = agree_on_files(rpc.call(stored_names, actor=actor))
    orders = rpc.call(keep_only, agreed, actor=actor)
    # NOTE: the writers hold the same names now, but the order their files' sequence numbers
    # give may differ (a file one rank could not read at an earlier start kept its old
    # number); one writer's order for all, or their LRUs would evict differently
    order: list[str] = next((names for names in orders if names is not None), [])
    left = rpc.call(adopt_order, order, actor=actor)
    held: dict[str, int] = {}
    for node, nbytes in rpc.call(held_bytes, actor=actor):
        held[node] = held.get(node, 0) + nbytes
    rpc.call(evict_old_folders, budget, held, actor=actor)
    return next((keys for keys in left if keys), [])


def agree_budget(actor: RankActor, rpc: CollectiveRPC) -> int:
    """Rank 0: the file tier's budget per node, bounded by every node's room
    (`disk_room.bound_budget`).

    Raises:
        OffloadError: an explicit budget past a node's room, or a default one that the room
            cut below one chunk's files.
    """
    config = actor.config
    assert config.fs_dir is not None
    rooms = dict(r for r in rpc.call(node_room, actor=actor) if r is not None)
    root = os.path.abspath(config.fs_dir)
    budget = disk_room.bound_budget(config.fs_bytes, config.fs_bytes_per_node, rooms, root)
    try:
        disk_capacity(actor._installed(), actor.topology, budget)
    except OffloadError:
        if budget == config.fs_bytes_per_node:
            raise
        raise OffloadError(
            f"the file tier's default budget ({FS_BYTES_FACTOR} x cpu_bytes_per_node = "
            f"{format_size(config.fs_bytes_per_node)} per node) is cut to "
            f"{format_size(budget)}, half the room the disk of {root} has (its free space and "
            "the folders of earlier runs), which holds no chunk's files; free space there or "
            "give --fs-bytes") from None
    if budget < config.fs_bytes_per_node:
        log.warning("file tier %s: the default budget %s per node is cut to %s, half the room "
                    "the disk has (free space and folders of earlier runs); give --fs-bytes "
                    "(fs_bytes) to choose it", root, format_size(config.fs_bytes_per_node),
                    format_size(budget))
    return budget

