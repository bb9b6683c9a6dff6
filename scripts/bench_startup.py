"""Node start-up benchmark: our layouts against the naive design, pinned tensors and the floor.

One run, one table.  For a budget B per node and N ranks on this host:

* **ours/<layout>** -- `HostTier.create` on every rank (nameless memfds, or secure files in
  ``--shm-dir``; multi-segment mapping, sharded GIL-free pre-fault, selective pipelined pinning);
* **naive** -- one shared file of B bytes; every rank maps all of it, pre-faults all of it and
  registers all of it (what a first implementation does);
* **pin_memory** -- every rank allocates its share with ``torch.empty(..., pin_memory=True)``
  (PyTorch's caching host allocator rounds each request up to a power of two);
* **background/<layout>** -- `HostTier.create` with background set-up (DESIGN.md section
  3.9): the time until ``create`` returns, until the first 16-block store is decided
  successfully on every rank, and until every row is ready (``full``), beside the blocking
  create of the same layout; on a GPU a probe thread on every rank launches a tiny kernel
  and waits for it every millisecond from ``create``'s return until every row is ready, and
  reports the longest wait (a registration holds the driver);
* **floor** -- one process creating 16 files of B/16 bytes of the same kind as ours (memfds, or
  files in ``--shm-dir``; ``posix_fallocate`` from 16 threads allocates their shmem pages) and
  populating them with ``MADV_POPULATE_WRITE`` from 16 threads, nothing else: how fast this host
  can make B bytes resident, without pinning.

Node start-up = from the moment every rank starts (barrier) until the last rank is ready.
Resident bytes are the growth of used memory (``MemTotal - MemFree``) while the variant holds
its memory.  The VM's RAM grows on first touch, so the script first warms ``--warm`` bytes.

    python3 scripts/bench_startup.py --nproc 2 --cpu-bytes 32GiB --json out.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import datetime
import itertools
import mmap
import os
import queue as queue_module
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the probes' samplers are developer tools (tools/)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from stack_sampler import StackSampler
from wait_sampler import WaitSampler

from offload.bounds import flag_type, parse_seconds
from offload.config import TierConfig
from offload.observe.report import write_json
from offload.observe.timeline import draw_timeline
from offload.region import cleanup
from offload.region.geometry import ByteRange, RegionGeometry, segment_ranges
from offload.region.prefault import plan_pieces, prefault
from offload.sizes import format_size, parse_size, parse_sizes
from offload.system.nameless import create_memfds
from offload.system.paths import write_atomic
from offload.system.shm import Mapping, close_fds, create_segments, open_segment, unlink_quiet

GiB = 1 << 30


def used_bytes() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemFree"]


def process_threads() -> dict[int, str]:
    """This process's threads by thread id, as ``driver`` (those the CUDA driver started, named
    ``cuda...``) or ``thread``: a registration that waits in the driver may be waiting for a
    lock one of them holds."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm", "rb") as f:
            found[int(tid)] = "driver" if f.read().startswith(b"cuda") else "thread"
    return found


def device_for(rank: int) -> torch.device:
    if torch.cuda.is_available():
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


