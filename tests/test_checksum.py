# SPDX-License-Identifier: Apache-2.0
"""The page checksum's definition (`offload.integrity`) and the damage it must see.

First the definition: `raw_sums` against the plain-integer formula, the native helper
(``page_sums.c``) against `raw_sums`, each identity it mixes in.  Then the error classes
SECURITY.md promises, each over many units:

* any damage confined to one 64-bit word (``mix`` is a bijection): every single bit flip;
* every pair of top-bit flips in a unit (two bf16 sign flips) -- a linear weighted sum misses
  every one of them;
* every swap of two adjacent words, including words that differ only in bit 63;
* 10**5 random 1-, 2-, 3- and 4-bit errors each.

A unit's raw sum is a sum of one term per word, so the sum after damage is the sum before
plus, per damaged word, (new term - old term): the tests compute those differences for whole
arrays of damages at once, exactly, rather than re-summing 16 KiB per trial.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import integrity
from offload.transfer.host import page_sums_library

UNIT_WORDS = integrity.UNIT_BYTES // integrity.WORD
TOP = np.uint64(1 << 63)


def terms(words: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Each word's term of its unit's raw sum, for words at word positions ``index``."""
    return integrity.word_terms(words, index)


def sample_units(count: int, seed: int) -> list[np.ndarray]:
    """Units of one full ``UNIT_BYTES`` each, as uint64 words: random bytes, all zeros, small
    bf16-like values (sign and exponent bits mostly equal), and a repeated pattern."""
    rng = np.random.default_rng(seed)
    units = [rng.integers(0, 2**64, UNIT_WORDS, dtype=np.uint64, endpoint=False)
             for _ in range(count)]
    bf16 = (rng.normal(0, 0.02, UNIT_WORDS * 4).astype(np.float32).view(np.uint32) >> 16)
    units += [np.zeros(UNIT_WORDS, dtype=np.uint64),
              bf16.astype(np.uint16).view(np.uint64).copy(),
              np.full(UNIT_WORDS, 0x3C003C003C003C00, dtype=np.uint64)]
    return units


def missed(deltas: np.ndarray) -> int:
    """Rows of ``deltas`` (one damage per row, one column per damaged word) whose changes sum
    to 0 mod 2**64: the damages the checksum would not see."""
    with np.errstate(over="ignore"):
        return int((deltas.sum(axis=1, dtype=np.uint64) == 0).sum())


