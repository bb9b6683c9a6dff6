"""File tier throughput against parallel ``dd`` with O_DIRECT on the same disk, same run.

Writes ``--bytes`` of page-aligned host rows (``--row-bytes`` each, random bytes) through a
`FileTier` with ``--threads`` I/O threads (one file per row: header + row in one ``pwritev``,
``fdatasync``, rename, directory ``fsync``), then reads them all back into host rows (headers and
crc32c checked).  The baseline moves the same bytes with ``--threads`` parallel ``dd`` streams:
``dd if=ROWS skip=FIRST oflag=direct conv=fsync bs=ROW`` to one file each, where ROWS is the
host rows' own memfd (through ``/proc/PID/fd``: the very bytes the tier writes, not zeros,
which a virtual disk may store cheaply), then ``dd iflag=direct`` back to /dev/null.  The
tier's figures count payload bytes, like dd's.  Order per repetition: dd write, tier write, dd
read, tier read; the best of ``--reps`` is reported, with every repetition in the JSON.
DESIGN.md section 8's target: tier >= 0.9 x dd.

    python scripts/bench_fs.py --dir /tmp --bytes 1GiB --row-bytes 16MiB --threads 8 --json o.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import crc32c
import numpy as np

from offload.sizes import format_size, parse_size
from offload.tiers import FileTier


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rows = args.bytes // args.row_bytes
    if rows < args.threads or args.row_bytes % 4096:
        sys.exit(f"--bytes {args.bytes} must hold at least --threads {args.threads} rows of "
                 f"--row-bytes {args.row_bytes} (a multiple of 4096)")
    source = os.memfd_create("bench-fs-rows", os.MFD_CLOEXEC)  # dd reads the rows from it
    os.ftruncate(source, rows * args.row_bytes)
    host = mmap.mmap(source, rows * args.row_bytes)
    np.frombuffer(host, dtype=np.uint64)[:] = np.random.default_rng(0).integers(
        0, 2**63, size=len(host) // 8, dtype=np.uint64)
    views = [memoryview(host)[i * args.row_bytes:(i + 1) * args.row_bytes] for i in range(rows)]
    expected = [crc32c.crc32c(v) for v in views]
    work = tempfile.mkdtemp(prefix="bench-fs-", dir=args.dir)
    reps: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            reps.append(_one_rep(work, rep, views, expected, source, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.close(source)
    result = _summary(args, rows, reps)
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["verified"] else 1


def _one_rep(work: str, rep: int, views: list[memoryview], expected: list[int], source: int,
             args: argparse.Namespace) -> dict[str, Any]:
    payload = len(views) * args.row_bytes
    dd_dir = os.path.join(work, f"dd{rep}")
    os.mkdir(dd_dir)
    dd_write = _dd(dd_dir, len(views), args, source=source)
    tier_root = os.path.join(work, f"tier{rep}")
    os.mkdir(tier_root)
    with FileTier(tier_root, len(views) * (args.row_bytes + 4096), {"bench": rep},
                  args.row_bytes, io_threads=args.threads) as tier:
        start = time.perf_counter()
        spills = [tier.put(i, view) for i, view in enumerate(views)]
        stored = all(s.stored.result() for s in spills)
        tier_write = time.perf_counter() - start
        dd_read = _dd(dd_dir, len(views), args)
        for view in views:
            view[:64] = bytes(64)  # spoil every row: the read must bring the bytes back
        start = time.perf_counter()
        reads = [tier.get(i, view) for i, view in enumerate(views)]
        hits = all(r.result() for r in reads)
        tier_read = time.perf_counter() - start
        verified = stored and hits and [crc32c.crc32c(v) for v in views] == expected
        report = tier.to_json()
    shutil.rmtree(dd_dir)
    shutil.rmtree(tier_root)
    seconds = {"tier_write": tier_write, "dd_write": dd_write, "tier_read": tier_read,
               "dd_read": dd_read}
    return {**{f"{k}_GBps": payload / s / 1e9 for k, s in seconds.items()},
            "verified": verified, "fs_tier": report}


def _dd(directory: str, rows: int, args: argparse.Namespace, source: int | None = None
        ) -> float:
    """Seconds for ``--threads`` dd streams to move ``rows`` rows together: with ``source``
    (the rows' memfd) stream ``i`` writes its share of the rows to its own file, else it reads
    that file back."""
    counts = [rows // args.threads + (i < rows % args.threads) for i in range(args.threads)]
    firsts = [sum(counts[:i]) for i in range(args.threads)]
    commands = []
    for i, (first, count) in enumerate(zip(firsts, counts, strict=True)):
        path = os.path.join(directory, f"stream{i}")
        if source is not None:
            commands.append(["dd", f"if=/proc/{os.getpid()}/fd/{source}", f"skip={first}",
                             f"of={path}", f"bs={args.row_bytes}", f"count={count}",
                             "oflag=direct", "conv=fsync", "status=none"])
        else:
            commands.append(["dd", f"if={path}", "of=/dev/null", f"bs={args.row_bytes}",
                             f"count={count}", "iflag=direct", "status=none"])
    start = time.perf_counter()
    procs = [subprocess.Popen(c) for c in commands]
    if any(p.wait() for p in procs):
        sys.exit(f"dd failed: {' '.join(commands[0])}")
    return time.perf_counter() - start


def _summary(args: argparse.Namespace, rows: int, reps: list[dict[str, Any]]) -> dict[str, Any]:
    best = {k: round(max(r[k] for r in reps), 3) for k in
            ("tier_write_GBps", "dd_write_GBps", "tier_read_GBps", "dd_read_GBps")}
    return {"dir": args.dir, "bytes": rows * args.row_bytes, "row_bytes": args.row_bytes,
            "rows": rows, "threads": args.threads, "reps": len(reps),
            "o_direct": reps[0]["fs_tier"]["o_direct"], **best,
            "write_ratio": round(best["tier_write_GBps"] / best["dd_write_GBps"], 3),
            "read_ratio": round(best["tier_read_GBps"] / best["dd_read_GBps"], 3),
            "verified": all(r["verified"] for r in reps), "runs": reps}


def _print(r: dict[str, Any]) -> None:
    print(f"{format_size(r['bytes'])} in {r['rows']} rows of {format_size(r['row_bytes'])}, "
          f"{r['threads']} threads / dd streams, {r['dir']} "
          f"({'O_DIRECT' if r['o_direct'] else 'buffered'}), best of {r['reps']}")
    print("| direction | tier GB/s | dd GB/s | tier / dd |")
    print("| --- | --- | --- | --- |")
    for d in ("write", "read"):
        print(f"| {d} | {r[f'tier_{d}_GBps']:.3f} | {r[f'dd_{d}_GBps']:.3f} | "
              f"**{r[f'{d}_ratio']:.2f}** |")
    print(f"verified: {r['verified']}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp", help="filesystem to measure (a temp dir inside)")
    p.add_argument("--bytes", type=lambda s: parse_size(s, "--bytes"), default=parse_size("1GiB"))
    p.add_argument("--row-bytes", type=lambda s: parse_size(s, "--row-bytes"),
                   default=parse_size("16MiB"))
    p.add_argument("--threads", type=int, default=8, help="tier I/O threads = dd streams")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", help="write the result there")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
