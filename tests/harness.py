"""Start real multi-process torch.distributed (gloo) groups for tests.

`run_group(fn, world)` spawns ``world`` fresh processes, sets the torchrun environment in each
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT and, per rank, OFFLOAD_NODE_ID
when ``nodes`` is given), initialises a gloo group with a short timeout and calls
``fn(rank, *args)``.  The function travels with cloudpickle, so tests may pass closures.  Each
rank's outcome (return value, or the one-line error, and the exit code) comes back; a rank that
is killed or hangs shows up as such instead of blocking the test.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import random
import socket
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle

from offload.region import cleanup


@dataclass
class Outcome:
    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None
    error_type: str | None = None

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None


def run_on_free_port(command: Callable[[str], list[str]], attempts: int = 3,
                     **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command(port))`` with a free rendezvous port, again with a new port when
    another process took it between `free_port` and torchrun's bind (EADDRINUSE: tests run in
    parallel), so a port race never reads as a test failure."""
    for attempt in range(attempts):
        proc = subprocess.run(command(str(free_port())), capture_output=True, text=True,
                              **kwargs)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr or attempt == attempts - 1:
            return proc
    raise AssertionError("unreachable")


def tail(proc: subprocess.CompletedProcess[str], chars: int = 3000) -> str:
    """A failed command's last output, stdout too: a job that printed its result and then died
    (at exit, say) shows that it had finished, which stderr alone hides."""
    return (f"exit {proc.returncode}\n--- stdout (end) ---\n{proc.stdout[-chars // 2:]}\n"
            f"--- stderr (end) ---\n{proc.stderr[-chars:]}")


def free_port() -> int:
    """A port free at this instant.  Another process may take it before the caller binds it, so
    a caller retries on EADDRINUSE (`run_on_free_port`) or binds port 0 itself (`run_group`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive ports free at this instant, below Linux's ephemeral
    range (32768 on): ports picked by `free_port` and every outgoing connection's local port
    come from that range, so a parallel test cannot take these between the pick and the bind
    (only another pick here could, 1 in thousands)."""
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(20000, 32768 - count)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise AssertionError(f"no {count} consecutive free ports in 20000-32767")


def _rendezvous(rank: int, world: int, ports: Any, timeout: datetime.timedelta) -> Any:
    """Rank 0 hosts the group's store, as under torchrun's env:// rendezvous (tests kill it to
    see the others notice), but binds port 0 and hands the port it got to the other ranks: a
    port picked in advance can be taken by a parallel test before rank 0 binds it, and a rank
    could then even join that test's store."""
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout, wait_for_workers=False)
        for _ in range(world - 1):
            ports.put(store.port)
    else:
        try:
            port = ports.get(timeout=timeout.total_seconds())
        except queue.Empty:
            raise TimeoutError("rank 0 never published its store's port") from None
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout)
    os.environ["MASTER_PORT"] = str(store.port)  # what torchrun would have exported
    return store


def _child(payload: bytes, rank: int, env: dict[str, str], results: Any, pg_timeout: float,
           released: Any, linger_s: float, ports: Any) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    fn, args = cloudpickle.loads(payload)
    try:
        world, timeout = int(env["WORLD_SIZE"]), datetime.timedelta(seconds=pg_timeout)
        dist.init_process_group("gloo", store=_rendezvous(rank, world, ports, timeout),
                                rank=rank, world_size=world, timeout=timeout)
        value = fn(rank, *args)
        results.put((rank, cloudpickle.dumps(value), None, None))
    except BaseException as exc:  # report every failure, including SystemExit
        results.put((rank, None, f"{exc}\n{traceback.format_exc()}", type(exc).__name__))
        results.close()
        results.join_thread()
        if rank == 0:  # its store stays up until every rank reported (bounded by the group's
            # timeout): a rank still joining the group would otherwise fail on the store, not
            # on the test's own error (a test that means rank 0 to die kills it)
            released.wait(min(linger_s, pg_timeout))
        os._exit(1)
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass
    results.close()
    results.join_thread()
    if rank == 0:  # it hosts the store: up until every rank reported (the barrier fails early
        released.wait(linger_s)  # when a test killed ranks, and the others may still poll)
    cleanup.exit_now(0)  # no interpreter finalization to race gloo's threads


