"""The start-up report: a JSON document (DESIGN.md section 10) and the table rank 0 prints."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from typing import Any

from offload.errors import OffloadError
from offload.observe.timeline import PHASES
from offload.sizes import format_size
from offload.system.paths import write_atomic

_PHASES = (*(name for name, _ in PHASES), "total")


def count_shm_files(shm_dir: str, tier_id: str) -> int:
    """Files of this job still present in the shm directory (0 after a clean close): this
    user's entries named as the tier names its segments (`offload.system.shm.segment_paths`).
    Another user can see the tier id and plant a name holding it; that is not ours to count."""
    prefix, uid = f"offload-{tier_id}-", os.geteuid()
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return 0
    left = 0
    for entry in entries:
        if entry.name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                left += entry.stat(follow_symlinks=False).st_uid == uid
    return left


def render_table(report: dict[str, Any]) -> str:
    """Plan summary, one row per rank, and the transfer line -- per DP replica when there are
    several (ranks are the replica's own)."""
    replicas = report.get("replicas", [report])
    dp = f"dp {report['dp']} x " if report.get("dp", 1) > 1 else ""
    lines = [f"offload: world {report['world_size']} ({dp}tp {report['tp']} x pp "
             f"{report['pp']}), layout {report['layout']}, device {report['device']}"]
    for replica in replicas:
        if len(replicas) > 1:
            first, last = replica["world_ranks"][0], replica["world_ranks"][-1]
            lines.append(f"replica {replica['replica']} (world ranks {first}-{last}, ranks "
                         f"below are the replica's): {len(replica['nodes'])} node(s)")
        else:
            lines[0] += f", {len(replica['nodes'])} node(s)"
        lines += _replica_lines(replica)
    lines.append(f"shm files left: {report['shm_files_left']}")
    return "\n".join(lines)


def _replica_lines(report: dict[str, Any]) -> list[str]:
    plan = report["plan"]
    lines = [
        f"plan: {plan['chunk_count']} chunks x {plan['blocks_per_chunk']} blocks, budget "
        f"{format_size(plan['cpu_bytes_per_node'])}/node, rows "
        + ", ".join(f"{n}={format_size(b)}" for n, b in plan["row_bytes"].items()),
    ]
    header = ["rank", "node", "lr", "tp", "pp", "slot", "memory", "region", "prefault",
              "pinned"]
    header += [f"{p}_s" for p in _PHASES]
    rows = [header]
    for r in report["ranks"]:
        t = r["timings_s"]
        rows.append([str(r["rank"]), str(r["node_id"]), str(r["local_rank"]), str(r["tp_rank"]),
                     str(r["pp_rank"]), str(r["slot"]), memory_label(r),
                     format_size(r["region_bytes"]), format_size(r["prefault_bytes"]),
                     format_size(r["pinned_bytes"])]
                    + [f"{t.get(p, 0.0):.3f}" for p in _PHASES])
    lines += _align(rows)
    transfer = report.get("transfer")
    if transfer:
        lines.append(
            f"transfer: {transfer['rounds']} rounds, stored {format_size(transfer['stored_bytes'])}"
            f" at {transfer['store_GBps']} GB/s, loaded {format_size(transfer['loaded_bytes'])} "
            f"at {transfer['load_GBps']} GB/s, evictions {transfer['evictions']}, "
            f"verified={transfer['verified']} ({transfer['mismatched_blocks']} bad of "
            f"{transfer['checked_blocks']} blocks)")
    fs = report.get("fs_tier")
    if fs:
        mode = "O_DIRECT" if fs["o_direct"] else "buffered"
        lines.append(
            f"fs tier: {fs['dir']} ({mode}, {fs['aggregate']}): wrote "
            f"{format_size(fs['written_bytes'])} at {fs['write_GBps']} GB/s, read "
            f"{format_size(fs['read_bytes'])} at {fs['read_GBps']} GB/s, hits {fs['hits']}, "
            f"misses {fs['misses']}, corrupt {fs['corrupt']}, evicted {fs['evicted']}"
            + (f", write errors {fs['write_errors']}" if fs["write_errors"] else ""))
    paths = report.get("paths")
    if paths:
        total = sum(paths.values()) or 1
        lines.append("paths: " + ", ".join(f"{name} {count} ({100 * count / total:.0f}%)"
                                           for name, count in paths.items() if count)
                     + " of the ranks' copies")
    readiness = report.get("readiness")
    if readiness:
        def seconds(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f} s"
        mode = "background set-up" if readiness["background"] else "blocking set-up"
        lines.append(f"readiness ({mode}): create returned after "
                     f"{seconds(readiness['create_s'])}, first job succeeded after "
                     f"{seconds(readiness['first_job_s'])}, every row ready after "
                     f"{seconds(readiness['full_s'])}")
    kept = report.get("keep")
    if kept:
        hit = kept["first_hit_s"]
        lines.append(f"keep ({kept['keep_s']:g} s): adopted {kept['adopted_chunks']} chunks "
                     f"({format_size(kept['adopted_bytes'])}), first adopted hit "
                     + ("-" if hit is None else f"after {hit:.3f} s"))
    integrity = report.get("integrity")
    if integrity:
        state = "on" if integrity["enabled"] else "off"
        lines.append(f"integrity: {state}, {integrity['mismatches']} job(s) failed the "
                     "page checksum check")
    audit = report.get("audit")
    if audit:
        lines.append(f"audit: {audit['checked_blocks']} blocks hashed on load, "
                     f"{audit['mismatched_blocks']} mismatched")
    return lines


def paths_block(ranks: list[dict[str, Any]]) -> dict[str, int]:
    """The report's ``paths`` block: copies per transfer path (``staged``, ``kernel``,
    ``copy_engine``, or the engine's one path), summed over the ranks."""
    total: dict[str, int] = {}
    for rank in ranks:
        for name, count in rank.get("paths", {}).items():
            total[name] = total.get(name, 0) + count
    return total


def readiness_block(background: bool, ranks: list[dict[str, Any]],
                    first_success_at: float | None, created_at: float) -> dict[str, Any]:
    """The report's ``readiness`` block (DESIGN.md section 3.9): ``create_s`` the longest
    `HostTier.create` over the ranks, ``first_job_s`` from the start of rank 0's ``create`` to
    the first job decided successfully, ``full_s`` until every row was ready on every rank
    (each rank from the start of its own ``create``)."""
    ready = [r["ready_s"] for r in ranks]
    return {"background": background,
            "create_s": max(r["timings_s"].get("total", 0.0) for r in ranks),
            "first_job_s": (None if first_success_at is None
                            else round(first_success_at - created_at, 6)),
            "full_s": None if None in ready else max(ready)}


def integrity_block(enabled: bool, mismatches: int) -> dict[str, Any]:
    """The report's ``integrity`` block: whether pages are checksummed, and how many jobs
    failed the check (summed over the ranks' engines, ``TransferEngine.mismatches``)."""
    return {"enabled": enabled, "mismatches": mismatches}


def memory_label(rank: dict[str, Any]) -> str:
    """What the rank's region is made of: ``anonymous``, ``file`` or ``memfd``, the last with
    the host's shmem huge-page mode (``memfd/never`` means 4 KiB pages)."""
    mode = rank.get("shmem_huge")
    return f"{rank['memory']}/{mode}" if mode else str(rank["memory"])


def _align(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
            for row in rows]


def write_json(path: str, report: object, what: str = "--report-json") -> None:
    """Write ``report`` to ``path`` atomically, never following a planted link
    (`offload.system.paths.write_atomic`): a reader never sees half a report.

    Raises:
        OffloadError: the file cannot be written (one line naming ``what`` and the path).
    """
    text = json.dumps(report, indent=2, sort_keys=False) + "\n"
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise OffloadError(f"{what} {path} cannot be written ({exc.strerror or exc}); pass a "
                           "path in a directory you can write") from None
