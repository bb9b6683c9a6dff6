"""Collective RPC over real gloo groups: results, remote exceptions, silent ranks, abort."""

from __future__ import annotations

import time

import pytest

from offload.control.quorum import default_store
from offload.control.rpc import Aborted, CollectiveRPC, RPCError
from offload.errors import OffloadError, PeerError
from tests.harness import run_group


def _rpc(rank: int, world: int, timeout_s: float = 10.0) -> CollectiveRPC:
    return CollectiveRPC(default_store("rpc-test"), rank, world, timeout_s)


def _square_rank(actor: dict, offset: int) -> int:
    return actor["rank"] ** 2 + offset


def test_call_gathers_every_rank_result_in_order() -> None:
    def body(rank: int) -> object:
        rpc = _rpc(rank, 3)
        actor = {"rank": rank}
        if rank == 0:
            first = rpc.call(_square_rank, 10, actor=actor)
            second = rpc.call(lambda a: a["rank"] * 2, actor=actor)  # closures travel too
            rpc.release()
            return first, second
        rpc.serve(actor)
        return "released"

    out = run_group(body, 3)
    assert all(o.ok for o in out), [o.error for o in out]
    assert out[0].value == ([10, 11, 14], [0, 2, 4])
    assert out[1].value == out[2].value == "released"


def test_remote_exception_names_the_rank_and_workers_keep_serving() -> None:
    def fails_on_two(actor: dict) -> int:
        if actor["rank"] == 2:
            raise OffloadError("shm dir /x is too small")
        return actor["rank"]

    def body(rank: int) -> object:
        rpc = _rpc(rank, 3)
        actor = {"rank": rank}
        if rank == 0:
            with pytest.raises(RPCError) as info:
                rpc.call(fails_on_two, actor=actor)
            after = rpc.call(lambda a: a["rank"], actor=actor)
            rpc.abort("giving up")
            return str(info.value), [f.rank for f in info.value.failures], after
        with pytest.raises(Aborted, match="giving up"):
            rpc.serve(actor)
        return "aborted"

    out = run_group(body, 3)
    assert all(o.ok for o in out), [o.error for o in out]
    message, failed, after = out[0].value
    assert message == "rank 2: shm dir /x is too small"
    assert failed == [2] and after == [0, 1, 2]


def test_bug_on_a_rank_reports_type_and_rank() -> None:
    def body(rank: int) -> object:
        rpc = _rpc(rank, 2)
        if rank == 0:
            with pytest.raises(RPCError, match=r"rank 1: ZeroDivisionError"):
                rpc.call(lambda a: 1 // a, actor=1)
            rpc.release()
            return "ok"
        rpc.serve(0)
        return "served"

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]


def test_a_rank_that_never_answers_fails_the_call_within_the_timeout() -> None:
    def hang_on_one(actor: dict) -> int:
        if actor["rank"] == 1:
            time.sleep(12)
        return actor["rank"]

    def body(rank: int) -> object:
        rpc = _rpc(rank, 3, timeout_s=2.0)
        actor = {"rank": rank}
        if rank == 0:
            began = time.monotonic()
            with pytest.raises(PeerError, match=r"ranks \[1\] did not answer hang_on_one"):
                rpc.call(hang_on_one, actor=actor)
            return time.monotonic() - began
        rpc.serve(actor)
        return None

    out = run_group(body, 3, timeout=40, pg_timeout=20)
    assert out[0].error is None and out[0].value is not None
    assert 1.5 < out[0].value < 5.0


def test_only_rank_zero_drives() -> None:
    def body(rank: int) -> object:
        rpc = _rpc(rank, 2)
        if rank == 1:
            with pytest.raises(RuntimeError, match="only rank 0 drives"):
                rpc.call(_square_rank, 0, actor={})
        return rank

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]


def _explode(message: str) -> None:
    raise RuntimeError(message)


