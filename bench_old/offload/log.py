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
