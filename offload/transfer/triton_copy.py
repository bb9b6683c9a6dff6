"""The fast backend: one Triton kernel launch per job over CUDA-registered host memory.

Each program copies tiles of pages through unified addressing (a registered host page has the
same address on the GPU), so scattered pages of every KV tensor move in a single launch.
On an H200 this one moved 1 GiB of scattered 16 KiB - 4 MiB blocks at 44-48 GB/s of a 55 GB/s
link (a simple kernel of DESIGN.md section 7 reached 51-52), where one ``copy_`` per 16 KiB
block gets 1.6-2.2 GB/s; at 4 KiB the host-side preparation (~10-16 ms per 262,144 pages)
bounds it to 27-36 GB/s.

The grid is bounded (a few persistent programs, each moving up to ``STEP_ELEMENTS`` per step):
a grid of one program per tile occupied every SM until the copy ended and cut a concurrent bf16
matmul from 726 to 94 TFLOP/s; a few dozen programs with up to 32 KiB in flight each already
cover the link's latency (see ``DEFAULT_COPY_PROGRAMS``).

The kernel sees addresses as element offsets from one small device allocation (the anchor),
which Triton specialises as 16-byte aligned; with every offset and size a multiple of 16 bytes
the hint ``tl.multiple_of`` lets it issue 16-byte accesses, otherwise it falls back to the widest
element that divides them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from offload.transfer.base import CopySide, Direction, absolute_copies
from offload.transfer.cuda import DEFAULT_COPY_PROGRAMS, StreamEngine
from offload.transfer.layout import SlotLayout, lowest_common_alignment, split_tiles

MAX_TILE_ELEMENTS = 2048  # 16 KiB of int64
STEP_ELEMENTS = 4096  # per program and step: 32 KiB in flight at 8-byte elements
NUM_WARPS = 4
_ELEMENT_TYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit(do_not_specialize=["n_tiles"])  # one compilation whatever the job's size
def _copy_tiles(table, base, n_tiles, ROWS: tl.constexpr, TILE: tl.constexpr,
                VEC: tl.constexpr):
    """``table`` is [3, n_tiles]: per tile the source and destination element offsets from
    ``base`` and the element count (at most TILE), all multiples of VEC.  Each program copies
    ROWS tiles per step, striding over the tiles by the grid size."""
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, TILE)[None, :]
    first = tl.program_id(0).to(tl.int64) * ROWS
    step = tl.num_programs(0).to(tl.int64) * ROWS
    for start in range(first, n_tiles, step):
        tile = start + rows
        valid = tile < n_tiles
        src = tl.multiple_of(tl.load(table + tile, mask=valid, other=0), VEC)
        dst = tl.multiple_of(tl.load(table + n_tiles + tile, mask=valid, other=0), VEC)
        count = tl.multiple_of(tl.load(table + 2 * n_tiles + tile, mask=valid, other=0), VEC)
        mask = cols < count[:, None]
        data = tl.load(base + src[:, None] + cols, mask=mask)
        tl.store(base + dst[:, None] + cols, data, mask=mask)


class TritonEngine(StreamEngine):
    """Requires the region to be registered with CUDA (pinned): the kernel dereferences its
    host addresses directly.  ``programs`` bounds the SMs a copy occupies, per direction."""

    name = "triton"

    def __init__(self, kv_tensors: Sequence[torch.Tensor], region: torch.Tensor,
                 layout: SlotLayout, chunk_count: int,
                 programs: Mapping[Direction, int] | None = None, num_warps: int = NUM_WARPS,
                 step_elements: int = STEP_ELEMENTS) -> None:
        super().__init__(kv_tensors, region, layout, chunk_count)
        self._anchor = torch.empty(2, dtype=torch.int64, device=self._device)
        self._programs = {**DEFAULT_COPY_PROGRAMS, **(programs or {})}
        self._num_warps = num_warps
        self._step = step_elements

    def _launch(self, direction: Direction, sides: list[CopySide]) -> None:
        """Addresses become offsets from the anchor in units of the widest element dividing
        all of them; the table is written straight into pinned memory, so its upload is
        asynchronous and the caching host allocator keeps it alive until the copy has run."""
        if not any(s.src_offsets.size for s in sides):
            return
        base = self._anchor.data_ptr()
        src, dst, count = absolute_copies(sides)
        src, dst = src - base, dst - base
        align = lowest_common_alignment([src, dst, count], cap=16)
        element = min(align, 8)
        shift = element.bit_length() - 1
        tile = min(MAX_TILE_ELEMENTS, _ceil_pow2(int(count.max()) >> shift))
        rows = max(1, self._step // tile)
        pieces = split_tiles(src >> shift, dst >> shift, count >> shift, tile)
        n_tiles = pieces[0].size
        table = torch.empty((3, n_tiles), dtype=torch.int64, pin_memory=True)
        np.stack(pieces, out=table.numpy())
        device_table = torch.empty_like(table, device=self._device)
        device_table.copy_(table, non_blocking=True)
        grid = (min(self._programs[direction], triton.cdiv(n_tiles, rows)),)
        _copy_tiles[grid](device_table, self._anchor.view(_ELEMENT_TYPES[element]), n_tiles,
                          ROWS=rows, TILE=tile, VEC=align // element, num_warps=self._num_warps)


def _ceil_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
