"""Watermark board and quorum: word layout in one process, then real gloo groups on one and two
(simulated) nodes."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from offload.control.board import LINE_BYTES, Board, new_failures, pack, unpack
from offload.control.quorum import Quorum, default_store
from offload.control.topology import NodeInfo, Topology
from offload.errors import OffloadError
from offload.region.nameless import create_memfd
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
    assert store.get("fail/0/1") == b"4 bad block 99"
    words = q.words()
    assert q.through(words) == 5 and q.laggards(words, 5) == [0] and q.laggards(words, 4) == []
    assert q.failures(words, 0, 5) == {2: (0, "boom"), 4: (0, "bad block 99")}
    assert q.failures(words, 3, 5) == {4: (0, "bad block 99")}
    store.delete_key("fail/0/0")  # records already read are not fetched again
    assert q.failures(q.words(), 0, 3) == {2: (0, "boom")}
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
    assert store.words_at_set == [pack(3, 0), pack(3, 0)]
    assert unpack(q.board.words()[0]) == (7, 2)
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
