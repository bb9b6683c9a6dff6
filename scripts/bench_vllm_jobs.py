# SPDX-License-Identifier: Apache-2.0
"""A vLLM-shaped job stream through the vLLM integration's core, against the raw tier API.

No vLLM needed: the stream is what vLLM's offloading connector sends, made here.  ``--requests``
requests run at once; each step every running request stores 1-16 new blocks (one store job
per request, ``--blocks-per-chunk`` blocks per offloaded block), and every ``--arrival``
steps a request finishes and a new one arrives that loads its prefix run (``--prefix`` blocks
of a finished request, one load job).  KV tensors are laid out as vLLM's canonical caches are:
one int8 ``[blocks, page]`` tensor per layer (``--layers``, ``--page-bytes``).

Three paths move the same stream, one process, one rank (a gloo group of one):

* ``core``  the integration: `TierIndex` (the scheduler's manager: prepare, bind, decide) and
            `TierWorker` (vLLM's block ids and chunks to `CopyJob`s, decisions, reports);
* ``raw``   the same copy jobs, built beforehand, through `HostTier.submit` / `finished`;
* ``vllm``  vLLM's own CPU offloading handler (``CPUOffloadingWorker``) on the same blocks,
            where vLLM and CUDA are installed (``--vllm``).

The stream runs once untimed through ``core`` (the first pass pays every warm-up: page
faults, native builds, caches), then ``raw`` and ``core`` in turn twice; each path reports its
faster pass.  Printed per path: host time per job on the workers' side (its submit plus its
share of each step's decisions and report, microseconds), the median submit, the scheduler
index's time per job (core only: lookups, prepare, bind, applying reports; vLLM's own manager
does the same work, in the scheduler's process) and the workers' throughput (job bytes / the
stream's wall time less the index's and the bench's own making of block ids); then the core's
overhead against ``raw`` (DESIGN.md section 8: at most 30 us per job and 5% throughput).

    python scripts/bench_vllm_jobs.py --device cuda --layers 80 --page-bytes 16KiB --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from offload.actor import CopyJob
from offload.config import TierConfig
from offload.sizes import format_size, parse_size
from offload.tier import HostTier
from offload.vllm import core

ROUNDS = 2  # timed passes of each path, after one untimed; each reports its fastest


@dataclass
class Job:
    """One job of the stream as vLLM sends it, and the copy job it becomes."""

    step: int
    job_id: int
    direction: str
    gpu_blocks: np.ndarray
    chunks: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    copy: CopyJob | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=8, help="KV tensors (one per layer)")
    p.add_argument("--page-bytes", default="16KiB", help="bytes of one block in one tensor")
    p.add_argument("--gpu-blocks", type=int, default=2048, help="GPU blocks per tensor")
    p.add_argument("--blocks-per-chunk", type=int, default=1,
                   help="vLLM's blocks per offloaded block (the tier's blocks per chunk)")
    p.add_argument("--cpu-bytes", default="256MiB", help="host tier budget")
    p.add_argument("--requests", type=int, default=8, help="requests running at once")
    p.add_argument("--steps", type=int, default=100, help="scheduler steps")
    p.add_argument("--arrival", type=int, default=4, help="a new request every N steps")
    p.add_argument("--prefix", type=int, default=64, help="blocks a new request loads")
    p.add_argument("--no-integrity", action="store_true", help="tier without checksums")
    p.add_argument("--vllm", action="store_true",
                   help="also run vLLM's CPU offloading handler (needs vLLM and CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def kv_tensors(args: argparse.Namespace) -> list[torch.Tensor]:
    page = parse_size(args.page_bytes)
    return [torch.randint(-128, 127, (args.gpu_blocks, page), dtype=torch.int8,
                          device=args.device) for _ in range(args.layers)]


def make_stream(args: argparse.Namespace) -> list[list[tuple[str, list[Any]]]]:
    """Per step, the (direction, keys) of each job vLLM would send: stores of 1-16 new blocks
    per running request, and the prefix load of a request that arrives."""
    rng = np.random.default_rng(args.seed)
    bpc = args.blocks_per_chunk
    running: dict[int, int] = {r: 0 for r in range(args.requests)}  # request -> blocks stored
    finished: list[tuple[int, int]] = []
    next_request = args.requests
    steps = []
    for step in range(args.steps):
        jobs: list[tuple[str, list[Any]]] = []
        if step and step % args.arrival == 0:
            done = min(running)
            finished.append((done, running.pop(done)))
            source, stored = finished[int(rng.integers(len(finished)))]
            chunks = min(args.prefix // bpc, stored // bpc)
            if chunks:
                jobs.append(("load", [(source, c) for c in range(chunks)]))
            running[next_request] = 0
            next_request += 1
        for request, stored in running.items():
            new = int(rng.integers(1, 17)) * bpc
            jobs.append(("store", [(request, (stored + i) // bpc)
                                   for i in range(0, new, bpc)]))
            running[request] = stored + new
        steps.append(jobs)
    return steps


def gpu_blocks(rng: np.random.Generator, n: int, total: int) -> np.ndarray:
    return rng.choice(total, size=n, replace=False).astype(np.int64)


def run_core(args: argparse.Namespace, tier: HostTier, stream: list) -> tuple[list[Job], dict]:
    """The integration's path; returns the jobs it sent (with their copy jobs) and timings:
    the scheduler's index per job, the worker's submit per job, the decisions per step."""
    rng = np.random.default_rng(args.seed + 1)
    bpc = args.blocks_per_chunk
    index = core.TierIndex()
    worker = core.TierWorker(tier, bpc)
    index.configure(worker.setup())
    sent: list[Job] = []
    timing: dict[str, Any] = {"index_s": [], "submit_s": [], "decide_s": [], "blocks_s": []}
    job_id = 0
    started = time.perf_counter()
    for number, step in enumerate(stream):
        for direction, keys in step:
            t0 = time.perf_counter()
            if direction == "load":
                keys = [k for k in keys if index.lookup(k) == "hit"]
                plan: Any = index.prepare_load(keys) if keys else None
            else:
                plan = index.prepare_store(keys)
            if plan is None or not len(plan.chunks):
                continue
            index.bind(job_id, plan.job_id)
            t1 = time.perf_counter()
            blocks = gpu_blocks(rng, len(plan.chunks) * bpc, args.gpu_blocks)  # vLLM's part
            t2 = time.perf_counter()
            worker.submit(job_id, direction, blocks, 0, plan.chunks)
            t3 = time.perf_counter()
            timing["index_s"].append(t1 - t0)
            timing["blocks_s"].append(t2 - t1)
            timing["submit_s"].append(t3 - t2)
            sent.append(Job(number, job_id, direction, blocks, plan.chunks))
            job_id += 1
        t0 = time.perf_counter()
        outcomes = worker.finished()
        report = worker.report(outcomes)
        t1 = time.perf_counter()
        index.apply(report)  # the scheduler's side
        for outcome in outcomes:
            index.decided(outcome.job_id)
        timing["decide_s"].append(t1 - t0)
        timing["index_s"].append(time.perf_counter() - t1)
    drain(tier, lambda: [index.decided(o.job_id) for o in worker.finished()])
    timing["wall_s"] = time.perf_counter() - started
    timing["jobs"] = len(sent)
    for job in sent:
        job.copy = core.copy_job(job.job_id, job.direction, job.gpu_blocks, 0, job.chunks,
                                 bpc)
    return sent, timing


def run_raw(args: argparse.Namespace, tier: HostTier, jobs: list[Job], per_step: list[int]
            ) -> dict:
    """The same copy jobs through the tier's API, decided once per step."""
    timing: dict[str, Any] = {"submit_s": [], "decide_s": []}
    started = time.perf_counter()
    at = 0
    for count in per_step:
        for job in jobs[at:at + count]:
            t0 = time.perf_counter()
            assert job.copy is not None
            tier.submit(job.copy)
            timing["submit_s"].append(time.perf_counter() - t0)
        at += count
        t0 = time.perf_counter()
        tier.finished()
        timing["decide_s"].append(time.perf_counter() - t0)
    drain(tier, tier.finished)
    timing["wall_s"] = time.perf_counter() - started
    timing["jobs"] = len(jobs)
    return timing


