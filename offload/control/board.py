# SPDX-License-Identifier: Apache-2.0
"""The node's progress board: one watermark word per rank in a nameless shared page.

Every rank of a node maps the same small ``memfd`` (created by the node leader and handed to its
peers over a Unix socket, `offload.system.nameless`).  Rank ``i`` of the node owns the 8-byte word
at byte ``128 * i`` -- its own cache line pair, so a rank's stores never invalidate a line another
rank writes (128 B covers x86's adjacent-line prefetch and Arm cores with 128 B lines).

The word packs two counters a rank only ever increases::

    word = completed << 20 | (failures mod 2**20)

Word 2 of each rank's line is its *ready word*, ``rows << 1 | stopped``: the rows below
``rows`` are usable on that rank (populated and registered), and ``stopped`` says its background
set-up ended on an error short of the whole region (DESIGN.md section 3.9).  It only rises and
only its rank's process writes it -- the set-up's pin thread after a registration returned, the
JIT thread once the copy kernel is compiled, or the main thread after a blocking set-up, one at a
time under the rank's lock (`RankActor._publish_ready`) -- so the same single-writer,
single-aligned-store argument as for the watermark below covers it: a reader who sees ``rows``
may copy into or out of those rows.

Word 3 of each rank's line is its *floor*: the rank will never again look up the failure record
of a job below it (`offload.control.quorum`: records below every rank's floor are dropped).  It only
rises, and only its rank's main thread writes it.

(Word 1 of rank 0's line is the RPC doorbell: the number of the latest request rank 0 posted to
the store, which workers on its node watch instead of polling the store; same single-writer,
single aligned store argument, the store's acknowledged ``set`` preceding the ring.)

``completed``: this rank's jobs are complete through sequence ``completed - 1`` (jobs complete in
submission order on every rank, so one number says it all); ``failures``: how many of them
failed on this rank (each failure's record is in the store under ``fail/<rank>`` *before* the
word counts it).  Packing both into one word means a reader never sees a watermark without the
failures it covers.

Memory ordering (why a plain store and a plain load are enough):

* **Atomicity.** The word is 8-byte aligned (the mapping is page-aligned, the offset a multiple
  of 128) and numpy reads and writes one ``int64`` element with a single aligned 8-byte access
  (``mov`` on x86-64, ``ldr``/``str`` on AArch64); both architectures make such accesses
  single-copy atomic, so a reader sees the old or the new word, never a mix.
* **Writer: copies before the watermark.** A rank raises its watermark only after its engine
  reported the job's copies complete: a CUDA event found complete by `cudaEventQuery` (the device's
  writes to host memory are then visible to the CPU: the driver orders them before signalling the
  event), or host copies that returned.  On x86 (TSO) stores are never reordered with older loads or
  stores, so the watermark store becomes visible after everything that decided it.  On Arm the
  watermark store is *control-dependent* on that completion check (it is executed only after the
  branch on its result), and Arm never makes a store visible before the loads its branch depends
  on are resolved, so the store cannot overtake the completion it announces; a CUDA query or
  synchronize also returns through driver code with full barriers.  This is the release half.
* **Reader: decisions after the watermark.** The decider loads the words, takes the minimum and
  only then acts (returns results, lets chunks be reused, sends the step's broadcast).  Every action
  another process can observe goes through a system call or a store round trip (socket I/O), which
  are full barriers on both architectures, and on Arm the actions are control-dependent on the
  loaded value.  This is the acquire half: nothing is reused or read on the strength of a watermark
  before the watermark was read.

A rank that dies leaves its word where it stopped; the decider sees the minimum not advance and
names that rank once the tier's timeout passes (`offload.control.quorum`).  The board needs no
cleanup: the kernel frees a nameless file when its last mapping goes.

Trust: the board's hand-off name is drawn at random and published only once bound, so no one
can bind it first; a peer maps the board only from a server of its own user (the leader's pid
where known) and only a sealed memfd of this user of the board's exact size (`Board.fetch`); a
forged board would let another user decide jobs complete.  The rendezvous store, which names
the tier, stays the trust boundary (torch.distributed's own).
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch.distributed as dist

from offload.control.stores import await_key
from offload.control.topology import Topology
from offload.system.nameless import (
    FdOffer,
    check_sizes,
    create_memfd,
    fetch_fds,
    new_socket_name,
)

LINE_BYTES = 128
FAILURE_BITS = 20
_FAILURE_MASK = (1 << FAILURE_BITS) - 1
_WORDS_PER_LINE = LINE_BYTES // 8


def pack(completed: int, failures: int) -> int:
    """One rank's watermark word (failures kept modulo 2**20: readers look at differences)."""
    return completed << FAILURE_BITS | failures & _FAILURE_MASK


def unpack(word: int) -> tuple[int, int]:
    """(completed, failures mod 2**20) of a watermark word."""
    return word >> FAILURE_BITS, word & _FAILURE_MASK


def unpack_ready(word: int) -> tuple[int, bool]:
    """(rows ready, stopped on an error) of a ready word."""
    return word >> 1, bool(word & 1)


