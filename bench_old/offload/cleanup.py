"""Process-wide closers that must run however the process ends.

torchrun sends SIGTERM to the surviving ranks when one dies, and a user presses Ctrl-C; without
handlers Python would die without unlinking.  Two kinds of callbacks:

* **unlinkers** remove names that would outlive the process (``--shm-dir`` files between
  creation and the mapping exchange; nameless regions have none).  A signal runs them at once:
  nothing else can leak, because the kernel frees mappings, memfds, hand-off sockets and CUDA
  registrations with the process.
* **closers** (``close`` of a region) unpin and unmap.  A signal does not run them: threads may
  still be pre-faulting or copying into the mapping.  The signal raises ``SystemExit`` instead,
  the main thread unwinds (joining its pools) and ``atexit`` runs the closers, newest first.

Each callback runs once; callbacks must be idempotent and must not take locks a signal could
interrupt.

Python runs signal handlers between bytecodes of the main thread, so a main thread blocked
inside a collective runs them only once that call returns or times out.

Entry points end through `exit_after`, which skips interpreter finalization (why: its
docstring).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

log = logging.getLogger(__name__)

Closer = Callable[[], None]
_closers: list[Closer] = []
_unlinkers: list[Closer] = []
_installed: set[int] = set()


def register(closer: Closer) -> None:
    _closers.append(closer)


def unregister(closer: Closer) -> None:
    """Forget ``closer`` (no error when it is not registered, e.g. already run)."""
    with contextlib.suppress(ValueError):
        _closers.remove(closer)


def register_unlinker(unlinker: Closer) -> None:
    _unlinkers.append(unlinker)


def unregister_unlinker(unlinker: Closer) -> None:
    with contextlib.suppress(ValueError):
        _unlinkers.remove(unlinker)


def run_all() -> None:
    """Run every registered unlinker and closer once, newest first; failures are logged, never
    raised.  Each is removed before it runs, so a re-entrant call never runs it twice."""
    _drain(_unlinkers)
    _drain(_closers)


def _drain(callbacks: list[Closer]) -> None:
    while callbacks:
        callback = callbacks.pop()
        try:
            callback()
        except Exception:
            log.exception("cleanup: %r failed", callback)


def install_signal_handlers(signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
                            ) -> bool:
    """On each signal run the unlinkers, then hand over to the previous Python handler if there
    was one, else raise ``SystemExit(128 + signum)`` (closers then run at exit).  Only the
    main thread may install handlers; elsewhere this returns False and does nothing.
    Installing twice is harmless."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in set(signums) - _installed:
        _installed.add(signum)
        previous = signal.getsignal(signum)
        signal.signal(signum, _handler(signum, previous))
    return True


def _handler(signum: int, previous: Any) -> Callable[[int, FrameType | None], None]:
    def handle(received: int, frame: FrameType | None) -> None:
        _drain(_unlinkers)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(received, frame)
            return
        raise SystemExit(128 + signum)

    return handle


def exit_after(main: Callable[[], int | None]) -> NoReturn:
    """Run an entry point's ``main``, then end the process with its status through
    ``os._exit`` once every unlinker and closer has run and the logs and standard streams are
    flushed.  ``SystemExit`` (argparse, ``--help``, our signal handlers' ``128 + signum``)
    gives the status like a normal exit would; any other exception prints its traceback and
    gives 1, as Python would.

    Why not a normal exit: during interpreter finalization a gloo worker thread that drops the
    last reference to a finished collective's tensors must take the GIL, and Python stops such
    a thread with a forced unwind through torch's noexcept destructor, so the process aborts
    ("terminate called without an active exception") after the job has succeeded.  Caught here
    at the end of launch/prefix_reload.py on a loaded 2-core host (intermittent: a few
    percent of jobs run in a loop, so a full test-suite run, which starts four, often hits it):
    gdb shows ``~AsyncAllgatherWork`` in ``ProcessGroupGloo::runLoop`` -> ``decref_pyobject`` ->
    ``take_gil`` -> ``pthread_exit`` while the main thread is in ``Py_FinalizeEx``; upstream
    pytorch/pytorch#190489, which ``destroy_process_group`` does not avoid.  Skipping
    finalization leaves nothing to race; the kernel reclaims mappings, memfds, sockets and CUDA
    state with the process."""
    status: object
    try:
        status = main()
    except SystemExit as exc:
        status = exc.code
    except BaseException:
        traceback.print_exc()
        status = 1
    if status is not None and not isinstance(status, int):
        print(status, file=sys.stderr)  # what Python prints for SystemExit("message")
        status = 1
    exit_now(status or 0)


def exit_now(status: int = 0) -> NoReturn:
    """End the process with ``status`` after every unlinker and closer has run and the logs and
    standard streams are flushed, without interpreter finalization (`exit_after` says why): for
    processes whose work is done, such as spawned ranks."""
    run_all()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


atexit.register(run_all)
