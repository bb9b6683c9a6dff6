"""The completion quorum: every rank's watermark, read without asking anyone.

Every rank submits the same jobs in the same order (SPMD, or the driver's broadcast), so a job is
known by its *sequence number* -- its place in that order -- and, because each rank's engine
completes jobs in submission order, one number per rank says how far it got: the rank has
completed every job with a smaller sequence (its *watermark*).  A job is complete on the quorum
once the minimum watermark over the ranks is past it.  Nothing is written per job.

Where the watermarks live:

* **this node**: the `Board`, a shared page with one word per rank (`offload.board`: layout and
  the memory-ordering argument).  Reading it is a few loads.
* **other nodes**: each node's leader copies its node's board words into one store key
  (``node/<i>``) when they changed, once per poll -- not per job, not per rank; a reader fetches
  one key per other node.  Single-node tiers never touch the store.
* **failures**: a rank whose copy failed rewrites its one record key ``fail/<rank>`` -- a
  JSON line ``[sequence, message]`` for each of its failures some rank may still look up, in
  order, then its failure count -- *before* its watermark word counts the failure, so whoever
  sees the count finds the record; a reader decodes only the lines it has not read.  Failures
  are rare; the success path never reads a record.

Failure records do not pile up.  Each rank publishes a *floor* (board word 3, shared across nodes
under ``floor/<i>`` rounded down to `FLOOR_STEP`): the lowest sequence whose record it may still
look up -- its oldest job not yet returned.  A rank keeps in memory only the records at or above
its own floor, indexed by sequence, and a writer leaves out of its key every record below every
rank's floor.  So the store holds one key per rank that ever failed, and memory and the cost of a
decision stay flat however many jobs failed.  A lower floor is always safe (a record is kept
longer), so a stale or rounded one never loses a record anyone needs.

Deciding and learning decisions is the tier's business (`offload.tier`); this module only says
how far every rank got and which jobs failed.
"""

from __future__ import annotations

import datetime
import heapq
import json
import os
from collections.abc import Callable, Iterable, Sequence

import torch.distributed as dist

from offload.board import Board, unpack, unpack_ready
from offload.errors import OffloadError
from offload.topology import Topology


