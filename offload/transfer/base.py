"""The engine protocol and what every backend shares: tensor checks, job checks, ordering.

A backend only decides *how* one checked job's pages move (`_issue`); checking the KV tensors
and the region once, checking each job and keeping jobs in submission order live here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Literal, Protocol, TypeAlias

import numpy as np
import torch

from offload.errors import MalformedJob, OffloadError
from offload.integrity import UNIT_BYTES, WORD, store_generation, trailer_bytes
from offload.transfer.fast_check import FastCheck, Target, checker_library
from offload.transfer.layout import (
    IndexArray,
    Job,
    SlotLayout,
    UniqueDestinations,
    check_job,
    show_value,
    tensor_ranges,
)
from offload.transfer.tensors import KVGeometry, kv_geometry, page_view, region_pages

# what a job is ordered after: an event, a stream, or None for the device's current stream
After: TypeAlias = torch.cuda.Event | torch.cuda.Stream | None

Direction = Literal["store", "load"]
DIRECTIONS: tuple[Direction, ...] = ("store", "load")


class TransferEngine(Protocol):
    """Moves one rank's blocks between its KV tensors and its host region.

    ``store`` copies GPU -> host, ``load`` host -> GPU.  Jobs complete in submission order; a job
    id is reported exactly once, by ``poll`` or ``wait_all``.

    Stream contract (CUDA backends): a job runs on the engine's own stream, ordered after
    ``after`` -- a ``torch.cuda.Event`` (the job waits for it), a ``torch.cuda.Stream`` (the job
    waits for the work queued on it so far) or ``None`` (the current stream of the KV tensors'
    device, so a store sees the compute kernels' pending writes and a load does not overtake
    them).  ``submit`` returns the job's completion event: a compute stream that
    ``wait_event``-s it may read loaded blocks (or overwrite stored ones) without a host round
    trip.  The host backend finishes the job inside ``submit`` and returns ``None``.

    ``submit`` is ``prepare`` (every check, nothing moved) then ``issue``: a caller that may
    still refuse a checked job for reasons of its own (the actor: a row not set up on this
    rank) calls the two itself, so every index is checked before anything of the job runs.

    Integrity (a layout with a checksum trailer): a store writes every page's checksum, a load
    checks it.  A finished job whose check failed is still reported by ``poll``/``wait_all``;
    ``job_error`` then names what did not match, and ``mismatches`` counts such jobs.
    """

    name: str
    integrity: bool
    mismatches: int
    generations: IndexArray  # each host page's generation (`renew`), mixed into its sums
    generation_base: int  # added to every store's generation (a kept tier's epoch)
    routes: dict[str, int]  # jobs per path that moved them (hybrid: kernel, staged, copy_engine)

    def submit(self, job_id: int, direction: Direction, gpu_blocks: object, chunk_ids: object,
               positions: object, after: After = None) -> torch.cuda.Event | None: ...

    def load_layers(self, job_id: int, gpu_blocks: object, chunk_ids: object,
                    positions: object, groups: int, after: After = None
                    ) -> list[torch.cuda.Event | None]: ...

    def check(self, job_id: int, gpu_blocks: object, chunk_ids: object, positions: object
              ) -> None: ...

    def prepare(self, job_id: int, direction: Direction, gpu_blocks: object, chunk_ids: object,
                positions: object, move: bool = True) -> Job: ...

    def issue(self, job_id: int, direction: Direction, job: Job, after: After = None
              ) -> torch.cuda.Event | None: ...

    def issue_layers(self, job_id: int, job: Job, groups: int, after: After = None
                     ) -> list[torch.cuda.Event | None]: ...

    def renew_store(self, job_id: int, job: Job) -> None: ...

    def renew(self, host_pages: object, generation: int) -> None: ...

    def poll(self) -> list[int]: ...

    def wait_all(self) -> list[int]: ...

    def job_error(self, job_id: int) -> str | None: ...

    def close(self) -> None: ...


def region_bytes_view(region: torch.Tensor, layout: SlotLayout, chunk_count: int) -> torch.Tensor:
    """Check that ``region`` is a flat uint8 CPU tensor spanning the plan's rows; return it."""
    need = layout.region_bytes(chunk_count)
    if region.dtype != torch.uint8 or region.dim() != 1 or not region.is_contiguous():
        raise OffloadError(
            f"the region tensor is {region.dtype} of shape {tuple(region.shape)}; pass a flat "
            "contiguous uint8 tensor over the whole mapping"
        )
    if region.device.type != "cpu":
        raise OffloadError(f"the region tensor is on {region.device}; it must be host memory")
    if region.numel() < need:
        raise OffloadError(
            f"the region tensor has {region.numel()} bytes but {chunk_count} chunks of "
            f"{layout.row_stride} bytes need {need}; map the whole region"
        )
    return region


