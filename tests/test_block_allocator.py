"""Tests for serving.block_allocator (and the LRU pool under it)."""

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from serving.block_allocator import BlockAllocator
from serving.block_hash import chained_block_hashes
from serving.lru_pool import PoolExhaustedError, PoolUsage


def chunk_hashes(num_chunks, seed=0, block_size=4):
    tokens = [seed * 1000 + t for t in range(num_chunks * block_size)]
    return chained_block_hashes(tokens, block_size)


def test_allocate_and_free_count_references():
    blocks = BlockAllocator(4)
    ids = blocks.allocate(3)
    assert sorted(ids) == sorted(set(ids)) and all(0 <= i < 4 for i in ids)
    assert [blocks.refcount(i) for i in ids] == [1, 1, 1]
    assert blocks.usage() == PoolUsage(total=4, used=3, cached=0)
    blocks.pin(ids[:1])
    blocks.free(ids)
    assert blocks.refcount(ids[0]) == 1
    assert blocks.usage().used == 1
    blocks.free(ids[:1])
    assert blocks.usage() == PoolUsage(total=4, used=0, cached=0)
    assert blocks.usage().free == 4


def test_exhaustion_allocates_nothing():
    blocks = BlockAllocator(3)
    blocks.allocate(2)
    with pytest.raises(PoolExhaustedError, match="asked for 2"):
        blocks.allocate(2)
    assert blocks.num_allocatable == 1
    assert blocks.allocate(0) == []


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda b: b.free([0]), "id 0 has 0 references"),
        (lambda b: b.pin([1]), "id 1 is free"),
        (lambda b: b.pin([7]), "id 7 is outside"),
        (lambda b: b.free([-1]), "id -1 is outside"),
        (lambda b: b.allocate(-1), "-1"),
        (lambda b: b.register(chunk_hashes(3), [0]), "need 2 blocks"),
        (lambda b: b.register(chunk_hashes(1), [0]), "block 0 is unreferenced"),
        (lambda b: b.blocks_needed(-3), "-3"),
    ],
)
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(BlockAllocator(4, dcp=2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_blocks": 0}, "num_blocks"), ({"block_size": 0}, "block_size"), ({"dcp": 3}, "dcp")],
)
def test_constructor_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockAllocator(**{"num_blocks": 4, **kwargs})


def test_failed_release_drops_no_reference():
    blocks = BlockAllocator(2)
    a, b = blocks.allocate(2)
    with pytest.raises(ValueError, match=f"id {b} has 1 references, cannot release 2"):
        blocks.free([a, b, b])
    assert (blocks.refcount(a), blocks.refcount(b)) == (1, 1)


def test_blocks_needed_uses_logical_blocks():
    blocks = BlockAllocator(8, block_size=512, dcp=4)
    assert blocks.tokens_per_block == 2048
    assert [blocks.blocks_needed(n) for n in (0, 1, 2048, 2049, 8192)] == [0, 1, 1, 2, 4]


def test_registered_blocks_stay_cached_after_release_and_can_be_pinned_again():
    blocks = BlockAllocator(4, block_size=4)
    hashes = chunk_hashes(3)
    table = blocks.allocate(3)
    assert blocks.register(hashes, table) == 3
    assert blocks.register(hashes, table) == 0
    blocks.free(table)
    assert blocks.usage() == PoolUsage(total=4, used=0, cached=3)
    assert blocks.cached_chunks(hashes) == table
    blocks.pin(table[:2])
    assert blocks.usage().used == 2
    blocks.free(table[:2])
    assert blocks.cached_chunks(hashes) == table


def test_cached_chunks_stops_at_first_miss():
    blocks = BlockAllocator(3, block_size=4)
    hashes = chunk_hashes(3)
    table = blocks.allocate(3)
    blocks.register(hashes, table)
    other = chunk_hashes(3, seed=1)
    assert blocks.cached_chunks(other) == []
    assert blocks.cached_chunks(hashes[:1] + other[1:]) == table[:1]
    blocks.free([table[1]])
    blocks.free([table[0], table[2]])
    assert blocks.allocate(1) == [table[1]]  # evicts the middle chunk
    assert blocks.cached_chunks(hashes) == table[:1]


def test_first_registration_of_a_chunk_wins():
    blocks = BlockAllocator(4, block_size=4)
    hashes = chunk_hashes(2)
    first, second = blocks.allocate(1), blocks.allocate(2)
    blocks.register(hashes[:1], first)
    assert blocks.register(hashes, second) == 1
    assert blocks.cached_chunks(hashes) == [first[0], second[1]]


def test_eviction_is_least_recently_released_first_and_free_blocks_go_before_cached():
    blocks = BlockAllocator(4, block_size=4)
    a, b, c, d = (blocks.allocate(1)[0] for _ in range(4))
    for seed, block_id in enumerate([a, b, c]):
        blocks.register(chunk_hashes(1, seed=seed), [block_id])
    blocks.free([b])
    blocks.free([a])
    blocks.free([d])  # free, not cached: handed out before any eviction
    blocks.free([c])
    assert blocks.allocate(1) == [d]
    assert blocks.num_evictions == 0
    assert blocks.allocate(1) == [b]
    assert blocks.num_evictions == 1
    assert blocks.cached_chunks(chunk_hashes(1, seed=1)) == []
    assert blocks.cached_chunks(chunk_hashes(1, seed=0)) == [a]
    assert blocks.allocate(2) == [a, c]
    assert blocks.usage() == PoolUsage(total=4, used=4, cached=0)


def test_freeing_a_table_evicts_its_deepest_blocks_first():
    blocks = BlockAllocator(3, block_size=4)
    hashes = chunk_hashes(3)
    table = blocks.allocate(3)
    blocks.register(hashes, table)
    blocks.free(table)
    blocks.allocate(1)
    assert blocks.cached_chunks(hashes) == table[:2]


def test_referenced_blocks_are_never_evicted():
    blocks = BlockAllocator(3, block_size=4)
    table = blocks.allocate(3)
    blocks.register(chunk_hashes(3), table)
    blocks.free(table[2:])
    assert blocks.allocate(1) == table[2:]
    with pytest.raises(PoolExhaustedError):
        blocks.allocate(1)
    assert blocks.cached_chunks(chunk_hashes(3)) == table[:2]


def test_logical_blocks_under_dcp():
    blocks = BlockAllocator(4, block_size=4, dcp=2)
    hashes = chunk_hashes(5)
    table = blocks.allocate(3)
    blocks.register(hashes, table)
    chunk_blocks = blocks.cached_chunks(hashes)
    assert chunk_blocks == [table[0], table[0], table[1], table[1], table[2]]
    assert blocks.prefix_block_table(chunk_blocks) == tuple(table)
    assert blocks.prefix_block_table(chunk_blocks[:3]) == tuple(table[:2])
    assert blocks.prefix_block_table([]) == ()


def test_prefix_table_takes_the_block_of_the_last_chunk_in_each_logical_block():
    # A request that copied block `a` (chunk 0) into `b` and went on to write chunk 1:
    # chunk 0 stays mapped to `a`, chunk 1 maps to `b`, and `b` holds both.
    blocks = BlockAllocator(4, block_size=4, dcp=2)
    hashes = chunk_hashes(2)
    a, b = blocks.allocate(2)
    blocks.register(hashes[:1], [a])
    blocks.register(hashes, [b])
    chunk_blocks = blocks.cached_chunks(hashes)
    assert chunk_blocks == [a, b]
    assert blocks.prefix_block_table(chunk_blocks) == (b,)
    assert blocks.prefix_block_table(chunk_blocks[:1]) == (a,)


class BlockAllocatorMachine(RuleBasedStateMachine):
    """Random allocate / pin / free / register sequences against a plain model."""

    def __init__(self):
        super().__init__()
        self.blocks = BlockAllocator(6, block_size=2)
        self.refs = {}  # block -> references the model holds
        self.keys = {}  # chunk hash -> block
        self.lru = []  # unreferenced cached blocks, least recently released first
        self.next_seed = 0

    def cached(self, block_id):
        return block_id in self.keys.values()

    @rule(count=st.integers(0, 3))
    def allocate(self, count):
        free = [b for b in range(6) if self.refs.get(b, 0) == 0 and not self.cached(b)]
        if count > len(free) + len(self.lru):
            with pytest.raises(PoolExhaustedError):
                self.blocks.allocate(count)
            return
        got = self.blocks.allocate(count)
        for block_id in got:
            assert self.refs.get(block_id, 0) == 0, "handed out a referenced block"
            if self.cached(block_id):
                assert not set(free) - set(got), "evicted while a free block was left"
                assert block_id == self.lru.pop(0), "evicted out of LRU order"
                self.keys = {k: b for k, b in self.keys.items() if b != block_id}
            self.refs[block_id] = 1

    @precondition(lambda self: any(self.refs.values()) or self.lru)
    @rule(data=st.data())
    def pin(self, data):
        choices = [b for b, n in self.refs.items() if n > 0] + self.lru
        block_id = data.draw(st.sampled_from(choices))
        self.blocks.pin([block_id])
        if block_id in self.lru:
            self.lru.remove(block_id)
        self.refs[block_id] = self.refs.get(block_id, 0) + 1

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def free(self, data):
        block_id = data.draw(st.sampled_from([b for b, n in self.refs.items() if n > 0]))
        self.blocks.free([block_id])
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0 and self.cached(block_id):
            self.lru.append(block_id)

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def register(self, data):
        block_id = data.draw(st.sampled_from([b for b, n in self.refs.items() if n > 0]))
        key = chunk_hashes(1, seed=self.next_seed, block_size=2)[0]
        self.next_seed += 1
        assert self.blocks.register([key], [block_id]) == 1
        self.keys[key] = block_id

    @invariant()
    def agrees_with_model(self):
        for block_id in range(6):
            assert self.blocks.refcount(block_id) == self.refs.get(block_id, 0)
        for key, block_id in self.keys.items():
            assert self.blocks.cached_chunks([key]) == [block_id]
        used = sum(1 for n in self.refs.values() if n > 0)
        cached = len(set(self.keys.values()))
        assert self.blocks.usage() == PoolUsage(total=6, used=used, cached=cached)


TestBlockAllocatorMachine = BlockAllocatorMachine.TestCase
TestBlockAllocatorMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
