"""Helpers shared by the host and GPU transfer tests (no tests here, and no hypothesis, so the
GPU tests import it on hosts without it): KV sets of several page sizes, scattered jobs, and a
byte-by-byte reference of the region."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from offload import integrity
from offload.config import TierConfig
from offload.control.plan import RankDescriptor, compute_plan
from offload.region.geometry import copy_starts
from offload.transfer import SlotLayout
from offload.transfer.base import TransferEngine
from offload.transfer.staging import ROW_ALIGN, StagePlan, stage_plan

Job = tuple[np.ndarray, np.ndarray, np.ndarray]
HYBRID_PAGES = (512, 60, 1000)  # bf16 attention pages, an odd fp32 state, a uint8 blob


def kv_set(num_blocks: int, pages: Sequence[int], device: str = "cpu",
           seed: int = 0) -> list[torch.Tensor]:
    """Random KV tensors, one per page size, of mixed dtypes (tensor ``t`` tries bf16, float32,
    uint8 from position ``t % 3`` on and takes the first that divides its page)."""
    generator = torch.Generator().manual_seed(seed)
    dtypes = (torch.bfloat16, torch.float32, torch.uint8)
    out = []
    for t, page in enumerate(pages):
        dtype = next(d for d in dtypes[t % 3:] if page % d.itemsize == 0)
        raw = torch.randint(0, 256, (num_blocks, page), dtype=torch.uint8, generator=generator)
        out.append(raw.view(dtype).to(device))
    return out


def engine_kv_set(num_blocks: int, pages: Sequence[int], device: str = "cpu",
                  seed: int = 0) -> list[torch.Tensor]:
    """KV tensors laid out the ways engines hold them, with mixed page sizes: for each page
    size, K and V as ``kv[:, 0]`` and ``kv[:, 1]`` of one ``[blocks, 2, heads, dim]`` tensor
    (block stride two pages), then one tensor padded per block (``[:, :page]`` of a wider
    tensor, stride page + 64 bytes).  Random bytes; the views keep their bases alive."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for page in pages:
        dtype = torch.bfloat16 if page % 2 == 0 else torch.uint8
        raw = torch.randint(0, 256, (num_blocks, 2, 1, page), dtype=torch.uint8,
                            generator=generator)
        kv = raw.view(dtype).to(device)  # [blocks, 2, 1, page / itemsize]
        out += [kv[:, 0], kv[:, 1]]
        padded = torch.randint(0, 256, (num_blocks, page + 64), dtype=torch.uint8,
                               generator=generator).to(device)
        out.append(padded[:, :page].view(dtype))
    return out


def slot_layout(pages: Sequence[int], bpc: int, rank: int = 1,
                integrity: bool = True) -> SlotLayout:
    """Rank ``rank``'s slot in a two-rank shared-layout plan, so the slot does not start at the
    row's first byte."""
    config = TierConfig(cpu_bytes_per_node=1 << 30, layout="shared", blocks_per_chunk=bpc, tp=2,
                        integrity=integrity)
    plan = compute_plan([RankDescriptor(r, "n0", r, 2, r, 0, tuple(pages), config)
                         for r in range(2)])
    return SlotLayout.from_plan(plan, rank)


def with_cuts(layout: SlotLayout, count: int, seed: int) -> SlotLayout:
    """``layout`` with its rows registered in pieces: ``count`` cuts at random starts of its
    pages or its trailer (`offload.region.geometry.copy_starts`)."""
    starts = sorted(set(copy_starts(layout.slot_offset, layout.tensor_offsets,
                                    layout.page_bytes, layout.blocks_per_chunk,
                                    layout.trailer_offset)) - {0})
    rng = np.random.default_rng(seed)
    chosen = rng.choice(starts, size=min(count, len(starts)), replace=False)
    return dataclasses.replace(layout, cuts=tuple(sorted(int(c) for c in chosen)))


def staging_ring(pages: list[int], bpc: int, checked: bool, budget_rows: float
                 ) -> tuple[SlotLayout, StagePlan | str]:
    """`slot_layout` and its staging ring from a budget of ``budget_rows`` x two slot images:
    below one, the slot is cut into tensor groups; above, a slice holds several rows."""
    layout = slot_layout(pages, bpc, integrity=checked)
    slot = layout.tensor_offsets[-1] + bpc * pages[-1] + (
        integrity.trailer_bytes(pages, bpc) + 8 if checked else 0)
    return layout, stage_plan(layout, max(2 * ROW_ALIGN, int(2 * budget_rows * slot)))


def page_sizes(kv: Sequence[torch.Tensor]) -> list[int]:
    return [t[0].numel() * t.element_size() for t in kv]


def scattered_job(rng: np.random.Generator, n: int, num_blocks: int, chunk_count: int,
                  bpc: int) -> Job:
    """``n`` distinct blocks to ``n`` distinct host pages, both in random order."""
    blocks = rng.permutation(num_blocks)[:n]
    slots = rng.permutation(chunk_count * bpc)[:n]
    return blocks, slots // bpc, slots % bpc


def expected_region(before: torch.Tensor, kv: Sequence[torch.Tensor], layout: SlotLayout,
                    job: Job, job_id: int, sums: bool = True) -> torch.Tensor:
    """The region after storing ``job`` as job ``job_id``, written one page at a time from the
    slot formula, and (``sums`` and a layout with integrity) each page's sums at their place
    in the trailer, under the job's generation (`integrity.store_generation`)."""
    region = before.clone()
    keys = layout.tensor_keys()
    for t, tensor in enumerate(kv):
        page = layout.page_bytes[t]
        raw = tensor.cpu().reshape(tensor.shape[0], -1).view(torch.uint8)
        for block, chunk, pos in zip(*job, strict=True):
            start = (chunk * layout.row_stride + layout.slot_offset + layout.tensor_offsets[t]
                     + pos * page)
            region[start:start + page] = raw[block]
            if sums and layout.integrity:
                stored = integrity.page_sums(raw[block].numpy()[None, :], keys[t], [chunk],
                                             [integrity.store_generation(job_id)], [pos])
                at = (int(layout.trailer_offsets()[t]) + chunk * layout.row_stride
                      + 8 * pos * layout.units[t])
                region[at:at + stored.nbytes] = torch.from_numpy(
                    stored.reshape(-1).view(np.uint8))
    return region


def round_trip(engine: TransferEngine, kv: list[torch.Tensor], region: torch.Tensor,
               layout: SlotLayout, job: Job) -> None:
    """Store ``job``, check the region byte for byte, wipe the KV tensors, load the job back and
    check the loaded blocks match and the others stayed wiped."""
    original = [t.clone() for t in kv]
    expected = expected_region(region, kv, layout, job, 1, engine.integrity)
    engine.submit(1, "store", *job)
    assert engine.wait_all() == [1]
    assert torch.equal(region, expected)
    for t in kv:
        t.view(torch.uint8).fill_(0xA5)
    engine.submit(2, "load", *job)
    assert engine.wait_all() == [2]
    loaded = torch.zeros(kv[0].shape[0], dtype=torch.bool)
    loaded[torch.from_numpy(np.asarray(job[0]))] = True
    for now, before in zip(kv, original, strict=True):
        now_bytes, before_bytes = now.cpu().view(torch.uint8), before.cpu().view(torch.uint8)
        assert torch.equal(now_bytes[loaded], before_bytes[loaded])
        assert (now_bytes[~loaded] == 0xA5).all()