def new_failures(before: int, now: int) -> int:
    """How many failures a rank added between two reads of its (modular) failure counter."""
    return (now - before) & _FAILURE_MASK


class Board:
    """A node's watermark words; ``slot`` is this rank's index on its node."""

    def __init__(self, fd: int, ranks: int, slot: int) -> None:
        self._map: mmap.mmap | None = mmap.mmap(fd, ranks * LINE_BYTES, mmap.MAP_SHARED,
                                                mmap.PROT_READ | mmap.PROT_WRITE)
        self._words = np.frombuffer(self._map, dtype=np.int64)
        self.ranks = ranks
        self.slot = slot

    @classmethod
    def open(cls, topology: Topology, tier_id: str, store: dist.Store, timeout_s: float,
             leader_pid: int | None = None) -> Board:
        """Node-collective: the leader creates the zeroed board, binds a fresh hand-off name,
        and only then publishes that name in the tier's ``store`` and hands the board to the
        node's ranks; each maps it and closes its descriptor (the mapping keeps it alive).

        The name ends in 128 random bits and reaches the store only once it is bound, so no
        one who reads the store (any local user can) can bind it first.  A peer maps only a
        board its own user's process served (`fetch`).  Every wait is bounded by
        ``timeout_s``.

        Raises:
            PeerError: the leader offered nothing in time, or what was served is not its board.
        """
        ranks, slot = topology.local_world_size, topology.local_rank
        key = f"board/{topology.node_id}"
        if topology.is_leader:
            fd = create_memfd("board", ranks * LINE_BYTES)
            try:
                if ranks > 1:
                    with FdOffer(new_socket_name(tier_id, f"board-{topology.node_id}"),
                                 ranks - 1) as offer:
                        store.set(key, offer.name)
                        offer.hand_out([fd], timeout_s)
                return cls(fd, ranks, slot)
            finally:
                os.close(fd)
        name = await_key(store, key, timeout_s, topology.rank,
                         f"node {topology.node_id}'s board",
                         f"the node leader (rank {topology.node.leader_rank}) offered no board "
                         f"within {timeout_s:g} s; check its error").decode()
        return cls.fetch(name, ranks, slot, timeout_s, leader_pid)

    @classmethod
    def fetch(cls, name: str, ranks: int, slot: int, timeout_s: float,
              leader_pid: int | None = None) -> Board:
        """A peer's side of `open`: fetch the board offered under ``name`` and map it, only
        when its own user's process served it (that very process where ``leader_pid``, learnt
        through the store, is given) and it is a sealed memfd of this user of exactly
        ``ranks * LINE_BYTES`` (`offload.system.nameless.check_sizes`), so no other local user
        can forge or shrink the watermarks the decider trusts.

        Raises:
            PeerError: the leader offered nothing in time, or what was served is not its board.
        """
        (fd,) = fetch_fds(name, 1, timeout_s, leader_pid=leader_pid)
        try:
            check_sizes([fd], [ranks * LINE_BYTES], name)
            return cls(fd, ranks, slot)
        finally:
            os.close(fd)

    def publish(self, completed: int, failures: int) -> None:
        """This rank's new watermark: one aligned 8-byte store (see the module docstring)."""
        self._words[self.slot * _WORDS_PER_LINE] = pack(completed, failures)

    def words(self) -> list[int]:
        """Every rank's word of this node, in local-rank order (one aligned load each)."""
        return self._words[::_WORDS_PER_LINE].tolist()

    def publish_ready(self, rows: int, stopped: bool = False) -> None:
        """This rank's rows below ``rows`` are usable; ``stopped``: its set-up ended on an
        error there (one aligned 8-byte store, as `publish`)."""
        self._words[self.slot * _WORDS_PER_LINE + 2] = rows << 1 | int(stopped)

    def ready_words(self) -> list[int]:
        """Every rank's ready word of this node, in local-rank order (`unpack_ready`)."""
        return self._words[2::_WORDS_PER_LINE].tolist()

    def publish_floor(self, floor: int) -> None:
        """This rank looks up no failure record of a job below ``floor`` any more (one aligned
        8-byte store, as `publish`)."""
        self._words[self.slot * _WORDS_PER_LINE + 3] = floor

    def floors(self) -> list[int]:
        """Every rank's floor of this node, in local-rank order."""
        return self._words[3::_WORDS_PER_LINE].tolist()

    def ring(self, seq: int) -> None:
        """Rank 0 (slot 0 of its node, being its lowest rank): announce RPC request ``seq`` in
        word 1 of its line (`offload.control.rpc.Doorbell`)."""
        self._words[self.slot * _WORDS_PER_LINE + 1] = seq

    def rung(self) -> int:
        """The latest request number rank 0 announced on this node."""
        return int(self._words[1])

    def close(self) -> None:
        """Unmap (idempotent).  The numpy view must go first: it holds a buffer export."""
        if self._map is not None:
            del self._words
            self._map.close()
            self._map = None
