"""The settings of one host tier, shared by the library API and the main job.

Every field here must be identical on every rank; the plan step checks that and names the ranks
and the field that differ.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args

from offload.bounds import MAX_PORT, check_int, check_seconds, check_type
from offload.errors import OffloadError
from offload.system.paths import check_fs_dir, check_shm_dir

# The closed choices, typed for callers; the tuples are what the flags offer and what
# `TierConfig.__post_init__` checks at run time (a value can arrive untyped from a flag or JSON).
Layout = Literal["private", "shared", "replicated"]
PrivateMemory = Literal["anonymous", "memfd"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
PRIVATE_MEMORY: tuple[str, ...] = get_args(PrivateMemory)
GiB = 1 << 30
MiB = 1 << 20
DEFAULT_STAGING_BYTES = 128 * MiB  # `TierConfig.staging_bytes`
FS_BYTES_FACTOR = 4  # default file tier budget: this many times the host budget


@dataclass(frozen=True)
class TierConfig:
    """Geometry and mechanics settings of a tier.  Each field's docstring names the main job's
    flag where it has one; `__post_init__` refuses values out of range with one line naming the
    field, the value and the fix."""

    cpu_bytes_per_node: int
    """Host memory budget of the tier on each node, in bytes (``--cpu-bytes``; per DP replica).
    The plan fits whole chunks into it and never exceeds it (page rounding only lowers the
    chunk count)."""

    layout: Layout = "private"
    """How a node's ranks share host memory (``--layout``, docs/LAYOUTS.md): ``"private"`` one
    region per rank, ``"shared"`` one node region whose rows interleave the ranks' slots,
    ``"replicated"`` one node region holding one copy per pipeline stage."""

    blocks_per_chunk: int = 16
    """KV blocks per chunk (``--blocks-per-chunk``): a chunk is the unit the tier caches and
    evicts, and one row of the host regions."""

    tp: int | None = None
    """Tensor-parallel degree (``--tp``); None: the world size divided by ``pp``."""

    pp: int = 1
    """Pipeline-parallel degree (``--pp``); ranks are ``pp_rank * tp + tp_rank``."""

    page_size: int = 4096
    """Alignment of slots in bytes: a power of two (checked here) and a multiple of the system
    page.  Slots are page-aligned, so rows and segments are page multiples and no page holds two
    ranks' bytes."""

    shm_dir: str | None = None
    """None (the default) makes regions nameless memfds that the kernel frees with the last
    process holding them; a directory keeps visible region files there (it must exist, be
    writable and be memory-backed: checked here, before anything is created)."""

    segment_threshold: int = 2 * GiB
    """A region of at least this many bytes (and more than one row) is split into several
    shmem files, by whole rows: one file serialises page-cache insertion.  The main job sets
    it to twice ``--segment-bytes``; tests shrink it to MiB."""

    min_segment_bytes: int = 1 * GiB
    """Smallest file of a split region (``--segment-bytes``): it gets at most its bytes
    divided by this many files."""

    max_segments: int = 32
    """Most files one region is split into."""

    max_registration_bytes: int = 64 * GiB
    """Cap on one CUDA host registration: a single call of 512 GiB fails on current drivers;
    64 GiB is safe.  Whole-row registrations take as many rows as fit under it."""

    max_slot_rows: int = 65536
    """Most rows for which a node region (shared, replicated) is registered as one range per
    row over the rank's slot; beyond it (or with a slot as wide as the row) whole rows are
    registered instead."""

    prefault_threads: int = 8
    """Threads per rank that pre-fault its region (``--prefault-threads``).  With ``background``
    they run under SCHED_IDLE, using only CPU time the engine leaves, and the ranks whose
    set-up runs on the same CPUs use at most half of them between them (fewer threads per
    rank where that is fewer; DESIGN.md section 3.9)."""

    timeout_s: float = 300.0
    """Seconds a rank waits for a peer (``--timeout``) -- an RPC reply, a hand-off, a job's
    completion on every rank -- before it raises an error naming the ranks behind; positive."""

    fs_dir: str | None = None
    """Enables the file tier behind host memory (``--fs-tier``, docs/FILE_TIER.md): chunks
    evicted from host memory are spilled to files under this directory and read back on a
    lookup that hits on disk.  It must exist and be writable (checked here).  None: no file
    tier."""

    fs_namespace: str | None = None
    """What computed the KV the file tier keeps (``--fs-namespace``; required with ``fs_dir``):
    the model id and revision, and whatever else changes the KV of a token prefix that the
    caller's chunk keys leave out (e.g. a quantization).  It enters the files' fingerprint, so
    a restart with another model never reads the old one's files; engines' block hashes
    commonly leave the model out."""

    fs_bytes: int | None = None
    """The file tier's budget per node in bytes (``--fs-bytes``; needs ``fs_dir``).  None means
    `FS_BYTES_FACTOR` x ``cpu_bytes_per_node`` (`fs_bytes_per_node`), cut at set-up to half
    the room the disk has (free space and folders of earlier runs, `offload.tiers.disk_room`);
    an explicit budget past that room fails set-up with one line."""

    fs_io_timeout_s: float = 5.0
    """Deadline of one file-tier read or write, in seconds (``--fs-io-timeout``): past it the
    key is a miss and serving goes on; a host row that a late read may still fill stays out of
    use until the read returns."""

    private_memory: PrivateMemory = "anonymous"
    """What a nameless private region is made of (``--private-memory``).  ``"anonymous"`` (the
    default) is the process's own memory with transparent huge pages requested
    (``MADV_HUGEPAGE``; the host's THP setting decides) and kept out of forked children
    (``MADV_DONTFORK``, so a fork cannot turn pinned pages copy-on-write): huge pages make
    pre-fault and CUDA registration faster (docs/BENCHMARKS.md, "Private regions on anonymous
    huge pages").  ``"memfd"`` is a nameless shmem file as the node layouts use.  Regions other
    ranks map (shared, replicated) are always shmem files."""

    integrity: bool = True
    """Checksum every page as it is copied (mixed with its tier, tensor, chunk and position),
    keep the sums in a trailer of each slot and check them on every load: a mismatch fails the
    job (DESIGN.md section 6, "Trust").  False (``--no-integrity``) leaves the trailer out."""

    numa: bool = True
    """Pre-fault each rank's pages from threads on its GPU's NUMA node, preferring that node's
    memory (`offload.region.numa`); False (``--no-numa``) leaves placement to the kernel."""

    staging_bytes: int = DEFAULT_STAGING_BYTES
    """GPU memory per rank for the staged path (``--staging-bytes``): whole-chunk jobs are
    gathered or scattered on the GPU through a ring of this many bytes and moved by the copy
    engines, so a copy holds SMs only for a short HBM pass (`offload.transfer.staging`).  0
    turns it off: whole chunks then run on the copy kernel."""

    background: bool = False
    """Background set-up (``--background-setup``, DESIGN.md section 3.9): `HostTier.create`
    returns once the plan is agreed and the regions are mapped, and pre-fault and registration
    continue on the tier's own threads in row order.  Rows come online as every rank has
    registered its part; a job touching a row that is not ready yet fails with reason "not
    ready" on every rank, and the chunk manager hands out only ready rows (`HostTier.ready`,
    `HostTier.wait_ready`)."""

    setup_context: bool = True
    """Background set-up registers in a CUDA context of the tier's own (``PORTABLE``, so the
    engine's context sees the memory pinned and mapped): a registration holds its context's
    driver lock, and in the engine's context every kernel launch issued meanwhile waits for
    it.  Measured inside the tier, 48 GiB over 2 ranks on an H200 host: the engine's launch
    p99 during set-up 0.4 against 0.9 ms; with registrations beside populating (as now)
    0.9-1.0 against 3.8-3.9 ms, and 0.2-0.4% of launches over 2 ms against 3.6-4.2%
    (docs/BENCHMARKS.md, "Registering beside write faults").  It costs about 260 MiB of GPU
    memory per rank for the tier's life, taken as set-up starts (on its own thread, beside the
    copy kernel's JIT, after ``create`` returned): an engine that sizes later allocations from
    the free GPU memory should leave that much, or the context cannot be made and set-up
    registers in the engine's context with a warning.  False (``--no-setup-context``)
    registers in the engine's context.  Without ``background`` nothing registers beside the
    engine: this is moot."""

    keep_s: float = 0.0
    """Keep this tier's host regions and index for this many seconds after its last process
    exits, cleanly or killed (``--keep``; docs/KEEP.md): a tier created meanwhile on the same
    nodes, by the same user, with the same geometry and ``fs_namespace``, adopts them warm.  0
    (the default) keeps nothing.  Needs ``fs_namespace`` (what computed the KV) and nameless
    regions (no ``shm_dir``); private regions are then memfds, as ``private_memory="memfd"``."""

    metrics_port: int | None = None
    """Serve live Prometheus metrics (``offload_*``, `offload.observe.metrics`) on this port plus
    the rank's local rank (``--metrics-port``); needs ``offload[metrics]``.  None: not served."""

    metrics_addr: str = "127.0.0.1"
    """The address the metrics servers listen on (``--metrics-addr``): this host only by
    default; ``0.0.0.0`` lets a remote Prometheus scrape them (docs/SECURITY.md)."""

    def __post_init__(self) -> None:
        # NOTE: a value can arrive untyped (JSON, an engine's extra config, a flag): every
        # field is checked against its annotation first, so no later check or use meets a
        # str where an int belongs, and no float (nan, inf) where a whole number belongs
        hints = _field_types()
        for f in dataclasses.fields(self):
            check_type(getattr(self, f.name), hints[f.name], _describe(f.name),
                       _FIX.get(f.name, ""))
        for name, minimum in _MINIMUM.items():
            value = getattr(self, name)
            if value is not None:
                check_int(value, _describe(name), minimum, fix=_FIX.get(name, ""))
        if self.metrics_port is not None and not 0 < self.metrics_port <= MAX_PORT:
            raise OffloadError(f"{_describe('metrics_port')} = {self.metrics_port} is not a TCP "
                               f"port; give one from 1 to {MAX_PORT} (each rank adds its local "
                               "rank)")
        if self.page_size & (self.page_size - 1):
            raise OffloadError(f"page_size = {self.page_size} is not a power of two; use 4096")
        for name in ("timeout_s", "fs_io_timeout_s"):
            check_seconds(getattr(self, name), _describe(name), _FIX[name])
        if self.shm_dir is not None:
            check_shm_dir(self.shm_dir)
        self._check_file_tier()
        self._check_keep()

    def _check_keep(self) -> None:
        if self.keep_s == 0:
            return
        check_seconds(self.keep_s, _describe("keep_s"), _FIX["keep_s"])
        if self.shm_dir is not None:
            raise OffloadError(f"{_describe('keep_s')} = {self.keep_s:g} cannot keep named "
                               f"regions ({_describe('shm_dir')} = {self.shm_dir!r}); drop "
                               "--shm-dir (nameless regions are kept) or --keep")
        if not self.integrity:
            raise OffloadError(f"{_describe('keep_s')} = {self.keep_s:g} needs page checksums "
                               f"({_describe('integrity')} is off): every adopted page is "
                               "checked on load; drop --no-integrity or --keep")
        if not self.fs_namespace:
            raise OffloadError(f"{_describe('keep_s')} = {self.keep_s:g} needs "
                               f"{_describe('fs_namespace')}: name what computes the KV (the "
                               "model id and revision), so no other model adopts the kept tier")

    def _check_file_tier(self) -> None:
        if self.fs_dir is not None and not self.fs_namespace:
            given = "is empty" if self.fs_namespace == "" else "is not given"
            raise OffloadError(f"{_describe('fs_dir')} is given but {_describe('fs_namespace')} "
                               f"{given}; name what computes the KV (the model id and "
                               "revision), so a restart with another model never reads these "
                               "files")
        if self.fs_namespace is not None and self.fs_dir is None and not self.keep_s:
            raise OffloadError(f"{_describe('fs_namespace')} = {self.fs_namespace!r} is given "
                               f"without {_describe('fs_dir')}; add --fs-tier DIR or drop it")
        if self.fs_bytes is not None and self.fs_dir is None:
            raise OffloadError(f"{_describe('fs_bytes')} = {self.fs_bytes} is given without "
                               f"{_describe('fs_dir')}; add --fs-tier DIR or drop it")
        if self.fs_dir is not None:
            check_fs_dir(self.fs_dir, _describe("fs_dir"))

    @property
    def fs_bytes_per_node(self) -> int:
        """The file tier's budget per node (0 without a file tier)."""
        if self.fs_dir is None:
            return 0
        return self.fs_bytes if self.fs_bytes is not None else FS_BYTES_FACTOR * \
            self.cpu_bytes_per_node

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


