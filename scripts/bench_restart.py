# SPDX-License-Identifier: Apache-2.0
"""A restart of the engine, cold against kept (docs/KEEP.md): how soon the first hit comes.

Three lives in a row, each a fresh set of ``--ranks`` processes (as an engine's restart is), on
one tier geometry with background set-up:

* ``cold``   no retention: ``create``, then the first store and its load back, which wait for
             the first row set-up brings online -- what a restart costs today;
* ``kept``   ``keep_s`` on: the same, then ``--stored`` chunks stored; the tier closes and its
             node keeper holds the regions and the index;
* ``adopt``  the same configuration again: ``create`` adopts what was kept, and the first load
             of a stored key is the first hit.

Printed per life: ``create`` (s), first hit (s from the start of ``create`` to the first load
decided successful on every rank), chunks adopted; then adopt / cold for the first hit.  The
bench's keeper is dropped at the end (nothing is left).

    python scripts/bench_restart.py --device cuda --cpu-bytes 100GiB
    python scripts/bench_restart.py --device cuda --ranks 2 --cpu-bytes 48GiB
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from typing import Any

import torch
from bench_ranks import join_group, spawn_group  # this script's folder

from offload.bounds import flag_type
from offload.sizes import format_size, parse_size

LIVES = ("cold", "kept", "adopt")


def _life(rank: int, port: int, out: Any, args: argparse.Namespace, life: str) -> None:
    os.environ["OFFLOAD_NODE_ID"] = args.node  # the bench's own node: its keeper alone
    import torch.distributed as dist

    from offload import CopyJob, HostTier, TierConfig
    from offload.region import cleanup

    device = join_group(rank, args.ranks, port, args.timeout, args.device)
    kv = [torch.randint(0, 256, (args.gpu_blocks, args.page_bytes), dtype=torch.uint8,
                        device=device) for _ in range(2 * args.layers)]
    keep = life != "cold"
    config = TierConfig(cpu_bytes_per_node=args.cpu_bytes, blocks_per_chunk=args.bpc,
                        tp=args.ranks, timeout_s=args.timeout, background=True,
                        keep_s=args.keep if keep else 0.0,
                        fs_namespace=args.namespace if keep else None)
    began = time.perf_counter()
    tier = HostTier.create(kv, config)
    create_s = time.perf_counter() - began
    manager = tier.manager
    ids = iter(range(1 << 30))

    def decided(make: Any) -> Any:
        box = [make() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def copy(direction: str, chunks: list[tuple[int, int]]) -> bool:
        blocks, rows, positions = [], [], []
        for key, chunk in chunks:
            for p in range(args.bpc):
                blocks.append((key * args.bpc + p) % args.gpu_blocks)
                rows.append(chunk)
                positions.append(p)
        job_id = next(ids)
        tier.submit(CopyJob(job_id, direction, blocks, rows, positions))
        try:
            tier.wait([job_id])
        except Exception:
            return False
        return True

    def store(key: int) -> bool:
        tier.wait_ready(args.timeout, rows=1)  # the manager hands out rows set up everywhere
        job = decided(lambda: manager.prepare_store([key]))
        ok = copy("store", job.chunks)
        if rank == 0:
            manager.complete_store(job.job_id, ok=ok)
        return ok

    def load(key: int) -> bool:
        if not decided(lambda: manager.residence(key) == "host"):
            return False
        job = decided(lambda: manager.prepare_load([key]))
        # an adopted row serves once set-up registered it again (a job before is refused)
        tier.wait_ready(args.timeout, rows=max(chunk for _, chunk in job.chunks) + 1)
        ok = copy("load", job.chunks)
        if rank == 0:
            manager.complete_load(job.job_id, damaged=() if ok else [key])
        return ok

    first_hit = None
    if life != "adopt":
        if store(0) and load(0):
            first_hit = time.perf_counter() - began
        if life == "kept":
            tier.wait_ready(args.timeout)
            for key in range(1, args.stored):
                store(key)
    elif load(0):
        first_hit = time.perf_counter() - began
    kept = tier.keep_report() if rank == 0 else None
    tier.close()
    if rank == 0:
        out.put({"life": life, "create_s": create_s, "first_hit_s": first_hit,
                 "adopted_chunks": (kept or {}).get("adopted_chunks"),
                 "adopted_bytes": (kept or {}).get("adopted_bytes")})
    dist.destroy_process_group()
    out.close()
    out.join_thread()
    cleanup.exit_now(0)  # no interpreter finalization to race gloo's threads


def run_life(args: argparse.Namespace, life: str) -> dict[str, Any]:
    """One life on fresh processes; rank 0's figures."""
    result: dict[str, Any] = spawn_group(_life, args.ranks, (args, life), args.timeout,
                                         f"life {life}: a rank")
    return result


def drop_keepers(namespace: str, node: str) -> list[str]:
    """Drop the bench's keeper (it is idle once its last life closed)."""
    from offload.region import kept

    return [name for name, info in kept.keepers(node) if info.get("namespace") == namespace
            and kept.drop(name) is None]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1, help="ranks of the one node (tp = ranks)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--cpu-bytes", type=flag_type(parse_size, "--cpu-bytes"), default="8GiB",
                   help="the node's host tier")
    p.add_argument("--layers", type=int, default=8, help="layers; tensors = 2 x layers")
    p.add_argument("--page-bytes", type=flag_type(parse_size, "--page-bytes"), default="16KiB",
                   help="bytes of one block in one tensor")
    p.add_argument("--gpu-blocks", type=int, default=1024, help="blocks per KV tensor")
    p.add_argument("--bpc", type=int, default=16, help="blocks per chunk")
    p.add_argument("--stored", type=int, default=64, help="chunks the kept life stores")
    p.add_argument("--keep", type=float, default=60.0,
                   help="keep_s of the kept lives (the keeper is dropped at the end anyway)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a life fails")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.namespace = f"bench-restart-{uuid.uuid4().hex[:8]}"
    args.node = f"bench-restart-{uuid.uuid4().hex[:8]}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    try:
        for life in LIVES:
            rows.append(run_life(args, life))
    finally:
        drop_keepers(args.namespace, args.node)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"{args.ranks} rank(s), {format_size(args.cpu_bytes)} host tier, {2 * args.layers} "
          f"tensors x {format_size(args.page_bytes)} pages, background set-up, {name}")
    print(f"{'life':6} {'create_s':>9} {'first_hit_s':>12} {'adopted':>8} {'adopted_bytes':>14}")
    for row in rows:
        hit = f"{row['first_hit_s']:.3f}" if row["first_hit_s"] is not None else "none"
        adopted = row["adopted_chunks"] if row["adopted_chunks"] is not None else "-"
        size = format_size(row["adopted_bytes"]) if row["adopted_bytes"] else "-"
        print(f"{row['life']:6} {row['create_s']:9.3f} {hit:>12} {adopted!s:>8} {size:>14}")
    cold, adopt = rows[0]["first_hit_s"], rows[2]["first_hit_s"]
    if cold and adopt:
        print(f"first hit, adopt / cold: {adopt / cold:.3f}")
    return 0 if adopt is not None and rows[2]["adopted_chunks"] else 1


if __name__ == "__main__":
    sys.exit(main())
