"""Whether this host backs shmem (memfd) regions with transparent huge pages.

Registering a region with CUDA walks its pages; with 4 KiB pages that is what bounds a node
region's start-up, and huge pages register much faster (docs/BENCHMARKS.md, "Private
regions on anonymous huge pages").  Whether shmem pages are huge is a host setting,
``/sys/kernel/mm/transparent_hugepage/shmem_enabled``, which most distributions leave at
``never``.  The leader allocates a node region with ``posix_fallocate`` on its memfds, which
gets huge pages under ``always``, ``within_size`` and ``force`` but not ``advise`` (that one
needs a mapping asking for them at fault time); ``within_size`` more than halves shared
start-up (docs/BENCHMARKS.md, "shmem huge pages for node regions").  The tier cannot change the
setting (root's, host-wide), so it reports it and says how.
"""

from __future__ import annotations

import re
from pathlib import Path

SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
HUGE_WHEN_ALLOCATED = frozenset({"always", "within_size", "force"})


def shmem_huge_mode(path: Path = SHMEM_ENABLED) -> str | None:
    """The selected mode (the bracketed word, e.g. ``never``), or None where the file is
    missing or unreadable (no THP in the kernel, a sandbox)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    found = re.search(r"\[([a-z_]+)\]", text)
    return found.group(1) if found else None


def small_page_hint(mode: str | None) -> str | None:
    """What to tell the user when memfd regions get 4 KiB pages under ``mode``; None when they
    get huge pages or the mode is unknown."""
    if mode is None or mode in HUGE_WHEN_ALLOCATED:
        return None
    return (f"memfd regions get 4 KiB pages on this host (shmem_enabled={mode}), and "
            "registering those with CUDA bounds start-up; as root, `echo within_size > "
            f"{SHMEM_ENABLED}` gives them huge pages (48 GiB shared on an H200 host: "
            "6.07 -> 2.69 s)")
