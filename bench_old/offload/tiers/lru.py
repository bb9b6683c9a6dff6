"""The file tier's eviction rule, in one place: keys in recency order under a capacity.

Two processes take the same decisions with this class and must never differ:

* every writing rank's `FileTier` (its own files; keys are file names), under the tier's lock;
* the chunk manager's `DiskIndex` on the scheduling rank, which replays the calls every
  writer's tier receives, in the same order, to know what the disks hold without any I/O or
  reply, and decides spills and promotions from that.

So a decision may depend on the sequence of calls only: the class is pure (no I/O, no locks,
no clock) and knows nothing of a key's state.  A key whose file is being written, whose write
failed or timed out, or whose file was found damaged or unreadable holds its slot like any
other (the tier's rule for such *dead* keys, and its reason, is in `offload.tiers.file_tier`).

Rules:

* ``put`` of a held key makes it most recently used and evicts nothing; a new key first evicts
  least recently used keys until it fits, then becomes most recently used;
* ``touch`` makes a held key most recently used (an absent key: nothing changes);
* ``discard`` forgets a key and frees its slot;
* iteration runs from the least to the most recently used key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Lru(Generic[K]):
    """At most ``capacity`` keys, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"LRU capacity = {capacity} is below its minimum 1")
        self.capacity = capacity
        self._keys: OrderedDict[K, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[K]:
        return iter(self._keys)

    def put(self, key: K) -> list[K]:
        """Make ``key`` held and most recently used; return the keys evicted for it (least
        recently used first; none when ``key`` was held already)."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return []
        victims = []
        while len(self._keys) >= self.capacity:
            victims.append(self._keys.popitem(last=False)[0])
        self._keys[key] = None
        return victims

    def touch(self, key: K) -> bool:
        """Make a held ``key`` most recently used; False (and no change) when it is absent."""
        if key not in self._keys:
            return False
        self._keys.move_to_end(key)
        return True

    def reorder(self, order: Iterable[K]) -> None:
        """Put the held keys in ``order`` (least recently used first): after a restart every
        writer adopts one writer's order, so they evict alike.  ``order`` must name exactly
        the held keys."""
        keys = list(order)
        if len(keys) != len(self._keys) or set(keys) != set(self._keys):
            raise ValueError("an LRU order must name exactly the held keys")
        self._keys = OrderedDict.fromkeys(keys)

    def discard(self, key: K) -> bool:
        """Forget ``key``; False when it was absent."""
        if key not in self._keys:
            return False
        del self._keys[key]
        return True