# ------------------------------------------------------------------ variants (run on every rank)
def ours(rank: int, world: int, args: argparse.Namespace, layout: str) -> dict[str, Any]:
    from offload.tier import HostTier

    device = device_for(rank)
    tp = world // args.pp
    payload = stage_payloads(args)[rank // tp]
    blocks = max(args.blocks_per_chunk, args.job_blocks)
    kv = [torch.zeros((blocks, payload // args.tensors), dtype=torch.uint8, device=device)
          for _ in range(args.tensors)]
    background = layout.startswith("background:")
    config = TierConfig(cpu_bytes_per_node=args.cpu_bytes, layout=layout.split(":")[-1],
                        blocks_per_chunk=args.blocks_per_chunk, tp=tp, pp=args.pp,
                        prefault_threads=args.threads, timeout_s=600, shm_dir=args.shm_dir,
                        background=background, setup_context=background and args.setup_context,
                        private_memory=args.private_memory, integrity=args.integrity)
    start, baseline = begin(rank)
    sampler = StackSampler().start() if args.stack_samples else None
    tier = HostTier.create(kv, config, backend=args.backend)
    created = time.time()
    # what set-up costs the engine's own launches once create returned
    setup_threads = (tier.actor.region.background_setup.thread_ids()
                     if background and tier.actor.region is not None
                     and tier.actor.region.background_setup is not None else {})
    probe = (LaunchProbe(device, args.probe_waits, {**process_threads(), **setup_threads})
             if background and device.type == "cuda" else None)
    first, first_ready = first_job(tier, args.blocks_per_chunk)
    during = (jobs_during_setup(tier, args.job_blocks, payload)
              if background and args.jobs_during_setup else None)
    tier.wait_ready(600)
    if sampler is not None:
        sampler.stop()
        name = layout.replace(":", "-")
        write_atomic(f"{args.stack_samples}-{name}-rank{rank}.txt", sampler.report() + "\n")
    ready = time.time() if background else created  # blocking: ready when create returns
    waits = None
    if probe is not None:
        setup = tier.actor.region.background_setup
        assert setup is not None
        waits = probe.stop(setup.calls, setup.started)
        # the same probe with nothing else going on: the wait a launch from a Python thread
        # of this process sees anyway, the baseline of set-up's
        idle = LaunchProbe(device, args.probe_waits)
        time.sleep(args.idle_probe_s)
        waits["idle"] = idle.stop([])
    jobs = jobs_when_ready(tier, args.job_blocks, payload)
    row = tier.actor.report()
    result = {"start": start, "ready": ready, "created": created, "first": first,
              "first_ready": first_ready, "jobs": jobs, "during": during,
              "registered": row["pinned_bytes"], "probe": waits,
              "own_bytes": tier.plan.slots[rank].slot_bytes * tier.plan.chunk_count, "row": row}
    hold(rank, result, baseline)
    tier.close()
    return result


def first_job(tier: Any, blocks: int) -> tuple[float, float]:
    """Store ``blocks`` blocks into the first ready chunk, as soon as there is one on every
    rank; return when the job is decided successfully and when the row was ready (wall
    clock)."""
    from offload import CopyJob

    while tier.ready.rows < 1:
        time.sleep(0.0002)
    first_ready = time.time()
    n = min(blocks, tier.plan.blocks_per_chunk)
    tier.submit(CopyJob(0, "store", tuple(range(n)), (0,) * n, tuple(range(n))))
    tier.wait([0])
    return time.time(), first_ready


def whole_chunk_job(tier: Any, blocks: int, job_id: int, direction: str) -> Any:
    """A job of ``blocks`` blocks (a whole number of chunks, from chunk 0) in ``direction``."""
    from offload import CopyJob

    bpc = tier.plan.blocks_per_chunk
    return CopyJob(job_id, direction, tuple(range(blocks)), tuple(j // bpc for j in range(blocks)),
                   tuple(j % bpc for j in range(blocks)))


def job_blocks(tier: Any, blocks: int) -> int:
    """``blocks`` rounded down to whole chunks the region has (0: none)."""
    bpc = tier.plan.blocks_per_chunk
    return min(blocks, tier.plan.chunk_count * bpc) // bpc * bpc


def timed_job(tier: Any, job: Any, nbytes: int) -> float:
    """GB/s of one job, from ``submit`` until it is decided; raises if it failed."""
    began = time.perf_counter()
    tier.submit(job)
    tier.wait([job.job_id])
    return nbytes / (time.perf_counter() - began) / 1e9


JOB_IDS = itertools.count(1_000_000)
SLOW_CALL_S = 0.02  # a registration this long is listed with when it came (call index, time)


def store_and_load(tier: Any, blocks: int, payload: int, rates: dict[str, list[float]]) -> None:
    """One store, then one load, of ``blocks`` blocks in whole chunks from chunk 0; each
    one's GB/s appended to ``rates[direction]``."""
    for direction in ("store", "load"):
        job = whole_chunk_job(tier, blocks, next(JOB_IDS), direction)
        rates.setdefault(direction, []).append(timed_job(tier, job, blocks * payload))


def medians(rates: dict[str, list[float]]) -> dict[str, float]:
    return {f"{d}_GBps": statistics.median(r) for d, r in rates.items()}


def jobs_when_ready(tier: Any, blocks: int, payload: int, reps: int = 5
                    ) -> dict[str, float] | None:
    """Once every row is ready: the median GB/s of ``reps`` stores and loads of ``blocks``
    blocks in whole chunks (an engine's prefix), each timed from ``submit`` to decided, so a
    layout's registrations are seen in the copies (None: ``blocks`` is 0)."""
    n = job_blocks(tier, blocks)
    if n == 0:
        return None
    rates: dict[str, list[float]] = {}
    for _ in range(reps):
        store_and_load(tier, n, payload, rates)
    return medians(rates)


def every_rank(flag: bool) -> bool:
    """True on every rank once ``flag`` is true on every rank (a collective)."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def jobs_during_setup(tier: Any, blocks: int, payload: int) -> dict[str, float] | None:
    """While set-up continues: stores and loads of ``blocks`` blocks in whole chunks over the
    first rows, back to back from when those rows are ready on every rank until every row is;
    the median GB/s of each direction (None: none ran before set-up ended)."""
    n = job_blocks(tier, blocks)
    if n == 0:
        return None
    rows = n // tier.plan.blocks_per_chunk
    while tier.ready.rows < rows:
        time.sleep(0.001)
    rates: dict[str, list[float]] = {}
    while not every_rank(tier.ready.full):  # every rank runs as many jobs
        store_and_load(tier, n, payload, rates)
    if not rates:
        return None
    return medians(rates) | {"jobs": sum(len(r) for r in rates.values())}


LAUNCH, SYNC, MAP = 1, 2, 3  # the probe's timed steps, as `WaitSampler` phases


class LaunchProbe:
    """Launches a one-element kernel on its own stream and waits for it, every millisecond,
    on a thread, until `stop`: the longest wait says how long set-up held the driver.  With
    ``sample_waits``, a `WaitSampler` reads where in the kernel the thread waits whenever a
    launch, its synchronisation or the 4 KiB mapping runs past 0.5 ms, and what the
    ``others`` threads (background set-up's) were doing meanwhile."""

    def __init__(self, device: torch.device, sample_waits: bool = False,
                 others: dict[int, str] | None = None) -> None:
        self._others = others or {}
        self._device = device
        self._stop = False
        self._sample_waits = sample_waits
        self.sampler: WaitSampler | None = None
        self.waits: list[float] = []
        self.maps: list[float] = []  # a 4 KiB mmap and munmap after each launch
        self.began: list[float] = []  # perf_counter when each launch began
        self.steps: list[tuple[float, float]] = []  # the sampler's keys: launch, sync
        self.launch_s: list[float] = []  # of each wait, the launch's part (the rest: sync)
        import threading

        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.cuda.set_device(self._device)
        x = torch.zeros(1, device=self._device)
        stream = torch.cuda.Stream(self._device)
        with torch.cuda.stream(stream):  # the kernel's first launch loads its module: not timed
            x.add_(1)
        stream.synchronize()
        sampler = self.sampler = (WaitSampler(others=self._others) if self._sample_waits
                                  else None)
        while not self._stop:
            began = time.perf_counter()
            launched = sampler.begin(LAUNCH) if sampler else 0.0
            with torch.cuda.stream(stream):
                x.add_(1)
            self.launch_s.append(time.perf_counter() - began)
            synced = sampler.begin(SYNC) if sampler else 0.0
            stream.synchronize()
            if sampler:
                sampler.end()
            self.waits.append(time.perf_counter() - began)
            self.began.append(began)
            self.steps.append((launched, synced))
            began = time.perf_counter()  # the mmap lock: held for reading by a populate
            if sampler:
                sampler.begin(MAP)
            mmap.mmap(-1, 4096).close()
            if sampler:
                sampler.end()
            self.maps.append(time.perf_counter() - began)
            time.sleep(0.001)

    def stop(self, calls: list[tuple[float, float]], since: float = 0.0) -> dict[str, Any]:
        """Stop and summarise the launches that began at ``since`` (perf_counter: when set-up
        began, after the tier's JIT) or later; ``before_max_ms`` is the longest wait before
        it (the tier's own start).  ``calls`` are set-up's registration calls (began,
        seconds): ``beside_max_ms`` is the longest wait that overlapped none of them (the
        process's own stalls), ``overlapped`` how many of the 10 worst overlapped one."""
        self._stop = True
        self._thread.join()
        where = self._where(since) if self.sampler is not None else None
        launches = list(zip(self.began, self.waits, strict=True))
        before = [w for b, w in launches if b < since]
        began = [b for b, _ in launches if b >= since]
        waits = [w for b, w in launches if b >= since]
        ordered = sorted(waits)
        if not ordered:
            return {"count": 0}
        calls = sorted(calls)
        starts = [b for b, _ in calls]

        def overlapping(i: int) -> float:
            """The longest registration call overlapping launch ``i`` (0.0: none)."""
            end = began[i] + waits[i]
            k = bisect.bisect_right(starts, end)
            return max((took for b, took in calls[max(0, k - 64):k] if b + took > began[i]),
                       default=0.0)

        by_wait = sorted(range(len(waits)), key=waits.__getitem__, reverse=True)
        free = [waits[i] for i in by_wait[:200] if not overlapping(i)]
        return {"count": len(ordered), "p50_ms": 1e3 * ordered[len(ordered) // 2],
                "p99_ms": 1e3 * ordered[int(len(ordered) * 0.99)],
                "max_ms": 1e3 * ordered[-1], "worst_at_s": began[by_wait[0]] - since,
                "over_2ms": sum(w > 0.002 for w in ordered),
                "overlapped": sum(bool(overlapping(i)) for i in by_wait[:10]),
                "worst_call_ms": 1e3 * overlapping(by_wait[0]),
                "beside_max_ms": 1e3 * max(free, default=0.0),
                "before_max_ms": 1e3 * max(before, default=0.0),
                "mmap_max_ms": 1e3 * max(self.maps, default=0.0),
                # when the long registrations came: (call, of calls, s after set-up began, ms)
                "slow_calls": [(k, len(calls), b - since, 1e3 * took)
                               for k, (b, took) in enumerate(calls) if took > SLOW_CALL_S],
                **({"where": where} if where is not None else {})}

    def _where(self, since: float) -> dict[str, Any]:
        """What the probe thread waited for in the kernel: its 10 worst launches from
        ``since`` on, in words (each step that ran past 0.5 ms), and over every long step, how
        often each phase, state and wait channel was seen."""
        sampler = self.sampler
        assert sampler is not None
        steps = sampler.stop()
        names = {LAUNCH: "launch", SYNC: "sync", MAP: "mmap"}
        seen: collections.Counter[str] = collections.Counter()
        for step in steps.values():
            for _, state, wchan, _ in step["samples"]:
                seen[f"{names.get(step['phase'], '?')} {state} {wchan}"] += 1
        counted = [i for i, b in enumerate(self.began) if b >= since]
        worst = sorted(counted, key=self.waits.__getitem__, reverse=True)[:10]

        def words(i: int) -> str:
            launch = self.launch_s[i]
            sampled = "; ".join(f"{names[phase]} {sampler.where(key)}"
                                for phase, key in zip((LAUNCH, SYNC), self.steps[i], strict=True)
                                if key in steps)
            return (f"{1e3 * self.waits[i]:.1f} ms (launch {1e3 * launch:.1f}, sync "
                    f"{1e3 * (self.waits[i] - launch):.1f}): {sampled or 'no sample'}")

        return {"worst": [words(i) for i in worst], "seen": dict(seen.most_common(12))}


def stage_payloads(args: argparse.Namespace) -> list[int]:
    """Each pipeline stage's KV bytes per block (``--stage-kv-bytes`` or the common size)."""
    if args.stage_kv_bytes:
        return list(args.stage_kv_bytes)
    return [args.kv_bytes_per_block] * args.pp


def naive(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from offload.region.pin import choose_registrar

    device = device_for(rank)
    size = args.cpu_bytes // 4096 * 4096
    path = os.path.join("/dev/shm", f"offload-bench-naive-{os.getppid()}")
    registrar = choose_registrar(device)
    start, baseline = begin(rank)
    fds = create_segments([path], [size]) if rank == 0 else []
    dist.barrier()
    if rank != 0:
        fds = [open_segment(path, size)]
    mapping = Mapping(fds, [size])
    close_fds(fds)
    dist.barrier()
    if rank == 0:
        unlink_quiet(path)
    prefault(mapping.address, [ByteRange(0, size)], threads=1)
    cap = 64 * GiB
    for offset in range(0, size, cap):
        registrar.register(mapping.address + offset, min(cap, size - offset))
    ready = time.time()
    result = {"start": start, "ready": ready, "registered": size, "own_bytes": size // world}
    hold(rank, result, baseline)
    for offset in range(0, size, cap):
        registrar.unregister(mapping.address + offset)
    mapping.close()
    return result


def pinned(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    device_for(rank)
    share = args.cpu_bytes // world
    if torch.cuda.is_available():
        torch.empty(1, pin_memory=True)  # the allocator's own set-up is not the tier's cost
    start, baseline = begin(rank)
    buffer = torch.empty(share, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    if not torch.cuda.is_available():
        buffer.fill_(0)  # CPU stand-in: make it resident
    ready = time.time()
    result = {"start": start, "ready": ready, "registered": share, "own_bytes": share}
    hold(rank, result, baseline)
    del buffer
    return result


def begin(rank: int) -> tuple[float, int]:
    """Every rank is initialised (torch, CUDA context): read the node's memory, then start
    the clock together."""
    dist.barrier()
    baseline = used_bytes() if rank == 0 else 0
    dist.barrier()
    return time.time(), baseline


def hold(rank: int, result: dict[str, Any], baseline: int) -> None:
    """Keep the memory while rank 0 reads how much the node holds."""
    dist.barrier()
    if rank == 0:
        result["resident"] = used_bytes() - baseline
    dist.barrier()


# ------------------------------------------------------------------ process plumbing
def _rank_main(rank: int, world: int, port: int, fn: Callable[..., dict[str, Any]],
               extra: tuple[Any, ...], queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    queue.put((rank, fn(rank, world, *extra)))
    dist.barrier()
    dist.destroy_process_group()
    queue.close()
    queue.join_thread()
    cleanup.exit_now(0)  # no interpreter finalization to race gloo's threads


def _stop_ranks(procs: list[Any]) -> None:
    """SIGTERM first, so each rank's cleanup unlinks what it named (``--shm-dir``); SIGKILL
    what is still there after 10 s."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def run_variant(world: int, fn: Callable[..., dict[str, Any]], *extra: Any) -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, extra, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 1800
    while len(results) < world:
        # a rank that dies before reporting leaves its peers in a collective: stop them all
        # rather than wait out the deadline
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            _stop_ranks(procs)
            raise SystemExit(f"a rank of {fn.__name__} exited with {failed[0]}" if failed
                             else f"{fn.__name__} did not finish within 1800 s")
        try:
            rank, result = queue.get(timeout=1)
        except queue_module.Empty:
            continue
        results[rank] = result
    for p in procs:
        p.join(120)  # past its result a rank only leaves the group
        if p.exitcode != 0:
            _stop_ranks(procs)
            raise SystemExit(f"a rank of {fn.__name__} exited with {p.exitcode}")
    began = min(r["start"] for r in results.values())
    seconds = max(r["ready"] for r in results.values()) - began
    stages: dict[str, Any] = {key: max(r[key] for r in results.values()) - began
              for key in ("created", "first", "first_ready") if key in results[0]}
    jit = _most_over_ranks(results, lambda row: row["timings_s"].get("jit"))
    if jit is not None:
        stages["jit_s"] = jit  # the slowest rank's JIT
    probes = [r["probe"] for r in results.values() if (r.get("probe") or {}).get("count")]
    if probes:
        stages["worst_wait_ms"] = max(p["max_ms"] for p in probes)
        stages["p50_wait_ms"] = max(p["p50_ms"] for p in probes)
        stages["p99_wait_ms"] = max(p["p99_ms"] for p in probes)
        stages["over_2ms"] = sum(p["over_2ms"] for p in probes)
        stages["launches"] = sum(p["count"] for p in probes)
        stages["mmap_max_ms"] = max(p["mmap_max_ms"] for p in probes)
        stages["beside_max_ms"] = max(p["beside_max_ms"] for p in probes)
        stages["overlapped"] = sum(p["overlapped"] for p in probes)
        stages["before_max_ms"] = max(p["before_max_ms"] for p in probes)
        idle = [p["idle"] for p in probes if p["idle"].get("count")]
        if idle:
            stages["idle_max_ms"] = max(p["max_ms"] for p in idle)
            stages["idle_p99_ms"] = max(p["p99_ms"] for p in idle)
            stages["idle_over_2ms"] = sum(p["over_2ms"] for p in idle)
            stages["idle_launches"] = sum(p["count"] for p in idle)
        where = [(p["where"], p["idle"].get("where")) for p in probes if "where" in p]
        if where:  # per rank: during set-up, and once every row was ready
            stages["where"] = where
        stages["slow_calls"] = [p.get("slow_calls", []) for p in probes]
    rated = [r["jobs"] for r in results.values() if r.get("jobs")]
    if rated:  # the slowest rank's
        stages["store_GBps"] = min(j["store_GBps"] for j in rated)
        stages["load_GBps"] = min(j["load_GBps"] for j in rated)
    during = [r["during"] for r in results.values() if r.get("during")]
    if len(during) == len(results):  # the slowest rank's, while set-up continued
        stages["during_store_GBps"] = min(j["store_GBps"] for j in during)
        stages["during_load_GBps"] = min(j["load_GBps"] for j in during)
        stages["during_jobs"] = min(j["jobs"] for j in during)
    longest = _most_over_ranks(results, lambda row: row.get("longest_registration_s"))
    if longest is not None:
        stages["reg_max_ms"] = 1e3 * longest
    return {"seconds": seconds, **stages, "resident": results[0]["resident"],
            "registered_per_rank": max(r["registered"] for r in results.values()),
            "own_per_rank": max(r["own_bytes"] for r in results.values()),
            "ranks": [results[r] for r in range(world)]}


def _most_over_ranks(results: dict[int, dict[str, Any]],
                     pick: Callable[[dict[str, Any]], float | None]) -> float | None:
    """The largest of ``pick(report row)`` over the ranks that have one, or None."""
    values = [pick(r["row"]) for r in results.values() if "row" in r]
    present = [v for v in values if v is not None]
    return max(present) if present else None


def floor(args: argparse.Namespace) -> dict[str, Any]:
    """Raw parallel pre-fault of the same bytes: ``--floor-files`` files populated by
    ``--floor-threads`` threads, nothing else."""
    files, threads = args.floor_files, args.floor_threads
    geometry = RegionGeometry("private", files, args.cpu_bytes // files // 4096 * 4096, 0,
                              args.cpu_bytes // files // 4096 * 4096, 4096)
    config = TierConfig(cpu_bytes_per_node=args.cpu_bytes, segment_threshold=1,
                        min_segment_bytes=geometry.row_stride, max_segments=files)
    segments = segment_ranges(geometry, config)
    lengths = [s.length for s in segments]
    baseline = used_bytes()
    start = time.perf_counter()
    if args.shm_dir is None:
        fds = create_memfds(f"bench-floor-{os.getpid()}", lengths, threads)
    else:
        paths = [os.path.join(args.shm_dir, f"offload-bench-floor-{os.getpid()}-{i}")
                 for i in range(len(segments))]
        fds = create_segments(paths, lengths, threads=threads, unlink=True)
    mapping = Mapping(fds, [s.length for s in segments])
    close_fds(fds)
    pieces = plan_pieces([ByteRange(0, geometry.total_bytes)], segments, threads, 4096)
    prefault(mapping.address, pieces, threads=threads)
    seconds = time.perf_counter() - start
    resident = used_bytes() - baseline
    mapping.close()
    return {"seconds": seconds, "resident": resident, "registered_per_rank": 0,
            "own_per_rank": 0}


def warm(nbytes: int) -> float:
    """Touch ``nbytes`` once so the VM has grown its RAM before anything is timed."""
    if nbytes <= 0:
        return 0.0
    return floor(argparse.Namespace(cpu_bytes=nbytes, floor_files=16, floor_threads=16,
                                    shm_dir=None))["seconds"]


def warm_jit(args: argparse.Namespace) -> float | None:
    """On a GPU, create and close a small blocking tier of the same shape once, untimed, so
    the copy kernel's compiled form is in Triton's on-disk cache before any variant: the first
    variant of a run otherwise compiles it cold (4-5 s against 0.6-1.1 s), and a blocking
    private create waits for its JIT where background set-up does not.  Returns its seconds."""
    if not torch.cuda.is_available():
        return None
    small = argparse.Namespace(**vars(args))
    small.cpu_bytes = args.nproc * args.blocks_per_chunk * max(stage_payloads(args)) * 4
    small.job_blocks = 0
    began = time.perf_counter()
    run_variant(args.nproc, ours, small, "private")
    return time.perf_counter() - began


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks on this node (tp x pp)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (tp = nproc / pp)")
    p.add_argument("--stage-kv-bytes", type=flag_type(parse_sizes, "--stage-kv-bytes"),
                   default=None, metavar="S0,S1,...",
                   help="per-stage KV bytes per block (heterogeneous stages)")
    p.add_argument("--floor-files", type=int, default=16, help="files of the floor variant")
    p.add_argument("--floor-threads", type=int, default=16, help="threads of the floor variant")
    p.add_argument("--cpu-bytes", type=flag_type(parse_size, "--cpu-bytes"), default="32GiB",
                   help="budget per node")
    p.add_argument("--kv-bytes-per-block", type=flag_type(parse_size, "--kv-bytes-per-block"),
                   default="512KiB")
    p.add_argument("--blocks-per-chunk", type=int, default=16)
    p.add_argument("--tensors", type=int, default=2,
                   help="KV tensors the per-block payload is split into (160 with "
                        "--kv-bytes-per-block 2560KiB: 16 KiB pages, engine-shaped)")
    p.add_argument("--threads", type=int, default=16,
                   help="pre-fault threads per rank (background set-up: with the ranks "
                        "sharing its CPUs, at most half of them)")
    p.add_argument("--private-memory", choices=("anonymous", "memfd"), default="anonymous",
                   help="what our private layout's regions are made of (TierConfig."
                        "private_memory)")
    p.add_argument("--job-blocks", type=int, default=128,
                   help="our layouts: once every row is ready, time stores and loads of this "
                        "many blocks in whole chunks (0: none)")
    p.add_argument("--jobs-during-setup", action="store_true",
                   help="background: also run --job-blocks stores and loads back to back over "
                        "the first rows from when they are ready until every row is, and "
                        "report their GB/s (they slow set-up: off for the readiness figures)")
    p.add_argument("--backend", default="auto",
                   choices=("auto", "hybrid", "triton", "copy_engine", "per_block", "host"),
                   help="our layouts: the tier's transfer backend (HostTier.create's backend)")
    p.add_argument("--no-integrity", dest="integrity", action="store_false",
                   help="our layouts: slots without checksums (TierConfig.integrity)")
    p.add_argument("--no-setup-context", dest="setup_context", action="store_false",
                   help="background: register in the engine's CUDA context, not one of the "
                        "tier's own (TierConfig.setup_context)")
    p.add_argument("--idle-probe-s", type=flag_type(parse_seconds, "--idle-probe-s"), default=2.0,
                   help="background on a GPU: run the launch probe this long once every row "
                        "is ready, as the baseline of its waits during set-up")
    p.add_argument("--probe-waits", action="store_true",
                   help="background on a GPU: whenever a launch of the probe, its "
                        "synchronisation or its 4 KiB mmap runs past 0.5 ms, read what its "
                        "thread waits for in the kernel (state, wait channel, kernel stack; "
                        "tools/wait_sampler.py), and what set-up's pin and pre-fault threads "
                        "and the process's others (the CUDA driver's own among them) were "
                        "doing meanwhile (their states, the stacks of those awake and of the "
                        "pin thread); print the worst "
                        "launches' and the most frequent")
    p.add_argument("--layouts", default="private,shared,replicated")
    p.add_argument("--variants", default="floor,ours,naive,pin_memory",
                   help="any of floor, ours, background, naive, pin_memory")
    p.add_argument("--shm-dir", default=None, metavar="DIR",
                   help="ours and floor use named files in DIR (default: nameless memfds)")
    p.add_argument("--warm", type=flag_type(parse_size, "--warm"), default=None,
                   help="bytes to touch first (default 2 x budget)")
    p.add_argument("--json", default=None, help="write all figures there")
    p.add_argument("--timeline", default=None, metavar="PREFIX",
                   help="draw each of our layouts' per-rank timeline to PREFIX-<layout>.png")
    p.add_argument("--stack-samples", default=None, metavar="PREFIX",
                   help="sample every thread's Python stack every 5 ms from the start of create "
                        "until every row is ready, and write the most frequent stacks and each "
                        "stall of the sampler (a held GIL) to PREFIX-<variant>-rank<r>.txt")
    args = p.parse_args()
    if args.nproc % args.pp:
        p.error(f"--pp {args.pp} does not divide --nproc {args.nproc}")
    if len(stage_payloads(args)) != args.pp:
        p.error(f"--stage-kv-bytes gives {len(stage_payloads(args))} sizes for --pp {args.pp}")
    variants = args.variants.split(",")
    warm_s = warm(args.warm if args.warm else 2 * args.cpu_bytes)
    jit_warm_s = warm_jit(args) if {"ours", "background"} & set(variants) else None
    rows: dict[str, dict[str, Any]] = {}
    if "floor" in variants:
        rows["floor"] = floor(args)
    if "ours" in variants:
        for layout in args.layouts.split(","):
            if layout == "replicated" and len(set(stage_payloads(args))) > 1:
                print("skipping ours/replicated: it needs equal payloads on every stage")
                continue
            rows[f"ours/{layout}"] = run_variant(args.nproc, ours, args, layout)
            if args.timeline:
                draw_timeline([r["row"] for r in rows[f"ours/{layout}"]["ranks"]],
                              f"{args.timeline}-{layout}.png",
                              f"{layout}, {args.nproc} ranks, {format_size(args.cpu_bytes)}")
    if "background" in variants:
        for layout in args.layouts.split(","):
            if layout == "replicated" and len(set(stage_payloads(args))) > 1:
                continue
            row = rows[f"background/{layout}"] = run_variant(args.nproc, ours, args,
                                                             f"background:{layout}")
            if args.timeline:
                draw_timeline([r["row"] for r in row["ranks"]],
                              f"{args.timeline}-background-{layout}.png",
                              f"background {layout}, {args.nproc} ranks, "
                              f"{format_size(args.cpu_bytes)}", row["first"])
    if "naive" in variants:
        rows["naive"] = run_variant(args.nproc, naive, args)
    if "pin_memory" in variants:
        rows["pin_memory"] = run_variant(args.nproc, pinned, args)
    report = {"date": datetime.date.today().isoformat(), "nproc": args.nproc,
              "cpu_bytes": args.cpu_bytes, "cuda": torch.cuda.is_available(),
              "gpus": torch.cuda.device_count(), "warm_s": warm_s, "jit_warm_s": jit_warm_s,
              "setup_context": args.setup_context, "variants": rows}
    if args.json:
        write_json(args.json, report, "--json")
    print_table(report)


def print_table(report: dict[str, Any]) -> None:
    rows = report["variants"]
    budget = report["cpu_bytes"]
    floor_s = rows.get("floor", {}).get("seconds")
    pin_s = rows.get("pin_memory", {}).get("seconds")
    naive_s = rows.get("naive", {}).get("seconds")
    jit = report.get("jit_warm_s")
    print(f"\nnode start-up, {report['nproc']} ranks, budget {format_size(budget)}, "
          f"{report['gpus']} GPU(s), warm-up {report['warm_s']:.1f} s"
          + (f", copy kernel compiled ahead in {jit:.1f} s" if jit is not None else ""))
    header = ("variant", "seconds", "GiB/s", "reg/rank", "own/rank", "resident/B", "vs floor",
              "pin_mem/x", "naive/x")
    print("{:<22}{:>9}{:>8}{:>11}{:>11}{:>11}{:>10}{:>10}{:>9}".format(*header))
    for name, r in rows.items():
        s = r["seconds"]
        print("{:<22}{:>9.2f}{:>8.2f}{:>11}{:>11}{:>11.3f}{:>10}{:>10}{:>9}".format(
            name, s, budget / s / GiB, format_size(r["registered_per_rank"]),
            format_size(r["own_per_rank"]), r["resident"] / budget,
            f"{s / floor_s:.2f}" if floor_s else "-", f"{pin_s / s:.2f}" if pin_s else "-",
            f"{naive_s / s:.2f}" if naive_s else "-"))
    staged = {name: r for name, r in rows.items() if "created" in r}
    if not staged:
        return
    print("\ncreate returned / first 16-block store decided / every row ready, seconds from "
          "the start; full/blocking: full against the blocking create of the layout")
    print("(first_ready: row 0 ready on every rank; launch waits: the probe's, over every "
          "rank; >2ms: how many of all launches waited longer; mmap_ms: the probe's longest "
          "4 KiB mmap and munmap; reg_ms: the longest registration call; GB/s: stores and "
          "loads of --job-blocks blocks once every row is ready, the slowest rank's median)")
    header = ("variant", "create", "first_ready", "first_job", "full", "full/blocking",
              "worst_ms", "p99_ms", "p50_ms", ">2ms", "jit_s", "mmap_ms", "reg_ms",
              "store/load GB/s")
    print("{:<22}{:>8}{:>12}{:>11}{:>8}{:>15}{:>10}{:>8}{:>8}{:>12}{:>7}{:>9}{:>8}{:>17}"
          .format(*header))
    for name, r in staged.items():
        blocking = rows.get("ours/" + name.split("/")[-1], {}).get("seconds")
        probed = "worst_wait_ms" in r
        rates = (f"{r['store_GBps']:.1f}/{r['load_GBps']:.1f}" if "store_GBps" in r
                 else "-")
        print("{:<22}{:>8.3f}{:>12}{:>11.3f}{:>8.2f}{:>15}{:>10}{:>8}{:>8}{:>12}{:>7}{:>9}{:>8}"
              "{:>17}".format(
            name, r["created"], f"{r['first_ready']:.3f}" if "first_ready" in r else "-",
            r["first"], r["seconds"],
            f"{r['seconds'] / blocking:.2f}" if blocking and name.startswith("background")
            else "-", f"{r['worst_wait_ms']:.1f}" if probed else "-",
            f"{r['p99_wait_ms']:.2f}" if probed else "-",
            f"{r['p50_wait_ms']:.3f}" if probed else "-",
            f"{r['over_2ms']}/{r['launches']}" if probed else "-",
            f"{r['jit_s']:.2f}" if "jit_s" in r else "-",
            f"{r['mmap_max_ms']:.1f}" if probed else "-",
            f"{r['reg_max_ms']:.0f}" if "reg_max_ms" in r else "-", rates))
    probed_rows = {name: r for name, r in staged.items()
                   if "worst_wait_ms" in r or "during_store_GBps" in r}
    if probed_rows:
        print("\nwhere the launch waits come from: worst_ms during set-up (from when it began, "
              "after the JIT); beside_ms the longest of them that overlapped no registration "
              "call; reg_in_10 how many of each rank's 10 worst overlapped one; before_ms the "
              "longest wait before set-up began (the tier's own start, its JIT); idle: the "
              "probe once every row was ready, nothing "
              "else running; during: --jobs-during-setup's store/load GB/s (slowest rank's "
              "median) against after readiness")
        causes = ("variant", "worst_ms", "beside_ms", "reg_in_10", "before_ms", "idle_worst",
                  "idle_p99", "idle>2ms", "during GB/s", "jobs", "during/after")
        columns = "{:<22}{:>10}{:>11}{:>11}{:>11}{:>12}{:>10}{:>12}{:>15}{:>6}{:>14}"
        print(columns.format(*causes))
        for name, r in probed_rows.items():
            during = "during_store_GBps" in r
            ratio = (f"{r['during_store_GBps'] / r['store_GBps']:.2f}/"
                     f"{r['during_load_GBps'] / r['load_GBps']:.2f}"
                     if during and "store_GBps" in r else "-")
            probed = "worst_wait_ms" in r
            print(columns.format(
                name, f"{r['worst_wait_ms']:.1f}" if probed else "-",
                f"{r['beside_max_ms']:.1f}" if probed else "-", r.get("overlapped", "-"),
                f"{r['before_max_ms']:.1f}" if probed else "-",
                f"{r['idle_max_ms']:.1f}" if "idle_max_ms" in r else "-",
                f"{r['idle_p99_ms']:.2f}" if "idle_p99_ms" in r else "-",
                f"{r['idle_over_2ms']}/{r['idle_launches']}" if "idle_over_2ms" in r else "-",
                f"{r['during_store_GBps']:.1f}/{r['during_load_GBps']:.1f}" if during else "-",
                r.get("during_jobs", "-"), ratio))
    for name, r in staged.items():
        for rank, (during, idle) in enumerate(r.get("where", [])):
            print(f"\n{name}, rank {rank}: what the probe's thread waited for in the kernel "
                  "(steps past 0.5 ms; R: for a CPU)")
            print("  most seen during set-up: " + "; ".join(
                f"{what} x{count}" for what, count in list(during["seen"].items())[:5]))
            if idle is not None:
                print("  most seen once ready:    " + "; ".join(
                    f"{what} x{count}" for what, count in list(idle["seen"].items())[:3]))
            for line in during["worst"][:3]:
                print("  worst: " + line)
    for name, r in staged.items():
        for rank, slow in enumerate(r.get("slow_calls", [])):
            if slow:
                print(f"{name}, rank {rank}: registrations over {1e3 * SLOW_CALL_S:.0f} ms: "
                      + "; ".join(f"call {k} of {n} at {t:.2f} s: {ms:.1f} ms"
                                  for k, n, t, ms in slow[:8]))


if __name__ == "__main__":
    main()
