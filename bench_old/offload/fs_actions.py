"""The file tier's steps as every rank runs them, and rank 0's side of setting it up.

Rank 0's chunk manager decides what moves between host memory and disk (pure bookkeeping);
these functions are what every rank executes, in the same order on every rank, through the
collective RPC (``HostTier.call(fn, ...)`` runs ``fn(actor, ...)`` everywhere and gathers the
results).  Spills of a store travel inside its `CopyJob` instead (the actor writes them out
before the store reuses their rows), so SPMD callers get them too.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from offload.actor import refuse_unready
from offload.integrity import promotion_generation
from offload.tiers.rank_files import RankFiles, WorkItem, agree_on_files

if TYPE_CHECKING:
    from offload.actor import RankActor
    from offload.rpc import CollectiveRPC


def open_files(actor: RankActor) -> None:
    """Open this rank's file tier over its region (after the region exists)."""
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
    quarantined)."""
    files = _files(actor)
    # the manager hands out ready rows only: a caller named another
    refuse_unready([chunk for _, chunk in reads], actor.ready_rows, actor.topology.rank,
                   "a promotion reads into", "promote into the chunks the manager hands out")
    verified = files.promote(reads, promotion_generation(job_id), spills)
    return verified, files.busy_rows()


def busy_rows(results: Sequence[tuple[list[bool], list[int]]]) -> list[int]:
    """The union of every rank's busy rows in ``promote`` results."""
    return sorted({chunk for _, busy in results for chunk in busy})


def discard(actor: RankActor, keys: Sequence[Hashable]) -> None:
    _files(actor).discard(keys)


def report(actor: RankActor) -> dict[str, Any] | None:
    return _files(actor).to_json()


def _files(actor: RankActor) -> RankFiles:
    if actor.files is None:
        raise RuntimeError("this rank has no file tier (TierConfig.fs_dir is unset)")
    return actor.files


# ---------------------------------------------------------------------- rank 0


def setup(actor: RankActor, rpc: CollectiveRPC) -> list[bytes]:
    """Rank 0, during set-up: every rank opens its tier; the writers agree on the files all of
    them hold after a restart (a file one rank lost or found damaged is dropped everywhere);
    return the agreed keys in LRU order, for the chunk manager's picture of the disk."""
    rpc.call(open_files, actor=actor)
    agreed = agree_on_files(rpc.call(stored_names, actor=actor))
    orders = rpc.call(keep_only, agreed, actor=actor)
    # NOTE: the writers hold the same names now, but the order their files' sequence numbers
    # give may differ (a file one rank could not read at an earlier start kept its old
    # number); one writer's order for all, or their LRUs would evict differently
    order: list[str] = next((names for names in orders if names is not None), [])
    left = rpc.call(adopt_order, order, actor=actor)
    return next((keys for keys in left if keys), [])