class _Unloadable:
    """Pickles fine, but unpickling it raises (as a callable from a module the worker cannot
    import would)."""

    def __reduce__(self) -> tuple:
        return _explode, ("cannot rebuild this here",)


def test_a_request_a_worker_cannot_unpickle_is_that_ranks_error() -> None:
    def body(rank: int) -> object:
        rpc = _rpc(rank, 3, timeout_s=30.0)
        actor = {"rank": rank}
        if rank == 0:
            began = time.monotonic()
            with pytest.raises(RPCError) as info:
                rpc.call(lambda a, payload: a["rank"], _Unloadable(), actor=actor)
            waited = time.monotonic() - began
            after = rpc.call(lambda a: a["rank"], actor=actor)  # the workers still serve
            rpc.release()
            return str(info.value), waited, after
        rpc.serve(actor)
        return "released"

    out = run_group(body, 3)
    assert all(o.ok for o in out), [o.error for o in out]
    message, waited, after = out[0].value
    assert message.startswith("rank 1 (and ranks [2]): the request could not be unpickled: "
                              "RuntimeError: cannot rebuild this here"), message
    assert waited < 10 and after == [0, 1, 2]


def test_a_reply_that_cannot_be_pickled_is_that_ranks_error() -> None:
    def body(rank: int) -> object:
        import threading

        rpc = _rpc(rank, 2, timeout_s=30.0)
        if rank == 0:
            began = time.monotonic()
            with pytest.raises(RPCError, match=r"^rank 1: the reply could not be pickled: "
                                               r"TypeError: .*lock"):
                rpc.call(lambda a: threading.Lock() if a == 1 else 0, actor=0)
            waited = time.monotonic() - began
            rpc.release()
            return waited
        rpc.serve(1)
        return "released"

    out = run_group(body, 2)
    assert all(o.ok for o in out), [o.error for o in out]
    assert out[0].value < 10


def test_serve_waits_without_limit_unless_given_one() -> None:
    def body(rank: int) -> object:
        import inspect

        rpc = _rpc(rank, 2)
        if rank == 0:
            time.sleep(1.5)  # idle longer than rank 1's limit
            return None
        assert inspect.signature(rpc.serve).parameters["idle_limit_s"].default is None
        began = time.monotonic()
        with pytest.raises(PeerError, match=r"heard nothing from rank 0 for 0.5 s "
                                            r"\(idle_limit_s\)"):
            rpc.serve({}, idle_limit_s=0.5)
        return time.monotonic() - began

    out = run_group(body, 2)
    assert out[1].ok, out[1].error
    assert 0.5 <= out[1].value < 1.5


def test_workers_on_rank_zeros_node_take_commands_from_the_doorbell() -> None:
    """With a doorbell (the board word) the workers read no request before it rings: a request
    set in the store without a ring is not picked up; the ring is."""

    def body(rank: int, tier_id: str) -> object:
        from offload.control.board import Board
        from offload.control.topology import discover

        board = Board.open(discover(None, 1, 20), tier_id, default_store(f"board-{tier_id}"),
                           20)
        rpc = CollectiveRPC(default_store("rpc-bell"), rank, 3, 10.0, doorbell=board)
        actor = {"rank": rank}
        if rank == 0:
            first = rpc.call(_square_rank, 1, actor=actor)
            rpc.store.set("req/2", b"not a request")  # no ring: nobody may read it yet
            time.sleep(0.5)
            rpc._seq = 1
            second = rpc.call(_square_rank, 2, actor=actor)  # overwrites req/2 and rings
            rpc.release()
            board.close()
            return first, second
        rpc.serve(actor)
        rung = board.rung()
        board.close()
        return rung

    out = run_group(body, 3, args=(f"t{time.monotonic_ns()}",))
    assert all(o.ok for o in out), [o.error for o in out]
    assert out[0].value == ([1, 2, 5], [2, 3, 6])
    assert out[1].value == out[2].value == 3  # two calls and the release rang