def run_vllm(args: argparse.Namespace, kv: list[torch.Tensor], jobs: list[Job],
             per_step: list[int], chunk_count: int) -> dict:
    """vLLM's own handler on the same blocks and chunks (its pinned tensors as the host)."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

    page = kv[0].shape[1]
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in kv],
                               [[CanonicalKVCacheRef(i, page) for i in range(len(kv))]])
    handler = CPUOffloadingWorker(caches, args.blocks_per_chunk, chunk_count)
    timing: dict[str, Any] = {"submit_s": [], "decide_s": []}
    started = time.perf_counter()
    at = 0
    for count in per_step:
        for job in jobs[at:at + count]:
            gpu = GPULoadStoreSpec(job.gpu_blocks.tolist(), [len(job.gpu_blocks)], [0])
            cpu = CPULoadStoreSpec(job.chunks.tolist())
            t0 = time.perf_counter()
            if job.direction == "store":
                handler.submit_store(job.job_id, gpu, cpu)
            else:
                handler.submit_load(job.job_id, cpu, gpu)
            timing["submit_s"].append(time.perf_counter() - t0)
        at += count
        t0 = time.perf_counter()
        handler.get_finished()
        timing["decide_s"].append(time.perf_counter() - t0)
    handler.wait({j.job_id for j in jobs})
    handler.get_finished()
    timing["wall_s"] = time.perf_counter() - started
    timing["jobs"] = len(jobs)
    handler.shutdown()
    return timing


def drain(tier: HostTier, finish: Any) -> None:
    deadline = time.monotonic() + 120
    while tier.actor.jobs.live and time.monotonic() < deadline:
        finish()
        time.sleep(0.0002)


def summary(name: str, timing: dict, job_bytes: int) -> dict:
    """Host time per job (its submit plus its share of the step's decisions), the median
    submit, the scheduler index's time per job (core only) and the stream's throughput."""
    jobs = max(1, timing["jobs"])
    per_job = (sum(timing["submit_s"]) + sum(timing["decide_s"])) / jobs
    index = sum(timing.get("index_s", [])) / jobs
    # the workers' side: less the scheduler's index and the bench's own making of block ids
    wall = timing["wall_s"] - sum(timing.get("index_s", [])) - sum(timing.get("blocks_s", []))
    return {"path": name, "jobs": timing["jobs"], "host_us_per_job": per_job * 1e6,
            "median_submit_us": statistics.median(timing["submit_s"]) * 1e6,
            "index_us_per_job": index * 1e6,
            "GBps": job_bytes / wall / 1e9, "wall_s": timing["wall_s"]}


def init_group() -> str:
    """A gloo group of one (its file store in a temporary folder, returned for removal)."""
    store_dir = tempfile.mkdtemp(prefix="bench-vllm-jobs-")
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=0,
                            world_size=1)
    return store_dir


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    if args.vllm and args.device != "cuda":
        print("--vllm: vLLM's handler moves CUDA tensors only; add --device cuda",
              file=sys.stderr)
        return 2
    os.environ.setdefault("OFFLOAD_NODE_ID", "bench")
    store_dir = init_group()
    kv = kv_tensors(args)
    config = TierConfig(cpu_bytes_per_node=parse_size(args.cpu_bytes),
                        blocks_per_chunk=args.blocks_per_chunk, integrity=not args.no_integrity)
    tier = HostTier.create(kv, config)
    stream = make_stream(args)
    jobs, _ = run_core(args, tier, stream)  # untimed: the first pass pays every warm-up
    per_step = [sum(1 for j in jobs if j.step == n) for n in range(len(stream))]
    page = kv[0].shape[1]
    job_bytes = sum(len(j.gpu_blocks) for j in jobs) * page * len(kv)
    timings: dict[str, list[dict]] = {"core": [], "raw": []}
    for _ in range(ROUNDS):  # alternated, so a drift of the host falls on both
        timings["raw"].append(run_raw(args, tier, jobs, per_step))
        timings["core"].append(run_core(args, tier, stream)[1])
    rows = [summary(name, min(runs, key=lambda t: t["wall_s"]), job_bytes)
            for name, runs in (("core", timings["core"]), ("raw", timings["raw"]))]
    chunk_count = tier.plan.chunk_count
    tier.close()
    if args.vllm:
        rows.append(summary("vllm", run_vllm(args, kv, jobs, per_step, chunk_count),
                            job_bytes))
    core_row, raw_row = rows[0], rows[1]
    print(f"{len(jobs)} jobs, {format_size(job_bytes)} moved, {args.layers} x "
          f"{format_size(page)} pages, {args.device}")
    print(f"{'path':6} {'jobs':>6} {'host us/job':>12} {'median submit us':>17} "
          f"{'index us/job':>13} {'GB/s':>8}")
    for row in rows:
        print(f"{row['path']:6} {row['jobs']:>6} {row['host_us_per_job']:>12.1f} "
              f"{row['median_submit_us']:>17.1f} {row['index_us_per_job']:>13.1f} "
              f"{row['GBps']:>8.3f}")
    overhead = {"host_us_per_job": core_row["host_us_per_job"] - raw_row["host_us_per_job"],
                "throughput_ratio": core_row["GBps"] / raw_row["GBps"]}
    print(f"core vs raw: +{overhead['host_us_per_job']:.1f} us per job, throughput "
          f"{overhead['throughput_ratio']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "overhead": overhead}, f, indent=1)
    dist.destroy_process_group()
    shutil.rmtree(store_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    from offload.region.cleanup import exit_after

    exit_after(main)