def default_store(prefix: str, timeout_s: float = 300.0) -> dist.Store:
    """The job's torch.distributed store, namespaced under ``prefix``.

    torch has no public accessor for the store `init_process_group` created, so this uses
    `torch.distributed.distributed_c10d._get_default_store`: reusing that store needs no new
    port and inherits its rendezvous (torchrun's agent store included).  Where the private
    accessor is missing (renamed in a later torch) or no default group exists, it falls back to
    a `TCPStore` at ``MASTER_ADDR:MASTER_PORT`` -- the address torchrun exports -- hosted by rank
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


Words = dict[int, int]  # global rank -> its packed watermark word
Failure = tuple[int, str]  # (lowest failing rank, its message) of one failed job
FLOOR_STEP = 64  # floors are shared across nodes in steps of this many jobs (`Quorum.share`)


class Quorum:
    """This rank's side of the quorum: publish its own watermark, read everyone's.

    Construct it on every rank, collectively in effect: a node leader of a multi-node tier sets
    its node's keys here, before any reader can ask for them (the tier's next collective orders
    that).  ``first_needed`` gives the lowest sequence whose failure record this rank may still
    look up (the tier sets it; it must never decrease); until then every record is kept.
    """

    def __init__(self, store: dist.Store, topology: Topology, board: Board) -> None:
        self.store = store
        self.topology = topology
        self.board = board
        self.first_needed: Callable[[], int] = lambda: 0
        self._node = topology.nodes.index(topology.node)
        self._remote = [(i, n.ranks) for i, n in enumerate(topology.nodes) if i != self._node]
        self._written = 0  # this rank's failures so far
        self._kept: list[tuple[int, str]] = []  # this rank's records in its key: (seq, JSON)
        self._floor = 0  # this rank's published floor
        self._read: dict[int, int] = {}  # rank -> its failures counted in the record read last
        self._seen: dict[int, int] = {}  # rank -> failure count of its word when read last
        self._failed: dict[int, Failure] = {}  # seq -> failure, for seqs at or above the floor
        self._seqs: list[int] = []  # heap of `_failed`'s sequences, to drop those below floor
        self._shared: dict[str, list[int]] = {}  # what the leader last shared, per key
        if self._remote and topology.is_leader:
            self.share()

    # ------------------------------------------------------------------ this rank
    def advance(self, completed: int, failures: Sequence[tuple[int, str]] = ()) -> None:
        """This rank has completed every job below ``completed``; ``failures`` lists the
        (sequence, message) of the newly completed ones that failed.  Record first, word
        last: a reader that sees the count finds the record."""
        if failures:
            self._write(failures)
        self.board.publish(completed, self._written)
        self.settle()

    def _write(self, failures: Sequence[tuple[int, str]]) -> None:
        """Rewrite this rank's record key with the new failures, leaving out those below every
        rank's floor (nobody looks them up any more)."""
        self._written += len(failures)
        self._kept.extend((seq, json.dumps([seq, message])) for seq, message in failures)
        low = self._lowest_floor()
        drop = 0
        while drop < len(self._kept) and self._kept[drop][0] < low:
            drop += 1
        del self._kept[:drop]
        lines = [record for _, record in self._kept]  # each encoded once
        self.store.set(f"fail/{self.topology.rank}", "\n".join([*lines, str(self._written)]))

    def _lowest_floor(self) -> int:
        """A lower bound of every rank's floor: this node's from the board, the others' from
        their shared (rounded, perhaps stale: only ever lower) keys."""
        low = min(self.board.floors())
        if self._remote:
            for value in self.store.multi_get([f"floor/{i}" for i, _ in self._remote]):
                low = min(low, *map(int, value.decode().split(",")))
        return low

    def settle(self) -> None:
        """Publish this rank's floor if it rose, and forget the failures below it."""
        floor = self.first_needed()
        if floor == self._floor:
            return
        if floor < self._floor:  # records below the old floor may be gone: a tier bug
            raise RuntimeError(f"rank {self.topology.rank}'s failure-record floor fell from "
                               f"{self._floor} to {floor}")
        self._floor = floor
        self.board.publish_floor(floor)
        while self._seqs and self._seqs[0] < floor:
            del self._failed[heapq.heappop(self._seqs)]

    def share(self) -> None:
        """Node leader of a multi-node tier: publish the node's words if they changed (once per
        poll; a single-node tier returns at once).  Floors go in steps of `FLOOR_STEP`, so
        that key changes once per that many jobs, not at every decision."""
        if not self._remote or not self.topology.is_leader:
            return
        floors = [f - f % FLOOR_STEP for f in self.board.floors()]
        for key, words in (("node", self.board.words()), ("ready", self.board.ready_words()),
                           ("floor", floors)):
            if words != self._shared.get(key):
                self.store.set(f"{key}/{self._node}", ",".join(map(str, words)))
                self._shared[key] = words

    # ------------------------------------------------------------------ every rank
    def words(self) -> Words:
        """Every rank's latest word: this node's from the board, each other node's from its
        one store key."""
        return self._everyone(self.board.words(), "node")

    def ready_words(self) -> Words:
        """Every rank's ready word (`offload.board.unpack_ready`): this node's from the
        board, each other node's from the key its leader shares when they change (set, all
        zero, when its `Quorum` was made; then on the leader's polls)."""
        return self._everyone(self.board.ready_words(), "ready")

    def _everyone(self, mine: list[int], key: str) -> Words:
        """This node's words ``mine`` and every other node's from its ``<key>/<node>`` store
        key (one `multi_get`), by global rank."""
        words = dict(zip(self.topology.node.ranks, mine, strict=True))
        if self._remote:
            values = self.store.multi_get([f"{key}/{i}" for i, _ in self._remote])
            for (_, ranks), value in zip(self._remote, values, strict=True):
                words.update(zip(ranks, map(int, value.decode().split(",")), strict=True))
        return words

    @staticmethod
    def ready_rows(words: Words) -> int:
        """The tier's ready watermark: rows below it are usable on every rank."""
        return min(unpack_ready(w)[0] for w in words.values())

    @staticmethod
    def through(words: Words) -> int:
        """Jobs with a sequence below this are complete on every rank."""
        return min(unpack(w)[0] for w in words.values())

    @staticmethod
    def laggards(words: Words, seq: int) -> list[int]:
        """Ranks that have not completed job ``seq``."""
        return sorted(r for r, w in words.items() if unpack(w)[0] <= seq)

    # ------------------------------------------------------------------ failure records
    def read(self, words: Words) -> None:
        """Fetch the record of every rank whose word counts failures not read yet (one
        `multi_get`; none when no count moved).  Afterwards `failure` is exact for every
        sequence below `through(words)` at or above this rank's floor: those records were
        written before the words were."""
        fresh = []
        for rank, word in words.items():
            count = unpack(word)[1]
            if count != self._seen.get(rank, 0):
                self._seen[rank] = count
                fresh.append(rank)
        self._fetch(fresh)

    def catch_up(self, counts: Iterable[tuple[int, int]]) -> None:
        """Fetch the record of every rank of which ``counts`` (the decider's `counts`) holds
        more failures than this rank has read: afterwards `failure` agrees with the decider's
        for every sequence below the decider's mark at or above this rank's floor."""
        self._fetch([rank for rank, count in counts if count > self._read.get(rank, 0)])

    def counts(self) -> tuple[tuple[int, int], ...]:
        """(rank, failures read of it) for every rank of which a failure was read: what a
        follower fetches up to (`catch_up`)."""
        return tuple(sorted((r, n) for r, n in self._read.items() if n))

    def _fetch(self, ranks: list[int]) -> None:
        if not ranks:
            return
        values = self.store.multi_get([f"fail/{rank}" for rank in ranks])
        for rank, value in zip(ranks, values, strict=True):
            records, _, count = value.rpartition(b"\n")
            new = int(count) - self._read.get(rank, 0)
            if new <= 0:
                continue
            self._read[rank] = int(count)
            for line in records.rsplit(b"\n", new)[-new:] if records else ():  # the new ones
                seq, message = json.loads(line)
                self._note(seq, rank, message)

    def _note(self, seq: int, rank: int, message: str) -> None:
        """Index one record by its sequence; the lowest failing rank's message wins."""
        if seq < self._floor:
            return
        known = self._failed.get(seq)
        if known is None:
            heapq.heappush(self._seqs, seq)
        if known is None or rank < known[0]:
            self._failed[seq] = (rank, message)

    def failure(self, seq: int) -> Failure | None:
        """(lowest failing rank, its message) of job ``seq`` as read so far, or None."""
        return self._failed.get(seq)

    def failures(self, words: Words, first: int, end: int) -> dict[int, Failure]:
        """Failed jobs with ``first <= sequence < end``: sequence -> (lowest failing rank,
        message) (`read`, then the index: exact below `through(words)`)."""
        self.read(words)
        if end - first <= len(self._failed):
            return {s: f for s in range(first, end) if (f := self._failed.get(s)) is not None}
        return {s: f for s, f in self._failed.items() if first <= s < end}
