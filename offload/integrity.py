# SPDX-License-Identifier: Apache-2.0
"""Page checksums: the one definition every backend computes (DESIGN.md section 6, "Trust").

Pure numpy, no torch and no CUDA; the Triton kernel (`offload.transfer.kernel`) computes the
same values on the GPU and the tests hold the two to this module.

* A page is cut into *units*: one unit per ``UNIT_BYTES`` piece (the kernel's work item), the
  last one shorter; a page of at most ``UNIT_BYTES`` is one unit.
* A unit's raw sum: its bytes as little-endian 64-bit words ``w_i`` (the tail zero-padded to a
  whole word; a shorter unit has fewer words, no padding words),
  ``s = sum_i mix(w_i ^ word_key(i)) mod 2**64`` with ``word_key(i) = (i + 1) * GOLDEN``.
  ``mix`` (splitmix64's finaliser) is a bijection, so any damage confined to one word -- any
  number of its bits -- changes ``s``; position keys make two swapped words change it too.
  NOTE: the term is nonlinear on purpose.  A weighted sum (``sum w_i * (2i + 1)``) is linear
  over Z/2**64: flipping bit 63 of any two words adds ``2**63 * (odd + odd) = 0``, so a pair of
  bf16 sign flips passed, as did about 1 in 2,600 random 2-bit errors.  Through ``mix`` each
  damaged word moves the sum by a pseudo-random amount, so damage spread over several words
  goes unnoticed only where those amounts cancel mod 2**64: about 2**-64 per unit.  A CRC
  would prove more for small bit counts, but it is a carry-less polynomial computation with
  no cheap lane-parallel form in the copy kernel; the finaliser is ~15 integer operations per
  8 bytes on every backend, and a sum of independent terms reduces like any other.
* The stored value mixes in the unit's identity: ``stored = s + identity mod 2**64`` with
  ``identity = mix(mix(mix(mix(tensor_key ^ chunk) ^ generation) ^ position) ^ unit)``,
  ``tensor_key = mix(seed + (tensor + 1) * GOLDEN)`` and ``mix`` the splitmix64 finaliser (a
  bijection).  The seed is the tier's: one per plan slot (`offload.control.plan.integrity_seed`),
  so a page that is a valid page of another chunk, position, tensor, rank or stage does not match.
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


def word_keys(words: int) -> U64:
    """``word_key(i) = (i + 1) * GOLDEN mod 2**64`` for the first ``words`` words of a unit."""
    with np.errstate(over="ignore"):
        return np.arange(1, words + 1, dtype=np.uint64) * np.uint64(GOLDEN)


_KEYS = word_keys(UNIT_BYTES // WORD)


def word_terms(words: Any, index: Any) -> U64:
    """Each word's term of its unit's raw sum: ``mix(word ^ word_key(index))`` for uint64
    ``words`` at word positions ``index`` of their unit (broadcast together)."""
    return mix(np.asarray(words, dtype=np.uint64) ^ _KEYS[index])


def raw_sums(pages: np.ndarray) -> U64:
    """The raw sums of ``pages``, a ``[n, page]`` uint8 array: ``[n, units(page)]`` uint64."""
    n, page = pages.shape
    count = units(page)
    width = UNIT_BYTES if count > 1 else -(-page // WORD) * WORD
    if page == count * width and pages.flags.c_contiguous:
        data = pages
    else:
        data = np.zeros((n, count * width), dtype=np.uint8)
        data[:, :page] = pages
    words = data.view(np.uint64).reshape(n, count, width // WORD)
    terms = word_terms(words, np.arange(width // WORD))
    tail = -(-(page - (count - 1) * width) // WORD)  # the last unit's own words
    terms[:, -1, tail:] = 0  # padding words beyond a short last unit are not part of it
    with np.errstate(over="ignore"):
        return terms.sum(axis=2, dtype=np.uint64)  # wraps mod 2**64


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
    """The raw sum of one unit in plain Python integers (the definition the tests hold
    `raw_sums`, the native helper and the kernel to)."""
    padded = unit_bytes + bytes(-len(unit_bytes) % WORD)
    total = 0
    for i in range(len(padded) // WORD):
        word = int.from_bytes(padded[i * WORD:(i + 1) * WORD], "little")
        total += mix(word ^ ((i + 1) * GOLDEN))
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
