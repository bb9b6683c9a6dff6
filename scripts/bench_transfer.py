"""Scattered-block transfer throughput against the same run's PCIe rate (DESIGN.md section 8).

For each block size, both directions, a random permutation of GPU blocks to host pages over
``--total-bytes`` of a registered host buffer, timed with CUDA events (warm-up first, median of
``--reps``):

* ours       the triton engine (one kernel launch per job);
* per_block  one ``copy_`` per block (timed on a sample of ``--per-block-max`` blocks);
* single     one ``copy_`` of the same bytes as one buffer: the link's rate in this run.

Then the cost to compute: a bf16 matmul's TFLOP/s alone, while the triton engine copies, and
while the copy engines copy.  ``--ranks N`` runs N processes at once (GPU ``rank % devices``),
phases aligned by a barrier, to see contention on the host link.

    python scripts/bench_transfer.py --sizes 4KiB,64KiB,1MiB --total-bytes 1GiB --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from bench_ranks import run_ranks  # this script's folder

from offload.bounds import flag_type
from offload.observe.report import write_json
from offload.sizes import format_size, parse_size, parse_sizes
from offload.system.nameless import memfd_mapping
from offload.transfer import Direction, SlotLayout
from offload.transfer.cuda import DEFAULT_COPY_PROGRAMS, PerBlockEngine, StreamEngine
from offload.transfer.registration import host_registered

DEFAULT_SIZES = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB"
MATMUL_N = 8192
BLOCKS_PER_CHUNK = 16


@dataclass
class Row:
    size: int
    direction: str
    ours_GBps: float
    per_block_GBps: float
    single_GBps: float
    matmul_TFLOPs_during_ours: float
    submit_ms: float  # host time of one submit (checks, index upload, launch)
    verified: bool

    @property
    def ratio(self) -> float:
        return self.ours_GBps / self.single_GBps


@dataclass
class RankResult:
    rank: int
    device: str
    rows: list[Row] = field(default_factory=list)
    matmul_TFLOPs_alone: float = 0.0
    matmul_TFLOPs_during_copy_engine: float = 0.0


def timed(fn: Callable[[], object], reps: int, warmup: int = 2,
          barrier: Any = None) -> float:
    """Median seconds of ``fn`` between CUDA events on the current stream (``fn`` must leave
    its work ordered before the current stream's next event)."""
    samples = []
    for i in range(warmup + reps):
        if barrier is not None:
            barrier.wait()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def engine_copy(engine: StreamEngine, direction: str, job: tuple[np.ndarray, ...],
                wait: bool = True) -> Callable[[], None]:
    """One job through ``engine``; with ``wait`` the current stream waits for it (so events
    time it) and the job is drained, else it is only queued."""
    def run() -> None:
        engine.submit(0, direction, *job)  # type: ignore[arg-type]
        if wait:
            torch.cuda.current_stream().wait_stream(engine.stream)
            engine.wait_all()
    return run


def matmul_seconds(a: torch.Tensor, count: int, during: Callable[[], None] | None = None
                   ) -> float:
    """Seconds for ``count`` matmuls on the current stream, started right after ``during``
    queued its copy on another stream."""
    torch.cuda.synchronize()
    if during is not None:
        during()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        a @ a
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


@dataclass
class Bench:
    """One rank's buffers and settings, shared by every block size."""

    args: argparse.Namespace
    barrier: Any
    gpu: torch.Tensor  # the KV data, total bytes
    check: torch.Tensor  # where stored blocks are loaded back for verification
    host: torch.Tensor  # registered host buffer, total bytes
    a: torch.Tensor  # matmul operand
    mm_count: int  # matmuls lasting about one single-buffer copy
    rng: np.random.Generator

    def time(self, fn: Callable[[], object], reps: int | None = None, warmup: int = 2) -> float:
        return timed(fn, reps or self.args.reps, warmup, self.barrier)

    def tflops(self, during: Callable[[], None] | None = None, reps: int = 3) -> float:
        """Median matmul rate over ``reps`` runs, each started just after ``during``."""
        seconds = statistics.median(
            matmul_seconds(self.a, self.mm_count, during) for _ in range(reps))
        return self.mm_count * 2 * MATMUL_N**3 / seconds / 1e12


def bench_size(b: Bench, size: int) -> list[Row]:
    """Both directions at one block size; each ends verified (the KV data is unchanged after
    the round trip and equals what the triton engine loads back from the host)."""
    from offload.transfer.kernel import TritonEngine  # imports triton: needs CUDA

    n = b.gpu.numel() // size // BLOCKS_PER_CHUNK * BLOCKS_PER_CHUNK
    layout = SlotLayout(BLOCKS_PER_CHUNK * size, 0, BLOCKS_PER_CHUNK, (size,), (0,))
    kv, kv_check = b.gpu[: n * size].view(n, size), b.check[: n * size].view(n, size)
    region = b.host[: n * size]
    chunks = n // BLOCKS_PER_CHUNK
    programs: dict[Direction, int] = {"load": b.args.load_programs,
                                      "store": b.args.store_programs}
    checker = TritonEngine([kv_check], region, layout, chunks, programs)
    if b.args.backend == "copy_engine":
        from offload.transfer.batch_copy import BatchCopyEngine

        ours: StreamEngine = BatchCopyEngine([kv], region, layout, chunks)
    elif b.args.backend == "hybrid":
        from offload.transfer.hybrid import HybridEngine

        ours = HybridEngine([kv], region, layout, chunks, programs)
    else:
        ours = TritonEngine([kv], region, layout, chunks, programs,
                            b.args.num_warps)
    slow = PerBlockEngine([kv], region, layout, chunks)
    slots = b.rng.permutation(n)
    job = (b.rng.permutation(n), slots // BLOCKS_PER_CHUNK, slots % BLOCKS_PER_CHUNK)
    sample = tuple(x[: b.args.per_block_max] for x in job)
    rows = []
    for direction in ("store", "load"):
        dst, src = (region, kv.view(-1)) if direction == "store" else (kv.view(-1), region)
        single = b.time(partial(dst.copy_, src, non_blocking=True))
        mine = b.time(engine_copy(ours, direction, job))
        per_block = b.time(engine_copy(slow, direction, sample), max(1, b.args.reps // 2), 1)
        tflops = b.tflops(engine_copy(ours, direction, job, wait=False))
        ours.wait_all()
        submitted = time.perf_counter()
        engine_copy(ours, direction, job, wait=False)()
        host_ms = (time.perf_counter() - submitted) * 1e3
        ours.wait_all()
        if direction == "store":
            engine_copy(checker, "load", job)()
        rows.append(Row(size, direction, n * size / mine / 1e9,
                        len(sample[0]) * size / per_block / 1e9, n * size / single / 1e9,
                        tflops, host_ms, torch.equal(kv_check, kv)))
    for engine in (ours, checker, slow):
        engine.close()
    return rows


def bench_rank(rank: int, args: argparse.Namespace, barrier: Any = None) -> RankResult:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    gpu = torch.randint(0, 256, (args.total_bytes,), dtype=torch.uint8, device=device)
    mapping = memfd_mapping(f"bench-transfer-{rank}", args.total_bytes)  # page-aligned
    host = mapping.tensor[:args.total_bytes].fill_(1)  # first touch, untimed
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=device)
    mm_one = matmul_seconds(a, 10) / 10
    result = RankResult(rank, torch.cuda.get_device_name(device))
    with host_registered(host):
        single = timed(lambda: host.copy_(gpu, non_blocking=True), args.reps, 2, barrier)
        b = Bench(args, barrier, gpu, torch.empty_like(gpu), host, a,
                  max(1, int(single / mm_one)), np.random.default_rng(rank))
        side = torch.cuda.Stream(device)

        def copy_engine_copy() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                host.copy_(gpu, non_blocking=True)

        result.matmul_TFLOPs_alone = b.tflops()
        result.matmul_TFLOPs_during_copy_engine = b.tflops(copy_engine_copy)
        for size in args.sizes:
            result.rows += bench_size(b, size)
    return result


def rank_result(rank: int, args: argparse.Namespace, barrier: Any) -> dict[str, Any]:
    return asdict(bench_rank(rank, args, barrier))


def print_table(results: list[dict[str, Any]]) -> None:
    head = (f"{'rank':>4} {'block':>9} {'dir':>5} {'ours':>7} {'per_blk':>7} {'single':>7} "
            f"{'ratio':>6} {'mm_kept':>7} {'sub_ms':>6} ok")
    print(head)
    for r in results:
        for row in r["rows"]:
            print(f"{r['rank']:>4} {format_size(row['size']):>9} {row['direction']:>5} "
                  f"{row['ours_GBps']:7.1f} {row['per_block_GBps']:7.1f} "
                  f"{row['single_GBps']:7.1f} {row['ours_GBps'] / row['single_GBps']:6.2f} "
                  f"{row['matmul_TFLOPs_during_ours'] / r['matmul_TFLOPs_alone']:7.2f} "
                  f"{row['submit_ms']:6.2f} "
                  f"{'y' if row['verified'] else 'NO'}")
        print(f"{r['rank']:>4} {r['device']}: bf16 {MATMUL_N}^3 matmul "
              f"{r['matmul_TFLOPs_alone']:.0f} TFLOP/s alone, "
              f"{r['matmul_TFLOPs_during_copy_engine']:.0f} during a copy-engine copy "
              "(GB/s columns; mm_kept = the matmul's rate during ours / alone; sub_ms = host "
              "time of a submit)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=flag_type(parse_sizes, "--sizes"), default=DEFAULT_SIZES,
                        help=f"comma-separated block sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--total-bytes", type=flag_type(parse_size, "--total-bytes"),
                        default="1GiB", help="bytes moved per size and rep")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--per-block-max", type=int, default=4096,
                        help="blocks in the per-block sample (one copy_ each is slow)")
    parser.add_argument("--ranks", type=int, default=1, help="processes running at once")
    for direction, programs in DEFAULT_COPY_PROGRAMS.items():
        parser.add_argument(f"--{direction}-programs", type=int, default=programs,
                            help=f"programs (SMs) of the triton kernel for a {direction} "
                            f"(default {programs})")
    parser.add_argument("--backend", default="hybrid",
                        choices=("hybrid", "triton", "copy_engine"),
                        help="our engine: hybrid (the tier's default), the Triton kernel alone "
                             "or one cuMemcpyBatchAsync per job")
    parser.add_argument("--num-warps", type=int, default=None,
                        help="warps per program of the triton kernel (default: the engine's)")
    parser.add_argument("--json", metavar="PATH", help="write the results there")
    args = parser.parse_args(argv)
    sizes = args.sizes or [0]
    if min(sizes) <= 0 or args.total_bytes < BLOCKS_PER_CHUNK * max(sizes):
        parser.error(f"--total-bytes must hold {BLOCKS_PER_CHUNK} blocks of the largest size")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_transfer: needs CUDA (no CUDA device visible); nothing measured",
              file=sys.stderr)
        return 2
    results = run_ranks(rank_result, args.ranks, args)
    if args.json:
        write_json(args.json, {"total_bytes": args.total_bytes, "ranks": args.ranks,
                               "programs": {"load": args.load_programs,
                                            "store": args.store_programs},
                               "results": results}, "--json")
    print_table(results)
    return 0 if all(row["verified"] for r in results for row in r["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
