"""Will the tier fit?  Checks made before any region memory is created.

Nameless (memfd) regions are not bounded by the size of any mount: they take memory until the
host or the container's cgroup has none left, and then the OOM killer, not an error, ends the
job.  So the budget is checked against the memory this process may still fill: the kernel's
``MemAvailable`` estimate and, for every enclosing memory cgroup with a limit, that limit minus
what the cgroup uses, less its reclaimable file cache (weights read from disk sit there and are
dropped on demand; shared memory is not).  A ``--shm-dir`` itself is checked with the other
settings (`offload.system.paths.check_shm_dir`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from offload.errors import OffloadError
from offload.sizes import format_size

_CGROUP_ROOT = "/sys/fs/cgroup"


def check_space(shm_dir: str | None, needed: int) -> None:
    """Fail before anything is created when ``needed`` bytes of shared memory (in ``shm_dir``
    when given) do not fit."""
    if shm_dir is not None:
        st = os.statvfs(shm_dir)
        free = st.f_bavail * st.f_frsize
        if needed > free:
            raise OffloadError(
                f"{shm_dir} has {free} B ({format_size(free)}) free but the node's regions need "
                f"{needed} B ({format_size(needed)}); lower --cpu-bytes or enlarge the mount")
    available, bound = available_memory()
    if needed > available:
        raise OffloadError(
            f"the node's regions need {needed} B ({format_size(needed)}) but only {available} B "
            f"({format_size(available)}) of memory is available ({bound}); lower --cpu-bytes "
            "or free memory (a kept tier holds some until its keep_s ends: `python -m "
            "offload.keep list`, `drop --all`)")


def strict_overcommit(path: str = "/proc/sys/vm/overcommit_memory") -> bool:
    """Whether the host refuses to overcommit (``vm.overcommit_memory`` = 2).  A memfd's page
    is then charged against the commit limit when it is first allocated, and a write fault
    past that limit is a SIGBUS (shmem's own choice), not an error a call returns: touched
    pages must be reserved first."""
    try:
        with open(path) as f:
            return f.read().strip() == "2"
    except OSError:
        return False


def available_memory() -> tuple[int, str]:
    """Bytes of memory this process may still fill, and what bounds it (``MemAvailable`` or
    the tightest enclosing cgroup limit)."""
    best = (meminfo()["MemAvailable"], "MemAvailable in /proc/meminfo")
    for room, where in _cgroup_rooms():
        if room < best[0]:
            best = (room, f"memory cgroup limit of {where}")
    return best


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info


# cgroup v2 and v1 spell the same three facts differently.
_V2 = ("memory.max", "memory.current", ("active_file", "inactive_file"))
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes",
       ("total_active_file", "total_inactive_file"))
_V1_UNLIMITED = 1 << 62  # v1 reports "no limit" as a page-rounded LONG_MAX


def _cgroup_rooms(proc_cgroup: str = "/proc/self/cgroup", root: str = _CGROUP_ROOT
                  ) -> Iterator[tuple[int, str]]:
    """``limit - usage + reclaimable file cache`` of this process's memory cgroup and of each
    of its ancestors that has a limit (a parent's limit binds its children too)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            yield from _rooms(root, path, _V2)
        elif "memory" in controllers.split(","):
            yield from _rooms(os.path.join(root, "memory"), path, _V1)


def _rooms(mount: str, path: str, names: tuple[str, str, tuple[str, ...]]
           ) -> Iterator[tuple[int, str]]:
    max_name, current_name, reclaimable = names
    # Inside a cgroup namespace the mount shows our own cgroup at its root, so walk up from the
    # deepest directory of ``path`` that exists.
    parts = [p for p in path.split("/") if p]
    while parts and not os.path.isdir(os.path.join(mount, *parts)):
        parts.pop(0)
    while True:
        where = os.path.join(mount, *parts)
        limit = _read_int(os.path.join(where, max_name))
        if limit is not None and limit < _V1_UNLIMITED:
            used = _read_int(os.path.join(where, current_name)) or 0
            stat = _read_stat(os.path.join(where, "memory.stat"))
            yield limit - used + sum(stat.get(k, 0) for k in reclaimable), where
        if not parts:
            return
        parts.pop()


def _read_int(path: str) -> int | None:
    """An integer file's value; None when missing or ``max`` (no limit)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _read_stat(path: str) -> dict[str, int]:
    try:
        with open(path) as f:
            return {k: int(v) for k, v in (line.split() for line in f if line.strip())}
    except OSError:
        return {}