def check_geometry(kv_tensors: Sequence[torch.Tensor], layout: SlotLayout) -> KVGeometry:
    """`kv_geometry`, and the page sizes must be the ones the plan was computed from."""
    if len(kv_tensors) != layout.num_tensors:
        raise OffloadError(
            f"got {len(kv_tensors)} KV tensors but the plan has {layout.num_tensors} page sizes; "
            "pass the same tensors the plan was computed from"
        )
    geometry = kv_geometry(kv_tensors)
    for t, (have, want) in enumerate(zip(geometry.page_bytes, layout.page_bytes, strict=True)):
        if have != want:
            raise OffloadError(
                f"KV tensor {t} holds {have} bytes per block but the plan says {want}; "
                "compute the plan from these tensors"
            )
    return geometry


class EngineBase:
    """Checks tensors once and every job before ``_issue`` moves it."""

    name = "base"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int) -> None:
        self._geometry = check_geometry(kv_tensors, layout)
        self._kv = list(kv_tensors)
        self._region = region_bytes_view(region, layout, chunk_count)
        if layout.trailer_offset is not None and (self._region.data_ptr() + layout.slot_offset
                                                  + layout.trailer_offset) % WORD:
            raise OffloadError(
                f"the region starts at {self._region.data_ptr():#x}, so the checksum trailers "
                f"do not lie on {WORD}-byte boundaries; map the region page-aligned (HostTier "
                "does) or plan without integrity")
        self._layout = layout
        self._chunk_count = chunk_count
        self._kv_bases: IndexArray = np.array([t.data_ptr() for t in kv_tensors], dtype=np.int64)
        self._block_strides: IndexArray = np.array(self._geometry.block_strides, dtype=np.int64)
        self._unique = {
            "store": UniqueDestinations("host_pages", chunk_count * layout.blocks_per_chunk,
                                        layout.blocks_per_chunk),
            "load": UniqueDestinations("blocks", self._geometry.num_blocks,
                                       layout.blocks_per_chunk)}
        self._pack_target: Target | None = None  # kernel engines: their staging buffer
        self._closed = False
        self.integrity = layout.integrity  # whether this engine's jobs write and check sums
        # each host page's generation, mixed into its sums (`offload.integrity`): renewed by
        # every store that writes the page; a job takes its pages' when it is issued
        self.generations: IndexArray = np.zeros(max(1, chunk_count * layout.blocks_per_chunk),
                                                dtype=np.int64)
        # added to every store's generation: a kept tier's epoch (`offload.keep_index`), so
        # no store of this life repeats a generation an adopted page carries
        self.generation_base = 0
        self.mismatches = 0  # finished jobs whose checksums did not match
        self._errors: dict[int, str] = {}
        # jobs per path; an engine of one path counts them here, one of several overrides it
        self.routes: dict[str, int] = {self.name: 0}

    @cached_property
    def _fast(self) -> FastCheck | None:
        """The native job check, made at the first job rather than in start-up (building its
        library, once per host, takes a compiler run)."""
        lib = checker_library()
        return (FastCheck(lib, self._layout, self._geometry.num_blocks, self._chunk_count,
                          self._unique) if lib is not None else None)

    @property
    def layout(self) -> SlotLayout:
        return self._layout

    def _page_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per KV tensor: its ``[blocks, page]`` view (any block stride) and the region's
        ``[chunks, positions, page]`` view of its pages, for backends that index pages."""
        g, layout = self._geometry, self._layout
        return [
            (page_view(kv, page, stride),
             region_pages(self._region, offset, page, layout.blocks_per_chunk,
                          layout.row_stride, self._chunk_count))
            for kv, page, stride, offset in zip(self._kv, g.page_bytes, g.block_strides,
                                                layout.host_page_offsets().tolist(), strict=True)
        ]

    def submit(self, job_id: int, direction: Direction, gpu_blocks: object, chunk_ids: object,
               positions: object, after: After = None) -> torch.cuda.Event | None:
        """Queue job ``job_id``; validation errors are raised here, before anything moves
        (`prepare`, then `issue`)."""
        job = self.prepare(job_id, direction, gpu_blocks, chunk_ids, positions)
        return self.issue(job_id, direction, job, after)

    def prepare(self, job_id: int, direction: Direction, gpu_blocks: object, chunk_ids: object,
                positions: object, move: bool = True) -> Job:
        """Check job ``job_id`` and return it checked, moving and renewing nothing, so a caller
        can refuse the job for reasons of its own before `issue`.

        Raises `MalformedJob` for what the plan and the job alone decide (a direction other
        than store or load, index types and lengths, a chunk id or position out of range, a
        destination written twice: every rank refuses alike), `OffloadError` for a GPU block
        past this rank's KV cache or a closed engine.  A job to ``move`` is packed where the
        next `issue` takes it from (a kernel engine's staging buffer): issue it before the
        next `prepare`, or drop it."""
        self._refuse_if_closed(job_id)
        if not (isinstance(direction, str) and direction in DIRECTIONS):
            raise MalformedJob(f"job {job_id} has direction {show_value(direction)}; use "
                               "'store' or 'load'")
        return self._check(gpu_blocks, chunk_ids, positions, direction,
                           self._pack_target if move else None)

    def issue(self, job_id: int, direction: Direction, job: Job, after: After = None
              ) -> torch.cuda.Event | None:
        """Move ``job``, which the last `prepare` checked (for this ``direction``); a store
        first renews its pages (`renew`).  Returns what `submit` returns."""
        self._refuse_if_closed(job_id)
        if direction == "store":  # ids unique, from 0 up (the actor's sequence numbers)
            self.renew(job.host_pages, self.generation_base + store_generation(job_id))
        done = self._issue(job_id, direction, job, after)
        self._count_route()
        return done

    def load_layers(self, job_id: int, gpu_blocks: object, chunk_ids: object,
                    positions: object, groups: int, after: After = None
                    ) -> list[torch.cuda.Event | None]:
        """Load job ``job_id`` layer group by layer group (`tensor_ranges`: ``groups`` runs of
        consecutive KV tensors, in the order the tensors were given), so a forward pass can
        start on the first layers while later ones still copy.  Returns one event per group,
        in order: group ``g``'s blocks are loaded (or poisoned, on a checksum mismatch) once
        its event fired.  The job is still one job: it completes, and is checked, as a whole
        (`poll`, `job_error`).  A backend without group launches (the copy engines, the host)
        returns the job's completion event (None on the host) for every group."""
        tensor_ranges(self._layout.num_tensors, groups)  # a bad count before the check
        job = self.prepare(job_id, "load", gpu_blocks, chunk_ids, positions)
        return self.issue_layers(job_id, job, groups, after)

    def issue_layers(self, job_id: int, job: Job, groups: int, after: After = None
                     ) -> list[torch.cuda.Event | None]:
        """`load_layers` for a load the last `prepare` checked."""
        self._refuse_if_closed(job_id)
        ranges = tensor_ranges(self._layout.num_tensors, groups)
        events = self._issue_layers(job_id, job, ranges, after)
        self._count_route()
        return events

    def _refuse_if_closed(self, job_id: int) -> None:
        if self._closed:
            raise OffloadError(f"job {job_id} submitted to a closed {self.name} engine")

    def _count_route(self) -> None:
        """Count an issued job for an engine of one path (one of several counts in its
        router, and its `routes` holds no entry of its own name)."""
        if self.name in self.routes:
            self.routes[self.name] += 1

    def _issue_layers(self, job_id: int, job: Job, ranges: list[tuple[int, int]], after: After
                      ) -> list[torch.cuda.Event | None]:
        """Without group launches: the whole job, its completion event for every group."""
        return [self._issue(job_id, "load", job, after)] * len(ranges)

    def check(self, job_id: int, gpu_blocks: object, chunk_ids: object, positions: object
              ) -> None:
        """Validate store ``job_id`` without moving anything (a replicated store's non-writer
        ranks) and renew its chunks as the stage's writer does: this rank checks the sums the
        writer stores."""
        self.renew_store(job_id, self.prepare(job_id, "store", gpu_blocks, chunk_ids,
                                              positions, move=False))

    def renew_store(self, job_id: int, job: Job) -> None:
        """`check` for a store `prepare` checked (``move=False``): renew its pages."""
        self.renew(job.host_pages, self.generation_base + store_generation(job_id))

    def renew(self, host_pages: object, generation: int) -> None:
        """Give ``host_pages`` (chunk x blocks_per_chunk + position, in range) a new
        generation: from now on only bytes stored (or promoted) under it pass their check;
        what an earlier store left there fails.  Every rank renews the same pages with the
        same generation, before the copy that writes them is issued.

        A job takes its pages' generations when it is issued (the kernel's from its index
        upload, `layout.pack_generations`; the host backend copies at once), so a job already
        queued keeps writing or checking under the generation it was issued with."""
        self.generations[np.asarray(host_pages, dtype=np.int64)] = generation

    def _check(self, gpu_blocks: object, chunk_ids: object, positions: object,
               direction: Direction, target: Target | None = None) -> Job:
        """The native check where it accepts the job, else the numpy one (which words the
        errors): `offload.transfer.fast_check`.  A job to be moved is packed into ``target``
        (the kernel's staging slot)."""
        if self._fast is not None:
            job = self._fast.check(direction, gpu_blocks, chunk_ids, positions, target)
            if job is not None:
                return job
        return check_job(self._layout, gpu_blocks, chunk_ids, positions,
                         num_blocks=self._geometry.num_blocks, chunk_count=self._chunk_count,
                         unique=self._unique[direction])

    def _issue(self, job_id: int, direction: Direction, job: Job, after: After
               ) -> torch.cuda.Event | None:
        raise NotImplementedError

    def poll(self) -> list[int]:
        raise NotImplementedError

    def wait_all(self) -> list[int]:
        raise NotImplementedError

    # ------------------------------------------------------------------ integrity
    def job_error(self, job_id: int) -> str | None:
        """Why finished job ``job_id`` failed (and forget it), or None when it succeeded.

        Args:
            job_id: a job ``poll`` or ``wait_all`` reported.

        Returns:
            e.g. ``"integrity: tensor 3 chunk 17 position 2 does not match what was stored"``,
            or None.
        """
        return self._errors.pop(job_id, None)

    def _mismatch(self, job_id: int, tensor: int, host_page: int, unit: int) -> None:
        """Record that job ``job_id`` loaded a unit whose checksum did not match."""
        chunk, position = divmod(host_page, self._layout.blocks_per_chunk)
        piece = f" (bytes from {unit * UNIT_BYTES})" if unit else ""
        self.mismatches += 1
        self._errors[job_id] = (f"integrity: tensor {tensor} chunk {chunk} position {position}"
                                f"{piece} does not match what was stored")

    def _trailers(self) -> np.ndarray:
        """The region's checksum trailers as a ``[chunks, words]`` uint64 view (one row per
        chunk; `SlotLayout.trailer_offsets` places each sum)."""
        layout = self._layout
        start = int(layout.trailer_offsets()[0])
        words = trailer_bytes(layout.page_bytes, layout.blocks_per_chunk) // WORD
        return np.ndarray((self._chunk_count, words), dtype=np.uint64,
                          buffer=self._region.numpy(), offset=start,
                          strides=(layout.row_stride, WORD))

    def close(self) -> None:
        """Finish in-flight jobs and refuse new ones; idempotent."""
        if not self._closed:
            self.wait_all()
            self._closed = True
