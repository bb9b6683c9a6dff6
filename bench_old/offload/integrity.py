# SPDX-License-Identifier: Apache-2.0
"""Page checksums: the one definition every backend computes (DESIGN.md section 6, "Trust").

Pure numpy, no torch and no CUDA; the Triton kernel (`offload.transfer.kernel`) computes the
same values on the GPU and the tests hold the two to this module.

* A page is cut into *units*: one unit per ``UNIT_BYTES`` piece (the kernel's work item), the
  last one shorter; a page of at most ``UNIT_BYTES`` is one unit.
* A unit's raw sum: its bytes as little-endian 64-bit words (the tail zero-padded),
  ``s = sum_i word_i * (2i + 1) mod 2**64``.  Odd weights: one flipped bit changes ``s`` by an
  odd multiple of a power of two below 2**64, never by 0.  Position weights: two swapped words
  change it.  Written per byte (``byte_k * 256**(k % 8) * (2 * (k // 8) + 1)``) the sum does
  not depend on how wide the reads are, so a kernel reading 1-, 2-, 4- or 8-byte elements gets
  the same value.
* The stored value mixes in the unit's identity: ``stored = s + identity mod 2**64`` with
  ``identity = mix(mix(mix(mix(tensor_key ^ chunk) ^ generation) ^ position) ^ unit)``,
  ``tensor_key = mix(seed + (tensor + 1) * GOLDEN)`` and ``mix`` the splitmix64 finaliser (a
  bijection).  The seed is the tier's: one per plan slot (`offload.plan.integrity_seed`), so a
  page that is a valid page of another chunk, position, tensor, rank or stage does not match.
* The *generation* is the page's (chunk and position): every store job renews the pages it
  writes (`store_generation`: its sequence number, the same on every rank), and a promotion
  from the file tier renews its rows' pages (`promotion_generation`).  A page and sum left from
  an earlier store -- because the newest store's copy of it went missing -- then carry an older
  generation and fail the check.  Generation 0 is a page never stored since the region was
  made, and the file tier's chunk-free identity.  Which page holds which key stays the
  caller's bookkeeping: a load of a page the caller never stored returns what the last store
  of that page wrote, checked.
* The sums of a slot lie in a trailer after its pages, tensor-major like the pages: tensor
  ``t``'s entry for (position, unit) is word ``bpc * unit_offsets[t] + position * units[t] +
  unit`` of the trailer.  Being in the slot, the sums travel wherever the slot's bytes go.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

UNIT_BYTES = 16 << 10  # one checksum unit: a page, or a piece of a larger one
WORD = 8  # bytes per summed word, and per stored sum
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MASK = (1 << 64) - 1
# A promotion's generation: its job id above this bit, apart from every store's (job sequence
# numbers never come near 2**62).
PROMOTED = 1 << 62

U64 = np.ndarray[Any, np.dtype[np.uint64]]


def units(page: int) -> int:
    """Checksum units of one page of ``page`` bytes."""
    return -(-page // UNIT_BYTES)


def unit_offsets(page_bytes: Sequence[int]) -> tuple[int, ...]:
    """Per tensor, the units of one page of every tensor before it (its place in a trailer
    row of one position)."""
    offsets, total = [], 0
    for page in page_bytes:
        offsets.append(total)
        total += units(page)
    return tuple(offsets)


def trailer_bytes(page_bytes: Sequence[int], blocks_per_chunk: int) -> int:
    """Bytes of one slot's trailer: one word per unit of every page."""
    return WORD * blocks_per_chunk * sum(units(p) for p in page_bytes)


