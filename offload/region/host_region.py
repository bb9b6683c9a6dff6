"""One rank's host region: create, map, pre-fault and pin it per the plan's layout.

A region is one or several shmem files mapped back to back (``shm.Mapping``).  By default they
are nameless memfds (``nameless``): the kernel frees them with the last process holding them,
whatever ends the job.  With ``shm_dir`` they are named files there, for hosts that want to see
them.  Before anything is created the node leader checks that the node's regions fit in memory
(and in ``shm_dir``): one node exchange for private regions (every rank creates its own, so the
check must precede all of them), the first step of the protocol below for node regions.

* ``private`` -- the rank's own memory: anonymous by default (transparent huge pages requested,
  kept out of forked children; `TierConfig.private_memory`), else its own files, nameless or
  unlinked right after creation; no hand-off, nothing to leak even on SIGKILL.
* ``shared`` / ``replicated``, nameless -- the leader binds its hand-off socket under a fresh
  random name, creates and reserves the memfds; node exchange, which carries that name to the
  peers; the leader hands the descriptors to each peer over the
  socket while the peers fetch them, and every rank maps them; node exchange.  Every rank then
  closes its descriptors: only the mappings hold the memory.
* ``shared`` / ``replicated``, named -- the leader creates the files; node exchange; the others
  open, verify and map them; node exchange; every rank then unlinks the paths (the leader's
  unlink is the protocol; the others' closes the window in which a leader killed right after
  the exchange would leak them).  Segment names derive from the tier id, so on any error path
  every rank removes whatever of them is still there.

Then the rank pre-faults its share (``geometry.prefault_ranges``) and registers
``geometry.registration_ranges``.  Slot-sized registrations (shared: one per row over the
rank's slot, pages only it populates) are pipelined: a pin thread registers each as soon as the
pre-fault pieces holding its pages are in.  Whole-row ranges (private; replicated, whose ranks
register their stage's slot but pre-fault one shard; shared with wide slots) are registered
after pre-fault and, for node layouts, the node's exchange, in as few calls as the registration
cap allows: registering a private region in runs behind its pre-fault hid none of the
registration and varied more from host to host, and more pin threads slowed shared's slots
(docs/BENCHMARKS.md, "Nameless regions: node start-up" and "Private registration in runs behind
pre-fault").

With ``background`` set-up, `create` returns once the region is mapped on every rank of the node;
a `BackgroundSetup` then populates and registers it unit by unit in row order
(`geometry.setup_units`), announcing through ``on_ready`` how far it got, and memfds are
reserved behind it by the rank that created them (`BackgroundReservation`).
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from offload.config import TierConfig
from offload.control.plan import Plan
from offload.control.topology import Topology, processes_on_node
from offload.errors import OffloadError, one_line
from offload.region import cleanup
from offload.region.background import (
    MAX_REGISTRATIONS,
    MAX_UNIT_BYTES,
    UNIT_BYTES,
    BackgroundReservation,
    BackgroundSetup,
    ReadyFn,
    process_cpus,
    setup_cpus,
    setup_threads,
    sharing_processes,
)
from offload.region.geometry import (
    ByteRange,
    copy_starts,
    merge_ranges,
    node_registers_whole_rows,
    prefault_ranges,
    region_geometry,
    registration_ranges,
    segment_ranges,
    sized_setup,
)
from offload.region.hugepages import shmem_huge_mode, small_page_hint
from offload.region.numa import Placement, bytes_on_node
from offload.region.pin import Pinner, Registrar
from offload.region.pipeline import PinPipeline
from offload.region.prefault import ProgressFn, plan_pieces, prefault
from offload.region.retain import Retention, attach
from offload.region.space import check_space, strict_overcommit
from offload.region.sync import NodeSync
from offload.system.nameless import (
    FdOffer,
    check_sizes,
    create_memfds,
    fetch_fds,
    new_socket_name,
)
from offload.system.shm import (
    Mapping,
    check_tier_id,
    close_fds,
    create_segments,
    open_segment,
    segment_paths,
    unlink_if_ours,
    unlink_quiet,
)

log = logging.getLogger(__name__)


@dataclass
class KeepSpec:
    """Retention of this rank's region (docs/KEEP.md): ``retention`` is the node leader's
    claimed keeper link (None on other ranks, and on a leader whose node keeps nothing this
    run); ``adopt`` is the group's decision to take every region from the keepers."""

    tier_id: str
    adopt: bool
    retention: Retention | None = None


