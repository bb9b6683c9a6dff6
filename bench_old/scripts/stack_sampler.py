# SPDX-License-Identifier: Apache-2.0
"""Where a process's threads spend a stretch of time: every thread's Python stack, sampled.

`StackSampler` wakes every ``interval_s`` and reads ``sys._current_frames()``.  For each thread
it counts the innermost frames it found (file:line function), and it notes every wake-up that
came late (``late_s``): the sampler needs the GIL to run, so a late wake-up means some thread
held it, and the first sample after it shows what each thread was doing -- the one inside a C
call that holds the GIL is among them.  Used by ``bench_startup.py --stack-samples``.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback

DEPTH = 3  # innermost frames per sample


class StackSampler:
    def __init__(self, interval_s: float = 0.005, late_s: float = 0.05) -> None:
        self._interval_s, self._late_s = interval_s, late_s
        self._stop = threading.Event()
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.late: list[tuple[float, float, dict[str, str]]] = []  # (at, gap, stacks after)
        self.samples = 0
        self._began = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._began = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        last = time.perf_counter()
        while not self._stop.wait(self._interval_s):
            now = time.perf_counter()
            names = {t.ident: t.name for t in threading.enumerate()}
            stacks = {}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                where = " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                   for f in reversed(traceback.extract_stack(frame)[-DEPTH:]))
                name = names.get(ident, str(ident))
                self.counts[name][where] += 1
                stacks[name] = where
            self.samples += 1
            gap = now - last - self._interval_s
            if gap > self._late_s:
                self.late.append((last - self._began, gap, stacks))
            last = now

    def report(self, top: int = 8) -> str:
        """The most frequent stacks per thread, then every late wake-up with what followed."""
        lines = [f"{self.samples} samples every {1e3 * self._interval_s:.0f} ms"]
        for name, counter in sorted(self.counts.items()):
            lines.append(f"== {name}")
            lines += [f"  {n:6d}  {where}" for where, n in counter.most_common(top)]
        lines.append(f"== wake-ups later than {1e3 * self._late_s:.0f} ms (the GIL was held)")
        for at, gap, stacks in self.late:
            lines.append(f"  at {at:.3f} s, {1e3 * gap:.0f} ms late; then:")
            lines += [f"    {name}: {where}" for name, where in sorted(stacks.items())]
        return "\n".join(lines)
