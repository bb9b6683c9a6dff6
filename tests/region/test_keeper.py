# SPDX-License-Identifier: Apache-2.0
"""The keeper process (`offload.region.keeper`) and its admin command (`offload.keep`): it holds
memfds while a client is attached, counts ``keep_s`` down once none is (a clean close or a
SIGKILL alike) and then exits, freeing them; it serves only its own user and a client accepts
only a keeper of its own user."""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid

import pytest

from offload import keep
from offload.region import kept
from offload.region.keeper import KeeperError, KeeperLink, keeper_name, start_keeper
from offload.system.nameless import create_memfd
from tests.other_user import NOBODY, as_root, listener, other_process


def _name() -> str:
    return keeper_name(os.geteuid(), f"test-{uuid.uuid4().hex}", "model")


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie child of ours is reaped, and counts as gone)."""
    try:
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return False
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout_s: float) -> float:
    """Seconds until ``pid`` exited; fails the test past ``timeout_s`` (after killing it)."""
    start = time.monotonic()
    while _alive(pid):
        if time.monotonic() - start > timeout_s:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"keeper {pid} still runs after {timeout_s:g} s")
        time.sleep(0.02)
    return time.monotonic() - start


def _keeper_with_part(name: str, keep_s: float, nbytes: int = 1 << 20
                      ) -> tuple[KeeperLink, int]:
    link = start_keeper(name, keep_s, "node", "model", timeout_s=10)
    assert link is not None
    info, _ = link.request("claim", owner="t1", keep_s=keep_s)
    fd = create_memfd("t", nbytes)
    try:
        link.request("put", [fd], tag="L0", sizes=[nbytes])
    finally:
        os.close(fd)
    return link, info["pid"]


def test_idle_keeper_exits_after_keep_s_and_its_memfds_go_with_it() -> None:
    name = _name()
    link, pid = _keeper_with_part(name, keep_s=0.5)
    assert any("offload-t" in os.readlink(f"/proc/{pid}/fd/{fd}")
               for fd in os.listdir(f"/proc/{pid}/fd"))  # it holds the memfd
    link.close()  # the tier's life ends: the countdown starts
    waited = wait_gone(pid, timeout_s=10)
    assert 0.3 < waited < 5, waited
    assert KeeperLink.connect(name, 1) is None  # the abstract name went with it


def test_an_attached_keeper_outlives_keep_s_and_a_new_life_gets_its_memfds() -> None:
    name = _name()
    link, pid = _keeper_with_part(name, keep_s=0.3)
    time.sleep(1.0)  # attached: no countdown
    assert _alive(pid)
    link.close()
    time.sleep(0.05)
    second = KeeperLink.connect(name, 5)  # within keep_s: adopted
    assert second is not None
    info, _ = second.request("claim", owner="t2")
    assert info["parts"] == {"L0": [1 << 20]} and info["bytes"] == 1 << 20
    _, fds = second.request("get", tag="L0")
    assert len(fds) == 1 and os.fstat(fds[0]).st_size == 1 << 20
    os.close(fds[0])
    second.close()
    wait_gone(pid, timeout_s=10)


def test_a_claimed_keeper_refuses_another_tier_and_a_drop() -> None:
    name = _name()
    link, pid = _keeper_with_part(name, keep_s=5)
    try:
        other = KeeperLink.connect(name, 5)
        assert other is not None
        with pytest.raises(KeeperError, match="in use by the live tier t1"):
            other.request("claim", owner="t2")
        with pytest.raises(KeeperError, match="attached"):
            other.request("drop")
        with pytest.raises(KeeperError, match="needs a claim"):
            other.request("get", tag="L0")
        other.close()
        assert kept.drop(name) is not None and _alive(pid)
    finally:
        link.close()
    assert kept.drop(name) is None  # idle now: dropped at once, not after keep_s
    assert wait_gone(pid, timeout_s=5) < 2


def test_list_shows_this_users_keepers_and_drop_all_frees_the_idle_ones() -> None:
    name = _name()
    link, pid = _keeper_with_part(name, keep_s=30)
    try:
        found = dict(kept.keepers())
        assert found[name]["bytes"] == 1 << 20 and found[name]["attached"] == 1
        assert found[name]["pid"] == pid
        assert keep.main(["list"]) == 0
    finally:
        link.close()
    found = dict(kept.keepers())
    assert found[name]["attached"] == 0 and 0 < found[name]["left_s"] <= 30
    assert name in kept.drop_idle()
    wait_gone(pid, timeout_s=5)


def test_sigkill_of_the_attached_client_starts_the_countdown() -> None:
    name = _name()
    link, pid = _keeper_with_part(name, keep_s=0.5)
    link.close()

    def attach(pipe: int) -> None:
        client = KeeperLink.connect(name, 5)
        assert client is not None
        client.request("claim", owner="t3")
        os.write(pipe, b"a")
        time.sleep(60)

    with other_process(attach, uid=None, timeout_s=5) as child:
        assert child.read() == b"a"
        time.sleep(1.0)  # past keep_s, while attached
        assert _alive(pid)
        os.kill(child.pid, signal.SIGKILL)
    wait_gone(pid, timeout_s=10)


def test_sigkill_of_the_keeper_frees_everything_at_once() -> None:
    name = _name()
    link, pid = _keeper_with_part(name, keep_s=60)
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid, timeout_s=5)
    with pytest.raises(KeeperError, match="went away"):
        link.request("info")
    link.close()
    assert KeeperLink.connect(name, 1) is None


@as_root
def test_the_keeper_serves_no_other_user() -> None:
    name = _name()
    link, pid = _keeper_with_part(name, keep_s=5)

    def stranger(pipe: int) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect("\0" + name)
        try:
            sock.sendall(b'\x00\x00\x00\x0f{"op": "info"}')
            answer = sock.recv(100)
        except (ConnectionResetError, BrokenPipeError):  # closed before or while we wrote
            answer = b""
        os.write(pipe, b"closed" if answer == b"" else b"answered")

    try:
        with other_process(stranger) as child:
            assert child.read_all() == b"closed"
    finally:
        link.close()
        kept.drop(name)
    wait_gone(pid, timeout_s=5)


@as_root
def test_a_keeper_name_squatted_by_another_user_is_refused() -> None:
    name = _name()

    with other_process(listener(name.encode()), timeout_s=1) as child:
        assert child.read() == b"r"
        with pytest.raises(KeeperError, match=f"held by uid {NOBODY}"):
            KeeperLink.connect(name, 5)
        assert start_keeper(name, 1, "n", "m", 5) is None  # the name is taken: no keeper
        os.kill(child.pid, signal.SIGKILL)


def test_an_oversized_message_is_refused_before_its_body_is_read() -> None:
    """A length past the wire's bound fails at once, with the sender still connected and no
    body sent: nothing waits for (or buffers) what was announced."""
    from offload.region.keeper import _LEN, _MAX_MESSAGE, receive_message

    ours, theirs = socket.socketpair()
    try:
        ours.settimeout(5)
        theirs.sendall(_LEN.pack(_MAX_MESSAGE + 1) + b"{")
        began = time.monotonic()
        with pytest.raises(ConnectionError):
            receive_message(ours)
        assert time.monotonic() - began < 1
    finally:
        ours.close()
        theirs.close()
