"""Process-wide closers that must run however the process ends.

torchrun sends SIGTERM to the surviving ranks when one dies, and a user presses Ctrl-C; without
handlers Python would die without unmapping, unregistering or unlinking.  Regions register their
``close`` here; ``run_all`` runs each closer once (newest first), on a signal, at exit, or when
asked.  Closers must be idempotent and must not take locks a signal could interrupt.

Python runs signal handlers between bytecodes of the main thread, so a main thread blocked
inside a collective runs them only once that call returns or times out.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

Closer = Callable[[], None]
_closers: list[Closer] = []
_installed: set[int] = set()


def register(closer: Closer) -> None:
    _closers.append(closer)


def unregister(closer: Closer) -> None:
    """Forget ``closer`` (no error when it is not registered, e.g. already run)."""
    with contextlib.suppress(ValueError):
        _closers.remove(closer)


def run_all() -> None:
    """Run every registered closer once, newest first; failures are logged, never raised.
    Each closer is removed before it runs, so a re-entrant call never runs it twice."""
    while _closers:
        closer = _closers.pop()
        try:
            closer()
        except Exception:
            log.exception("cleanup: %r failed", closer)


def install_signal_handlers(signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
                            ) -> bool:
    """On each signal run all closers, then hand over to the previous Python handler if there
    was one, else exit with status 128 + signum.  Only the main thread may install handlers;
    elsewhere this returns False and does nothing.  Installing twice is harmless."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in set(signums) - _installed:
        _installed.add(signum)
        previous = signal.getsignal(signum)
        signal.signal(signum, _handler(signum, previous))
    return True


def _handler(signum: int, previous: Any) -> Callable[[int, FrameType | None], None]:
    def handle(received: int, frame: FrameType | None) -> None:
        run_all()
        if callable(previous) and previous is not signal.default_int_handler:
            previous(received, frame)
            return
        raise SystemExit(128 + signum)

    return handle


atexit.register(run_all)
