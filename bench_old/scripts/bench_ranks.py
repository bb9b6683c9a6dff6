"""Run one benchmark function on several processes at once (the GPU benchmarks' ``--ranks``).

Each process calls ``bench(rank, args, barrier)``, which returns a dict with a ``"rank"`` key;
``barrier`` (None with one rank) lets the ranks time the same moments.  Spawned, so CUDA starts
fresh in each; ``bench`` must be a module-level function (it travels by reference).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

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