def run_group(fn: Callable[..., Any], world: int, *, args: Sequence[Any] = (),
              nodes: Sequence[str] | None = None, timeout: float = 90.0,
              pg_timeout: float = 30.0, extra_env: dict[str, str] | None = None
              ) -> list[Outcome]:
    """Run ``fn(rank, *args)`` on ``world`` gloo ranks; ``nodes[r]`` is rank r's node id."""
    ctx = mp.get_context("spawn")
    results, released, ports = ctx.Queue(), ctx.Event(), ctx.Queue()
    payload = cloudpickle.dumps((fn, tuple(args)))
    node_of = list(nodes) if nodes is not None else ["node0"] * world
    procs = []
    for rank in range(world):
        same = [r for r in range(world) if node_of[r] == node_of[rank]]
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(same.index(rank)), "LOCAL_WORLD_SIZE": str(len(same)),
            "OFFLOAD_NODE_ID": node_of[rank],
            **(extra_env or {}),
        }
        p = ctx.Process(target=_child,
                        args=(payload, rank, env, results, pg_timeout, released, timeout,
                              ports))
        p.start()
        procs.append(p)
    outcomes = {r: Outcome(r, None) for r in range(world)}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)

    def take(block_s: float) -> bool:
        try:
            rank, value, error, etype = results.get(timeout=block_s)
        except queue.Empty:
            return False
        o = outcomes[rank]
        o.value = cloudpickle.loads(value) if value is not None else None
        o.error, o.error_type = error, etype
        reported.add(rank)
        return True

    reported: set[int] = set()
    while len(reported) < world and datetime.datetime.now() < deadline:
        if not take(0.2) and not any(p.is_alive() for r, p in enumerate(procs)
                                     if r not in reported):
            break  # (rank 0 stays alive for the store until `released`)
    released.set()
    for p in procs:
        p.join(timeout=max(0.1, (deadline - datetime.datetime.now()).total_seconds()))
        if p.is_alive():
            p.kill()
            p.join()
    while take(0.1):  # results a rank queued just before it exited
        pass
    for rank in set(range(world)) - reported:
        outcomes[rank].error = outcomes[rank].error or "no result (the rank died or hung)"
    for rank, p in enumerate(procs):
        outcomes[rank].exitcode = p.exitcode
    return [outcomes[r] for r in range(world)]


def shm_entries(directory: str = "/dev/shm") -> set[str]:
    """offload's files in the shm directory, to compare before and after a test (other
    programs, multiprocessing's semaphores included, come and go there concurrently)."""
    return {name for name in os.listdir(directory) if name.startswith("offload")}


def store_drop_load(tier: Any, kv: Sequence[Any], blocks: tuple[int, ...],
                    chunks: tuple[int, ...], positions: tuple[int, ...]) -> None:
    """SPMD round trip every rank runs: store the blocks (the node's writer only, in the
    replicated layout), zero the KV tensors, load the blocks back."""
    from offload import CopyJob

    replicated = tier.plan.layout == "replicated"
    tier.submit(CopyJob(1, "store", blocks, chunks, positions, writer_only=replicated))
    tier.wait([1])
    for t in kv:
        t.zero_()
    tier.submit(CopyJob(2, "load", blocks, chunks, positions))
    tier.wait([2])


def has_our_traceback(text: str) -> bool:
    """Whether a traceback in ``text`` shows a frame of our code (offload/ or launch/): torchrun
    prints its own when a worker exits non-zero, and a virtual environment inside the checkout
    must not count as ours."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return any(f'File "{os.path.join(root, part)}/' in text for part in ("offload", "launch"))


def decide_all(tier: Any, rank: int, decider: int = 0) -> list[tuple[Any, bool, Any, Any]]:
    """Decider: call finished() until nothing is in flight; everyone: learn the final mark.
    Returns this rank's results as (job id, success, failed rank, error) tuples."""
    import torch.distributed as dist

    results = []
    if rank == decider:
        deadline = time.monotonic() + 20
        while tier.actor.jobs.live and time.monotonic() < deadline:
            results += tier.finished()
            time.sleep(0.001)
    box = [tier.mark if rank == decider else None]
    dist.broadcast_object_list(box, src=decider)
    if rank != decider:
        results += tier.finished(box[0])
    return [(r.job_id, r.success, r.failed_rank, r.error) for r in results]
