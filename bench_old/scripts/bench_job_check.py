# SPDX-License-Identifier: Apache-2.0
"""Time the job check on this host's CPU: the native check every engine tries first
(`offload.transfer.fast_check`, one C call) against the numpy fallback (`check_job`), on jobs
of scattered destinations given as tuples and as int64 arrays.  Prints microseconds per job and
the fallback's cost as a multiple of the native check's.

    python scripts/bench_job_check.py --entries 1,16,1024,65536
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numpy as np

from offload.transfer.fast_check import FastCheck, checker_library
from offload.transfer.layout import SlotLayout, UniqueDestinations, check_job


def per_call_us(fn: Callable[[], object], seconds: float) -> float:
    """Mean microseconds of ``fn`` over at least ``seconds`` (after one warm-up call)."""
    fn()
    calls, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds:
        fn()
        calls += 1
    return elapsed / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", default="1,16,1024,65536", help="job sizes, comma-separated")
    p.add_argument("--blocks", type=int, default=100_000, help="GPU blocks (load space)")
    p.add_argument("--chunks", type=int, default=20_000, help="host chunks (store space)")
    p.add_argument("--bpc", type=int, default=16, help="blocks per chunk")
    p.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    args = p.parse_args()
    layout = SlotLayout(row_stride=args.bpc * 16384, slot_offset=0, blocks_per_chunk=args.bpc,
                        page_bytes=(16384,), tensor_offsets=(0,))
    space = args.chunks * args.bpc
    lib = checker_library()
    print(f"store jobs over {space} host pages; native check "
          f"{'on' if lib is not None else 'off (no compiler or Python headers)'}")
    print(f"{'entries':>8} {'given as':>8} {'numpy us':>10} {'native us':>10} {'ratio':>7}")
    for n in (int(e) for e in args.entries.split(",")):
        rng = np.random.default_rng(n)
        blocks = rng.choice(args.blocks, n, replace=False)
        host = rng.choice(space, n, replace=False)
        columns = (blocks, host // args.bpc, host % args.bpc)
        for kind in ("tuples", "arrays"):
            job = columns if kind == "arrays" else tuple(tuple(c.tolist()) for c in columns)
            unique = UniqueDestinations("host_pages", space, args.bpc)
            fallback = per_call_us(functools.partial(
                check_job, layout, *job, num_blocks=args.blocks, chunk_count=args.chunks,
                unique=unique), args.seconds)
            native = None
            if lib is not None:
                fast = FastCheck(lib, layout, args.blocks, args.chunks,
                                 {"store": UniqueDestinations("host_pages", space, args.bpc)})
                native = per_call_us(functools.partial(fast.check, "store", *job),
                                     args.seconds)
            shown = f"{native:10.1f} {fallback / native:7.2f}" if native else f"{'-':>10} {'-':>7}"
            print(f"{n:8d} {kind:>8} {fallback:10.1f} {shown}")


if __name__ == "__main__":
    main()
