"""Run one benchmark function on several processes at once (the GPU benchmarks' ``--ranks``).

`run_ranks`: each process calls ``bench(rank, args, barrier)``, which returns a dict with a
``"rank"`` key; ``barrier`` (None with one rank) lets the ranks time the same moments.
`spawn_group` / `join_group`: ranks of one gloo group, as torchrun would start them on one
node, for benchmarks that run a tier.  Spawned, so CUDA starts fresh in each; the function
must be module-level (it travels by reference).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
from collections.abc import Callable
from typing import Any

import torch

Bench = Callable[[int, argparse.Namespace, Any], dict[str, Any]]


def run_ranks(bench: Bench, ranks: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``bench`` on ``ranks`` processes (in this one when 1); the results in rank order."""
    if ranks == 1:
        return [bench(0, args, None)]
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(bench, r, args, barrier, results))
             for r in range(ranks)]
    for p in procs:
        p.start()
    out = [results.get() for _ in procs]
    for p in procs:
        p.join()
    return sorted(out, key=lambda r: r["rank"])


def _worker(bench: Bench, rank: int, args: argparse.Namespace, barrier: Any, results: Any
            ) -> None:
    results.put(bench(rank, args, barrier))


def spawn_group(target: Callable[..., None], ranks: int, extra: tuple[Any, ...],
                timeout_s: float, what: str = "a rank") -> Any:
    """``target(rank, port, out, *extra)`` on ``ranks`` fresh processes of one group (``port``
    free on this host for its rendezvous); returns what rank 0 puts on ``out``.  Ranks still
    running a minute after that are killed.

    Raises:
        SystemExit: some rank failed, naming the exit codes.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, out, *extra)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"{what} failed: exit codes {[p.exitcode for p in procs]}")
    return result


def join_group(rank: int, ranks: int, port: int, timeout_s: float, device: str
               ) -> torch.device:
    """This process as rank ``rank`` of a one-node gloo group of ``ranks`` (the environment a
    torchrun worker gets); returns its device: CUDA ``rank mod count`` for ``cuda``, else the
    CPU."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ranks))
    dist.init_process_group("gloo", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=timeout_s))
    if device != "cuda":
        return torch.device("cpu")
    chosen = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(chosen)
    return chosen
