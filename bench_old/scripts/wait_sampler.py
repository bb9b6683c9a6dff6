# SPDX-License-Identifier: Apache-2.0
"""What a thread is waiting for in the kernel while one of its timed steps runs long.

`WaitSampler` watches one thread of this process from a small child process (this file run as
a script: the standard library only, so it starts in milliseconds and takes no CPU from what it
watches beyond its reads), so that neither the GIL nor this process's scheduling hides what it
sees.  The watched thread marks each step it times (`begin` with a phase number, `end`) in a
shared page; while a step has run longer than ``after_s``, the child reads the thread's
``/proc/<pid>/task/<tid>/stat`` state, ``wchan`` and, where readable (root), the top of its
kernel ``stack`` every ``interval_s``.  State ``R`` is a thread waiting for a CPU (or running);
``S``/``D`` with a wait channel says for what: ``rwsem_down_*`` a lock such as the mmap lock,
``futex_*`` a user-space lock (a driver's mutex, or the GIL), ``*nanosleep`` a sleep.

``others`` (thread id -> role, e.g. background set-up's pin and pre-fault threads) are read at
the same moments: which of them runs, waits for a CPU (``R``: preempted, maybe inside a call
that holds the mmap lock) or blocks, and the kernel stack of each one not asleep, so a long
wait can be lined up with what they were doing.

Used by ``bench_startup.py --probe-waits`` on the launch probe's thread.
"""

from __future__ import annotations

import collections
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from typing import Any

STACK_FRAMES = 4  # innermost kernel frames kept per sample
# The stacks of the pin thread and the CUDA driver's own threads are kept asleep too, and
# deeper: a registration that sleeps (state S) holds the driver all the same, it may be waiting
# for one of the driver's threads, and the innermost frames of a sleeper are the scheduler's.
ASLEEP_ROLES, ASLEEP_FRAMES = ("pin", "driver"), 10
# Once a step has run this long, every other task on the host running or in uninterruptible
# sleep (R, D) is read once: what a driver call waits for may be a kernel thread's work.
HOST_AFTER_S = 0.02
# ... for at most this long and this many tasks: the scan runs in the sampling loop (~35 us a
# task), and a host of thousands of threads would otherwise leave the step unsampled meanwhile.
HOST_SCAN_S, HOST_MOST = 0.02, 12
BEGAN, PHASE, STOP, READY = range(4)  # the shared page's doubles


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # the same clock in both processes


def _read(path: str) -> str:
    """A /proc file's text, or "" once it is gone.  Any bytes: a task's name is whatever its
    process set, cut at 15 bytes (maybe inside a character)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _state(task: str) -> str:
    """A thread's scheduler state (``R``, ``S``, ``D``, ...), ``?`` once it is gone."""
    stat = _read(f"{task}/stat")
    return stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"


def _sample(task: str, frames: int = STACK_FRAMES) -> tuple[str, str, str]:
    """(state, wait channel, the ``frames`` innermost kernel frames) of one thread."""
    return (_state(task), *_where(task, frames))


def _where(task: str, frames: int = STACK_FRAMES) -> tuple[str, str]:
    """(wait channel, the ``frames`` innermost kernel frames) of one thread."""
    wchan = _read(f"{task}/wchan").strip() or "-"
    kept = [line.split("] ", 1)[-1].split("+", 1)[0]
            for line in _read(f"{task}/stack").splitlines()[:frames]]
    return wchan, " < ".join(kept)


OTHERS_EVERY = 4  # a long step's samples between two reads of the other threads


def _others(pid: int, others: dict[str, str]) -> str:
    """One line on the ``others`` threads: per role the count in each state, then the role,
    state and kernel stack of each one awake (not ``S``) and of those of `ASLEEP_ROLES` in any
    state, e.g. ``pin D1; prefault R2 S6 | pin D: gup_... < ...``."""
    by_role: dict[str, collections.Counter[str]] = {}
    awake = []
    for tid, role in others.items():
        task = f"/proc/{pid}/task/{tid}"
        state = _state(task)  # the stack and wait channel only of those shown
        by_role.setdefault(role, collections.Counter())[state] += 1
        if state != "?" and (role in ASLEEP_ROLES or state != "S"):
            wchan, stack = _where(task, ASLEEP_FRAMES if role in ASLEEP_ROLES
                                  else STACK_FRAMES)
            awake.append(f"{role} {state}: {stack or wchan}")
    counts = "; ".join(f"{role} " + " ".join(f"{s}{n}" for s, n in sorted(c.items()))
                       for role, c in sorted(by_role.items()))
    return counts + (" | " + " / ".join(awake) if awake else "")


def _host(pid: int) -> list[str]:
    """The tasks of the host outside process ``pid`` and this one that run or wait in
    uninterruptible sleep (``R``, ``D``): ``comm state: kernel stack``, at most `HOST_MOST`
    of them and what `HOST_SCAN_S` finds (then a last entry says the scan was cut short)."""
    found: list[str] = []
    deadline = _now() + HOST_SCAN_S
    for proc in os.listdir("/proc"):
        if not proc.isdigit() or int(proc) in (pid, os.getpid()):
            continue
        try:
            tasks = os.listdir(f"/proc/{proc}/task")
        except OSError:  # gone
            continue
        for tid in tasks:
            if len(found) >= HOST_MOST or _now() > deadline:
                return [*found, "(scan cut short)"]
            task = f"/proc/{proc}/task/{tid}"
            state = _state(task)
            if state in ("R", "D"):
                wchan, stack = _where(task)
                found.append(f"{_read(f'{task}/comm').strip()} {state}: {stack or wchan}")
    return found


