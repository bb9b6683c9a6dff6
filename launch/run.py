"""The main job: set the host tier up on this host, run verified rounds, report.

    torchrun --standalone --nproc-per-node 2 launch/run.py --cpu-bytes 256MiB

Every rank creates its share of the tier; rank 0 drives verified store/load rounds, prints the
start-up table and writes the JSON report.  With ``--dp N`` the world holds N data-parallel
replicas of ``tp x pp`` ranks each, ``rank = dp_rank * tp * pp + pp_rank * tp + tp_rank``; each
replica gets its own tier (plan, regions, quorum, budget per node) on its own process group,
driven by the replica's first rank, and world rank 0 reports them all.  Exit status 0 only when
every round of every replica verified byte-exact; user errors print one line and exit 1 with
nothing left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a script by torchrun: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from launch import rounds, synthetic
from offload import fs_actions
from offload.actor import RankActor
from offload.bounds import check_seconds
from offload.config import FS_BYTES_FACTOR, LAYOUTS, TierConfig
from offload.control.quorum import default_store
from offload.control.rpc import Aborted
from offload.control.topology import check_grid
from offload.errors import OffloadError
from offload.observe.log import setup_logging
from offload.observe.report import (
    count_shm_files,
    integrity_block,
    paths_block,
    readiness_block,
    render_table,
    write_json,
)
from offload.observe.timeline import draw_timeline
from offload.region import cleanup
from offload.sizes import parse_size
from offload.tier import HostTier
from offload.tiers.rank_files import combine_reports
from offload.transfer.engine import BACKENDS

log = logging.getLogger("launch.run")
# The file tier's namespace for this job's KV: its own deterministic pattern, not a model's.
SYNTHETIC_KV = "offload-main-job-synthetic-kv"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N launch/run.py",
        description="Create offload's host KV tier on this host (or across nodes), run "
                    "verified store/load rounds and print a per-rank start-up report. Sizes "
                    "accept 4096, 64KiB, 256MiB, 4GiB. Environment: OFFLOAD_NODE_ID overrides "
                    "the node identity (simulate several nodes on one host).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cpu-bytes", default="256MiB", metavar="SIZE",
                   help="host budget per node (per DP replica)")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas, one tier each; rank = dp_rank x tp x pp + "
                        "pp_rank x tp + tp_rank")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (unset: world / dp / pp)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel size; dp x tp x pp = world")
    p.add_argument("--layout", default="private", choices=LAYOUTS,
                   help="private: one region per rank; shared: one node region of interleaved "
                        "slots; replicated: one node copy per pipeline stage of data "
                        "identical on the stage's ranks")
    p.add_argument("--kv-bytes-per-block", default="64KiB", metavar="SIZE",
                   help="each rank's payload of one block (split into K and V tensors)")
    p.add_argument("--stage-kv-bytes", default=None, metavar="S0,S1,...",
                   help="per-pipeline-stage payloads (overrides --kv-bytes-per-block)")
    p.add_argument("--blocks-per-chunk", type=int, default=16, help="blocks per chunk")
    p.add_argument("--num-gpu-blocks", type=int, default=64,
                   help="blocks in each rank's synthetic KV cache")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the KV cache lives (auto: cuda when available)")
    p.add_argument("--rounds", type=int, default=2, help="verified store/load rounds")
    p.add_argument("--fs-tier", default=None, metavar="DIR",
                   help="enable the file tier under DIR (an existing, writable directory on a "
                        "local disk, of this user or root and sticky if others can write it): "
                        "chunks evicted from host memory are spilled there and "
                        "read back on a disk hit; each rank keeps its files in "
                        "DIR/fp-<geometry fingerprint>/ (one per DP replica), so a restart "
                        "with the same geometry finds them")
    p.add_argument("--fs-namespace", default=None, metavar="NAME",
                   help="what computed the KV the file tier keeps; it enters the files' "
                        "fingerprint, so a restart with another one never reads them. An "
                        "engine passes its model id and revision; this job's KV is its own "
                        f"synthetic pattern (default: {SYNTHETIC_KV})")
    p.add_argument("--keep", type=float, default=0.0, metavar="SECONDS",
                   help="keep the host tier for this many seconds after the job ends (cleanly "
                        "or killed), so a rerun of the same geometry and --fs-namespace adopts "
                        "it warm (docs/KEEP.md; list or free it with `python -m offload.keep`); "
                        "0 (default) keeps nothing")
    p.add_argument("--fs-bytes", default=None, metavar="SIZE",
                   help="file tier budget per node (needs --fs-tier; unset: "
                        f"{FS_BYTES_FACTOR} x --cpu-bytes)")
    p.add_argument("--fs-io-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="deadline of one file-tier read or write; past it the chunk is a miss "
                        "and the job goes on (default: 5)")
    p.add_argument("--report-json", default=None, metavar="PATH",
                   help="rank 0 writes the JSON report there")
    p.add_argument("--timeline", default=None, metavar="PATH",
                   help="rank 0 draws the per-rank phase timeline there (PNG; needs matplotlib)")
    p.add_argument("--audit", action="store_true",
                   help="hash every block before store and after load; count mismatches in the "
                        "report (exit 1 on any)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="transfer backend (auto picks by device and pinning)")
    p.add_argument("--shm-dir", default=None, metavar="DIR",
                   help="keep visible region files in DIR (an existing, writable tmpfs such as "
                        "/dev/shm, of this user or root and sticky if others can write it); "
                        "default: nameless regions the kernel frees with the job")
    p.add_argument("--private-memory", default="anonymous", choices=("anonymous", "memfd"),
                   help="what a nameless private region is made of: the rank's own memory with "
                        "transparent huge pages requested (faster pre-fault and pinning) or a "
                        "memfd (default: anonymous)")
    p.add_argument("--prefault-threads", type=int, default=8,
                   help="threads populating each rank's region (with --background-setup at idle "
                        "CPU priority, and with the ranks sharing its CPUs on at most half "
                        "of them)")
    p.add_argument("--segment-bytes", default="1GiB", metavar="SIZE",
                   help="target size of one shm file; regions of 2 x this and more are split")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any rank waits for a peer before failing the job")
    p.add_argument("--no-integrity", dest="integrity", action="store_false",
                   help="do not checksum pages on store nor check them on load")
    p.add_argument("--no-numa", dest="numa", action="store_false",
                   help="do not place each rank's pages on its GPU's NUMA node")
    p.add_argument("--staging-bytes", default="128MiB", metavar="SIZE",
                   help="GPU memory per rank for the staged path: whole-chunk jobs are gathered "
                        "on the GPU and moved by the copy engines, so the model keeps its SMs "
                        "(0: off, whole chunks run on the copy kernel)")
    p.add_argument("--background-setup", dest="background", action="store_true",
                   help="return from set-up once the regions are mapped and pre-fault and pin "
                        "them on the tier's own threads, row range by row range: rows come "
                        "online while the job runs (jobs only use ready rows) and the report's "
                        "readiness block says when the first job succeeded and when every row "
                        "was ready")
    p.add_argument("--no-setup-context", dest="setup_context", action="store_false",
                   help="with --background-setup, register in the job's own CUDA context "
                        "instead of one of the tier's own (which costs ~260 MiB of GPU memory "
                        "per rank and keeps the job's kernel launches from waiting behind "
                        "registrations)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve live Prometheus metrics (offload_*) at /metrics on PORT + each "
                        "rank's local rank (needs offload[metrics]); default off")
    p.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                   help="address the metrics servers listen on (0.0.0.0 for a remote "
                        "Prometheus)")
    return p


def replica_world(args: argparse.Namespace, world: int) -> int:
    """Ranks per DP replica."""
    if args.dp < 1:
        raise OffloadError(f"--dp {args.dp} must be at least 1")
    if world % args.dp:
        raise OffloadError(f"--dp {args.dp} does not divide the {world} ranks; choose a dp "
                           f"that divides {world}")
    if args.dp > 1 and args.tp is not None and args.dp * args.tp * args.pp != world:
        raise OffloadError(f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} = "
                           f"{args.dp * args.tp * args.pp} but the world has {world} ranks; "
                           f"choose dp, tp and pp whose product is {world}")
    return world // args.dp


def replica_groups(dp: int, size: int) -> list[Any]:
    """One gloo group per replica (None for a single replica: the default group).  Every rank
    creates every group, in order: `new_group` is collective over the default group."""
    if dp == 1:
        return [None]
    return [dist.new_group(list(range(d * size, (d + 1) * size))) for d in range(dp)]


def config_from_args(args: argparse.Namespace, world: int) -> TierConfig:
    for name in ("blocks_per_chunk", "num_gpu_blocks", "rounds", "pp", "prefault_threads"):
        if getattr(args, name) < 1:
            raise OffloadError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at "
                               "least 1")
    if args.tp is None and world % args.pp:
        raise OffloadError(f"--pp {args.pp} does not divide the {world} ranks; choose a pp "
                           f"that divides {world} or give --tp")
    tp = args.tp if args.tp is not None else world // args.pp
    check_grid(world, tp, args.pp)
    segment = parse_size(args.segment_bytes, "--segment-bytes")
    return TierConfig(
        cpu_bytes_per_node=parse_size(args.cpu_bytes, "--cpu-bytes"), layout=args.layout,
        blocks_per_chunk=args.blocks_per_chunk, tp=tp, pp=args.pp, shm_dir=args.shm_dir,
        segment_threshold=2 * segment, min_segment_bytes=segment,
        prefault_threads=args.prefault_threads, timeout_s=args.timeout, fs_dir=args.fs_tier,
        fs_namespace=(args.fs_namespace if args.fs_namespace is not None
                      or (args.fs_tier is None and not args.keep) else SYNTHETIC_KV),
        keep_s=args.keep,
        private_memory=args.private_memory, fs_io_timeout_s=args.fs_io_timeout,
        integrity=args.integrity, metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
        numa=args.numa, staging_bytes=parse_size(args.staging_bytes, "--staging-bytes"),
        background=args.background, setup_context=args.setup_context,
        fs_bytes=None if args.fs_bytes is None else parse_size(args.fs_bytes, "--fs-bytes"))


def payload_for(args: argparse.Namespace, pp_rank: int, pp: int) -> int:
    if args.stage_kv_bytes is None:
        stages = [parse_size(args.kv_bytes_per_block, "--kv-bytes-per-block")] * pp
    else:
        stages = [parse_size(s, "--stage-kv-bytes entry")
                  for s in args.stage_kv_bytes.split(",")]
    if len(stages) != pp:
        raise OffloadError(f"--stage-kv-bytes gives {len(stages)} payloads but --pp is {pp}; "
                           "give one size per pipeline stage")
    if min(stages) < 1:
        raise OffloadError(f"a KV payload of {min(stages)} bytes per block is empty; give "
                           "--kv-bytes-per-block / --stage-kv-bytes of at least 1 byte")
    return stages[pp_rank]


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise OffloadError("--device cuda but CUDA is not available here; use --device cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def run(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    size = replica_world(args, world)
    config = config_from_args(args, size)
    assert config.tp is not None
    dp_rank, group = rank // size, replica_groups(args.dp, size)[rank // size]
    device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    payload = payload_for(args, rank % size // config.tp, config.pp)
    kv = synthetic.make_kv(payload, args.num_gpu_blocks, device)
    tier = HostTier.create(kv, config, backend=args.backend, audit=args.audit, group=group)
    replica = drive(tier, args, dp_rank) if tier.topology.rank == 0 else None
    if replica is None:
        tier.serve()
    tier.close()
    dist.barrier()  # every rank of every replica has closed: nothing of theirs may remain
    left = shm_files_left(tier, config.shm_dir or "/dev/shm")
    replicas: list[Any] = [None] * world
    dist.all_gather_object(replicas, replica)
    if rank != 0:
        return 0
    report: dict[str, Any] = {
        "world_size": world, "dp": args.dp, "tp": config.tp, "pp": config.pp,
        "layout": config.layout, "device": device.type,
        "replicas": [r for r in replicas if r is not None]}
    report.update(report["replicas"][0])  # replica 0 at the top: a single replica's report
    for key in ("replica", "world_ranks"):
        report.pop(key)
    if args.audit:
        report["audit"] = {key: sum(r["audit"][key] for r in report["replicas"])
                           for key in ("checked_blocks", "mismatched_blocks")}
    report["shm_files_left"] = left
    print(render_table(report), flush=True)
    if args.report_json:
        write_json(args.report_json, report)
    if args.timeline:
        draw_timeline(report["ranks"], args.timeline,
                      f"{config.layout}, {world} ranks, {args.cpu_bytes} per node",
                      report["readiness"]["first_job_s"])
    bad = [r["replica"] for r in report["replicas"] if not r["transfer"]["verified"]]
    audit_bad = report.get("audit", {}).get("mismatched_blocks", 0)
    ok = not bad and report["shm_files_left"] == 0 and not audit_bad
    if not ok:
        log.error("verification failed: replicas %s had mismatched blocks, %d audit "
                  "mismatches, %d shm files left", bad, audit_bad, report["shm_files_left"])
    return 0 if ok else 1


def drive(tier: HostTier, args: argparse.Namespace, dp_rank: int) -> dict[str, Any]:
    """The replica's first rank: run the rounds, collect its ranks' reports, release them."""
    config = tier.actor.config
    try:
        stats = rounds.run_rounds(tier, args.rounds, args.num_gpu_blocks)
        tier.wait_ready()  # the report's figures are final once every row is set up
        ranks = tier.call(RankActor.report)
        files = tier.call(fs_actions.report) if config.fs_dir is not None else None
    except BaseException as exc:
        tier.abort(str(exc) or type(exc).__name__)
        raise
    tier.release()
    replica: dict[str, Any] = {
        "replica": dp_rank, "world_ranks": [tier.topology.global_rank(r)
                                            for r in range(tier.topology.world_size)],
        "tier_id": tier.actor.tier_id, "nodes": tier.topology.to_json(),
        "plan": tier.plan.to_json(), "ranks": ranks, "transfer": stats.to_json()}
    if files is not None:
        assert config.fs_dir is not None
        replica["fs_tier"] = combine_reports(os.path.abspath(config.fs_dir), files)
    if args.audit:
        replica["audit"] = {key: sum(r["audit"][key] for r in ranks)
                            for key in ("checked_blocks", "mismatched_blocks")}
    replica["paths"] = paths_block(ranks)
    replica["readiness"] = readiness_block(config.background, ranks, tier.first_success_at,
                                           tier.actor.created_at)
    kept = tier.keep_report()
    if kept is not None:
        replica["keep"] = kept
    replica["integrity"] = integrity_block(all(r["integrity"]["enabled"] for r in ranks),
                                           sum(r["integrity"]["mismatches"] for r in ranks))
    return replica


def shm_files_left(tier: HostTier, shm_dir: str) -> int:
    """Collective over the world: every node leader of every replica counts its tier's files on
    its own host after close; the total comes back on every rank (other hosts' /dev/shm is not
    visible from rank 0).  Nameless regions count /dev/shm, where a named file of theirs would
    be a bug."""
    tier_id = tier.actor.tier_id
    mine = count_shm_files(shm_dir, tier_id) if tier.topology.is_leader else 0
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, (socket.gethostname(), tier_id, mine))
    per_host: dict[tuple[str, str], int] = {}
    for host, tier_of, count in counts:  # simulated nodes share a host: count it once
        per_host[host, tier_of] = max(per_host.get((host, tier_of), 0), count)
    return sum(per_host.values())


# The flags that take seconds, with the fix each refusal names.  ``--timeout`` is the group's
# own timeout (torch's store turns a bad one into a C++ traceback on every rank), so they are
# all checked before the process group exists.
SECONDS_FLAGS = {"timeout": "give the seconds a rank may wait for a peer, e.g. --timeout 300",
                 "fs_io_timeout": "give the seconds one file-tier read or write may take, e.g. "
                                  "--fs-io-timeout 5"}


def check_before_start(args: argparse.Namespace) -> None:
    """The flags used before the process group exists: every seconds flag ``args`` has
    (`SECONDS_FLAGS`), against the bound every wait accepts (`offload.bounds.check_seconds`).

    Raises:
        OffloadError: naming the flag, the value, the limit and the fix.
    """
    for dest, fix in SECONDS_FLAGS.items():
        if hasattr(args, dest):
            check_seconds(getattr(args, dest), f"--{dest.replace('_', '-')}", fix)


def main(argv: list[str] | None = None) -> int:
    return start(run, build_parser(), argv)


def start(job: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser,
          argv: list[str] | None) -> int:
    """The main of every entry point under torchrun: parse the flags, check those used before
    the group exists (one line for the job), then `run_entry`.  Returns the exit status."""
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        check_before_start(args)
    except OffloadError as exc:
        # NOTE: every rank has the same flags and there is no store yet to agree who prints:
        # rank 0 prints the one line, the others wait a while before exiting, so torchrun does
        # not stop rank 0 for a worker's failure before it printed.
        if rank == 0:
            print(f"offload: error: {exc}", file=sys.stderr, flush=True)
        else:
            time.sleep(_WORKER_GRACE_S)
        return 1
    return run_entry(job, args)


def run_entry(job: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """What every entry point under torchrun does around its ``job``: logging, signal
    handlers, the gloo group (``--timeout``), one-line errors (`report_error`) and cleanup on
    every exit path.  Returns the exit status."""
    setup_logging()
    cleanup.install_signal_handlers()
    rank = int(os.environ.get("RANK", "0"))
    try:
        if not dist.is_initialized():
            _init_group(args.timeout)
        return job(args)
    except OffloadError as exc:
        report_error(exc, rank)
        return 1
    finally:
        cleanup.run_all()
        if dist.is_initialized():
            dist.destroy_process_group()


def report_error(exc: OffloadError, rank: int, grace_s: float = 5.0) -> None:
    """One line per job, not per rank.  Settings errors are seen alike on every rank and a
    worker's own errors reach rank 0 through the RPC, so rank 0 prints and says so in the
    store; a worker prints only if rank 0 has not within ``grace_s`` (its error was its own).
    Waiting also keeps torchrun from stopping rank 0 before it printed."""
    if isinstance(exc, Aborted):
        return  # rank 0 aborted the job and printed the cause
    reported = _ERROR_KEY if dist.is_initialized() else None
    if rank == 0:
        print(f"offload: error: {exc}", file=sys.stderr, flush=True)
        if reported:
            with contextlib.suppress(Exception):
                default_store("offload").set(reported, "1")
        return
    if reported:
        with contextlib.suppress(Exception):
            store = default_store("offload", grace_s)
            store.wait([reported], datetime.timedelta(seconds=grace_s))
            return
    print(f"offload: error: [rank {rank}] {exc}", file=sys.stderr, flush=True)


_ERROR_KEY = "main-job/error-reported"
_WORKER_GRACE_S = 5.0  # how long a worker lets rank 0 print a settings error


def _init_group(timeout_s: float) -> None:
    """The control plane always runs on gloo: object collectives and barriers, no GPU."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT",
                                                                              "29517"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    # NOTE: gloo's init returns on one rank while another may still be connecting its mesh; a
    # settings error found right after (a bad --fs-tier) would make the fast rank exit and
    # the slow one's init fail with a C++ traceback instead of the one-line error.
    dist.barrier()


if __name__ == "__main__":
    cleanup.exit_after(main)
