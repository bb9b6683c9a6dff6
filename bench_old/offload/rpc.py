"""Collective RPC: the actor system's control channel.

Rank 0 (the driver) sends a callable and its arguments, cloudpickled, to every rank's actor
through the torch.distributed store; every rank runs ``fn(actor, *args)`` -- rank 0 too, so the
callable may itself use collectives -- and rank 0 gathers each rank's result.  An exception on any
rank comes back to rank 0 with the rank's number and fails the call; a rank that never answers
fails it after a bounded timeout naming the silent ranks.  Worker ranks sit in `serve` until the
driver releases them (normal end) or aborts (error: they raise too, so the whole job exits
non-zero).

The store is torch.distributed's own (the torchrun rendezvous store behind a PrefixStore), so no
transport of our own is involved; payloads are small (plans, job descriptions, stats).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import cloudpickle
import torch.distributed as dist

from offload.errors import OffloadError, PeerError

log = logging.getLogger(__name__)

_RELEASE = "release"
_ABORT = "abort"
_CALL = "call"
_POST = "post"
_SPINS = 200  # looks at a doorbell before backing off (each a load, a yield between)


class Doorbell(Protocol):
    """Rank 0's request counter where its node's workers can read it without the store."""

    def ring(self, seq: int) -> None: ...

    def rung(self) -> int: ...


@dataclass(frozen=True)
class RemoteFailure:
    """What a rank sends back instead of a result when its callable raised."""

    rank: int
    type_name: str
    message: str
    traceback: str
    user_error: bool


class RPCError(PeerError):
    """A collective call failed on one or more ranks (the message names them)."""

    def __init__(self, message: str, failures: list[RemoteFailure]):
        super().__init__(message)
        self.failures = failures


class Aborted(PeerError):
    """Rank 0 aborted the job; it reports the cause itself, so workers need not repeat it."""


class CollectiveRPC:
    """One control channel.  Create it on every rank with the same store and world.

    ``doorbell`` (rank 0 and the workers on rank 0's node): rank 0 rings it after posting each
    request, and those workers watch it instead of polling the store, so they can spin on it
    briefly (a load, no round trip) and pick a command up within microseconds."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float,
                 poll_s: float = 0.002, doorbell: Doorbell | None = None):
        self.store = store
        self.doorbell = doorbell
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._backoff = 0.0
        self._spins = 0
        self._seq = 0

    # ------------------------------------------------------------------ driver (rank 0)
    def call(self, fn: Callable[..., Any], *args: Any, actor: Any = None,
             timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(actor, *args)`` on every rank; return the results indexed by rank."""
        self._require_driver()
        seq = self._post(_CALL, (fn, args))
        results: list[Any] = [None] * self.world_size
        failures: list[RemoteFailure] = []
        try:
            results[0] = fn(actor, *args)
        except Exception as exc:  # the driver's own failure joins the others'
            failures.append(_failure(0, exc))
        pending = set(range(1, self.world_size))
        started = time.monotonic()
        deadline = started + (timeout_s or self.timeout_s)
        polls = 0
        while pending and time.monotonic() < deadline:
            for r in sorted(pending):
                key = f"res/{seq}/{r}"
                if self.store.check([key]):
                    value = _unpickle_reply(self.store.get(key), r)
                    self.store.delete_key(key)
                    pending.discard(r)
                    if isinstance(value, RemoteFailure):
                        failures.append(value)
                    else:
                        results[r] = value
            if failures and pending:  # a failed peer: give the rest a short grace period
                deadline = min(deadline, time.monotonic() + 5.0)
            if pending:
                time.sleep(min(self.poll_s, 0.0002 * 2 ** min(polls, 4)))
                polls += 1
        if not pending:  # a rank that has not answered may not have read the request yet
            self.store.delete_key(f"req/{seq}")
        if failures or pending:
            raise _call_error(getattr(fn, "__name__", repr(fn)), failures, sorted(pending),
                              time.monotonic() - started)
        return results

    def post(self, fn: Callable[..., Any], *args: Any, actor: Any = None) -> tuple[int, Any]:
        """Run ``fn(actor, *args)`` on every rank without gathering anything: return this
        request's number and rank 0's own result.  A worker's failure is only logged there:
        ``fn`` must report its outcome another way (the actor's `submit` does, through the
        quorum).  `forget` the request once every worker has surely read it."""
        self._require_driver()
        seq = self._post(_POST, (fn, args))
        return seq, fn(actor, *args)

    def forget(self, seq: int) -> None:
        """Delete posted request ``seq`` (every worker has executed it)."""
        self.store.delete_key(f"req/{seq}")

    def release(self) -> None:
        """Let the workers' `serve` return normally."""
        self._require_driver()
        self._post(_RELEASE, None)

    def abort(self, message: str, grace_s: float = 5.0) -> None:
        """Make every worker's `serve` raise ``Aborted(message)``.

        Waits up to ``grace_s`` for the workers to acknowledge: when rank 0's process hosts the
        store (``tcp://`` or ``env://`` rendezvous outside torchrun), exiting at once would take
        the message down with it and leave the workers with a connection error instead.
        """
        self._require_driver()
        seq = self._post(_ABORT, message)
        keys = [f"ack/{seq}/{r}" for r in range(1, self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=grace_s))
        except dist.DistError:
            return  # a worker still busy must find the abort later: leave it in the store
        with contextlib.suppress(dist.DistError):
            for key in [f"req/{seq}", *keys]:
                self.store.delete_key(key)

    # ------------------------------------------------------------------ workers
    def serve(self, actor: Any, idle: Callable[[], float] | None = None,
              idle_limit_s: float | None = None) -> None:
        """Execute the driver's calls until it releases (return) or aborts (raise).

        ``idle()`` runs between polls (the actor reports finished copies there) and returns how
        long to wait before the next poll.  A worker waits for the next command as long as the
        driver lives (a lost store raises `PeerError`); ``idle_limit_s`` bounds that wait too.
        A request that cannot be unpickled here, or a reply that cannot be pickled, goes back
        as this rank's failure of the call instead of ending the worker.
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 drives; it does not serve")
        while True:
            self._seq += 1
            key = f"req/{self._seq}"
            idle_since = time.monotonic()
            self._backoff = 0.0
            self._spins = 0
            try:
                while not self._posted(key):
                    self._await(idle() if idle is not None else 0.05)
                    if (idle_limit_s is not None
                            and time.monotonic() - idle_since > idle_limit_s):
                        raise PeerError(
                            f"rank {self.rank} heard nothing from rank 0 for "
                            f"{idle_limit_s:g} s (idle_limit_s); the driver is gone or "
                            "idle longer than allowed: raise idle_limit_s or leave it unset")
            except dist.DistError as exc:
                raise PeerError(f"rank {self.rank} lost the store rank 0 serves: "
                                f"{str(exc).splitlines()[0]}; rank 0 is gone") from None
            try:
                kind, body = cloudpickle.loads(self.store.get(key))
            except Exception as exc:  # e.g. a callable from a module this rank cannot import
                self._reply(_failure(self.rank, exc, "the request could not be unpickled"))
                continue
            if kind == _RELEASE:
                return
            if kind == _ABORT:
                self.store.set(f"ack/{self._seq}/{self.rank}", "1")
                raise Aborted(body)
            fn, args = body
            try:
                reply: Any = fn(actor, *args)
            except Exception as exc:
                if kind == _POST:
                    log.debug("rank %d: posted %s failed: %s", self.rank,
                              getattr(fn, "__name__", fn), exc)
                    continue
                reply = _failure(self.rank, exc)
            if kind == _CALL:
                self._reply(reply)

    def _reply(self, reply: Any) -> None:
        try:
            payload = cloudpickle.dumps(reply)
        except Exception as exc:
            payload = cloudpickle.dumps(_failure(self.rank, exc,
                                                 "the reply could not be pickled"))
        self.store.set(f"res/{self._seq}/{self.rank}", payload)

    # ------------------------------------------------------------------ internals
    def _posted(self, key: str) -> bool:
        """Has rank 0 posted the next request?  (A doorbell is read before the store: a
        ring always follows the completed ``set``.)"""
        if self.doorbell is not None:
            return self.doorbell.rung() >= self._seq
        return bool(self.store.check([key]))

    def _await(self, pause: float) -> None:
        """Pause before the next look: with a doorbell first a few hundred looks with only a
        yield between, then (or without one) sleeps of at most ``pause`` (the caller's copies
        may need reporting), backing off from 20 us (0.2 ms on the store) to 50 ms, so a
        command that follows another is picked up at once and an idle worker costs almost
        nothing.  (The store's own timed ``wait`` would block better, but every timeout logs
        two C++ warnings.)"""
        if self.doorbell is not None and self._spins < _SPINS:
            self._spins += 1
            os.sched_yield()
            return
        first = 0.00002 if self.doorbell is not None else 0.0002
        self._backoff = min(self._backoff * 2, 0.05) if self._backoff else first
        time.sleep(min(pause, self._backoff))

    def _post(self, kind: str, body: Any) -> int:
        self._seq += 1
        self.store.set(f"req/{self._seq}", cloudpickle.dumps((kind, body)))
        if self.doorbell is not None:
            self.doorbell.ring(self._seq)
        return self._seq

    def _require_driver(self) -> None:
        if self.rank != 0:
            raise RuntimeError(f"only rank 0 drives the collective RPC (this is rank {self.rank})")


def _failure(rank: int, exc: BaseException, context: str = "") -> RemoteFailure:
    message = f"{context}: {type(exc).__name__}: {exc}" if context else str(exc)
    return RemoteFailure(rank, type(exc).__name__, message, traceback.format_exc(),
                         isinstance(exc, OffloadError) or bool(context))


def _unpickle_reply(payload: bytes, rank: int) -> Any:
    """A worker's reply, or that rank's failure when the driver cannot unpickle it."""
    try:
        return cloudpickle.loads(payload)
    except Exception as exc:
        return _failure(rank, exc, "its reply could not be unpickled on rank 0")


def _call_error(name: str, failures: list[RemoteFailure], silent: list[int],
                waited_s: float) -> RPCError:
    failures = sorted(failures, key=lambda f: f.rank)
    for f in failures:
        if not f.user_error:
            log.error("rank %d failed in %s:\n%s", f.rank, name, f.traceback)
    parts = []
    if failures:
        first = failures[0]
        others = f" (and ranks {[f.rank for f in failures[1:]]})" if len(failures) > 1 else ""
        detail = first.message if first.user_error else f"{first.type_name}: {first.message}"
        parts.append(f"rank {first.rank}{others}: {detail}")
    if silent:
        parts.append(f"ranks {silent} did not answer {name} within {waited_s:.0f} s")
    return RPCError("; ".join(parts), failures)
