"""Prefix cache: where a new request can resume, from cached KV blocks and KDA states.

A request of L tokens can skip its first p tokens only if the cache holds both halves of
the model's state after them: the MLA KV for [0, p) and a retained KDA state (every KDA
layer, recurrent and conv) for exactly p. p is a multiple of the lookup unit P (the KV
block size) and at most L - 1, since the last prompt token must be computed to get the
logits of the first generated token. Anything short of both halves at the same p is a
miss: resuming the recurrence from the wrong or an empty state produces wrong text at
full speed, so the cache never guesses.

Typical use by the scheduler, per request:

    hit = cache.acquire(prompt)            # longest hit, pinned; PrefixHit() on a miss
    ... copy hit.state_slot into the request's running slot; if hit.copy_last_block,
    ... copy hit.block_ids[-1] into a block of the request's own (copy-on-write)
    ... after each step: cache.register_blocks(prompt, table, num_computed) and
    ... cache.register_state(prompt, p, slot) for each retained state, then free the slots
    cache.release(hit)                     # when the request finishes or is preempted
"""

import dataclasses
from collections.abc import Sequence

from serving.block_allocator import BlockAllocator
from serving.block_hash import chained_block_hashes
from serving.state_slots import StateKey, StateSlotAllocator


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """Where a request resumes; the default value is a miss.

    Attributes:
      num_tokens: p, prompt tokens the request need not compute (0 on a miss).
      block_ids: blocks holding the KV of [0, p), one per logical block of P * dcp tokens.
      state_slot: slot retaining every KDA layer's state after exactly p tokens; None on
        a miss. The request copies it into its own running slot, since a step overwrites
        the slot it resumes from.
      copy_last_block: p ends inside the last block, whose later rows hold another
        sequence's KV. The request copies that block into one of its own and puts the
        copy in its block table (copy-on-write). When False every shared block is whole
        and the request only reads it.
    """

    num_tokens: int = 0
    block_ids: tuple[int, ...] = ()
    state_slot: int | None = None
    copy_last_block: bool = False


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """Counters for ``/metrics``, over all ``acquire`` calls.

    Attributes:
      requests: requests looked up for admission.
      hits: those that resume from a cached prefix.
      prompt_tokens: prompt tokens of the requests.
      hit_tokens: prompt tokens served from the cache.
    """

    requests: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0


class PrefixCache:
    """Longest-prefix lookup over a ``BlockAllocator`` and a ``StateSlotAllocator``.

    The cache owns no memory of its own: it records in the allocators which blocks and
    slots hold which prefixes, and references what a request resumes from so it cannot be
    evicted while the request runs.
    """

    def __init__(self, blocks: BlockAllocator, states: StateSlotAllocator):
        self.blocks = blocks
        self.states = states
        self._stats = PrefixCacheStats()

    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        """The longest prefix of ``token_ids`` the request can resume after, unpinned.

        Pure: adds no reference and does not touch the LRU order, so the result is only
        good until the next allocation or release. Use ``acquire`` to admit a request.
        """
        block_size = self.blocks.block_size
        max_chunks = max(len(token_ids) - 1, 0) // block_size
        hashes = chained_block_hashes(token_ids, block_size, max_blocks=max_chunks)
        chunk_blocks = self.blocks.cached_chunks(hashes)
        for num_chunks in range(len(chunk_blocks), 0, -1):
            position = num_chunks * block_size
            slot = self.states.find(StateKey(hashes[num_chunks - 1], position))
            if slot is not None:
                return PrefixHit(
                    num_tokens=position,
                    block_ids=self.blocks.prefix_block_table(chunk_blocks[:num_chunks]),
                    state_slot=slot,
                    copy_last_block=position % self.blocks.tokens_per_block != 0,
                )
        return PrefixHit()

    def acquire(self, token_ids: Sequence[int]) -> PrefixHit:
        """``lookup`` plus a reference on the hit's blocks and state slot.

        Call once per request admission (it counts towards ``stats``); a miss pins
        nothing. Give the hit back with ``release`` when the request finishes or is
        preempted, not before: its block table reads the shared blocks every step.
        """
        hit = self.lookup(token_ids)
        self.blocks.pin(hit.block_ids)
        if hit.state_slot is not None:
            self.states.pin([hit.state_slot])
        self._stats = dataclasses.replace(
            self._stats,
            requests=self._stats.requests + 1,
            hits=self._stats.hits + int(hit.num_tokens > 0),
            prompt_tokens=self._stats.prompt_tokens + len(token_ids),
            hit_tokens=self._stats.hit_tokens + hit.num_tokens,
        )
        return hit

    def release(self, hit: PrefixHit) -> None:
        """Drops the references ``acquire`` took for ``hit``."""
        self.blocks.free(hit.block_ids)
        if hit.state_slot is not None:
            self.states.free([hit.state_slot])

    def register_blocks(
        self, token_ids: Sequence[int], block_table: Sequence[int], num_computed: int
    ) -> int:
        """Makes the KV a request has written findable by later lookups.

        Records every full P-token chunk of [0, num_computed) as held by the blocks of
        ``block_table``, which the request still references. Call after the step that
        wrote the KV finished. Idempotent; costs a hash of the prefix, O(num_computed).

        Returns:
          How many chunks became newly cached.

        Raises:
          ValueError: naming a ``num_computed`` outside [0, len(token_ids)], or a table
            too short for it.
        """
        if not 0 <= num_computed <= len(token_ids):
            raise ValueError(
                f"num_computed must be in [0, {len(token_ids)}] tokens, got {num_computed}"
            )
        block_size = self.blocks.block_size
        hashes = chained_block_hashes(token_ids, block_size, max_blocks=num_computed // block_size)
        return self.blocks.register(hashes, block_table)

    def register_state(self, token_ids: Sequence[int], position: int, slot: int) -> bool:
        """Makes ``slot`` findable as the retained state after ``position`` tokens.

        The slot must hold, for every KDA layer, the state after the first ``position``
        tokens of ``token_ids``. Call after the step that wrote the slot finished with its
        update accepted. The caller keeps its reference on the slot and frees it afterwards.

        Returns:
          True if the slot now retains that state; False if another slot already did
          (the caller's slot then becomes free when it frees it).

        Raises:
          ValueError: naming a position that is not a positive multiple of P within the
            sequence, or a slot that is unreferenced or retains another state.
        """
        block_size = self.blocks.block_size
        if not 0 < position <= len(token_ids) or position % block_size:
            raise ValueError(
                f"position must be a positive multiple of {block_size} at most "
                f"{len(token_ids)}, got {position}"
            )
        prefix_hash = chained_block_hashes(token_ids[:position], block_size)[-1]
        return self.states.retain(slot, StateKey(prefix_hash, position))

    def stats(self) -> PrefixCacheStats:
        """Admission counters since construction."""
        return self._stats
