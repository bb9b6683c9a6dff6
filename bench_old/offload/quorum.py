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
* **failures**: a rank whose copy failed writes a record ``fail/<rank>/<k>`` (sequence and
  message) to the store *before* its watermark word counts the failure, so whoever sees the
  count can fetch the record.  Failures are rare; the success path never reads a record.

Deciding and learning decisions is the tier's business (`offload.tier`); this module only says
how far every rank got and which jobs failed.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence

import torch.distributed as dist

from offload.board import Board, new_failures, unpack, unpack_ready
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


class Quorum:
    """This rank's side of the quorum: publish its own watermark, read everyone's.

    Construct it on every rank, collectively in effect: a node leader of a multi-node tier sets
    its node's key here, before any reader can ask for it (the tier's next collective orders
    that).
    """

    def __init__(self, store: dist.Store, topology: Topology, board: Board) -> None:
        self.store = store
        self.topology = topology
        self.board = board
        self._node = topology.nodes.index(topology.node)
        self._remote = [(i, n.ranks) for i, n in enumerate(topology.nodes) if i != self._node]
        self._failures = 0  # this rank's failure records so far
        self._records: dict[int, list[tuple[int, str]]] = {}  # rank -> failure records read
        self._shared: dict[str, list[int]] = {}  # what the leader last shared, per key
        if self._remote and topology.is_leader:
            self.share()

    # ------------------------------------------------------------------ this rank
    def advance(self, completed: int, failures: Sequence[tuple[int, str]] = ()) -> None:
        """This rank has completed every job below ``completed``; ``failures`` lists the
        (sequence, message) of the newly completed ones that failed.  Records first, word
        last: a reader that sees the count finds the records."""
        rank = self.topology.rank
        for seq, message in failures:
            self.store.set(f"fail/{rank}/{self._failures}", f"{seq} {message}")
            self._failures += 1
        self.board.publish(completed, self._failures)

    def share(self) -> None:
        """Node leader of a multi-node tier: publish the node's words if they changed (once per
        poll; a single-node tier returns at once)."""
        if not self._remote or not self.topology.is_leader:
            return
        for key, words in (("node", self.board.words()), ("ready", self.board.ready_words())):
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

    def failures(self, words: Words, first: int, end: int) -> dict[int, tuple[int, str]]:
        """Failed jobs with ``first <= sequence < end``: sequence -> (lowest failing rank,
        message).  Exact for every sequence below `through(words)`: their records were
        written before the words were.  Fetches only records not read before."""
        for rank, word in words.items():
            known = self._records.setdefault(rank, [])
            fresh = new_failures(len(known), unpack(word)[1])
            if fresh:
                keys = [f"fail/{rank}/{k}" for k in range(len(known), len(known) + fresh)]
                for value in self.store.multi_get(keys):
                    number, _, message = value.decode().partition(" ")
                    known.append((int(number), message))
        found: dict[int, tuple[int, str]] = {}
        for rank in sorted(self._records):
            for seq, message in self._records[rank]:
                if first <= seq < end:
                    found.setdefault(seq, (rank, message))
        return found
