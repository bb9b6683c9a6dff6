"""Watermark board and quorum: word layout in one process, then real gloo groups on one and two
(simulated) nodes."""

from __future__ import annotations

import os
import random
import statistics
import time

import pytest
import torch.distributed as dist

from offload.control.board import LINE_BYTES, Board, new_failures, pack, unpack
from offload.control.quorum import FLOOR_STEP, Quorum, default_store
from offload.control.topology import NodeInfo, Topology
from offload.errors import OffloadError
from offload.system.nameless import create_memfd
from tests.harness import free_port, run_group

# ---------------------------------------------------------------- one process


def test_a_word_packs_the_watermark_and_a_modular_failure_count() -> None:
    assert unpack(pack(123456789, 3)) == (123456789, 3)
    assert unpack(pack(7, (1 << 20) + 2)) == (7, 2)  # failures wrap; readers use differences
    assert new_failures((1 << 20) - 1, 1) == 2


def test_each_rank_owns_a_word_in_its_own_128_byte_line() -> None:
    fd = create_memfd("test-board", 3 * LINE_BYTES)
    try:
        boards = [Board(fd, 3, slot) for slot in range(3)]
        boards[1].publish(5, 1)
        boards[2].publish(9, 0)
        expected = bytearray(3 * LINE_BYTES)  # word i at byte 128 * i, nothing else written
        expected[LINE_BYTES:LINE_BYTES + 8] = pack(5, 1).to_bytes(8, "little")
        expected[2 * LINE_BYTES:2 * LINE_BYTES + 8] = pack(9, 0).to_bytes(8, "little")
        assert os.pread(fd, 3 * LINE_BYTES, 0) == bytes(expected)
        assert boards[0].words() == [0, pack(5, 1), pack(9, 0)]
        for b in boards:
            b.close()
            b.close()
    finally:
        os.close(fd)


def _one_rank_quorum(store: dist.Store) -> Quorum:
    topology = Topology(0, 1, 1, 1, (NodeInfo("n0", (0,)),))
    fd = create_memfd("test-board", LINE_BYTES)
    try:
        return Quorum(store, topology, Board(fd, 1, 0))
    finally:
        os.close(fd)


def test_failure_records_are_stored_before_the_word_counts_them() -> None:
    store = dist.HashStore()
    q = _one_rank_quorum(store)
    q.advance(2)
    q.advance(5, [(2, "boom"), (4, "bad block 99")])
    assert store.get("fail/0") == b'[2, "boom"]\n[4, "bad block 99"]\n2'
    words = q.words()
    assert q.through(words) == 5 and q.laggards(words, 5) == [0] and q.laggards(words, 4) == []
    assert q.failures(words, 0, 5) == {2: (0, "boom"), 4: (0, "bad block 99")}
    assert q.failures(words, 3, 5) == {4: (0, "bad block 99")}
    store.delete_key("fail/0")  # records already read are not fetched again
    assert q.failures(q.words(), 0, 3) == {2: (0, "boom")}
    assert q.counts() == ((0, 2),)
    q.board.close()


class _WordAtEachSet:
    """A store that notes this rank's board word as each record is written."""

    def __init__(self, board: Board) -> None:
        self.board = board
        self.words_at_set: list[int] = []
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.words_at_set.append(self.board.words()[0])
        self.values[key] = value.encode()


def test_no_reader_can_see_a_failure_count_before_its_record() -> None:
    """The word is published last: while a record is being written (or if the writer dies
    then), readers still see the old word, so nobody waits on a record that is not there."""
    q = _one_rank_quorum(dist.HashStore())
    store = _WordAtEachSet(q.board)
    q.store = store  # type: ignore[assignment]
    q.advance(3)
    q.advance(7, [(4, "boom"), (6, "bad")])
    q.advance(9, [(8, "worse")])
    assert store.words_at_set == [pack(3, 0), pack(7, 2)]
    assert unpack(q.board.words()[0]) == (9, 3)
    q.board.close()


