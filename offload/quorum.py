"""The copy-completion quorum: a job is done only when every rank of the quorum has copied.

Each rank adds one to a per-job counter in torch.distributed's key-value store (the c10d `Store`
that `init_process_group` already created), and the scheduling rank reads the counter without
blocking.  A store counter, not a collective, because ranks finish copies at different times
and the scheduler must poll many jobs without making every rank enter a call together.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterable

import torch.distributed as dist

from offload.errors import OffloadError, PeerError


def default_store(prefix: str, timeout_s: float = 300.0) -> dist.Store:
    """The job's torch.distributed store, namespaced under ``prefix``.

    torch has no public accessor for the store `init_process_group` created, so this uses
    `torch.distributed.distributed_c10d._get_default_store`: reusing that store needs no new
    port and inherits its rendezvous (torchrun's agent store included).  Where the private
    accessor is missing (renamed in a later torch) or no default group exists, it falls back to
    a `TCPStore` at ``MASTER_ADDR:MASTER_PORT`` — the address torchrun exports — hosted by rank
    0 unless torchrun's agent already serves it (``TORCHELASTIC_USE_AGENT_STORE``), as torch's
    own ``env://`` rendezvous does.  ``timeout_s`` bounds that fallback's connection and calls.
    """
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        base = _get_default_store()
    except (ImportError, ValueError, RuntimeError):
        base = _env_tcp_store(timeout_s)
    return dist.PrefixStore(prefix, base)


def _env_tcp_store(timeout_s: float) -> dist.Store:
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as exc:
        raise OffloadError(
            f"no torch.distributed process group and no usable torchrun environment ({exc}); "
            "call torch.distributed.init_process_group or launch with torchrun"
        ) from None
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(host, port, world, is_master=rank == 0 and not agent_serves,
                         timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class Quorum:
    """Completion counters of jobs on a c10d store, one key per job under ``prefix``.

    Every rank constructs one over the same store and prefix and reports its copies.  Either
    only the scheduling rank reads (`done`, `wait`) and then `forget`s a job, or every rank
    reads and each `retire`s it once; either way no rank reads a counter after it was deleted.
    Job ids must be unique for the life of a prefix (the scheduler's, or a sequence every rank
    counts alike).
    """

    def __init__(self, store: dist.Store, members: int, prefix: str = "quorum") -> None:
        if members < 1:
            raise OffloadError(f"a quorum needs at least 1 member, got {members}")
        self.store = store
        self.members = members
        self.prefix = prefix

    def _key(self, job_id: int) -> str:
        return f"{self.prefix}/{job_id}"

    def report(self, job_id: int) -> None:
        """This rank's copies of ``job_id`` are complete."""
        self.store.add(self._key(job_id), 1)

    def count(self, job_id: int) -> int:
        """How many ranks have reported ``job_id`` (adding 0 reads without blocking, where
        ``get`` would wait for a key nobody has created yet)."""
        return int(self.store.add(self._key(job_id), 0))

    def done(self, job_id: int) -> bool:
        """Non-blocking: has every member reported ``job_id``?"""
        return self.count(job_id) >= self.members

    def wait(self, job_ids: Iterable[int], timeout_s: float, poll_s: float = 0.002) -> None:
        """Block until every job is done, or raise `PeerError` once ``timeout_s`` has passed,
        naming the first unfinished job and how many ranks reported it (a rank that died or
        hangs stops reporting; the survivors must fail instead of waiting forever)."""
        pending = list(dict.fromkeys(job_ids))
        deadline = time.monotonic() + timeout_s
        delay = poll_s
        while True:
            pending = [job for job in pending if not self.done(job)]
            if not pending:
                return
            if time.monotonic() >= deadline:
                job = pending[0]
                raise PeerError(
                    f"job {job}: {self.count(job)} of {self.members} ranks reported its copies "
                    f"within {timeout_s:g} s ({len(pending)} job(s) unfinished); a rank died or "
                    "stopped answering"
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.05)

    def retire(self, job_id: int) -> None:
        """Every-rank variant of `forget`, for jobs that all ranks read (the SPMD API): each
        rank calls it once after it saw the job done; the last of the members deletes the
        counters, so no rank ever reads a deleted counter."""
        seen = f"{self._key(job_id)}/seen"
        if int(self.store.add(seen, 1)) >= self.members:
            self.store.delete_key(self._key(job_id))
            self.store.delete_key(seen)

    def forget(self, job_id: int) -> None:
        """Delete the counter once the scheduler has consumed a done job, so the store does
        not grow with every job.  Call it only after `done` is true: a later `report` or
        `count` would create the key again."""
        self.store.delete_key(self._key(job_id))
