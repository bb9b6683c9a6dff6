"""The main job's synthetic KV cache and its seeded contents.

Each rank holds two KV tensors (K and V halves of ``--kv-bytes-per-block``; one tensor when the
payload is a single byte) shaped ``[num_gpu_blocks, page]`` of bytes.  Contents are a cheap
integer hash of (round, pipeline stage, tensor-parallel rank, tensor, block, byte index),
computed with whole-tensor ops on the tensor's own device, so the data differs wherever real KV
differs and can be regenerated for verification without keeping a copy.  The replicated layout
holds one copy per pipeline stage (KV identical on a stage's TP ranks, as MLA latent KV is), so
there the TP rank does not enter the hash, but the stage always does: a rank that loaded another
stage's bytes fails verification.
"""

from __future__ import annotations

import torch

_MULT = 2654435761  # Knuth's multiplicative hash constant


def split_payload(payload: int) -> tuple[int, ...]:
    """K and V pages of one block."""
    return (payload,) if payload < 2 else (payload // 2, payload - payload // 2)


def make_kv(payload: int, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.zeros((num_blocks, page), dtype=torch.uint8, device=device)
            for page in split_payload(payload)]


def expected(seed: int, tensor: int, blocks: torch.Tensor, page: int) -> torch.Tensor:
    """The bytes blocks ``blocks`` of KV tensor ``tensor`` hold under ``seed``:
    ``[len(blocks), page]`` uint8 on ``blocks.device``."""
    index = torch.arange(page, dtype=torch.int64, device=blocks.device)
    mix = (blocks.to(torch.int64)[:, None] * 1_000_003 + tensor * 7_919 + seed * 104_729)
    value = (index[None, :] + mix) * _MULT
    return ((value >> 16) ^ (value >> 5) ^ mix).remainder(256).to(torch.uint8)


def round_seed(round_index: int, pp_rank: int, tp_rank: int, replicated: bool,
               replica: int = 0) -> int:
    """Distinct for every (DP replica, round, stage, TP rank) -- TP rank left out in the
    replicated layout, where a stage's ranks hold identical data; the replica enters so that a
    replica that loaded another replica's blocks fails verification."""
    width = 1 << 10  # more stages or TP ranks than any grid has; keeps the hash in int64
    return (((replica * width + round_index) * width + pp_rank) * width
            + (0 if replicated else tp_rank + 1))


def fill(kv: list[torch.Tensor], seed: int) -> None:
    for t, tensor in enumerate(kv):
        blocks = torch.arange(tensor.shape[0], device=tensor.device)
        tensor.copy_(expected(seed, t, blocks, tensor.shape[1]))


def poison(kv: list[torch.Tensor]) -> None:
    """Drop the GPU copy: overwrite every block so only a real load can restore it."""
    for tensor in kv:
        tensor.fill_(0xA5)


def count_mismatches(kv: list[torch.Tensor], seed: int, blocks: list[int]) -> int:
    """How many of ``blocks`` differ anywhere from the seeded contents."""
    if not blocks:
        return 0
    bad = torch.zeros(len(blocks), dtype=torch.bool, device=kv[0].device)
    index = torch.tensor(blocks, dtype=torch.int64, device=kv[0].device)
    for t, tensor in enumerate(kv):
        bad |= (tensor[index] != expected(seed, t, index, tensor.shape[1])).any(dim=1)
    return int(bad.sum().item())
