"""Host registrations one after another, each timed: does a process's Nth registration cost
more than its first?

Background set-up registers a region in units of ~8 MiB, one call each (DESIGN.md section
3.9).  At 100 GiB on one rank (12,790 calls) one call per set-up took 35-168 ms, most often
55-68 GiB in, whatever the unit's size (docs/BENCHMARKS.md, "The long registration waits for
the GPU side, not for the host").  This script registers as set-up does without the tier -- by
default no engine, no kernel, no probe -- so a stall it shows is the driver's: it maps
``--bytes`` of anonymous memory (or one memfd with ``--memory memfd``), populates every page,
then registers it in pieces of each of ``--units`` in order, timing each call, and lists the
calls over ``--slow-ms`` with their number among the process's registrations (from 1, the baseline's
first) and the bytes of that size registered before them.  Its baseline, in the same run and
the same memory, is one registration of the whole range (as the blocking create registers a
private region), and each unit's GiB/s is printed against it.  Every range is unregistered
before the next unit size is tried, and the memory is unmapped at the end.  What one size left
behind in the driver may change the next: to compare sizes, run one per process.

    python3 tools/bench_registrations.py --bytes 64GiB --units 4MiB

Set-up does two things this does not by default: it registers nothing larger first, and its
pre-fault threads populate the units ahead while they are registered.  ``--no-whole`` leaves
out the baseline; ``--populate beside`` runs set-up's own `BackgroundSetup` over the memory
instead (one unit size, no baseline), so a stall that needs either shows here too:

    python3 tools/bench_registrations.py --bytes 100GiB --units 8MiB --populate beside

In set-up the engine's own thread launches kernels beside the registrations; ``--probe`` runs
`bench_startup.py`'s launch probe (a one-element kernel launched and waited for every
millisecond, in the primary context) while the script registers, and prints its longest wait
and the registration it overlapped.

``--before triton`` compiles, loads and runs a one-line Triton kernel in the process before
anything is registered, as the tier's JIT does with its copy kernel; the stall needs it
(docs/BENCHMARKS.md, "The registration stall follows Triton"), and the other choices of
``--before`` take Triton's steps apart:

    python3 tools/bench_registrations.py --bytes 100GiB --populate beside --probe --before triton

On a machine without CUDA (``--device cpu``) the registrations are the recording stand-in:
it checks the script, not the driver.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import itertools
import mmap
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload.bounds import flag_type  # noqa: E402
from offload.config import TierConfig  # noqa: E402
from offload.observe.report import write_json  # noqa: E402
from offload.region.background import BackgroundSetup  # noqa: E402
from offload.region.geometry import ByteRange, RegionGeometry, setup_units  # noqa: E402
from offload.region.pin import Pinner, Registrar, choose_registrar  # noqa: E402
from offload.region.prefault import madvise_populate, touch_pages  # noqa: E402
from offload.sizes import (  # noqa: E402
    format_size,
    parse_size,
    parse_sizes,  # noqa: E402
)
from offload.system.cuda_driver import driver_call  # noqa: E402
from offload.system.nameless import memfd_mapping  # noqa: E402
from offload.system.shm import Mapping  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    needs_cuda = [name for name, given in (("probe", args.probe),
                                           ("before", args.before != "nothing")) if given]
    if needs_cuda and device.type != "cuda":
        print(f"bench_registrations.py: --{needs_cuda[0]} launches kernels and needs CUDA, not "
              f"{device}; leave it out", file=sys.stderr)
        return 2
    if args.before != "nothing":
        _run_before(args.before, device)
    mapping = (Mapping.anonymous(args.bytes) if args.memory == "anonymous"
               else memfd_mapping("bench-registrations", args.bytes, args.threads))
    where = (f"on {device}"
             f"{' in a context of its own' if args.own_context and device.type == 'cuda' else ''}")
    timed: list[tuple[float, float]] = []  # every registration call: (perf_counter, seconds)
    probe, probe_began = None, 0.0
    try:
        probe = _start_probe(device) if args.probe else None
        populate_s = None
        if args.populate == "first":
            began = time.perf_counter()
            _populate(mapping, args.threads)
            populate_s = time.perf_counter() - began
            print(f"{format_size(mapping.size)} of {args.memory} memory populated in "
                  f"{populate_s:.2f} s; registering {where}", flush=True)
        else:
            print(f"{format_size(mapping.size)} of {args.memory} memory: populating and "
                  f"registering it as background set-up does, {where}", flush=True)
        registrar = choose_registrar(device, own_context=args.own_context)
        count = itertools.count(1)  # the process's registrations, the baseline's first
        try:
            probe_began = time.perf_counter()  # the probe's summary: from here on
            registrar.prepare()
            whole = (_register(registrar, mapping, mapping.size, args.slow_ms, count, timed)
                     if args.whole else None)
            if args.populate == "first":
                runs = [_register(registrar, mapping, unit, args.slow_ms, count, timed)
                        for unit in args.units]
            else:
                runs = [_register_beside(registrar, mapping, args.units[0], args.threads,
                                         args.slow_ms, count, timed)]
            own_context = registrar.own_context
        finally:
            registrar.close()
    finally:
        try:
            waits = probe.stop(timed, probe_began) if probe is not None else None
        finally:
            mapping.close()
    _print(whole, runs, args.slow_ms)
    if waits is not None:
        _print_probe(waits)
    if args.json:
        write_json(args.json, {
            "bytes": args.bytes, "memory": args.memory, "device": str(device),
            "own_context": own_context, "populate": args.populate, "populate_s": populate_s,
            "whole": whole, "units": runs, "probe": waits, "before": args.before}, "--json")
    return 0


def _populate(mapping: Mapping, threads: int) -> None:
    """Every page, from ``threads`` threads in 1 GiB pieces (ctypes lets go of the GIL)."""
    piece = 1 << 30

    def populate(offset: int) -> None:
        length = min(piece, mapping.size - offset)
        err = madvise_populate(mapping.address + offset, length)
        if err == errno.EINVAL:  # a kernel without the advice
            touch_pages(mapping.address + offset, length)
        elif err:
            raise OSError(err, f"populating the memory: {os.strerror(err)}")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(populate, range(0, mapping.size, piece)))


def _run_before(before: str, device: torch.device) -> None:
    """Do in this process what ``--before`` names, before anything is registered: what the
    tier's process does that the script's does not (its JIT compiles its copy kernel with
    Triton) and the alternatives to it."""
    torch.zeros(1, device=device)  # the primary context, current on this thread
    if before == "triton":  # compiled, loaded and run, as the tier's JIT does
        import add_one_kernel

        add_one_kernel.run(device)
    elif before == "triton-import":  # Triton's driver set up, nothing compiled
        import triton

        triton.runtime.driver.active.get_current_device()
    elif before == "cubin":  # Triton's compiled form, loaded by the driver alone, not run
        import subprocess

        child = Path(__file__).with_name("add_one_kernel.py")
        compiled = subprocess.run([sys.executable, str(child)], capture_output=True,
                                  timeout=600)
        if compiled.returncode != 0:
            raise RuntimeError(f"{child.name} exited with {compiled.returncode}: "
                               f"{compiled.stderr.decode(errors='replace')[-2000:]}")
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        driver_call("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(compiled.stdout))
        # with lazy module loading (CUDA 12's default) the function reaches the GPU here
        driver_call("cuModuleGetFunction", ctypes.byref(function), module, b"add_one")
    elif before == "nvrtc":  # a kernel of torch's own, compiled by NVRTC, and run
        plus_one = torch.cuda.jiterator._create_jit_fn(
            "template <typename T> T plus_one(T x) { return x + T(1); }")
        plus_one(torch.zeros(4096, device=device))
    torch.cuda.synchronize(device)
    print(f"before registering: {before} done", flush=True)


def _start_probe(device: torch.device) -> Any:
    """`bench_startup.py`'s launch probe on ``device``'s primary context (imported here: the
    script runs without it on a machine without CUDA)."""
    from bench_startup import LaunchProbe

    if device.index is None:  # the probe's thread sets its device: name it
        device = torch.device(device.type, torch.cuda.current_device())
    return LaunchProbe(device)


def _register(registrar: Registrar, mapping: Mapping, unit: int, slow_ms: float,
              count: Iterator[int], timed: list[tuple[float, float]]) -> dict[str, Any]:
    """Register the mapping in ``unit`` pieces, in order, each call timed and numbered from
    ``count`` (and added to ``timed``); then unregister every piece (timed as a whole; all of
    them, whatever fails)."""
    calls: list[tuple[int, float]] = []
    pinner = Pinner(registrar, mapping.address)
    try:
        began = time.perf_counter()
        for offset in range(0, mapping.size, unit):
            start = time.perf_counter()
            pinner.pin(ByteRange(offset, min(unit, mapping.size - offset)))
            took = time.perf_counter() - start
            calls.append((next(count), took))
            timed.append((start, took))
        seconds = time.perf_counter() - began
    finally:
        unregistered = time.perf_counter()
        pinner.unpin_all()
        unregister_s = time.perf_counter() - unregistered
    return _figures(unit, calls, mapping.size, seconds, unregister_s, slow_ms)


def _register_beside(registrar: Registrar, mapping: Mapping, unit: int, threads: int,
                     slow_ms: float, count: Iterator[int], timed: list[tuple[float, float]]
                     ) -> dict[str, Any]:
    """Populate and register the mapping (rows of ``unit``; a tail short of one is left out)
    as background set-up does, with `BackgroundSetup` itself: ``threads`` pre-fault threads
    write-fault units ahead at idle priority while its pin thread registers each unit once it
    is populated.  Its calls, numbered from ``count`` (and added to ``timed``); then unregister
    every piece."""
    rows = mapping.size // unit
    geometry = RegionGeometry("private", rows, unit, 0, unit, mmap.PAGESIZE)
    units = setup_units(geometry, TierConfig(cpu_bytes_per_node=mapping.size), unit)
    pinner = Pinner(registrar, mapping.address)
    setup = BackgroundSetup(mapping.address, units, pinner, threads, lambda rows, stop: None)
    try:
        began = time.perf_counter()
        setup.start().wait()
        seconds = time.perf_counter() - began
        if setup.error is not None:
            raise RuntimeError(f"background set-up stopped: {setup.error}")
    finally:
        setup.stop()
        unregistered = time.perf_counter()
        pinner.unpin_all()
        unregister_s = time.perf_counter() - unregistered
    calls = [(next(count), took) for _, took in setup.calls]
    timed.extend(setup.calls)
    return _figures(unit, calls, geometry.total_bytes, seconds, unregister_s, slow_ms)


def _figures(unit: int, calls: list[tuple[int, float]], nbytes: int, seconds: float,
             unregister_s: float, slow_ms: float) -> dict[str, Any]:
    """One unit size's figures from its calls: (the process's call number, seconds)."""
    ordered = sorted(took for _, took in calls)
    slow = [(n, i * unit, 1e3 * took) for i, (n, took) in enumerate(calls)
            if 1e3 * took > slow_ms]
    return {"unit": unit, "calls": len(calls), "seconds": seconds,
            "GiBps": nbytes / seconds / (1 << 30) if seconds > 0 else float("inf"),
            "p50_ms": 1e3 * ordered[len(ordered) // 2], "max_ms": 1e3 * ordered[-1],
            "unregister_s": unregister_s, "slow": slow}


def _print(whole: dict[str, Any] | None, runs: list[dict[str, Any]], slow_ms: float) -> None:
    """One row per unit size, the whole-range registration first; GiB/s against it."""
    print(f"\n{'unit':>10}{'calls':>8}{'seconds':>9}{'GiB/s':>8}{'x whole':>9}{'p50 ms':>8}"
          f"{'max ms':>8}{'unreg s':>9}  calls over {slow_ms:g} ms: the process's call number "
          "(this size registered before)")
    for run in [whole, *runs] if whole is not None else runs:
        ratio = (run["GiBps"] / whole["GiBps"] if whole is not None and whole["GiBps"]
                 else float("nan"))
        slow = "; ".join(f"{i} ({format_size(before)}): {ms:.1f}"
                         for i, before, ms in run["slow"][:6])
        more = f" and {len(run['slow']) - 6} more" if len(run["slow"]) > 6 else ""
        name = "whole" if run is whole else format_size(run["unit"])
        print(f"{name:>10}{run['calls']:>8}{run['seconds']:>9.2f}{run['GiBps']:>8.1f}"
              f"{ratio:>9.2f}{run['p50_ms']:>8.2f}{run['max_ms']:>8.1f}"
              f"{run['unregister_s']:>9.2f}  {slow or '-'}{more}")


def _print_probe(waits: dict[str, Any]) -> None:
    """The launch probe's line: how long the engine's launches waited beside the calls."""
    if not waits.get("count"):
        print("\nprobe: no launch finished")
        return
    beside = (f"beside a registration of {waits['worst_call_ms']:.1f} ms"
              if waits["worst_call_ms"] else "beside no registration call")
    print(f"\nprobe (a one-element kernel launched and waited for every ms, primary context, "
          f"from the first registration to the last unregistration): {waits['count']} "
          f"launches, p50 {waits['p50_ms']:.3f} ms, worst {waits['max_ms']:.1f} ms at "
          f"{waits['worst_at_s']:.2f} s {beside}, {waits['over_2ms']} over 2 ms")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=flag_type(parse_size, "--bytes"), default="64GiB",
                   help="memory to register (default 64GiB)")
    p.add_argument("--units", type=flag_type(parse_sizes, "--units"), default="8MiB",
                   help="registration sizes to try after the whole range, in order, "
                        "comma-separated (default 8MiB, background set-up's)")
    p.add_argument("--memory", choices=("anonymous", "memfd"), default="anonymous",
                   help="anonymous memory (a private region) or one memfd (a node region)")
    p.add_argument("--own-context", action=argparse.BooleanOptionalAction, default=True,
                   help="register in a CUDA context of the script's own, as background set-up "
                        "does (--no-own-context: the primary context)")
    p.add_argument("--threads", type=int, default=8, help="threads populating the memory")
    p.add_argument("--populate", choices=("first", "beside"), default="first",
                   help="first: populate all the memory, then register it; beside: as "
                        "background set-up does, its pre-fault threads populating units ahead "
                        "while each is registered once populated (the first --units size only; "
                        "no whole-range baseline)")
    p.add_argument("--whole", action=argparse.BooleanOptionalAction, default=None,
                   help="register the whole range first, as the baseline (the default with "
                        "--populate first; --no-whole: the units are the process's first "
                        "registrations)")
    p.add_argument("--slow-ms", type=float, default=20.0,
                   help="list the calls that took longer (default 20)")
    p.add_argument("--probe", action="store_true",
                   help="launch a one-element kernel and wait for it every millisecond in the "
                        "primary context while registering, as the engine's thread does in "
                        "set-up, and print the longest wait (CUDA only)")
    p.add_argument("--before", choices=("nothing", "triton", "triton-import", "cubin", "nvrtc"),
                   default="nothing",
                   help="first, in this process (CUDA only): triton: compile, load and run a "
                        "one-line Triton kernel, as the tier's JIT does with its copy kernel; "
                        "triton-import: import Triton and set up its driver only; cubin: "
                        "compile it in a child process and load its cubin with "
                        "cuModuleLoadData here (Triton never imported); nvrtc: compile and run "
                        "a kernel with torch's jiterator")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu: the recording stand-in, to check the script without CUDA")
    p.add_argument("--json", default=None, help="write every figure there")
    args = p.parse_args(argv)
    if args.populate == "beside" and (args.whole or len(args.units) != 1):
        p.error("--populate beside registers the memory as it is populated, once: give one "
                "--units size and leave out --whole")
    if args.whole is None:
        args.whole = args.populate == "first"
    page = 4096
    bad = [u for u in args.units if u <= 0 or u % page] + (
        [args.bytes] if args.bytes <= 0 or args.bytes % page else [])
    if bad:
        p.error(f"sizes must be positive multiples of {page} B: {bad[0]} is not; give e.g. "
                "8MiB")
    return args


if __name__ == "__main__":
    sys.exit(main())