def _watch(pid: int, tid: int, fd: int, after_s: float, interval_s: float,
           others: dict[str, str]) -> None:
    """The child: sample the thread (and ``others``) while its current step has run past
    ``after_s``; print every long step's samples as JSON once told to stop."""
    page = mmap.mmap(fd, mmap.PAGESIZE)
    marker = memoryview(page).cast("d")
    task = f"/proc/{pid}/task/{tid}"
    steps: dict[str, dict[str, Any]] = {}
    marker[READY] = 1.0
    while not marker[STOP] and os.path.exists(task):
        began, phase = marker[BEGAN], marker[PHASE]
        if began > 0 and _now() - began >= after_s:
            state, wchan, stack = _sample(task)
            at = round(_now() - began, 6)
            if marker[BEGAN] == began:  # the step had not ended while we read
                step = steps.setdefault(repr(began), {"phase": int(phase), "samples": [],
                                                      "others": [], "host": None})
                step["samples"].append((at, state, wchan, stack))
                if step["host"] is None and at >= HOST_AFTER_S:
                    step["host"] = _host(pid)
                # the others after the watched thread, and not at every sample: reading
                # them takes ~1 ms for a dozen threads (a state each, stacks of those shown),
                # which would thin out the watched thread's own samples
                if others and len(step["samples"]) % OTHERS_EVERY == 1:
                    beside = _others(pid, others)
                    if marker[BEGAN] == began:
                        step["others"].append(beside)
        time.sleep(interval_s)
    json.dump(steps, sys.stdout)


class WaitSampler:
    """Create it in the watched thread (it records that thread's id); call `begin`/`end`
    around each timed step there, `stop` from anywhere.  ``steps`` maps each long step's start
    (`time.CLOCK_MONOTONIC`, as `begin` returned it) to its phase and samples."""

    def __init__(self, after_s: float = 0.0005, interval_s: float = 0.0002,
                 others: dict[int, str] | None = None) -> None:
        fd = os.memfd_create("wait-sampler")
        try:
            os.ftruncate(fd, mmap.PAGESIZE)
            self._page = mmap.mmap(fd, mmap.PAGESIZE)
            self._child = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(os.getpid()),
                 str(threading.get_native_id()), str(fd), repr(after_s), repr(interval_s),
                 json.dumps({str(t): role for t, role in (others or {}).items()})],
                pass_fds=[fd], stdout=subprocess.PIPE, text=True)
        finally:
            os.close(fd)
        self._marker = memoryview(self._page).cast("d")
        self.steps: dict[float, dict[str, Any]] = {}
        deadline = time.monotonic() + 30  # the child's interpreter start: steps before it
        while not self._marker[READY] and self._child.poll() is None:  # would go unseen
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)

    def begin(self, phase: int) -> float:
        """Mark a step of ``phase`` as running; returns its start (`CLOCK_MONOTONIC`)."""
        began = _now()
        self._marker[PHASE] = phase
        self._marker[BEGAN] = began
        return began

    def end(self) -> None:
        self._marker[BEGAN] = 0.0

    def stop(self) -> dict[float, dict[str, Any]]:
        self._marker[STOP] = 1.0
        try:
            out, _ = self._child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self._child.kill()
            out, _ = self._child.communicate()
        self.steps = {float(k): v for k, v in json.loads(out or "{}").items()}
        self._marker.release()
        self._page.close()
        return self.steps

    def where(self, began: float) -> str:
        """The step begun at ``began``, in words: its most frequent state and wait channel,
        how often of its samples, and the kernel stack seen with them ("no sample" when the
        sampler never saw it run long); with ``others``, then ``beside:`` their most frequent
        state counts (how often of their reads) and the most frequent awake threads' stacks;
        past `HOST_AFTER_S`, ``elsewhere:`` the host's other running or blocked tasks."""
        step = self.steps.get(began)
        if step is None or not step["samples"]:
            return "no sample"
        seen = collections.Counter((state, wchan) for _, state, wchan, _ in step["samples"])
        (state, wchan), count = seen.most_common(1)[0]
        stacks = collections.Counter(stack for _, s, w, stack in step["samples"]
                                     if (s, w) == (state, wchan) and stack)
        top = f" [{stacks.most_common(1)[0][0]}]" if stacks else ""
        lines = step.get("others", [])
        counts = collections.Counter(line.split(" | ")[0] for line in lines)
        awake = collections.Counter(line.split(" | ", 1)[1] for line in lines if " | " in line)
        also = ""
        if counts:
            summary, seen_n = counts.most_common(1)[0]
            also = f"; beside: {summary} ({seen_n} of {len(lines)})"
            also += f" | {awake.most_common(1)[0][0]}" if awake else ""
        if step.get("host"):
            also += "; elsewhere: " + " / ".join(step["host"])
        return f"{state} {wchan} ({count} of {len(step['samples'])}){top}{also}"


if __name__ == "__main__":
    _watch(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]),
           float(sys.argv[5]), json.loads(sys.argv[6]))
