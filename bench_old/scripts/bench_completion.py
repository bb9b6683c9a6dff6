"""Completion latency: a 1-block SPMD job from `submit` to decided, at several rank counts.

Every rank submits the same 1-block store (jobs alternate between two blocks), then the decider
(rank 0) spins on `finished()` until the job comes back; the other ranks `poll()` and pass the
decider's mark to `finished(mark)` the way an engine's step broadcast would.  A barrier before
each job (outside the timed span) keeps the ranks in step: ``--barrier gloo`` (the default) is
`dist.barrier`, in which every rank sleeps, so each job starts on a CPU that just woke up (on a
VM, an idle vCPU is descheduled by the host: tens of microseconds to wake, caches cold);
``--barrier spin`` is a shared-memory counter every rank spins on (yielding), the way an
engine's busy step loop meets its next submit (vLLM's workers spin on a shared-memory
broadcast queue).  The timed span is rank 0's
`submit` start to the moment it holds the decision (``submit_median_us``: the part spent inside
`submit`, which on CPU tensors includes the copy itself).  The ranks leave the barrier up to
hundreds of microseconds apart, so ``from_last_us`` also times each job from the *last* rank's
`submit` start (``time.perf_counter`` is CLOCK_MONOTONIC, one clock for every process of the
host): the completion path itself, without the skew of the engine's own broadcast.  CUDA KV
tensors where a GPU exists (``--device cuda``, rank ``r`` on GPU ``r % count``), else CPU
tensors.

``--driven`` times rank 0's `run(job)` instead: the command broadcast through the store, every
rank's copy, and the same watermark completion.

On a tier without `finished()` (an older commit, for a before/after run) every rank spins on
`done(job_id)` instead, so one script measures both.

    python scripts/bench_completion.py --ranks 2,4,8 --jobs 2000 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def meet(arrived: Any, rank: int, generation: int) -> None:
    """The ranks' untimed meeting before a job: `dist.barrier` when ``arrived`` is None, else
    every rank marks ``generation`` in its own slot of ``arrived`` (shared memory) and spins
    (yielding the core, ranks may outnumber cores) until every slot has it."""
    if arrived is None:
        import torch.distributed as dist

        dist.barrier()
        return
    arrived[rank] = generation
    while min(arrived) < generation:
        os.sched_yield()


def _rank_main(rank: int, world: int, port: int, jobs: int, device: str, driven: bool,
               blocks: int, arrived: Any, out: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    import torch
    import torch.distributed as dist

    from offload import CopyJob, HostTier, TierConfig, cleanup

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    kv = [torch.randn(4, 2, 2048, device=device).to(torch.bfloat16)]
    tier = HostTier.create(kv, TierConfig(cpu_bytes_per_node=16 << 20, blocks_per_chunk=4,
                                          tp=world, timeout_s=60))
    engine_loop = hasattr(tier, "finished")

    def job(i: int) -> CopyJob:  # 1 block: i % 2 -> chunk 0 position i % 2; 0: no copy at all
        return CopyJob(i, "store", (i % 2,) * blocks, (0,) * blocks, (i % 2,) * blocks)

    samples, submits, starts, decided = [], [], [], []
    mark = None
    if driven:  # rank 0 drives every job through the RPC; the others serve
        if rank == 0:
            for i in range(jobs):
                began = time.perf_counter()
                tier.run(job(i))
                samples.append(time.perf_counter() - began)
            tier.release()
            submits = samples
        else:
            tier.serve()
        jobs = 0
    for i in range(jobs):
        box = [mark]
        dist.broadcast_object_list(box, src=0)  # the engine's step broadcast, untimed
        mark = box[0]
        if engine_loop and rank != 0 and mark is not None:
            tier.finished(mark)
        meet(arrived, rank, i + 1)
        began = time.perf_counter()
        tier.submit(job(i))
        submits.append(time.perf_counter() - began)
        starts.append(began)
        if not engine_loop:
            while not tier.done(i):
                os.sched_yield()  # ranks may outnumber cores: let the others copy
        elif rank == 0:
            while not any(r.job_id == i for r in tier.finished()):
                os.sched_yield()
            decided.append(time.perf_counter())
            mark = tier.mark
        else:
            while tier.poll():  # our copy must land before we block in the next broadcast
                os.sched_yield()
        samples.append(time.perf_counter() - began)
    if driven:
        pass
    elif engine_loop and rank != 0:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        tier.finished(box[0])
    elif engine_loop:
        dist.broadcast_object_list([mark], src=0)
    tier.close()
    everyone: list[Any] = [None] * world
    if not driven:
        dist.all_gather_object(everyone, starts)
    if rank == 0:
        skip = min(50, len(samples) // 10)
        from_last = sorted(d - max(s[i] for s in everyone)
                           for i, d in enumerate(decided) if i >= skip)
        warm = sorted(samples[skip:])
        out.put({"ranks": world, "jobs": len(warm),
                 "median_us": round(statistics.median(warm) * 1e6, 1),
                 "p99_us": round(warm[int(0.99 * (len(warm) - 1))] * 1e6, 1),
                 "submit_median_us": round(statistics.median(submits[skip:]) * 1e6, 1),
                 "from_last_us": (round(statistics.median(from_last) * 1e6, 1)
                                  if from_last else None),
                 "path": "run" if driven else "finished" if engine_loop else "done",
                 "blocks": blocks,
                 "barrier": "gloo" if arrived is None else "spin",
                 "device": device})
    dist.destroy_process_group()
    out.close()
    out.join_thread()
    cleanup.exit_now(0)  # no interpreter finalization to race gloo's threads


def measure(world: int, jobs: int, device: str, driven: bool = False, blocks: int = 1,
            barrier: str = "gloo") -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    arrived = ctx.RawArray("q", world) if barrier == "spin" else None
    procs = [ctx.Process(target=_rank_main,
                         args=(r, world, port, jobs, device, driven, blocks, arrived, out))
             for r in range(world)]
    for p in procs:
        p.start()
    row = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8", help="comma-separated rank counts")
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--driven", action="store_true",
                        help="time rank 0's run(job) (RPC broadcast + quorum) instead")
    parser.add_argument("--blocks", type=int, choices=(0, 1), default=1,
                        help="blocks per job; 0 times the completion path alone (no copy)")
    parser.add_argument("--barrier", choices=("gloo", "spin"), default="gloo",
                        help="how ranks meet before each job: sleeping in dist.barrier, or "
                             "spinning on shared memory like a busy engine loop")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        row = measure(world, args.jobs, device, args.driven, args.blocks, args.barrier)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
