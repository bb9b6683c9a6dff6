"""Engine-shaped transfers: every job moves N blocks x every KV tensor (DESIGN.md sections 6, 8).

An inference engine's KV cache is one tensor per layer and K/V (``--layers 80`` -> 160 tensors)
with small pages (``--page-bytes 16KiB``); each scheduler step stores or loads a few to a few
thousand blocks.  For each backend and job size (``--blocks``), both directions, median of
``--reps`` jobs:

* GB/s      job bytes / (submit -> completion), wall clock on the host;
* submit_us host time inside ``submit`` (checks, index upload, launch), after the host waited
            for the previous job;
* b2b_us    the same for jobs submitted back to back, each while the one before copies;
* link      one pinned buffer of ``--link-bytes`` copied in one piece, same run: the ratio's base.

Every backend's last job of each size is verified byte for byte (stored blocks loaded back into
other blocks).  ``--layer-groups G`` submits every load layer-wise (``load_layers``: ``G``
groups of consecutive tensors, one event each), to compare with the same loads whole.
``--matmul`` runs a bf16 matmul loop (the stand-in forward pass) while jobs of
each size copy without a pause and prints the fraction of its speed alone it kept
(``mm_kept``) and the copies' rate meanwhile (``during``, x link);  ``path`` says which path
of the engine ran (hybrid: ``staged``, ``kernel`` or ``copy_engine``);
``--sweep-programs 8,32:64,...`` runs the kernel with each program budget (and step KiB);
``--contention`` times a small job submitted behind a long compute queue (no data dependency)
on a normal and a high-priority stream.  ``--ranks N`` runs N processes at once (GPU
``rank % devices``).  ``--integrity on|off|both``: slots with a checksum trailer (the library's
default), without, or each backend both ways in turn (rows carry ``integrity``; ``both``
prints the on/off ratios).

    python scripts/bench_engine.py --layers 80 --page-bytes 16KiB --blocks 1,16,128,1024 \\
        --backend hybrid,triton,copy_engine --json engine.json

Uses only ``make_engine``, ``submit``, ``wait_all`` and ``memfd_mapping`` of the library, so
before/after figures come from one script.  The host buffer is a page-aligned memfd mapping like
the tier's region; ``--host-buffer torch-empty`` gives a 64-byte-aligned ``torch.empty`` buffer,
which understates the kernel (docs/BENCHMARKS.md, "Engine-shaped transfers", the host-buffer
table).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from bench_ranks import run_ranks  # this script's folder

from offload.bounds import flag_type
from offload.integrity import trailer_bytes
from offload.observe.report import write_json
from offload.sizes import format_size, parse_size, round_up
from offload.system.nameless import memfd_mapping
from offload.transfer import SlotLayout, make_engine
from offload.transfer.registration import host_registered

MATMUL_N = 8192
MATMUL_DURING = 80  # matmuls in one timed window (~0.1 s on an H200)


def kv_tensors(layers: int, page: int, num_blocks: int, layout: str, device: torch.device
               ) -> list[torch.Tensor]:
    """2 x ``layers`` KV tensors of ``num_blocks`` pages: separate ``[blocks, page]`` tensors
    or K/V views of one ``[blocks, 2, page]`` tensor per layer; random bytes."""
    out = []
    for _ in range(layers):
        if layout == "views":
            kv = torch.randint(0, 256, (num_blocks, 2, page), dtype=torch.uint8, device=device)
            out += [kv[:, 0], kv[:, 1]]
        else:
            out += [torch.randint(0, 256, (num_blocks, page), dtype=torch.uint8, device=device)
                    for _ in range(2)]
    return out


def make_job(rng: np.random.Generator, n: int, num_blocks: int, chunk_count: int, bpc: int,
             pattern: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``scattered``: random blocks to random host pages; ``chunks``: random blocks filling
    whole chunks in position order (what an engine stores); ``runs``: the same from consecutive
    blocks (copy-engine friendly)."""
    if pattern == "scattered":
        blocks = rng.permutation(num_blocks)[:n]
        pages = rng.permutation(chunk_count * bpc)[:n]
        return blocks, pages // bpc, pages % bpc
    chunks = rng.permutation(chunk_count)[: -(-n // bpc)]
    pages = (chunks[:, None] * bpc + np.arange(bpc)).ravel()[:n]
    if pattern == "chunks":
        blocks = rng.permutation(num_blocks)[:n]
    else:
        starts = rng.permutation(num_blocks // bpc)[: chunks.size] * bpc
        blocks = (starts[:, None] + np.arange(bpc)).ravel()[:n]
    return blocks, pages // bpc, pages % bpc


def link_rate(host: torch.Tensor, gpu: torch.Tensor, reps: int) -> dict[str, float]:
    """GB/s of one ``copy_`` of the whole buffer, per direction (CUDA events)."""
    out = {}
    for direction, (dst, src) in {"store": (host, gpu), "load": (gpu, host)}.items():
        samples = []
        for _ in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        out[direction] = host.numel() / statistics.median(samples[1:]) / 1e9
    return out


def matmul_tflops(a: torch.Tensor, count: int, during: Callable[[], None] | None = None
                  ) -> float:
    torch.cuda.synchronize()
    if during is not None:
        during()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        a @ a
    end.record()
    torch.cuda.synchronize()
    return count * 2 * MATMUL_N**3 / (start.elapsed_time(end) / 1e3) / 1e12


def build_engine(name: str, kv: list[torch.Tensor], region: torch.Tensor, layout: SlotLayout,
                 chunk_count: int, kernel: str | None, priority: int = 0) -> Any:
    """``name`` through ``make_engine``, or the kernel with ``kernel`` =
    "PROGRAMS[:STEP_KIB[:WORD[:TILE_KIB[:WARPS]]]]" (the program budget of both directions,
    bytes a program moves per step, widest access, largest piece of a page, warps)."""
    if kernel is None:
        return make_engine(kv, region, region.data_ptr(), layout, chunk_count, True, name,
                           priority)
    from offload.transfer.kernel import (
        MAX_TILE_BYTES,
        MAX_WORD,
        STEP_BYTES,
        TritonEngine,
    )

    programs, step, word, tile, warps = (kernel.split(":") + [""] * 4)[:5]
    return TritonEngine(kv, region, layout, chunk_count,
                        {"store": int(programs), "load": int(programs)},
                        int(warps) if warps else None,
                        step_bytes=int(step) << 10 if step else STEP_BYTES,
                        max_word=int(word) if word else MAX_WORD,
                        tile_bytes=int(tile) << 10 if tile else MAX_TILE_BYTES)


class Rank:
    def __init__(self, args: argparse.Namespace, rank: int, barrier: Any) -> None:
        self.args, self.rank, self.barrier = args, rank, barrier
        self.device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(self.device)
        bpc, page = args.bpc, args.page_bytes
        self.num_blocks = 2 * max(args.blocks)
        self.chunk_count = -(-2 * max(args.blocks) // bpc)
        self.kv = kv_tensors(args.layers, page, self.num_blocks, args.layout, self.device)
        t = len(self.kv)
        offsets = tuple(bpc * page * i for i in range(t))
        self.layouts = {
            False: SlotLayout(bpc * page * t, 0, bpc, (page,) * t, offsets),
            True: SlotLayout(round_up(bpc * page * t + trailer_bytes((page,) * t, bpc), 4096),
                             0, bpc, (page,) * t, offsets, trailer_offset=bpc * page * t,
                             seed=rank)}
        self.layout = self.layouts[args.integrity[0]]
        size = self.layouts[True].region_bytes(self.chunk_count)
        if args.host_buffer == "memfd":  # page-aligned shmem, as the tier's regions
            self._host = memfd_mapping(f"bench-engine-{rank}", size)
            self.region = self._host.tensor
        else:  # 64-byte aligned, as a large torch.empty is: understates the kernel
            self.region = torch.empty(size, dtype=torch.uint8)
        self.region.fill_(1)  # first touch, untimed
        self.rng = np.random.default_rng(rank)
        self.job_bytes = page * t

    def sync(self) -> None:
        torch.cuda.synchronize()
        if self.barrier is not None:
            self.barrier.wait()

    def measure(self, engine: Any, n: int, direction: str) -> dict[str, float]:
        a = self.args
        jobs = [make_job(self.rng, n, self.num_blocks, self.chunk_count, a.bpc, a.pattern)
                for _ in range(a.reps + 2)]
        walls, hosts = [], []
        before = dict(getattr(engine, "routes", {}))
        for i, job in enumerate(jobs):
            self.sync()
            t0 = time.perf_counter()
            self.submit(engine, i, direction, job)
            t1 = time.perf_counter()
            engine.wait_all()
            t2 = time.perf_counter()
            if i >= 2:
                walls.append(t2 - t0)
                hosts.append(t1 - t0)
        wall = statistics.median(walls)
        routes = getattr(engine, "routes", {})
        path = max(routes, key=lambda k: routes[k] - before.get(k, 0)) if routes else engine.name
        return {"path": path, "GBps": n * self.job_bytes / wall / 1e9,
                "submit_us": statistics.median(hosts) * 1e6,
                "b2b_us": self.back_to_back_submit(engine, jobs, direction) * 1e6,
                "wall_us": wall * 1e6}

    def submit(self, engine: Any, job_id: int, direction: str, job: Any,
               after: Any = None) -> None:
        """One timed job: a load layer-wise with ``--layer-groups``, else whole."""
        if direction == "load" and self.args.layer_groups:
            engine.load_layers(job_id, *job, groups=self.args.layer_groups, after=after)
        else:
            engine.submit(job_id, direction, *job, after=after)

    def back_to_back_submit(self, engine: Any, jobs: list[Any], direction: str) -> float:
        """Median host time in ``submit`` of jobs issued back to back, each while the one
        before copies: an engine's steady state, where the host never waited for a copy
        (the timed loop above waits for each job, and on a VM a CPU that waited runs every
        step of the next ``submit`` several times slower: docs/BENCHMARKS.md, "Where a 1,024-block
        `submit` goes on these VMs")."""
        self.sync()
        hosts = []
        for i, job in enumerate(jobs):
            t0 = time.perf_counter()
            self.submit(engine, i, direction, job)
            hosts.append(time.perf_counter() - t0)
        engine.wait_all()
        return statistics.median(hosts[1:])

    def fill(self, engine: Any) -> None:
        """Store every host page once (untimed): loads then read what was stored, so their
        checksums match (a never-stored page fails its check)."""
        pages = np.arange(self.chunk_count * self.args.bpc)
        blocks = pages % self.num_blocks
        for part in np.array_split(np.arange(pages.size), max(1, pages.size // self.num_blocks)):
            engine.submit(-1, "store", blocks[part], pages[part] // self.args.bpc,
                          pages[part] % self.args.bpc)
            engine.wait_all()
        self.mismatches = engine.mismatches

    def verify(self, engine: Any, n: int) -> bool:
        blocks, chunks, positions = make_job(self.rng, n, self.num_blocks, self.chunk_count,
                                             self.args.bpc, self.args.pattern)
        engine.submit(0, "store", blocks, chunks, positions)
        engine.wait_all()
        saved = [t[torch.from_numpy(blocks).to(self.device)].clone() for t in self.kv]
        other = self.rng.permutation(self.num_blocks)[:n]
        engine.submit(1, "load", other, chunks, positions)
        engine.wait_all()
        index = torch.from_numpy(other).to(self.device)
        failed = [engine.job_error(j) for j in (0, 1)]  # a checksum mismatch fails it too
        return all(torch.equal(t[index], s) for t, s in zip(self.kv, saved, strict=True)) \
            and failed == [None, None]

    def run(self) -> dict[str, Any]:
        a = self.args
        out: dict[str, Any] = {"rank": self.rank, "device": torch.cuda.get_device_name(),
                               "rows": []}
        with host_registered(self.region):
            span = min(a.link_bytes, self.region.numel())
            gpu = torch.empty(span, dtype=torch.uint8, device=self.device)
            out["link_GBps"] = link_rate(self.region[:span], gpu, 5)
            del gpu
            configs = [(b, None, i) for b in a.backend for i in a.integrity]
            configs += [("triton", k, a.integrity[0]) for k in a.sweep_programs]
            mm = None
            if a.matmul:
                mm = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=self.device)
                matmul_tflops(mm, 5)  # cuBLAS set-up, untimed
                out["matmul_TFLOPs_alone"] = matmul_tflops(mm, MATMUL_DURING)
            for backend, kernel, integrity in configs:
                engine = build_engine(backend, self.kv, self.region, self.layouts[integrity],
                                      self.chunk_count, kernel, a.priority)
                self.fill(engine)
                label = backend if kernel is None else f"triton@{kernel}"
                for n in a.blocks:
                    for direction in ("store", "load"):
                        row = {"backend": label, "engine": engine.name, "blocks": n,
                               "layer_groups": a.layer_groups if direction == "load" else 0,
                               "integrity": "on" if integrity else "off",
                               "direction": direction, "bytes": n * self.job_bytes,
                               **self.measure(engine, n, direction)}
                        row["mismatches"] = engine.mismatches - self.mismatches
                        row["ratio"] = row["GBps"] / out["link_GBps"][direction]
                        if mm is not None:
                            alone, row["matmul_TFLOPs"], row["GBps_during"] = self.during(
                                engine, mm, n, direction)
                            row["matmul_kept"] = row["matmul_TFLOPs"] / alone
                        out["rows"].append(row)
                    out["rows"][-1]["verified"] = out["rows"][-2]["verified"] = \
                        self.verify(engine, n)
                engine.close()
            if a.contention:
                out["contention"] = self.contention()
        return out

    def during(self, engine: Any, mm: torch.Tensor, n: int, direction: str
               ) -> tuple[float, float, float]:
        """Matmul TFLOP/s alone (measured right before), then while jobs of ``n`` blocks copy
        without a pause (two in flight, the next submitted as one finishes), and the copies'
        GB/s over the same window."""
        jobs = [make_job(self.rng, n, self.num_blocks, self.chunk_count, self.args.bpc,
                         self.args.pattern) for _ in range(4)]
        alone = matmul_tflops(mm, MATMUL_DURING)  # just before: GPU clocks drift over a run
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        free = torch.cuda.Event()  # the copies depend on nothing the matmuls do
        free.record()
        start.record()
        for _ in range(MATMUL_DURING):
            mm @ mm
        end.record()
        t0, submitted, finished, last = time.perf_counter(), 0, 0, 0.0
        while not end.query():
            if submitted - finished < 2:
                self.submit(engine, submitted, direction, jobs[submitted % len(jobs)],
                            after=free)
                submitted += 1
            done = len(engine.poll())
            if done:
                finished, last = finished + done, time.perf_counter()
        window = max(last - t0, 1e-9)  # copies ran back to back until the last one finished
        engine.wait_all()
        tflops = MATMUL_DURING * 2 * MATMUL_N**3 / (start.elapsed_time(end) / 1e3) / 1e12
        return alone, tflops, finished * n * self.job_bytes / window / 1e9

    def contention(self) -> dict[str, float]:
        """Microseconds from submit to done of a 16-block load queued behind ~50 ms of matmuls
        that it does not depend on, on a normal and a high-priority copy stream, and idle."""
        from offload.transfer.kernel import TritonEngine

        mm = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=self.device)
        matmul_tflops(mm, 5)
        out = {}
        for label, priority in (("normal", 0), ("high", -1)):
            engine = TritonEngine(self.kv, self.region, self.layout, self.chunk_count,
                                  priority=priority)
            samples, idle = [], []
            for _ in range(5):
                job = make_job(self.rng, 16, self.num_blocks, self.chunk_count, self.args.bpc,
                               "scattered")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.submit(0, "load", *job)
                engine.wait_all()
                idle.append(time.perf_counter() - t0)
                free = torch.cuda.Event()
                free.record()
                for _ in range(40):
                    mm @ mm
                t0 = time.perf_counter()
                engine.submit(1, "load", *job, after=free)
                engine.wait_all()
                samples.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
            out[f"{label}_busy_us"] = statistics.median(samples) * 1e6
            out[f"{label}_idle_us"] = statistics.median(idle) * 1e6
            engine.close()
        return out


def rank_result(rank: int, args: argparse.Namespace, barrier: Any) -> dict[str, Any]:
    if args.stage_programs is not None:  # in the rank's own process
        import offload.transfer.kernel as kernel  # read at every staged launch

        kernel.STAGE_PROGRAMS = args.stage_programs
    return Rank(args, rank, barrier).run()


def print_table(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    print(f"{2 * args.layers} tensors x {format_size(args.page_bytes)} pages, layout "
          f"{args.layout}, pattern {args.pattern}, {args.bpc} blocks per chunk"
          + (f", loads in {args.layer_groups} layer groups" if args.layer_groups else ""))
    print(f"{'rank':>4} {'backend':>12} {'path':>11} {'integ':>5} {'blocks':>6} {'bytes':>9} "
          f"{'dir':>5} {'GB/s':>6} {'ratio':>5} {'sub_us':>7} {'b2b_us':>7} {'wall_us':>8} "
          f"{'mm_TF':>5} {'mm_kept':>7} {'during':>6} ok")
    for r in results:
        for row in r["rows"]:
            mm = row.get("matmul_TFLOPs")
            kept = "" if mm is None else f"{row['matmul_kept']:.3f}"
            link = r["link_GBps"][row["direction"]]
            during = "" if mm is None else f"{row['GBps_during'] / link:.2f}"
            print(f"{r['rank']:>4} {row['backend']:>12} {row['path']:>11} {row['integrity']:>5} "
                  f"{row['blocks']:>6} {format_size(row['bytes']):>9} {row['direction']:>5} "
                  f"{row['GBps']:6.1f} {row['ratio']:5.2f} {row['submit_us']:7.0f} "
                  f"{row['b2b_us']:7.0f} {row['wall_us']:8.0f} "
                  f"{'' if mm is None else f'{mm:.0f}':>5} {kept:>7} {during:>6} "
                  f"{'y' if row['verified'] and not row['mismatches'] else 'NO'}")
        link = r["link_GBps"]
        print(f"{r['rank']:>4} {r['device']}: link (one pinned buffer) store {link['store']:.1f} "
              f"/ load {link['load']:.1f} GB/s"
              + (f"; matmul alone {r['matmul_TFLOPs_alone']:.0f} TFLOP/s"
                 if "matmul_TFLOPs_alone" in r else ""))
        off = {(x["backend"], x["blocks"], x["direction"]): x for x in r["rows"]
               if x["integrity"] == "off"}
        on: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
        for x in r["rows"]:
            if x["integrity"] == "on" and (x["backend"], x["blocks"], x["direction"]) in off:
                on.setdefault((x["backend"], x["blocks"], x["direction"]), []).append(x)
        if on:
            print(f"{r['rank']:>4} integrity on (mean of its runs) vs off: GB/s ratio, added "
                  "submit_us, added b2b_us")
            for key, runs in on.items():
                base = off[key]

                def mean(field: str, runs: list[dict[str, Any]] = runs) -> float:
                    return statistics.mean(x[field] for x in runs)

                print(f"{r['rank']:>4} {key[0]:>12} {key[1]:>6} {key[2]:>5} "
                      f"{mean('GBps') / base['GBps']:6.3f} "
                      f"{mean('submit_us') - base['submit_us']:+7.1f} "
                      f"{mean('b2b_us') - base['b2b_us']:+7.1f}")
        if "contention" in r:
            print(f"{r['rank']:>4} 16-block load behind 40 matmuls (us): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in r["contention"].items()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=80, help="layers; tensors = 2 x layers")
    p.add_argument("--page-bytes", type=flag_type(parse_size, "--page-bytes"), default="16KiB",
                   help="bytes of one block in one tensor")
    p.add_argument("--blocks", default="1,16,128,1024", help="job sizes in blocks")
    p.add_argument("--backend", default="hybrid,triton,copy_engine",
                   help="comma-separated backends to measure")
    p.add_argument("--layout", default="separate", choices=("separate", "views"),
                   help="separate [blocks, page] tensors or K/V views of [blocks, 2, page]")
    p.add_argument("--pattern", default="chunks", choices=("scattered", "chunks", "runs"))
    p.add_argument("--bpc", type=int, default=16, help="blocks per chunk")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--link-bytes", type=flag_type(parse_size, "--link-bytes"), default="1GiB")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--matmul", action="store_true")
    p.add_argument("--layer-groups", type=int, default=0, metavar="G",
                   help="submit every timed load layer-wise in G groups (0: whole)")
    p.add_argument("--contention", action="store_true")
    p.add_argument("--sweep-programs", default="",
                   help="kernel settings to try, comma-separated "
                        "PROGRAMS[:STEP_KIB[:WORD[:TILE_KIB[:WARPS]]]]")
    p.add_argument("--host-buffer", default="memfd", choices=("memfd", "torch-empty"),
                   help="host memory: a page-aligned memfd mapping like the tier's regions, or "
                        "a 64-byte-aligned torch.empty buffer (the kernel loses 6-10%% on it)")
    p.add_argument("--integrity", choices=("on", "off", "both"), default="on",
                   help="page checksums on, off, or each backend both ways in the same run")
    p.add_argument("--stage-programs", type=int, default=None, metavar="N",
                   help="programs of the staged path's GPU pass (default: the library's "
                        "STAGE_PROGRAMS), to sweep it")
    p.add_argument("--priority", type=int, default=0,
                   help="the engines' CUDA stream priority (lower is higher, as in "
                        "torch.cuda.Stream; -1 is high on current GPUs)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.blocks = [int(b) for b in args.blocks.split(",")]
    args.backend = [b for b in args.backend.split(",") if b]
    args.sweep_programs = [x for x in args.sweep_programs.split(",") if x]
    # both: on, off, on again, so a drift over the run does not pass for the checksums' cost
    args.integrity = {"on": [True], "off": [False], "both": [True, False, True]}[args.integrity]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_engine: needs CUDA (no CUDA device visible); nothing measured",
              file=sys.stderr)
        return 2
    results = run_ranks(rank_result, args.ranks, args)
    if args.json:
        write_json(args.json, {"args": dict(vars(args)), "results": results}, "--json")
    print_table(args, results)
    return 0 if all(row["verified"] and not row["mismatches"] for r in results
                    for row in r["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