def mix(z: Any) -> Any:
    """splitmix64's finaliser over uint64 arrays (or a Python int, masked to 64 bits)."""
    if isinstance(z, int):
        z &= MASK
        z = ((z ^ (z >> 30)) * MIX1) & MASK
        z = ((z ^ (z >> 27)) * MIX2) & MASK
        return z ^ (z >> 31)
    with np.errstate(over="ignore"):
        z = np.asarray(z, dtype=np.uint64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
        return z ^ (z >> np.uint64(31))


def tensor_key(seed: int, tensor: int) -> int:
    """The first stage of a unit's identity: the tier's seed and the tensor."""
    return int(mix((seed + (tensor + 1) * GOLDEN) & MASK))


def store_generation(seq: int) -> int:
    """The generation a store job gives the pages it writes: its sequence number plus one (0
    is never stored).  Sequence numbers are unique and count from 0 (`RankActor.submit`), so
    no two stores share one and none reaches `PROMOTED`."""
    return seq + 1


def promotion_generation(job_id: int) -> int:
    """The generation a promotion (the chunk manager's job ``job_id``) gives its rows' pages."""
    return PROMOTED | job_id


def identity(key: Any, chunks: Any, generations: Any, positions: Any, unit: Any) -> U64:
    """``mix(mix(mix(mix(key ^ chunk) ^ generation) ^ position) ^ unit)``, broadcast over the
    arrays given (``key``: one `tensor_key` or an array of them; ``generations``: each page's,
    shaped like ``positions``)."""
    c = np.asarray(chunks, dtype=np.int64).astype(np.uint64)
    g = np.asarray(generations, dtype=np.int64).astype(np.uint64)
    p = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    u = np.asarray(unit, dtype=np.int64).astype(np.uint64)
    h = mix(np.asarray(key, dtype=np.uint64) ^ c)
    h = mix(h ^ g)
    h = mix(h ^ p)
    return mix(h ^ u)


def _weights(words: int) -> U64:
    return np.arange(1, 2 * words, 2, dtype=np.uint64)


_WEIGHTS = _weights(UNIT_BYTES // WORD)


def raw_sums(pages: np.ndarray) -> U64:
    """The raw sums of ``pages``, a ``[n, page]`` uint8 array: ``[n, units(page)]`` uint64."""
    n, page = pages.shape
    if page <= UNIT_BYTES and page % WORD == 0 and pages.flags.c_contiguous:
        return (pages.view(np.uint64) @ _WEIGHTS[:page // WORD])[:, None]  # the usual page
    count = units(page)
    width = UNIT_BYTES if count > 1 else -(-page // WORD) * WORD
    if page == count * width:
        data = np.ascontiguousarray(pages)
    else:
        data = np.zeros((n, count * width), dtype=np.uint8)
        data[:, :page] = pages
    words = data.view(np.uint64).reshape(n, count, width // WORD)
    return words @ _WEIGHTS[:width // WORD]  # integer matmul wraps mod 2**64


def page_sums(pages: np.ndarray, key: int, chunks: Any, generations: Any, positions: Any
              ) -> U64:
    """What the trailer holds for ``pages`` (``[n, page]`` uint8) of one tensor (its
    `tensor_key` ``key``) at the given chunks, generations and positions: ``[n, units(page)]``
    uint64."""
    raw = raw_sums(pages)
    unit = np.arange(raw.shape[1], dtype=np.int64)[None, :]
    ident = identity(key, np.asarray(chunks)[:, None], np.asarray(generations)[:, None],
                     np.asarray(positions)[:, None], unit)
    with np.errstate(over="ignore"):
        return raw + ident


def reference_sum(unit_bytes: bytes) -> int:
    """The raw sum of one unit byte by byte, in plain Python (the definition the tests hold
    `raw_sums` and the kernel to)."""
    total = 0
    for k, b in enumerate(unit_bytes):
        total += b * (256 ** (k % WORD)) * (2 * (k // WORD) + 1)
    return total & MASK


def move_sums(trailer: U64, page_bytes: Sequence[int], blocks_per_chunk: int, seed: int,
              source: tuple[int, Any], target: tuple[int, Any]) -> None:
    """Re-mix one slot's trailer (``trailer``: its uint64 words, changed in place) from the
    identities of ``source`` (chunk, generations: one, or one per position) to those of
    ``target``: what a whole slot copied elsewhere needs (the file tier: a spilled row to the
    chunk-free identity, a promoted one to its new chunk and generation).  The raw sums are
    kept, so a page damaged before the move still fails its check."""
    source_generations = np.broadcast_to(np.asarray(source[1], dtype=np.int64),
                                         (blocks_per_chunk,))[:, None]
    target_generations = np.broadcast_to(np.asarray(target[1], dtype=np.int64),
                                         (blocks_per_chunk,))[:, None]
    offsets = unit_offsets(page_bytes)
    with np.errstate(over="ignore"):
        for t, page in enumerate(page_bytes):
            count = units(page)
            key = tensor_key(seed, t)
            position = np.arange(blocks_per_chunk)[:, None]
            unit = np.arange(count)[None, :]
            start = blocks_per_chunk * offsets[t]
            words = trailer[start:start + blocks_per_chunk * count].reshape(blocks_per_chunk,
                                                                              count)
            words += (identity(key, target[0], target_generations, position, unit)
                      - identity(key, source[0], source_generations, position, unit))
