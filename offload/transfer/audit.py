"""Audit mode: hash every block before it is stored and after it is loaded.

The proof an operator can turn on in production: a block that comes back different from what
went out (a wrong offset, a torn copy, memory corruption, a rank whose "identical" replicated
data was not identical) is counted, without keeping a second copy of the data.  The hash is a
weighted sum of the block's 32-bit words with fixed pseudo-random weights, computed on the KV
tensor's own device in batches; it is sensitive to every word and to word order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

_BATCH = 256  # blocks hashed per kernel batch: bounds the temporary memory


def _weights(words: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0x0FF10AD + words)
    return torch.randint(1, 1 << 20, (words,), generator=gen, dtype=torch.int64).to(device)


def block_hashes(tensor: torch.Tensor, blocks: torch.Tensor) -> list[int]:
    """One 64-bit hash per block ``blocks[i]`` of ``tensor`` (dimension 0 = blocks)."""
    flat = tensor.reshape(tensor.shape[0], -1).view(torch.uint8)
    page = flat.shape[1]
    words = flat.view(torch.int32) if page % 4 == 0 else flat
    weights = _weights(words.shape[1], tensor.device)
    out: list[int] = []
    index = blocks.to(tensor.device)
    for start in range(0, len(index), _BATCH):
        chunk = words[index[start:start + _BATCH]].to(torch.int64)
        out.extend((chunk * weights).sum(dim=1).tolist())
    return out


@dataclass
class Auditor:
    """Remembers the hash of every stored (host page, tensor) and checks loads.  It takes a
    checked job's arrays (`offload.transfer.layout.Job`), never the caller's fields."""

    expected: dict[tuple[int, int], int] = field(default_factory=dict)
    checked_blocks: int = 0
    mismatched_blocks: int = 0

    def record(self, kv: Sequence[torch.Tensor], blocks: np.ndarray,
               host_pages: np.ndarray) -> None:
        index = torch.as_tensor(blocks, dtype=torch.int64)
        pages = host_pages.tolist()
        for t, tensor in enumerate(kv):
            for h, page in zip(block_hashes(tensor, index), pages, strict=True):
                self.expected[(page, t)] = h

    def check(self, kv: Sequence[torch.Tensor], blocks: np.ndarray,
              host_pages: np.ndarray) -> int:
        """Compare loaded blocks with their recorded hashes; return this load's mismatches."""
        index = torch.as_tensor(blocks, dtype=torch.int64)
        pages = host_pages.tolist()
        bad = [False] * len(pages)
        for t, tensor in enumerate(kv):
            hashes = block_hashes(tensor, index)
            for i, (h, page) in enumerate(zip(hashes, pages, strict=True)):
                if self.expected.get((page, t)) != h:
                    bad[i] = True
        self.checked_blocks += len(pages)
        self.mismatched_blocks += sum(bad)
        return sum(bad)

    def to_json(self) -> dict[str, int]:
        return {"checked_blocks": self.checked_blocks,
                "mismatched_blocks": self.mismatched_blocks}
