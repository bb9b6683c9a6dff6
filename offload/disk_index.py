"""The chunk manager's picture of the file tier: which keys are on disk, least recently used
first.

Every writing rank keeps its own `FileTier` with the same capacity and is given the same calls
in the same order, so all of them hold the same keys in the same LRU order.  This index replays
those calls on the scheduling rank without any I/O, by the FileTier's own rules (decisions are
taken when a call is made, never when its I/O ends):

* ``put`` of a key already present only makes it most recently used (no write); a new key first
  evicts least recently used keys until one more fits;
* ``touch`` and ``get`` (a promotion) make a present key most recently used;
* ``discard`` forgets a key.

A write that failed, or a file found damaged, is still "present" here as it is in the
FileTier's budget (a dead entry) until it is discarded: a promotion of it fails on some rank and
the caller then discards it everywhere, which brings every picture back in step.  Keys are
compared in their stored form (`key_bytes`), the form a restarted tier reports.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from offload.errors import OffloadError
from offload.tiers.file_format import key_bytes


class DiskIndex:
    """Keys on disk in LRU order (first = least recently used), at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise OffloadError(f"file tier capacity = {capacity} files is below its minimum 1; "
                               "raise --fs-bytes")
        self.capacity = capacity
        self.evicted = 0
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key_bytes(key) in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def put(self, key: Hashable) -> bool:
        """Mirror `FileTier.put`; True when the key is new (a file is written)."""
        k = key_bytes(key)
        if k in self._keys:
            self._keys.move_to_end(k)
            return False
        while len(self._keys) >= self.capacity:
            self._keys.popitem(last=False)
            self.evicted += 1
        self._keys[k] = None
        return True

    def touch(self, key: Hashable) -> bool:
        """Mirror `FileTier.touch` and the decision of `FileTier.get`: a present key becomes
        most recently used; False when it is absent."""
        k = key_bytes(key)
        if k not in self._keys:
            return False
        self._keys.move_to_end(k)
        return True

    def discard(self, key: Hashable) -> None:
        self._keys.pop(key_bytes(key), None)

    def seed(self, stored: Iterable[bytes]) -> None:
        """Adopt a restarted tier's keys (`FileTier.stored_keys`, LRU first) after every
        writer agreed on them; at most ``capacity`` of them, as the tier itself holds."""
        for k in stored:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def lru(self) -> list[bytes]:
        """Stored keys, least recently used first (for tests and reports)."""
        return list(self._keys)