def _simulated_nodes(nodes: list[str], store: dist.Store) -> list[Quorum]:
    """One `Quorum` per rank in this process: ``nodes[r]`` is rank r's node, each node its own
    board, every rank on the one ``store``."""
    names = list(dict.fromkeys(nodes))
    infos = tuple(NodeInfo(n, tuple(r for r, m in enumerate(nodes) if m == n)) for n in names)
    fds = {i.node_id: create_memfd("test-board", len(i.ranks) * LINE_BYTES) for i in infos}
    try:
        quorums = []
        for rank, name in enumerate(nodes):
            (info,) = (i for i in infos if i.node_id == name)
            board = Board(fds[name], len(info.ranks), info.ranks.index(rank))
            quorums.append(Quorum(store, Topology(rank, len(nodes), len(nodes), 1, infos),
                                  board))
        return quorums
    finally:
        for fd in fds.values():
            os.close(fd)


class _Learner:
    """A rank's decisions in a quorum simulation, as the tier makes them: everything below
    ``learned`` is decided, and the floor is that mark (every job is kept until decided)."""

    def __init__(self, quorum: Quorum) -> None:
        self.quorum = quorum
        self.learned = 0
        self.decided: dict[int, tuple[int, str] | None] = {}
        quorum.first_needed = lambda: self.learned

    def learn(self, through: int) -> None:
        self.decided.update((s, self.quorum.failure(s)) for s in range(self.learned, through))
        self.learned = through
        self.quorum.settle()


@pytest.mark.parametrize("decider", [0, 1, 2])
def test_a_follower_finds_every_failure_the_decider_counted(decider: int) -> None:
    """Ranks complete and fail jobs, leaders share and followers learn the decider's marks in
    a random order (marks skipped too): every follower reads the decider's very failures --
    the lowest failing rank's message for each job -- from the counts the mark carries, never
    from its own, possibly stale, view of another node."""
    rng = random.Random(decider)
    jobs = 400
    quorums = _simulated_nodes(["a", "a", "b"], dist.HashStore())
    ranks = [_Learner(q) for q in quorums]
    completed = [0] * 3
    truth: dict[int, tuple[int, str]] = {}
    marks: list[tuple[int, tuple[tuple[int, int], ...]]] = []
    while min(r.learned for r in ranks) < jobs:
        action = rng.random()
        if action < 0.4:  # a rank completes a few jobs, failing some
            r = rng.randrange(3)
            end = min(jobs, completed[r] + rng.randint(1, 4))
            failed = [(s, f"rank {r} failed {s}") for s in range(completed[r], end)
                      if rng.random() < 0.2]
            for s, message in failed:  # the lowest failing rank's message wins
                truth[s] = min(truth.get(s, (r, message)), (r, message))
            quorums[r].advance(end, failed)
            completed[r] = end
        elif action < 0.6:  # a leader shares its node's words
            quorums[rng.choice([0, 2])].share()
        elif action < 0.8:  # the decider decides what its view shows
            words = quorums[decider].words()
            through = quorums[decider].through(words)
            if through > ranks[decider].learned:
                quorums[decider].read(words)
                ranks[decider].learn(through)
                marks.append((through, quorums[decider].counts()))
        else:  # a follower learns a mark: the next one or the latest
            r = rng.choice([r for r in range(3) if r != decider])
            later = [m for m in marks if m[0] > ranks[r].learned]
            if later:
                through, counts = later[0] if rng.random() < 0.5 else later[-1]
                quorums[r].catch_up(counts)
                ranks[r].learn(through)
    expected = {s: truth.get(s) for s in range(jobs)}
    for r in ranks:
        assert r.decided == expected
        assert all(s >= r.learned for s in r.quorum._failed)  # nothing kept below the floor
    for q in quorums:
        q.board.close()