_FLAGS = {"cpu_bytes_per_node": "--cpu-bytes", "layout": "--layout",
          "blocks_per_chunk": "--blocks-per-chunk", "tp": "--tp", "pp": "--pp",
          "shm_dir": "--shm-dir", "prefault_threads": "--prefault-threads",
          "min_segment_bytes": "--segment-bytes", "segment_threshold": "--segment-bytes",
          "timeout_s": "--timeout", "fs_dir": "--fs-tier", "fs_bytes": "--fs-bytes",
          "fs_namespace": "--fs-namespace", "keep_s": "--keep",
          "fs_io_timeout_s": "--fs-io-timeout",
          "private_memory": "--private-memory", "integrity": "--no-integrity",
          "metrics_port": "--metrics-port", "metrics_addr": "--metrics-addr",
          "numa": "--no-numa", "staging_bytes": "--staging-bytes",
          "background": "--background-setup", "setup_context": "--no-setup-context"}


@functools.cache
def _field_types() -> dict[str, Any]:
    """The fields' annotations, resolved once (they are strings under postponed evaluation)."""
    return typing.get_type_hints(TierConfig)


# The whole-number fields and their minimum (their maximum is `offload.bounds.MAX_INT`).
_MINIMUM = {"cpu_bytes_per_node": 1, "blocks_per_chunk": 1, "tp": 1, "pp": 1, "page_size": 1,
            "segment_threshold": 1, "min_segment_bytes": 1, "max_segments": 1,
            "max_registration_bytes": 1, "max_slot_rows": 1, "prefault_threads": 1,
            "fs_bytes": 1, "staging_bytes": 0}
# The fix a refusal names where "give an int" / "give at least N" says too little.
_BYTES = "give a size such as 1GiB (in TierConfig a byte count: offload.parse_size('1GiB'))"
_FIX = {"cpu_bytes_per_node": _BYTES, "segment_threshold": _BYTES,
        "min_segment_bytes": _BYTES, "max_registration_bytes": _BYTES, "fs_bytes": _BYTES,
        "staging_bytes": "give GPU bytes such as 134217728 (128MiB), or 0 for no staging",
        "timeout_s": "give the seconds a rank may wait for a peer, such as 300",
        "fs_io_timeout_s": "give the seconds one file-tier read or write may take, such as 5",
        "keep_s": "give the seconds a kept tier waits for the next one, such as 60, or 0"}


def _describe(name: str) -> str:
    """A setting's name as both library users (TierConfig field) and main-job users (flag)
    know it."""
    flag = _FLAGS.get(name)
    return f"{name} ({flag})" if flag else name
