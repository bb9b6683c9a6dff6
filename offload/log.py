"""Logging where every line carries the rank."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(rank: int | None = None, level: int = logging.INFO) -> None:
    """Route the ``offload`` and ``launch`` loggers to stderr with a ``[rank N]`` prefix."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    for name in ("offload", "launch"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False


class ProgressLog:
    """Rate-limited progress lines for long pre-faults: bytes, GiB/s and ETA every ``every_s``."""

    def __init__(self, what: str, every_s: float = 2.0):
        self.what = what
        self.every_s = every_s
        self._last = 0.0
        self._log = logging.getLogger("offload.progress")

    def __call__(self, done: int, total: int, elapsed: float) -> None:
        if elapsed - self._last < self.every_s or total == 0:
            return
        self._last = elapsed
        rate = done / elapsed / (1 << 30) if elapsed > 0 else 0.0
        eta = (total - done) / (rate * (1 << 30)) if rate > 0 else float("inf")
        self._log.info("%s: %.2f / %.2f GiB (%.0f%%), %.2f GiB/s, ETA %.1f s", self.what,
                       done / (1 << 30), total / (1 << 30), 100.0 * done / total, rate, eta)
