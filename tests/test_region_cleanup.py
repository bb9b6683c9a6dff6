"""The process-wide closer registry and its signal handlers, in real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

from offload import cleanup
from tests.harness import shm_entries


def test_run_all_runs_each_closer_once_newest_first_and_survives_failures() -> None:
    order: list[str] = []

    def bad() -> None:
        order.append("bad")
        raise RuntimeError("closer failed")

    cleanup.register(lambda: order.append("first"))
    cleanup.register(bad)
    cleanup.register(lambda: order.append("last"))
    cleanup.run_all()
    cleanup.run_all()
    assert order == ["last", "bad", "first"]


def test_unregistered_closers_do_not_run() -> None:
    ran: list[int] = []

    def closer() -> None:
        ran.append(1)

    cleanup.register(closer)
    cleanup.unregister(closer)
    cleanup.unregister(closer)  # harmless twice
    cleanup.run_all()
    assert ran == []


def test_sigterm_closes_a_live_region_and_exits_143() -> None:
    """A child builds a named (not yet unlinked) region file, registers a closer that removes it,
    then waits; SIGTERM must run the closer and exit with 128 + 15."""
    job = uuid.uuid4().hex[:12]
    path = f"/dev/shm/offload-{job}-sig"
    script = textwrap.dedent(f"""
        import os, sys, time
        from offload import cleanup
        open({path!r}, "wb").close()
        cleanup.register(lambda: os.unlink({path!r}))
        assert cleanup.install_signal_handlers()
        print("ready", flush=True)
        time.sleep(30)
        sys.exit(0)
    """)
    before = shm_entries()
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(__file__)))
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    assert os.path.exists(path)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=10) == 128 + signal.SIGTERM
    assert {n for n in shm_entries() - before if job in n} == set()
