"""A job's check and packing in one native call (``job_check.c``): the fast path of `submit`.

`layout.check_job` costs ~15 whole-array numpy calls per job, and the kernel then copies the
two checked arrays into its pinned staging slot: fixed costs that dominate a small job's
`submit`.  One C call reads the three columns, checks every index, marks destinations to refuse
repeats and writes the job packed ``[blocks | host pages]`` in a fraction of that host time
for engine-sized jobs; very large jobs are memory-bound either way (docs/BENCHMARKS.md, "Every
job checked in one C call").

The columns are read through the buffer protocol (numpy arrays of any integer type, strided or
not) or as lists and tuples of ints, so the C holds the GIL (`ctypes.PyDLL`) and is compiled
against this interpreter's headers, which a host that runs Triton has; without them, or without
a compiler, with ``OFFLOAD_NATIVE=0``, or on a free-threaded Python (where another thread
could change a list while the C reads it), every job takes the numpy path.

The C never raises.  Anything it does not accept -- another input type (a CPU tensor, numpy
scalars in a list), an index out of range, a repeated destination -- goes to the numpy path,
which either accepts it or raises the error: one source of error messages, and the numpy path
stays the reference the tests hold the C to.

Repeats are found with stamps: an int32 per destination (the space `UniqueDestinations` checks,
when it is at most its scratch limit); a job marks its destinations with a number no earlier
job used and a repeat finds its own mark, so nothing is cleared between jobs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sysconfig
from collections.abc import Callable, Mapping
from functools import cache

import numpy as np

from offload.build_cache import SOURCES, load
from offload.transfer.layout import Job, SlotLayout, UniqueDestinations

log = logging.getLogger(__name__)

SOURCE = SOURCES["job_check"]
FIELDS = {"blocks": 0, "host_pages": 1}  # job_check.c's ``field``
LAST_STAMP = 2**31 - 1


# where a job of n entries may be packed: an int array of at least 2n, and who owns it
Target = Callable[[int], tuple[np.ndarray, object]]


class CheckContext(ctypes.Structure):
    """``struct offload_check`` of job_check.c, field by field."""

    _fields_ = [("num_blocks", ctypes.c_int64), ("chunk_count", ctypes.c_int64),
                ("bpc", ctypes.c_int64), ("field", ctypes.c_int32),
                ("stamps", ctypes.c_void_p)]


@cache
def checker_library() -> ctypes.CDLL | None:
    """The compiled ``job_check.c``, or None where it cannot be built (no Python headers, no
    compiler, ``OFFLOAD_NATIVE=0``) or must not run (a free-threaded Python); logged."""
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        log.info("a free-threaded Python: job checks keep the numpy path (the C reads lists "
                 "that another thread could change)")
        return None
    include = sysconfig.get_paths().get("include", "")
    if not os.path.exists(os.path.join(include, "Python.h")):
        log.info("no Python.h under %r: job checks keep the numpy path", include)
        return None
    lib = load(SOURCE, "job checks", "offload_check_job", [f"-I{include}"], ctypes.PyDLL)
    if lib is not None:
        lib.offload_check_job.argtypes = [ctypes.c_void_p, *[ctypes.py_object] * 4,
                                          ctypes.c_int32]
        lib.offload_check_job.restype = ctypes.c_ssize_t
    return lib


class _Direction:
    """One direction's context and stamps."""

    def __init__(self, layout: SlotLayout, num_blocks: int, chunk_count: int,
                 unique: UniqueDestinations) -> None:
        limit = num_blocks if unique.field == "blocks" else chunk_count * layout.blocks_per_chunk
        if unique.space != limit:  # the C marks stamps[destination] for every in-range one
            raise ValueError(f"{unique.field} destinations span {limit} ids but the repeat "
                             f"check covers {unique.space}")
        self.unique = unique
        stamped = unique.space <= unique.SCRATCH_LIMIT
        self.stamps = np.zeros(unique.space if stamped else 0, dtype=np.int32)
        self.context = CheckContext(num_blocks, chunk_count, layout.blocks_per_chunk,
                                    FIELDS[unique.field],
                                    self.stamps.ctypes.data if stamped else None)
        self.address = ctypes.addressof(self.context)
        self.stamped = stamped
        self.stamp = 0

    def next_stamp(self) -> int:
        """A number no job of this direction has marked with since the stamps were cleared."""
        if self.stamp == LAST_STAMP:
            self.stamps.fill(0)
            self.stamp = 0
        self.stamp += 1
        return self.stamp


class FastCheck:
    """One engine's native job checks, one context per direction (``unique`` names each
    direction's destination rule, as the engine's numpy path uses it)."""

    def __init__(self, lib: ctypes.CDLL, layout: SlotLayout, num_blocks: int, chunk_count: int,
                 unique: Mapping[str, UniqueDestinations]) -> None:
        self._call = lib.offload_check_job
        self._directions = {d: _Direction(layout, num_blocks, chunk_count, u)
                            for d, u in unique.items()}

    def check(self, direction: str, gpu_blocks: object, chunk_ids: object, positions: object,
              target: Target | None = None) -> Job | None:
        """The checked job, or None: the numpy path must check it (and word any error).  The
        job is written packed into a new int64 array, or into ``target(n)``'s array (int32 or
        int64, at least 2n long: the kernel's staging buffer, named in `Job.staged_in`)."""
        try:
            n = len(gpu_blocks)  # type: ignore[arg-type]
            if len(chunk_ids) != n or len(positions) != n:  # type: ignore[arg-type]
                return None  # nothing reserved or allocated for a malformed job
        except TypeError:
            return None
        side = self._directions[direction]
        owner = None
        if target is None:
            packed = np.empty(2 * n, dtype=np.int64)
        else:
            whole, owner = target(n)
            packed = whole[:2 * n]
        if self._call(side.address, packed, gpu_blocks, chunk_ids, positions,
                      side.next_stamp()) != n:
            return None
        job = Job(packed[:n], packed[n:], packed, owner)
        if not side.stamped:
            side.unique.check(job)  # a destination space past the stamps' limit: sorted
        return job
