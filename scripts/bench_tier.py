"""Engine-shaped jobs through the public API: `HostTier.create`, `submit`, `finished`.

What an engine sees (the tier's figure of merit for transfers): every rank submits the same
job -- N blocks x every KV tensor (``--layers`` x K/V, ``--page-bytes`` pages, whole chunks of
random blocks) -- and the decider (rank 0) spins on `finished()` until the job is decided on
every rank; the other ranks `poll()` and learn the decider's marks from a broadcast, as an
engine's step broadcast carries them.  Per job size and direction, median of ``--reps`` on rank 0:

* GB/s      bytes one rank moves / (its `submit` start -> decided on every rank);
* ratio     / the link: one copy of a pinned buffer as large as the largest job (CUDA), or
            one host-to-host copy (CPU), measured in the same run;
* submit_us host time inside `submit`; decided_us the whole span.

The ranks meet before each job (untimed) in ``--barrier gloo`` (`dist.barrier`, where every rank
sleeps, so each `submit` starts on a CPU that just woke up) or ``--barrier spin`` (a
shared-memory counter they spin on, as a busy engine's workers wait for the next step: vLLM's
spin on a shared-memory broadcast queue).  The first is the cold case, the second the hot one.

``--matmul`` repeats each size's jobs beside a bf16 matmul loop on the compute stream (the
stand-in forward pass; CUDA): ``mm_kept`` is the matmul's rate then over its rate alone,
``during`` the copies' rate meanwhile (x link).

``--integrity on|off|both`` runs the tier with page checksums (the default), without, or both:
two tiers side by side whose jobs alternate one by one, so the host's drift over the run (a
busy small host's is larger than the checksums' cost) falls on both alike; rows carry
``integrity`` and ``both`` prints the on/off ratios.

Each size's last store is loaded back into other blocks and compared byte for byte.  The tier's
region is what an engine gets (nameless memfds, page-aligned, pinned on CUDA); rank ``r`` uses
GPU ``r % count``.  ``--device cpu`` runs the host backend (CI's smoke test).

    python3 scripts/bench_tier.py --ranks 2 --layers 80 --page-bytes 16KiB --blocks 16,128,1024
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
from bench_completion import meet  # this script's folder
from bench_engine import (
    MATMUL_DURING,
    MATMUL_N,
    kv_tensors,
    link_rate,
    make_job,
    matmul_tflops,
)
from bench_ranks import join_group, spawn_group

from offload.bounds import flag_type, parse_seconds
from offload.integrity import trailer_bytes
from offload.observe.report import write_json
from offload.region import cleanup
from offload.sizes import format_size, parse_size, round_up


def _rank_main(rank: int, port: int, out: Any, args: argparse.Namespace, arrived: Any
               ) -> None:
    import torch.distributed as dist

    from offload import CopyJob, HostTier, TierConfig

    device = join_group(rank, args.ranks, port, args.timeout, args.device)
    bpc, page, tensors = args.bpc, args.page_bytes, 2 * args.layers
    chunk_count = 2 * -(-max(args.blocks) // bpc)
    num_blocks = chunk_count * bpc
    kv = kv_tensors(args.layers, page, num_blocks, "separate", device)
    rows: list[dict[str, Any]] = []
    tiers = {}
    for integrity in args.integrity:  # both tiers at once: their jobs alternate (--integrity)
        slot = round_up(bpc * page * tensors + trailer_bytes([page] * tensors, bpc), 4096)
        row = args.ranks * slot  # every rank's slot (private: rows per rank)
        tiers[integrity] = HostTier.create(kv, TierConfig(
            cpu_bytes_per_node=chunk_count * row, blocks_per_chunk=bpc, tp=args.ranks,
            timeout_s=args.timeout, layout="private", integrity=integrity))
        assert tiers[integrity].plan.chunk_count >= chunk_count, tiers[integrity].plan
    link, engine = _measure(tiers, args, rank, arrived, kv, rows, num_blocks, chunk_count,
                            device, dist, CopyJob)
    for tier in tiers.values():
        tier.close()
    if rank == 0:
        out.put({"rows": rows, "link_GBps": link, "engine": engine, "device": str(device),
                 "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"})
    dist.destroy_process_group()
    out.close()
    out.join_thread()
    cleanup.exit_now(0)  # no interpreter finalization to race gloo's threads


class _Driver:
    """One tier's jobs as an engine drives them: every rank submits, the decider (rank 0)
    spins on `finished`, the others poll and learn its marks from a broadcast."""

    def __init__(self, tier: Any, rank: int, arrived: Any, dist: Any,
                 CopyJob: Any) -> None:  # noqa: N803
        self.tier, self.rank, self.arrived, self.dist = tier, rank, arrived, dist
        self.CopyJob = CopyJob
        self.mark: Any = None
        self.job_id = 0

    def one(self, direction: str, blocks: Any, chunks: Any, positions: Any, after: Any = None
            ) -> tuple[float, float]:
        """Submit on every rank; rank 0 returns (submit s, submit -> decided s)."""
        self.catch_up()
        meet(self.arrived, self.rank, self.job_id + 1)
        began = time.perf_counter()
        self.tier.submit(self.CopyJob(self.job_id, direction, blocks, chunks, positions), after)
        submitted = time.perf_counter() - began
        if self.rank == 0:
            while not any(r.job_id == self.job_id for r in self.tier.finished()):
                pass
            self.mark = self.tier.mark
        else:
            while self.tier.poll():
                pass
        self.job_id += 1
        return submitted, time.perf_counter() - began

    def catch_up(self) -> None:
        """The engine's step broadcast of the decider's mark, untimed."""
        box = [self.mark]
        self.dist.broadcast_object_list(box, src=0)
        if self.rank != 0 and box[0] is not None:
            self.tier.finished(box[0])


def _measure(tiers: dict[bool, Any], args: argparse.Namespace, rank: int, arrived: Any,
             kv: list[torch.Tensor], rows: list[dict[str, Any]], num_blocks: int,
             chunk_count: int, device: torch.device, dist: Any,
             CopyJob: Any) -> tuple[dict[str, float], str]:  # noqa: N803
    """Every job size and direction through every tier (integrity on and/or off); appends
    rank 0's rows.  With both tiers, each job runs on one and then the other, their order
    swapped every job, so a drift of the host over the run falls on both alike.  Returns the
    link rate and the engine's name."""
    bpc, page, tensors = args.bpc, args.page_bytes, 2 * args.layers
    rng = np.random.default_rng(7)  # the same jobs on every rank
    first = next(iter(tiers.values()))
    link = _link(first, device, max(args.blocks) * page * tensors)
    drivers = {key: _Driver(tier, rank, arrived, dist, CopyJob) for key, tier in tiers.items()}
    mm = None
    if args.matmul and device.type == "cuda":
        mm = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=device)
        for _ in range(5):
            mm @ mm  # cuBLAS set-up, untimed
    pages = np.arange(chunk_count * bpc)  # untimed: every chunk stored once, so loads read
    for driver in drivers.values():  # stored pages (sums match)
        driver.one("store", pages % num_blocks, pages // bpc, pages % bpc)
    for n in args.blocks:
        for direction in ("store", "load"):
            jobs = [make_job(rng, n, num_blocks, chunk_count, bpc, "chunks")
                    for _ in range(args.reps + 2)]
            samples: dict[bool, list[tuple[float, float]]] = {key: [] for key in drivers}
            for i, job in enumerate(jobs):
                for key in (list(drivers) if i % 2 == 0 else list(drivers)[::-1]):
                    samples[key].append(drivers[key].one(direction, *job))
            for key, driver in drivers.items():
                taken = samples[key][2:]
                span = statistics.median(s for _, s in taken)
                rows.append({"integrity": "on" if key else "off", "blocks": n,
                             "direction": direction, "bytes": n * page * tensors,
                             "GBps": n * page * tensors / span / 1e9,
                             "ratio": n * page * tensors / span / 1e9 / link[direction],
                             "submit_us": statistics.median(s for s, _ in taken) * 1e6,
                             "decided_us": span * 1e6})
                if mm is not None:
                    rows[-1].update(_beside_matmul(driver.one, mm, direction, jobs,
                                                   rows[-1]["bytes"], link[direction]))
        for key, driver in drivers.items():
            verified = _verify(driver.one, kv, rng, n, num_blocks, chunk_count, bpc)
            for row in rows[-2 * len(drivers):]:
                if row["integrity"] == ("on" if key else "off"):
                    row["verified"] = verified
    for driver in drivers.values():
        driver.catch_up()
    engine = first.actor.engine.name if first.actor.engine else "?"
    return link, engine


def _beside_matmul(one: Any, mm: torch.Tensor, direction: str, jobs: list[Any],
                   job_bytes: int, link: float) -> dict[str, float]:
    """The same jobs again while a bf16 matmul loop runs on the compute stream: each rank
    queues ``MATMUL_DURING`` matmuls right after its first submit, and its jobs (which do not
    wait for them) go on until they have moved ~1.25x what the link moves in the matmuls'
    time alone, so the matmul runs beside copies throughout.  Returns the matmul's rate kept
    (during / alone, timed by CUDA events) and the copies' rate meanwhile (x link)."""
    alone = MATMUL_DURING * 2 * MATMUL_N**3 / (matmul_tflops(mm, MATMUL_DURING) * 1e12)  # s
    count = max(2, round(1.25 * alone * link * 1e9 / job_bytes))  # the same on every rank
    free = torch.cuda.Event()  # the copies depend on nothing the matmuls do
    free.record()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    for i in range(count):
        one(direction, *jobs[i % len(jobs)], after=free)
        if i == 0:
            start.record()
            for _ in range(MATMUL_DURING):
                mm @ mm
            end.record()
    copies = time.perf_counter() - began
    end.synchronize()
    during = start.elapsed_time(end) / 1e3
    return {"matmul_kept": alone / during,
            "during_ratio": count * job_bytes / copies / 1e9 / link}


def _link(tier: Any, device: torch.device, nbytes: int) -> dict[str, float]:
    """The same run's baseline: one copy of ``nbytes`` between the tier's own (pinned) region
    and the device, or host to host on CPU."""
    host = tier.actor.region.tensor[:nbytes]
    if device.type == "cuda":
        gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return link_rate(host, gpu, 5)
    other = torch.empty(nbytes, dtype=torch.uint8)
    other.copy_(host)  # first touch, untimed
    samples = []
    for _ in range(5):
        began = time.perf_counter()
        other.copy_(host)
        samples.append(time.perf_counter() - began)
    return dict.fromkeys(("store", "load"), nbytes / statistics.median(samples) / 1e9)


def _verify(one: Any, kv: list[torch.Tensor], rng: np.random.Generator, n: int,
            num_blocks: int, chunk_count: int, bpc: int) -> bool:
    blocks, chunks, positions = make_job(rng, n, num_blocks, chunk_count, bpc, "chunks")
    one("store", blocks, chunks, positions)
    saved = [t[torch.from_numpy(blocks).to(t.device)].clone() for t in kv]
    other = rng.permutation(num_blocks)[:n]
    one("load", other, chunks, positions)
    if kv[0].is_cuda:
        torch.cuda.synchronize(kv[0].device)
    index = torch.from_numpy(other).to(kv[0].device)
    return all(torch.equal(t[index], s) for t, s in zip(kv, saved, strict=True))


def run(args: argparse.Namespace) -> dict[str, Any]:
    arrived = (mp.get_context("spawn").RawArray("q", args.ranks) if args.barrier == "spin"
               else None)
    result: dict[str, Any] = spawn_group(_rank_main, args.ranks, (args, arrived), args.timeout)
    return result


def print_table(args: argparse.Namespace, result: dict[str, Any]) -> None:
    link = result["link_GBps"]
    print(f"{args.ranks} rank(s), {2 * args.layers} tensors x {format_size(args.page_bytes)} pages,"
          f" {result['engine']} engine on {result['name']}, {args.barrier} barrier; link store "
          f"{link['store']:.1f} / load {link['load']:.1f} GB/s")
    print(f"{'integ':>5} {'blocks':>6} {'bytes':>10} {'dir':>5} {'GB/s':>6} {'ratio':>5} "
          f"{'submit_us':>9} {'decided_us':>10} {'mm_kept':>7} {'during':>6} ok")
    for row in result["rows"]:
        kept = f"{row['matmul_kept']:.3f}" if "matmul_kept" in row else ""
        during = f"{row['during_ratio']:.2f}" if "during_ratio" in row else ""
        print(f"{row['integrity']:>5} {row['blocks']:>6} {format_size(row['bytes']):>10} "
              f"{row['direction']:>5} {row['GBps']:6.1f} {row['ratio']:5.2f} "
              f"{row['submit_us']:9.0f} {row['decided_us']:10.0f} {kept:>7} {during:>6} "
              f"{'y' if row['verified'] else 'NO'}")
    off = {(r["blocks"], r["direction"]): r for r in result["rows"] if r["integrity"] == "off"}
    pairs = [(r, off[r["blocks"], r["direction"]]) for r in result["rows"]
             if r["integrity"] == "on" and (r["blocks"], r["direction"]) in off]
    if pairs:
        print("integrity on vs off, job by job: time ratio (decided), added submit_us")
        for on, base in pairs:
            print(f"{on['blocks']:>6} {on['direction']:>5} {base['GBps'] / on['GBps']:6.3f} "
                  f"{on['submit_us'] - base['submit_us']:+8.1f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1, help="ranks (one tier, tp = ranks)")
    p.add_argument("--layers", type=int, default=80, help="layers; tensors = 2 x layers")
    p.add_argument("--page-bytes", type=flag_type(parse_size, "--page-bytes"), default="16KiB",
                   help="bytes of one block in one tensor")
    p.add_argument("--blocks", default="1,16,128,1024", help="job sizes in blocks")
    p.add_argument("--bpc", type=int, default=16, help="blocks per chunk")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    # checked by the parser, before the ranks start: torch's store takes it
    p.add_argument("--timeout", type=flag_type(parse_seconds, "--timeout"), default=300.0,
                   help="seconds before a rank fails")
    p.add_argument("--barrier", choices=("gloo", "spin"), default="gloo",
                   help="how ranks meet before each job: sleeping in dist.barrier, or spinning "
                        "on shared memory like a busy engine loop")
    p.add_argument("--integrity", choices=("on", "off", "both"), default="on",
                   help="page checksums on, off, or both (two tiers, their jobs alternating)")
    p.add_argument("--matmul", action="store_true",
                   help="also run each size's jobs beside a bf16 matmul loop (CUDA): the "
                        "matmul's rate kept (mm_kept) and the copies' rate meanwhile (during, "
                        "x link)")
    p.add_argument("--json", metavar="PATH", help="write the rows there too")
    args = p.parse_args(argv)
    args.blocks = [int(b) for b in args.blocks.split(",")]
    args.integrity = {"on": [True], "off": [False], "both": [True, False]}[args.integrity]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        write_json(args.json, {"args": vars(args), **result}, "--json")
    print_table(args, result)
    return 0 if all(row["verified"] for row in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
