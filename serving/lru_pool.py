"""A fixed pool of integer ids with reference counts and an LRU cache of released ids.

The MLA KV block allocator and the KDA state slot allocator both hand out ids this way.
An id is in exactly one of three states:

- referenced: refcount > 0; held by running requests (or a step in flight). Never evicted.
- cached: refcount == 0 but carrying cache keys; its contents stay findable by key and
  can be referenced again, until allocation needs the id and evicts it, least recently
  released first.
- free: refcount == 0 and no keys; allocated before any cached id is evicted.
"""

import collections
import dataclasses
from collections.abc import Hashable, Iterable


class PoolExhaustedError(RuntimeError):
    """Fewer ids can be allocated than were asked for; nothing was allocated."""


@dataclasses.dataclass(frozen=True)
class PoolUsage:
    """Counts for metrics.

    Attributes:
      total: ids in the pool.
      used: referenced ids (refcount > 0).
      cached: ids carrying cache keys, referenced or not.
    """

    total: int
    used: int
    cached: int

    @property
    def free(self) -> int:
        """Ids an allocation can have: free ones plus unreferenced cached ones."""
        return self.total - self.used


class LruPool:
    """Ids 0..size-1 with reference counts, cache keys and LRU eviction of released ids."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self._refcounts = [0] * size
        self._free = collections.deque(range(size))
        # Unreferenced ids with keys, least recently released first.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._keys: dict[int, list[Hashable]] = {}
        self._owners: dict[Hashable, int] = {}
        self.num_evictions = 0

    @property
    def size(self) -> int:
        """Ids in the pool."""
        return len(self._refcounts)

    @property
    def num_allocatable(self) -> int:
        """Ids ``allocate`` can hand out now, evicting cached ones if it must."""
        return len(self._free) + len(self._evictable)

    def allocate(self, count: int) -> list[int]:
        """Hands out ``count`` ids with refcount 1, evicting least recently released first.

        Raises:
          ValueError: for a negative count.
          PoolExhaustedError: when fewer than ``count`` ids are allocatable.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > self.num_allocatable:
            raise PoolExhaustedError(
                f"asked for {count} ids, {self.num_allocatable} of {self.size} allocatable"
            )
        ids = []
        for _ in range(count):
            if self._free:
                id_ = self._free.popleft()
            else:
                id_, _ = self._evictable.popitem(last=False)
                for key in self._keys.pop(id_):
                    del self._owners[key]
                self.num_evictions += 1
            self._refcounts[id_] = 1
            ids.append(id_)
        return ids

    def acquire(self, ids: Iterable[int]) -> None:
        """Adds a reference to each id (repeats add several); a cached id leaves the LRU.

        Raises:
          ValueError: naming an id that is out of range or free (neither referenced nor
            cached); then no reference is added.
        """
        ids = list(ids)
        for id_ in ids:
            self._check_range(id_)
            if self._refcounts[id_] == 0 and id_ not in self._evictable:
                raise ValueError(f"id {id_} is free: it holds nothing to reference")
        for id_ in ids:
            if self._refcounts[id_] == 0:
                del self._evictable[id_]
            self._refcounts[id_] += 1

    def release(self, ids: Iterable[int]) -> None:
        """Drops a reference from each id, in order; an id reaching 0 becomes cached or free.

        Ids released together enter the LRU in the given order, so the first is evicted
        first.

        Raises:
          ValueError: naming an id that is out of range or would drop below zero
            references; then no reference is dropped.
        """
        ids = list(ids)
        for id_, count in collections.Counter(ids).items():
            self._check_range(id_)
            if count > self._refcounts[id_]:
                raise ValueError(
                    f"id {id_} has {self._refcounts[id_]} references, cannot release {count}"
                )
        for id_ in ids:
            self._refcounts[id_] -= 1
            if self._refcounts[id_] == 0:
                if id_ in self._keys:
                    self._evictable[id_] = None
                else:
                    self._free.append(id_)

    def add_key(self, id_: int, key: Hashable) -> bool:
        """Makes the referenced ``id_`` findable by ``key`` until it is evicted.

        Returns:
          True if ``key`` now names ``id_``; False if it already names another id, which
          is left as it is (the first id registered for a key keeps it).

        Raises:
          ValueError: naming an id that is out of range or unreferenced (only a holder of
            an id knows what it contains).
        """
        self._check_range(id_)
        if self._refcounts[id_] == 0:
            raise ValueError(f"id {id_} is unreferenced; only a referenced id can get a key")
        owner = self._owners.get(key)
        if owner is not None:
            return owner == id_
        self._owners[key] = id_
        self._keys.setdefault(id_, []).append(key)
        return True

    def find(self, key: Hashable) -> int | None:
        """The id ``key`` names, or None. Does not add a reference or touch the LRU."""
        return self._owners.get(key)

    def keys(self, id_: int) -> tuple[Hashable, ...]:
        """The cache keys naming ``id_``, oldest first."""
        self._check_range(id_)
        return tuple(self._keys.get(id_, ()))

    def refcount(self, id_: int) -> int:
        """References held on ``id_``."""
        self._check_range(id_)
        return self._refcounts[id_]

    def usage(self) -> PoolUsage:
        """Total, referenced and cached id counts."""
        return PoolUsage(
            total=self.size, used=self.size - self.num_allocatable, cached=len(self._keys)
        )

    def _check_range(self, id_: int) -> None:
        if not 0 <= id_ < self.size:
            raise ValueError(f"id {id_} is outside the pool [0, {self.size})")
