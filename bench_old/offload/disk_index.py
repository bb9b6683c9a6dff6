"""The chunk manager's picture of the file tier: which keys are on disk, least recently used
first.

Every writing rank keeps its own `FileTier` with the same capacity and is given the same calls
in the same order, so all of them hold the same keys in the same LRU order.  This index replays
those calls on the scheduling rank without any I/O, with the tiers' own class (`Lru`, whose
rules it applies: decisions are taken when a call is made, never when its I/O ends):

* ``put`` of a key already present only makes it most recently used (no write here; a writer
  whose copy is dead writes it again, which changes no LRU decision); a new key first evicts
  least recently used keys until one more fits;
* ``touch`` and ``get`` (a promotion) make a present key most recently used;
* ``discard`` forgets a key.

A write that failed or timed out, or a file found damaged or unreadable, makes the key *dead*
on that writer (a miss there) but it keeps its slot and its place in the LRU, here as in the
tier (`offload.tiers.file_tier` says why), until it is discarded or evicted: a promotion of it
fails on some rank and the caller then discards it everywhere, which brings every picture back
in step.  Keys are compared in their stored form (`key_bytes`), the form a restarted tier
reports.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from offload.errors import OffloadError
from offload.tiers.file_format import key_bytes
from offload.tiers.lru import Lru


class DiskIndex:
    """Keys on disk in LRU order (first = least recently used), at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise OffloadError(f"file tier capacity = {capacity} files is below its minimum 1; "
                               "raise --fs-bytes")
        self.capacity = capacity
        self.evicted = 0
        self._lru: Lru[bytes] = Lru(capacity)

    def __contains__(self, key: Hashable) -> bool:
        return key_bytes(key) in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def put(self, key: Hashable) -> bool:
        """Mirror `FileTier.put`; True when the key is new (a file is written)."""
        k = key_bytes(key)
        new = k not in self._lru
        self.evicted += len(self._lru.put(k))
        return new

    def touch(self, key: Hashable) -> bool:
        """Mirror `FileTier.touch` and the decision of `FileTier.get`: a present key (dead or
        not) becomes most recently used; False when it is absent."""
        return self._lru.touch(key_bytes(key))

    def discard(self, key: Hashable) -> None:
        self._lru.discard(key_bytes(key))

    def seed(self, stored: Iterable[bytes]) -> None:
        """Adopt a restarted tier's keys (`FileTier.stored_keys`, LRU first) after every
        writer agreed on them; at most ``capacity`` of them, as the tier itself holds (a
        restarted tier reports no more than that: nothing is counted in ``evicted``)."""
        for k in stored:
            self._lru.put(k)

    def lru(self) -> list[bytes]:
        """Stored keys, least recently used first (for tests and reports)."""
        return list(self._lru)