@dataclass
class RegionStats:
    """What one rank's region cost.  ``timings_s``: ``create`` (files, mapping, unlink and the
    node exchanges around them), ``prefault`` (the populate call), ``pin`` (from the end of
    pre-fault until every range is registered: the part of pinning *not* hidden behind
    pre-fault, node exchanges included) and ``pin_busy`` (time spent inside registration
    calls).  ``pin_error`` is set when registration failed and was rolled back: the region
    then works unpinned and the caller decides, with the group, whether everyone unpins."""

    region_bytes: int = 0
    prefault_bytes: int = 0
    pinned_bytes: int = 0
    pin_plan_bytes: int = 0
    registrations: int = 0
    segments: int = 0
    prefault_fallback: bool = False
    pin_error: str | None = None
    memory: str = ""  # "anonymous" (private default), "memfd" or "file" (--shm-dir)
    shmem_huge: str | None = None  # memfd regions: the host's shmem_enabled mode (hugepages)
    numa_node: int | None = None  # where its pages were placed (None: no placement)
    numa_bytes: int | None = None  # bytes of the region this rank maps found on that node
    background: bool = False  # pre-fault and registration ran behind `create` (section 3.9)
    longest_registration_s: float | None = None  # background: the longest registration call
    own_context: bool | None = None  # background: registered in a CUDA context of its own
    setup_threads: int | None = None  # background: pre-fault (and reservation) threads
    adopted: bool = False  # taken from a keeper: no reservation, pages already populated
    timings_s: dict[str, float] = field(default_factory=dict)


def covers(outer: list[ByteRange], inner: list[ByteRange]) -> bool:
    """Whether every range of ``inner`` lies inside one range of the merged ``outer``."""
    merged = merge_ranges(outer)
    starts = [r.offset for r in merged]
    for r in inner:
        i = bisect.bisect_right(starts, r.offset) - 1
        if i < 0 or merged[i].end < r.end:
            return False
    return True