# ------------------------------------------------------------------ the definition
@settings(max_examples=200, deadline=None)
@given(page=st.integers(1, 40_000), n=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_raw_sums_follow_the_word_definition(page: int, n: int, seed: int) -> None:
    pages = np.random.default_rng(seed).integers(0, 256, (n, page), dtype=np.uint8)
    sums = integrity.raw_sums(pages)
    assert sums.shape == (n, integrity.units(page)) and sums.dtype == np.uint64
    for i in range(n):
        for u in range(sums.shape[1]):
            unit = pages[i, u * integrity.UNIT_BYTES:(u + 1) * integrity.UNIT_BYTES]
            assert int(sums[i, u]) == integrity.reference_sum(unit.tobytes())


@settings(max_examples=300, deadline=None)
@given(length=st.integers(1, integrity.UNIT_BYTES), skew=st.integers(0, 7),
       seed=st.integers(0, 2**32 - 1))
def test_the_native_sum_is_the_definition(length: int, skew: int, seed: int) -> None:
    """Any length, any alignment of the first byte."""
    lib = page_sums_library()
    if lib is None:
        pytest.skip("no C compiler: the native host path cannot be built")
    data = np.random.default_rng(seed).integers(0, 256, length + skew, dtype=np.uint8)
    expected = int(integrity.raw_sums(data[None, skew:])[0, 0])
    # the path this CPU takes (AVX2 where it has it), and the portable one every CPU has
    assert lib.offload_raw_sum(data.ctypes.data + skew, length) == expected
    assert lib.offload_raw_sum_scalar(data.ctypes.data + skew, length) == expected


def test_the_same_bytes_elsewhere_have_another_sum() -> None:
    """A valid page of another slot (seed), tensor, chunk, position or store (generation) does
    not match."""
    pages = np.random.default_rng(1).integers(0, 256, (1, 40_000), dtype=np.uint8)
    where = dict(seed=1, tensor=0, chunk=3, position=0, generation=integrity.store_generation(6))

    def stored(w: dict[str, int]) -> np.ndarray:
        key = integrity.tensor_key(w["seed"], w["tensor"])
        return integrity.page_sums(pages, key, [w["chunk"]], [w["generation"]],
                                   [w["position"]])

    for other in (dict(seed=2), dict(tensor=1), dict(chunk=4), dict(position=1),
                  dict(generation=8), dict(generation=integrity.promotion_generation(6))):
        assert (stored(where) != stored({**where, **other})).all(), other


def test_mix_is_the_same_on_ints_and_arrays() -> None:
    values = [0, 1, 2**63, 2**64 - 1, 12345678901234567]
    array = integrity.mix(np.array(values, dtype=np.uint64))
    assert [int(v) for v in array] == [integrity.mix(v) for v in values]
    assert integrity.mix(0) == 0 and integrity.mix(1) != 1


def test_a_unit_sums_its_word_terms() -> None:
    """The error-class tests below reason per word: the raw sum is the sum of the terms."""
    words = sample_units(1, seed=9)[0]
    with np.errstate(over="ignore"):
        total = terms(words, np.arange(UNIT_WORDS)).sum(dtype=np.uint64)
    assert integrity.raw_sums(words.view(np.uint8)[None, :])[0, 0] == total


def test_a_short_unit_has_no_padding_words() -> None:
    """A page of 60 bytes is 8 words, the last half padding; a unit of 16 KiB + 8 bytes
    ends in a unit of one word: neither sum counts words past the unit's end."""
    page = np.arange(60, dtype=np.uint8)[None, :]
    assert int(integrity.raw_sums(page)[0, 0]) == integrity.reference_sum(page.tobytes())
    long = np.full((1, integrity.UNIT_BYTES + 8), 7, dtype=np.uint8)
    assert int(integrity.raw_sums(long)[0, 1]) == integrity.reference_sum(bytes([7] * 8))


# ------------------------------------------------------------------ error classes
def test_any_damage_within_one_word_changes_the_sum() -> None:
    """Every single-bit flip of every word of sampled units, and random multi-bit damage of
    one word: ``mix`` is a bijection, so the word's term always changes."""
    rng = np.random.default_rng(3)
    index = np.arange(UNIT_WORDS)
    for words in sample_units(2, seed=3):
        before = terms(words, index)
        for bit in range(64):
            assert (terms(words ^ np.uint64(1 << bit), index) != before).all(), bit
        damage = rng.integers(1, 2**64, UNIT_WORDS, dtype=np.uint64, endpoint=False)
        assert (terms(words ^ damage, index) != before).all()


def test_every_pair_of_top_bit_flips_changes_the_sum() -> None:
    """All 2,096,128 pairs of words of a unit with bit 63 flipped in both (two bf16 sign
    flips), in each sampled unit: a pair goes unnoticed only if its two term changes are
    negatives of each other, looked up among all of them at once."""
    index = np.arange(UNIT_WORDS)
    for words in sample_units(4, seed=4):
        with np.errstate(over="ignore"):
            change = terms(words ^ TOP, index) - terms(words, index)
        negated = np.uint64(0) - change
        order = np.argsort(change)
        at = np.searchsorted(change[order], negated)
        found = (at < UNIT_WORDS) & (change[order][np.minimum(at, UNIT_WORDS - 1)] == negated)
        # a word paired with itself is not a pair of two flips
        partner = order[np.minimum(at, UNIT_WORDS - 1)]
        assert not (found & (partner != index)).any()


def test_every_adjacent_swap_changes_the_sum() -> None:
    """Words i and i + 1 swapped, for every i of each sampled unit, plus units whose
    neighbours differ only in bit 63 (a linear sum with odd weights missed exactly those)."""
    units = sample_units(4, seed=5)
    rng = np.random.default_rng(5)
    pairs = rng.integers(0, 2**63, UNIT_WORDS // 2, dtype=np.uint64)
    units.append(np.stack([pairs, pairs ^ TOP], axis=1).reshape(-1))  # w, w ^ 2**63, ...
    i = np.arange(UNIT_WORDS - 1)
    for words in units:
        a, b = words[i], words[i + 1]
        with np.errstate(over="ignore"):
            change = (terms(b, i) + terms(a, i + 1)) - (terms(a, i) + terms(b, i + 1))
        distinct = a != b  # swapping equal words changes no byte
        assert not ((change == 0) & distinct).any()


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_random_bit_errors_change_the_sum(bits: int) -> None:
    """10**5 random errors of ``bits`` distinct bits each, anywhere in a unit: none unseen
    (each escapes with probability about 2**-64)."""
    trials = 100_000
    rng = np.random.default_rng(10 + bits)
    words = sample_units(1, seed=bits)[0]
    flat = np.stack([rng.choice(UNIT_WORDS * 64, bits, replace=False) for _ in range(200)])
    flat = np.concatenate([flat, rng.integers(0, UNIT_WORDS * 64, (trials - 200, bits))])
    flat = flat[(np.sort(flat, axis=1)[:, 1:] != np.sort(flat, axis=1)[:, :-1]).all(axis=1)]
    word, bit = flat // 64, (flat % 64).astype(np.uint64)
    # per trial and word: the XOR of that word's flipped bits, counted once per word
    damage = np.zeros(flat.shape, dtype=np.uint64)
    for k in range(bits):
        same = word == word[:, k:k + 1]
        first = np.argmax(same, axis=1)  # the first column naming this word carries its damage
        np.bitwise_xor.at(damage, (np.arange(len(flat)), first), np.uint64(1) << bit[:, k])
    carried = damage != 0
    with np.errstate(over="ignore"):
        change = np.where(carried, terms(words[word] ^ damage, word) - terms(words[word], word),
                          np.uint64(0))
    assert len(flat) > 0.99 * trials
    assert missed(change) == 0
