"""Slots of the KDA state pools: running requests' states and retained checkpoints.

Every KDA layer owns a state pool (recurrent and conv history) and all of them share one
slot index, so a slot names the state of every KDA layer at once. A slot is used either
as a running request's state, which each step reads and overwrites, or as a retained
state: the frozen state after exactly p tokens of some prefix, written by a kernel
snapshot or copied out of a running slot, and keyed by (hash of tokens [0, p), p) so a
later request with that prefix can resume from it.
"""

from collections.abc import Iterable
from typing import NamedTuple

from serving.lru_pool import LruPool, PoolUsage


class StateKey(NamedTuple):
    """Names the retained state after the first ``position`` tokens of a prefix.

    Attributes:
      prefix_hash: chained hash of tokens [0, position) (``serving.block_hash``).
      position: p, the number of tokens the state has consumed.
    """

    prefix_hash: bytes
    position: int


class StateSlotAllocator:
    """Reference-counted state slots with retained-state keys and LRU eviction.

    A retained slot whose last reference is released stays findable until allocation
    needs it; then the least recently released goes first. A slot with references
    (a running request's, a snapshot destination of a step in flight, a retained state a
    request is resuming from) is never evicted.
    """

    def __init__(self, num_slots: int):
        """A pool of ``num_slots`` slot indices.

        Raises:
          ValueError: for a non-positive slot count.
        """
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self._pool = LruPool(num_slots)

    @property
    def num_slots(self) -> int:
        """Slots in the pool."""
        return self._pool.size

    @property
    def num_allocatable(self) -> int:
        """Slots ``allocate`` can hand out now, evicting retained ones if it must."""
        return self._pool.num_allocatable

    @property
    def num_evictions(self) -> int:
        """Retained states evicted so far."""
        return self._pool.num_evictions

    def allocate(self, count: int = 1) -> list[int]:
        """``count`` slots with one reference each; evicts retained states, LRU first.

        Raises:
          PoolExhaustedError: when fewer than ``count`` slots are allocatable (then none
            is allocated).
        """
        return self._pool.allocate(count)

    def pin(self, slots: Iterable[int]) -> None:
        """Adds a reference to each slot, e.g. a retained state a request resumes from."""
        self._pool.acquire(slots)

    def free(self, slots: Iterable[int]) -> None:
        """Drops a reference from each slot; a retained one stays findable until evicted."""
        self._pool.release(slots)

    def refcount(self, slot: int) -> int:
        """References held on ``slot``."""
        return self._pool.refcount(slot)

    def retain(self, slot: int, key: StateKey) -> bool:
        """Keys the referenced ``slot`` as the retained state ``key`` names.

        Call once the slot holds that state for every KDA layer (the step that wrote it
        has finished and its update was accepted), and never for a running slot, whose
        state moves on. The caller keeps its reference; ``free`` it when done.

        Returns:
          True if ``key`` now names ``slot``; False if another slot already retains that
          state (the caller then frees its own slot, which becomes free, not cached).

        Raises:
          ValueError: naming a position below 1, or a slot that is out of range,
            unreferenced or already retaining another state.
        """
        if key.position < 1:
            raise ValueError(f"a retained state needs position >= 1, got {key.position}")
        held = self._pool.keys(slot)
        if held and held != (key,):
            raise ValueError(
                f"slot {slot} already retains the state at position {held[0].position}"
            )
        return self._pool.add_key(slot, key)

    def find(self, key: StateKey) -> int | None:
        """The slot retaining ``key``'s state, or None. Adds no reference."""
        return self._pool.find(key)

    def usage(self) -> PoolUsage:
        """Total, referenced and retained slot counts."""
        return self._pool.usage()