def test_failure_records_stay_flat() -> None:
    """10^5 jobs fail on rank 1 (node b) and rank 0 (node a) decides them, rank 1 follows:
    the store's keys, every rank's kept records and the cost of a decision stay flat."""
    store = dist.HashStore()
    quorums = _simulated_nodes(["a", "b"], store)
    decider, follower = (_Learner(q) for q in quorums)
    chunk, sizes, times = 10_000, [], []
    for seq in range(10 * chunk):
        began = time.perf_counter()
        quorums[1].advance(seq + 1, [(seq, f"integrity: job {seq}")])
        quorums[0].advance(seq + 1)
        for q in quorums:  # each node's leader polls
            q.share()
        words = quorums[0].words()
        quorums[0].read(words)
        decider.learn(quorums[0].through(words))
        quorums[1].catch_up(quorums[0].counts())
        follower.learn(decider.learned)
        times.append(time.perf_counter() - began)
        if (seq + 1) % chunk == 0:  # fail at the first chunk that grew, not after 10^5
            kept = [len(q._failed) + len(q._kept) + len(q._read) for q in quorums]
            sizes.append(store.num_keys())
            assert sizes == [sizes[0]] * len(sizes) and max(kept) <= 3 * FLOOR_STEP, (sizes, kept)
    assert decider.decided[77_777] == follower.decided[77_777] == (1, "integrity: job 77777")
    # the second chunk is the reference: records up to a floor step are kept from there on
    second, last = (statistics.median(times[i:i + chunk]) for i in (chunk, len(times) - chunk))
    assert last < 2 * second + 20e-6, (second, last)
    for q in quorums:
        q.board.close()


def test_default_store_falls_back_to_the_torchrun_address(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    assert not dist.is_initialized()
    for name, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for attempt in range(3):  # a parallel test may take the picked port first (EADDRINUSE)
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        try:
            store = default_store("offload", timeout_s=10)
            break
        except dist.DistNetworkError:
            if attempt == 2:
                raise
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_default_store_without_group_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(OffloadError, match="init_process_group or launch with torchrun"):
        default_store("offload")


# ---------------------------------------------------------------- real groups
# Ordering between ranks comes from gloo barriers, never from sleeps, so the checks are exact.


def _watermarks(rank: int, tier_id: str) -> dict[str, object]:
    """Every rank advances to 10 + rank with a failure on rank 1; leaders share their node's
    words; every rank then reads all of them."""
    from offload.control.topology import discover

    topology = discover(None, 1, 20)
    board = Board.open(topology, tier_id, default_store(f"board-{tier_id}"), 20)
    q = Quorum(default_store("quorum-test"), topology, board)
    dist.barrier()  # every leader has set its node key
    seen: dict[str, object] = {"through_before": q.through(q.words())}
    q.advance(10 + rank, [(3, f"rank {rank} failed")] if rank == 1 else [])
    dist.barrier()  # every board word is written
    q.share()  # leaders of a multi-node tier copy their node's words to the store
    dist.barrier()
    words = q.words()
    seen["completed"] = [unpack(words[r])[0] for r in sorted(words)]
    seen["through"] = q.through(words)
    seen["laggards"] = q.laggards(words, 10)
    seen["failures"] = q.failures(words, 0, 10)
    dist.barrier()
    board.close()
    return seen


@pytest.mark.parametrize("nodes", [None, ["a", "a", "b", "b"]], ids=["one-node", "two-nodes"])
def test_every_rank_reads_every_watermark(nodes: list[str] | None) -> None:
    out = run_group(_watermarks, 4, args=(f"t{time.monotonic_ns()}",), nodes=nodes)
    assert all(o.ok for o in out), [o.error for o in out]
    for o in out:
        assert o.value == {"through_before": 0, "completed": [10, 11, 12, 13], "through": 10,
                           "laggards": [0], "failures": {3: (1, "rank 1 failed")}}
