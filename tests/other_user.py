# SPDX-License-Identifier: Apache-2.0
"""A forked child process that runs one action, optionally as another local user (uid 65534), for
tests of what the tier trusts.  Root only for another user: `as_root` skips otherwise.

The child is forked, not spawned: the interpreter and the repository may not be readable by the
other user, and the action needs nothing but ``os`` and ``socket``.  It talks back through a
pipe; `other_process` always reaps it (killed past its deadline), so no process is left behind.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0,
                             reason="needs root to run a process as another user (uid 65534)")


@dataclass
class Child:
    """A running child: its pid and the read end of its pipe."""

    pid: int
    pipe: int

    def read(self, nbytes: int = 1, timeout_s: float = 20.0) -> bytes:
        """Up to ``nbytes`` the child wrote (b"" once it closed the pipe).

        Raises:
            TimeoutError: nothing within ``timeout_s``.
        """
        ready, _, _ = select.select([self.pipe], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"child {self.pid} wrote nothing within {timeout_s:g} s")
        return os.read(self.pipe, nbytes)

    def read_all(self, timeout_s: float = 20.0) -> bytes:
        """Everything the child writes until it closes the pipe."""
        deadline = time.monotonic() + timeout_s
        out = b""
        while chunk := self.read(4096, max(0.0, deadline - time.monotonic())):
            out += chunk
        return out


@contextlib.contextmanager
def other_process(action: Callable[[int], None], uid: int | None = NOBODY,
                  timeout_s: float = 30.0) -> Iterator[Child]:
    """Fork a child that becomes ``uid`` (None: stays this user) and runs ``action(pipe)``;
    its exit status is 0 if ``action`` returned, 1 if it raised (the traceback goes to the
    pipe).  On leaving, the child is waited for up to ``timeout_s`` and killed past it."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(read_end)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            action(write_end)
            code = 0
        except BaseException:
            with contextlib.suppress(BaseException):
                os.write(write_end, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        yield Child(pid, read_end)
    finally:
        os.close(read_end)
        deadline = time.monotonic() + timeout_s
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)


def listener(name: bytes, backlog: int = 4, fill: bool = False) -> Callable[[int], None]:
    """An `other_process` action: listen on the abstract socket ``name`` (its backlog filled by
    one connection never accepted, where ``fill``), write ``r`` to the pipe, then sleep until
    killed -- another user holding a name a tier wants."""

    def listen(pipe: int) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(b"\0" + name)
        sock.listen(backlog)
        if fill:
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.connect(b"\0" + name)
        os.write(pipe, b"r")
        time.sleep(60)

    return listen