class HostRegion:
    """This rank's mapping of its region; build it with ``HostRegion.create``.

    ``tensor`` is a uint8 tensor over the whole mapping and ``tensor_view(t)`` this rank's
    ``[chunk_count, blocks_per_chunk, page_bytes[t]]`` view of KV tensor ``t``.  Views must not
    be used after ``close``.
    """

    def __init__(self, plan: Plan, rank: int, registrar: Registrar) -> None:
        self.plan = plan
        self.rank = rank
        self.geometry = region_geometry(plan, rank)
        self.registrar = registrar
        self.stats = RegionStats(region_bytes=self.geometry.total_bytes)
        self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._mapping: Mapping | None = None
        self._paths: list[str] = []
        self._pinner: Pinner | None = None
        self._pipeline: PinPipeline | None = None
        self._setup: BackgroundSetup | None = None
        # background set-up of memfds: the reservation of the files this rank created
        self._reservation: BackgroundReservation | None = None
        # row-relative offsets where a registration may begin inside a row (background
        # set-up's pieces below one row); every copy is split there (`SlotLayout.cuts`)
        self.cuts: tuple[int, ...] = ()
        self.keep: KeepSpec | None = None  # retention (docs/KEEP.md)
        self._own_link: Retention | None = None  # a private non-leader's keeper link

    @property
    def address(self) -> int:
        return self._mapping.address if self._mapping is not None else 0

    @property
    def size(self) -> int:
        return self._mapping.size if self._mapping is not None else 0

    @property
    def background_setup(self) -> BackgroundSetup | None:
        """The background set-up `create` prepared (None for a blocking create)."""
        return self._setup

    def start_setup(self, after: threading.Event | None = None) -> None:
        """Start the background set-up `create` prepared (idempotent; nothing without one):
        the reservation of this rank's memfds at once, the pre-fault and registration once
        ``after`` is set (the copy kernel's JIT, `BackgroundSetup.start`).  The tier starts it
        once its engine is built: a registration holds the CUDA driver, and the engine's own
        allocations would otherwise queue behind every unit's."""
        if self._setup is not None and not self._setup.launched:
            if self._reservation is not None:
                self._reservation.start()
            self._setup.start(after)

    def stop_setup(self) -> None:
        """Stop a background set-up where it is (idempotent; nothing without one)."""
        if self._setup is not None:
            self._setup.stop()
        if self._reservation is not None:
            self._reservation.stop()

    @classmethod
    def create(cls, plan: Plan, topology: Topology, config: TierConfig, tier_id: str,
               registrar: Registrar, progress: ProgressFn | None = None,
               on_ready: ReadyFn | None = None, keep: KeepSpec | None = None) -> HostRegion:
        """Build, pre-fault and pin this rank's region.  Collective over the node for the
        shared and replicated layouts (every local rank must call it); on any failure the
        region is closed and nothing is left in ``config.shm_dir``.

        With ``config.background`` it returns once the region is mapped, and pre-fault and
        registration continue on their own threads; ``on_ready(rows, stopped)`` hears of
        every step (`offload.region.background`)."""
        if config.page_size % mmap.PAGESIZE:
            raise OffloadError(
                f"page_size = {config.page_size} is not a multiple of this host's "
                f"{mmap.PAGESIZE} B memory page; use a multiple of {mmap.PAGESIZE}"
            )
        region = cls(plan, topology.rank, registrar)
        region.keep = keep
        cleanup.register(region.close)
        cleanup.register_unlinker(region.unlink_names)
        try:
            region._build(topology, config, tier_id, progress, on_ready)
        except BaseException:
            region.close()
            raise
        return region

    def _build(self, topology: Topology, config: TierConfig, tier_id: str,
               progress: ProgressFn | None, on_ready: ReadyFn | None) -> None:
        start = time.perf_counter()
        segments = segment_ranges(self.geometry, config)
        lengths = [s.length for s in segments]
        node_layout = self.plan.layout != "private"
        tag = f"L{topology.node.leader_rank}" if node_layout else f"r{topology.rank}"
        files = _Files(config, tier_id, tag, lengths)
        self._paths = files.paths()
        sync = NodeSync(topology)
        needed = self._node_bytes(topology)
        if config.background:
            self.stats.setup_threads = self._setup_threads(sync, topology, config)

        adopt = self.keep is not None and self.keep.adopt
        keeping = self.keep.retention if self.keep is not None else None

        def check() -> str | None:
            if not adopt:  # adopted memory is in use already
                check_space(config.shm_dir, needed)
            return keeping.link.name if keeping is not None else None

        if node_layout:
            self._map_node(sync, topology.is_leader, files, check)
        else:
            name = sync.step("checking the node's memory", check if topology.is_leader else None,
                             share=self.keep is not None)
            if self.keep is not None and name is not None and not topology.is_leader:
                self._own_link = attach(name, self.keep.tier_id, config.timeout_s)
            self._map_private(files, keeping if topology.is_leader else self._own_link)
        self.stats.timings_s["create"] = time.perf_counter() - start
        if self.stats.memory == "memfd":
            self.stats.shmem_huge = shmem_huge_mode()
            hint = small_page_hint(self.stats.shmem_huge)
            if hint and topology.is_leader:
                log.info("rank %d: %s", topology.rank, hint)
        if config.background:
            self._start_background(topology, config, progress, on_ready)
        else:
            self._prefault_and_pin(sync if node_layout else None, topology, config, segments,
                                   progress)

    def _start_background(self, topology: Topology, config: TierConfig,
                          progress: ProgressFn | None, on_ready: ReadyFn | None) -> None:
        slot = self.plan.slots[topology.rank]
        self.cuts, units = sized_setup(
            self.geometry, config, copy_starts(slot.slot_offset, slot.tensor_offsets,
                                               slot.page_bytes, self.plan.blocks_per_chunk,
                                               slot.trailer_offset), UNIT_BYTES,
            MAX_REGISTRATIONS, MAX_UNIT_BYTES)
        self.stats.background = True
        # a unit populates exactly the bytes it registers: the blocking path's registrations
        self.stats.prefault_bytes = self.stats.pin_plan_bytes = units.total_bytes
        self.pinned = self.registrar.counts_as_pinned and len(units) > 0
        pinner = self._pinner = Pinner(self.registrar, self.address)
        placement = Placement.for_node(self.plan.slots[topology.rank].numa_node)
        if placement is not None:
            self.stats.numa_node = placement.node

        def announce(rows: int, stopped: bool) -> None:
            if rows == self.plan.chunk_count or stopped:
                # before the announcement: whoever learns set-up ended (wait_ready, the
                # report) reads final figures and the error; announced whatever they do
                try:
                    self._finish_background_stats()
                except Exception:
                    log.exception("rank %d: background set-up statistics", self.rank)
            if on_ready is not None:
                on_ready(rows, stopped)

        assert self.stats.setup_threads is not None  # set in `_build`
        peers = self._populating_peers(topology, config)
        self._setup = BackgroundSetup(self.address, units, pinner, self.stats.setup_threads,
                                      announce, progress=progress,
                                      on_thread_start=placement.enter if placement else None,
                                      share=(peers.index(topology.rank), len(peers)))

    def _populating_peers(self, topology: Topology, config: TierConfig) -> tuple[int, ...]:
        """The node's ranks that register, and so populate, the same pages as this one (it
        among them): all of them where the node's rows are registered whole, the ranks of a
        replicated stage (its slots), else this rank alone."""
        if node_registers_whole_rows(self.geometry, config):
            return topology.node.ranks
        if self.plan.layout == "replicated":
            return topology.stage_peers
        return (topology.rank,)

    def _setup_threads(self, sync: NodeSync, topology: Topology, config: TierConfig) -> int:
        """Background set-up's pre-fault threads on this rank: the processes whose set-up
        runs on the same CPUs use at most half of them together (`setup_threads`).  The node's
        ranks exchange the CPUs their set-up threads will run on: a launcher may bind each to
        its own, or leave them all on one set (`sharing_processes`)."""

        def mine() -> tuple[list[int], list[int]]:  # inside the exchange: a failure is agreed
            placement = Placement.for_node(self.plan.slots[topology.rank].numa_node)
            affinity = process_cpus()
            cpus = setup_cpus(affinity, placement.cpus if placement is not None else frozenset())
            return sorted(cpus), sorted(affinity)

        node = sync.gather("sharing out the node's CPUs", mine)
        cpus, affinity = (frozenset(c) for c in node[topology.node.ranks.index(topology.rank)])
        sharing = sharing_processes((cpus, affinity), node,
                                    processes_on_node() or topology.local_world_size)
        return setup_threads(config.prefault_threads, sharing, len(cpus))

    def _finish_background_stats(self) -> None:
        """Called on the pin thread once set-up ended (every row, or an error): what the
        blocking path records at the end of `create`."""
        setup, pinner = self._setup, self._pinner
        assert setup is not None and pinner is not None
        self.stats.prefault_fallback = setup.fallback
        self.stats.timings_s["prefault"] = setup.populated_s
        self.stats.timings_s["pin_busy"] = setup.busy_s
        if setup.first_ready_s is not None:
            self.stats.timings_s["first_unit"] = setup.first_ready_s
        reservation = self._reservation
        if reservation is not None and reservation.finished_s is not None:
            self.stats.timings_s["reserve"] = reservation.finished_s
        self.stats.longest_registration_s = setup.longest_call_s
        self.stats.own_context = self.registrar.own_context
        self.stats.registrations = len(pinner.registered)
        self.stats.pinned_bytes = pinner.pinned_bytes
        self.stats.pin_error = setup.error
        if self.stats.numa_node is not None:
            self.stats.numa_bytes = bytes_on_node(self.address, self.geometry.total_bytes,
                                                  self.stats.numa_node)

    def _node_bytes(self, topology: Topology) -> int:
        """What this node's tier creates: every local rank's private region, or the one node
        region."""
        if self.plan.layout != "private":
            return self.geometry.total_bytes
        return sum(region_geometry(self.plan, r).total_bytes for r in topology.node.ranks)

    def _map_private(self, files: _Files, kept: Retention | None) -> None:
        if kept is not None:  # memfds, whatever private_memory says: a keeper holds them
            fds = self._kept_or_new(kept, files, unlink=True)
            try:
                self._attach(fds, files)
            finally:
                close_fds(fds)
            return
        if files.nameless and files.config.private_memory == "anonymous":
            self._mapping = Mapping.anonymous(sum(files.lengths))
            self.tensor = self._mapping.tensor
            self.stats.memory, self.stats.segments = "anonymous", 1
            return
        fds = self._create_files(files, unlink=True)
        self._paths = []
        try:
            self._attach(fds, files)
        finally:
            close_fds(fds)

    def _map_node(self, sync: NodeSync, leader: bool, files: _Files,
                  check: Callable[[], object]) -> None:
        fds: list[int] = []
        offer: list[FdOffer] = []
        peers = sync.topology.local_world_size - 1

        def create() -> str | None:
            check()
            if files.nameless:  # bound before the exchange that tells peers its name
                offer.append(FdOffer(new_socket_name(files.tier_id, files.tag), peers))
            kept = self.keep.retention if self.keep is not None else None
            fds.extend(self._create_files(files) if kept is None
                       else self._kept_or_new(kept, files))
            return offer[0].name if offer else None

        def hand_over_and_map() -> None:
            if files.nameless and leader:
                offer[0].start(fds, files.timeout_s)  # served while we map and exchange
            elif files.nameless:
                assert name is not None  # the leader's step shared it
                fds.extend(fetch_fds(name, len(files.lengths), files.timeout_s,
                                     leader_pid=sync.topology.leader_pid()))
                check_sizes(fds, files.lengths, name)
            elif not leader:
                fds.extend(open_segment(p, n) for p, n in zip(self._paths, files.lengths,
                                                              strict=True))
            self._attach(fds, files)

        try:
            name = sync.step("creating the node's region", create if leader else None,
                             share=True)
            sync.step("handing the node's region over and mapping it", hand_over_and_map)
        finally:
            for o in offer:
                o.close()
            close_fds(fds)
        for path in self._paths:
            unlink_quiet(path)
        self._paths = []

    def _kept_or_new(self, kept: Retention, files: _Files, unlink: bool = False) -> list[int]:
        """This creator's files from the keeper (adopted: populated, reserved, checked), or
        new ones handed to the keeper."""
        assert self.keep is not None
        if self.keep.adopt:
            fds = kept.fetch(files.tag, files.lengths)
            self.stats.adopted = True
            return fds
        fds = self._create_files(files, unlink=unlink)
        try:
            kept.deposit(files.tag, fds, files.lengths)
        except BaseException:
            close_fds(fds)
            raise
        return fds

    def _create_files(self, files: _Files, unlink: bool = False) -> list[int]:
        """Create this region's files (the node leader's, or a private rank's own).  With
        background set-up memfds are left unreserved and a `BackgroundReservation` of this
        rank's reserves them behind `create`, on its own threads: reserving 100 GiB is seconds
        `create` would otherwise spend.  Not named files, whose file system may lack fallocate,
        nor memfds on a host that refuses to overcommit, where set-up's write fault on a page
        not yet reserved would be a SIGBUS (`space.strict_overcommit`)."""
        deferred = files.config.background and files.nameless and not strict_overcommit()
        threads = self.stats.setup_threads or 1  # set in `_build` with background
        fds = files.create(self._paths, unlink=unlink, reserved=not deferred)
        if deferred:
            duplicates: list[int] = []
            try:
                duplicates = _duplicates(fds)
                self._reservation = BackgroundReservation(duplicates, files.lengths, threads)
            except BaseException:
                close_fds(duplicates + fds)
                raise
        return fds

    def _attach(self, fds: list[int], files: _Files) -> None:
        self._mapping = Mapping(fds, files.lengths)
        self.tensor = self._mapping.tensor
        self.stats.memory = "memfd" if files.nameless else "file"
        self.stats.segments = len(fds)

    def _prefault_and_pin(self, sync: NodeSync | None, topology: Topology, config: TierConfig,
                          segments: list[ByteRange], progress: ProgressFn | None) -> None:
        own = prefault_ranges(self.geometry, topology.local_rank, topology.local_world_size)
        registrations = registration_ranges(self.geometry, config)
        pieces = plan_pieces(own, segments, config.prefault_threads, config.page_size)
        self.stats.prefault_bytes = sum(r.length for r in own)
        self.stats.pin_plan_bytes = sum(r.length for r in registrations)
        pinner = self._pinner = Pinner(self.registrar, self.address)
        pipelined = (all(r.length < self.geometry.row_stride for r in registrations)
                     and covers(own, registrations))
        # Slot-sized registrations of pages this rank populates: each as soon as its pieces
        # are in.  Whole-row ranges (private, replicated, shared with wide slots): after
        # pre-fault (and the node's exchange), in as few calls as the cap allows.
        pipeline = self._pipeline = PinPipeline(pinner, registrations,
                                                pieces if pipelined else (),
                                                held=() if pipelined else registrations)
        placement = Placement.for_node(self.plan.slots[topology.rank].numa_node)

        def populate() -> None:
            result = prefault(self.address, pieces, threads=config.prefault_threads,
                              on_piece=pipeline.piece_done if pipelined else None,
                              progress=progress,
                              on_thread_start=placement.enter if placement else None)
            self.stats.prefault_fallback = result.fallback
            self.stats.timings_s["prefault"] = result.seconds
            if placement is not None:
                self.stats.numa_node = placement.node
                self.stats.numa_bytes = bytes_on_node(self.address, self.geometry.total_bytes,
                                                      placement.node)

        def pin() -> None:
            pipeline.release()
            try:
                pipeline.finish()
            except Exception as exc:  # roll back; the group decides to run unpinned
                pinner.unpin_all()
                self.stats.pin_error = one_line(exc)
                log.warning("rank %d could not pin its region, rolled back: %s", self.rank,
                            self.stats.pin_error)

        if sync is None:
            populate()
            pin_start = time.perf_counter()
            pin()
        else:
            sync.step("pre-faulting", populate)
            pin_start = time.perf_counter()
            sync.step("pinning", pin)
        self.stats.timings_s["pin"] = time.perf_counter() - pin_start
        self.stats.timings_s["pin_busy"] = pipeline.busy_s
        self.stats.registrations = len(pinner.registered)
        self.stats.pinned_bytes = pinner.pinned_bytes
        self.pinned = (self.registrar.counts_as_pinned and bool(registrations)
                       and self.stats.pin_error is None)

    def tensor_view(self, t: int) -> torch.Tensor:
        """``[chunk_count, blocks_per_chunk, page_bytes[t]]`` uint8 view of KV tensor ``t``
        in this rank's slot (tensor-major inside the slot)."""
        slot = self.plan.slots[self.rank]
        page = slot.page_bytes[t]
        return self.tensor.as_strided(
            (self.plan.chunk_count, self.plan.blocks_per_chunk, page),
            (self.geometry.row_stride, page, 1),
            slot.slot_offset + slot.tensor_offsets[t],
        )

    def unpin(self) -> None:
        """Unregister every range this rank registered (stopping a background set-up
        first); idempotent."""
        self.stop_setup()
        if self._pipeline is not None:
            self._pipeline.stop()
        if self._pinner is not None:
            self._pinner.unpin_all()
        self.pinned = False
        self.stats.pinned_bytes = 0

    def close(self) -> None:
        """Unlink any path still named, unpin, unmap.  Idempotent; every step clears its state
        before acting, so a signal-handler call interleaved with another finishes the job
        without repeating a step.  Never raises: failures are logged."""
        cleanup.unregister(self.close)
        self.unlink_names()
        _logged(self.unpin)
        _logged(self.registrar.close)  # its own context, if any: after every unregistration
        mapping, self._mapping = self._mapping, None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if mapping is not None:
            _logged(mapping.close)
        link, self._own_link = self._own_link, None
        if link is not None:  # detached: the keeper counts down once the tier's last is
            _logged(link.close)

    def unlink_names(self) -> None:
        """Remove any of this region's file names still present (the only state that outlives
        the process); safe from a signal handler.  Idempotent."""
        cleanup.unregister_unlinker(self.unlink_names)
        paths, self._paths = self._paths, []
        for path in paths:
            _logged(unlink_if_ours, path)


@dataclass(frozen=True)
class _Files:
    """How this region's files are made: nameless memfds (``shm_dir`` None) or named files in
    ``shm_dir``.  Either way their names carry the tier id and the creator's tag (``L<leader>``
    or ``r<rank>``), so ``/proc/<pid>/fd`` and the shm directory say whose they are."""

    config: TierConfig
    tier_id: str
    tag: str
    lengths: list[int]

    def __post_init__(self) -> None:
        check_tier_id(self.tier_id)

    @property
    def nameless(self) -> bool:
        return self.config.shm_dir is None

    @property
    def timeout_s(self) -> float:
        return self.config.timeout_s

    def paths(self) -> list[str]:
        if self.config.shm_dir is None:
            return []
        return segment_paths(self.config.shm_dir, self.tier_id, self.tag, len(self.lengths))

    def create(self, paths: list[str], unlink: bool = False, reserved: bool = True
               ) -> list[int]:
        """Create the files and return their descriptors.  Named files are always reserved;
        memfds unless ``reserved`` is False (background set-up of a node region reserves them
        behind `create`: `BackgroundReservation`)."""
        threads = self.config.prefault_threads
        if self.nameless:
            return create_memfds(f"{self.tier_id}-{self.tag}", self.lengths, threads, reserved)
        return create_segments(paths, self.lengths, threads, unlink=unlink)


def _duplicates(fds: list[int]) -> list[int]:
    """A duplicate of each descriptor (all or none)."""
    made: list[int] = []
    try:
        for fd in fds:
            made.append(os.dup(fd))
    except BaseException:
        close_fds(made)
        raise
    return made


def _logged(fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("closing host region: %r failed", fn)
