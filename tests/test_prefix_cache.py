"""Tests for serving.prefix_cache, including a simulated serving loop over fake device memory."""

import random

import hypothesis.strategies as st
import pytest
from hypothesis import event, given, settings

from serving.block_allocator import BlockAllocator
from serving.lru_pool import PoolExhaustedError, PoolUsage
from serving.plan import plan_prefill
from serving.prefix_cache import PrefixCache, PrefixCacheStats, PrefixHit
from serving.state_slots import StateSlotAllocator


def make_cache(num_blocks=32, num_slots=16, block_size=4, dcp=1):
    return PrefixCache(
        BlockAllocator(num_blocks, block_size=block_size, dcp=dcp), StateSlotAllocator(num_slots)
    )


class SimulatedServer:
    """Drives a PrefixCache like the scheduler and engine will, over fake device memory.

    ``kv[block][row]`` is the token whose KV a block row holds and ``state[slot]`` the
    tokens a KDA state has consumed, so a hit can be checked against what the memory
    really holds: a hit is correct iff its state consumed exactly the prompt's first p
    tokens and its blocks hold the prompt's first p tokens.
    """

    def __init__(self, cache, *, budget=None):
        self.cache = cache
        self.blocks, self.states = cache.blocks, cache.states
        self.rows = self.blocks.tokens_per_block
        self.budget = budget or 4 * self.rows
        self.kv = {}
        self.state = {}
        self.running = []  # (hit, own blocks, running slot)
        self.hits = []

    def in_use(self):
        blocks, slots = set(), set()
        for hit, own, slot in self.running:
            blocks |= set(hit.block_ids) | set(own)
            slots |= {slot} | ({hit.state_slot} - {None})
        return blocks, slots

    def allocate_blocks(self, count):
        in_use = self.in_use()[0]
        got = self.blocks.allocate(count)
        assert not in_use & set(got), "allocated a block a running request uses"
        for block_id in got:
            self.kv[block_id] = [None] * self.rows
        return got

    def allocate_slots(self, count):
        in_use = self.in_use()[1]
        got = self.states.allocate(count)
        assert not in_use & set(got), "allocated a slot a running request uses"
        for slot in got:
            self.state[slot] = None
        return got

    def check_hit(self, tokens, hit):
        p = hit.num_tokens
        assert p % self.blocks.block_size == 0 and p <= len(tokens) - 1
        assert len(hit.block_ids) == self.blocks.blocks_needed(p)
        assert hit.copy_last_block == (p % self.rows != 0)
        if p == 0:
            assert hit == PrefixHit()
            return
        assert self.state[hit.state_slot] == tuple(tokens[:p]), "resumed from a wrong state"
        for position in range(p):
            block_id = hit.block_ids[position // self.rows]
            assert self.kv[block_id][position % self.rows] == tokens[position], "wrong KV"

    def submit(self, tokens, *, coalesce=True):
        """Admits and prefills a request; it keeps running until ``finish``."""
        hit = self.cache.acquire(tokens)
        self.check_hit(tokens, hit)
        self.hits.append(hit.num_tokens)
        own, slot = [], None
        self.running.append((hit, own, slot))
        try:
            (slot,) = self.allocate_slots(1)
            self.running[-1] = (hit, own, slot)
            self.state[slot] = tuple(tokens[: hit.num_tokens])
            table = list(hit.block_ids)
            if hit.copy_last_block:  # copy-on-write of the partly shared block
                own += self.allocate_blocks(1)
                self.kv[own[-1]] = list(self.kv[table[-1]])
                table[-1] = own[-1]
            spans = plan_prefill(
                len(tokens),
                hit.num_tokens,
                block_size=self.blocks.block_size,
                dcp=self.blocks.dcp,
                budget=self.budget,
                coalesce=coalesce,
            )
            for span in spans:
                self.prefill(tokens, span, table, own, slot)
        except PoolExhaustedError:
            self.finish(len(self.running) - 1)  # preempted: frees everything it holds

    def prefill(self, tokens, span, table, own, slot):
        new = self.allocate_blocks(self.blocks.blocks_needed(span.end) - len(table))
        own += new
        table += new
        snapshots = self.allocate_slots(len(span.checkpoints))
        try:
            for position in range(span.start, span.end):
                self.kv[table[position // self.rows]][position % self.rows] = tokens[position]
            assert self.state[slot] == tuple(tokens[: span.start])
            self.state[slot] = tuple(tokens[: span.end])
            for position, snapshot in zip(span.checkpoints, snapshots):
                self.state[snapshot] = tuple(tokens[:position])
            self.cache.register_blocks(tokens, table, span.end)
            for position, snapshot in zip(span.checkpoints, snapshots):
                self.cache.register_state(tokens, position, snapshot)
            if span.retain_end:
                snapshots += self.allocate_slots(1)
                self.state[snapshots[-1]] = self.state[slot]  # copy out the running state
                self.cache.register_state(tokens, span.end, snapshots[-1])
        finally:
            self.states.free(snapshots)

    def finish(self, index):
        hit, own, slot = self.running.pop(index)
        self.cache.release(hit)
        self.blocks.free(own)
        if slot is not None:
            self.states.free([slot])


def test_longest_hit_is_at_most_one_token_short_of_the_prompt():
    server = SimulatedServer(make_cache())
    prompt = list(range(16))
    server.submit(prompt)
    server.finish(0)
    assert server.cache.lookup(prompt).num_tokens == 12
    assert server.cache.lookup(prompt + [99]).num_tokens == 16
    assert server.cache.lookup(prompt[:13]).num_tokens == 12
    assert server.cache.lookup(prompt[:12]).num_tokens == 8
    assert server.cache.lookup(prompt[:4]) == PrefixHit()
    assert server.cache.lookup([]) == PrefixHit()


def test_hit_needs_the_retained_state_for_exactly_that_position():
    cache = make_cache()
    prompt = list(range(16))
    table = cache.blocks.allocate(4)
    cache.register_blocks(prompt, table, 16)
    assert cache.lookup(prompt + [0]) == PrefixHit()  # all KV cached, no state: a miss
    (slot,) = cache.states.allocate()
    cache.register_state(prompt, 8, slot)
    hit = cache.lookup(prompt + [0])
    assert hit == PrefixHit(8, tuple(table[:2]), slot, False)
    assert cache.lookup(list(range(8)) + [50] * 9) == hit  # diverges after the state
    assert cache.lookup(list(range(7)) + [50] * 10) == PrefixHit()  # diverges before it


def test_hit_needs_the_kv_blocks():
    cache = make_cache(num_blocks=4)
    prompt = list(range(16))
    table = cache.blocks.allocate(4)
    cache.register_blocks(prompt, table, 16)
    slots = cache.states.allocate(2)
    cache.register_state(prompt, 8, slots[0])
    cache.register_state(prompt, 16, slots[1])
    cache.blocks.free(table[:1])
    cache.blocks.allocate(1)  # evicts block 0: the prefix chain is broken
    assert cache.lookup(prompt + [0]) == PrefixHit()
    cache.states.free(slots)
    cache.blocks.free(table[1:])


def test_acquired_hit_is_never_evicted():
    server = SimulatedServer(make_cache(num_blocks=6, num_slots=8))
    prompt = list(range(16))
    server.submit(prompt)
    server.finish(0)
    hit = server.cache.acquire(prompt + [1])
    assert hit.num_tokens == 16
    others = server.blocks.allocate(server.blocks.num_allocatable)
    server.states.allocate(server.states.num_allocatable)
    assert not set(others) & set(hit.block_ids)
    with pytest.raises(PoolExhaustedError):
        server.blocks.allocate(1)
    with pytest.raises(PoolExhaustedError):
        server.states.allocate(1)
    assert server.cache.lookup(prompt + [1]) == hit
    server.cache.release(hit)
    assert server.blocks.allocate(len(hit.block_ids)) == list(reversed(hit.block_ids))


def test_freeing_everything_returns_usage_to_zero():
    server = SimulatedServer(make_cache(dcp=2))
    for length in (17, 23, 30, 9):
        server.submit(list(range(length)))
    assert server.blocks.usage().used > 0
    while server.running:
        server.finish(0)
    assert server.blocks.usage().used == 0 and server.states.usage().used == 0
    assert server.blocks.usage().cached > 0 and server.states.usage().cached > 0


def test_dcp4_hit_inside_a_logical_block_is_copied_on_write():
    """DESIGN's 8K prompt at dcp 4 retains 4096, 6144, 7168, 7680 and its end, 8192."""
    cache = make_cache(num_blocks=16, num_slots=16, block_size=512, dcp=4)
    server = SimulatedServer(cache, budget=8192)
    prompt = [t % 1000 for t in range(8192)]
    server.submit(prompt)
    server.finish(0)
    assert cache.states.usage().cached == 5
    hit = cache.lookup(prompt)
    assert (hit.num_tokens, len(hit.block_ids), hit.copy_last_block) == (7680, 4, True)
    assert cache.lookup(prompt[:7000]).num_tokens == 6144
    assert not cache.lookup(prompt[:7000]).copy_last_block
    server.submit(prompt[:7680] + [5] * 600)  # resumes at 7680 through a copy of block 3
    server.submit(prompt + [7] * 10)
    assert server.hits == [0, 7680, 8192]
    extended = server.cache.lookup(prompt[:7680] + [5] * 600)
    assert extended.num_tokens == 8192 and extended.block_ids[-1] != hit.block_ids[-1]


def test_registration_arguments_are_checked():
    cache = make_cache()
    prompt = list(range(16))
    (slot,) = cache.states.allocate()
    with pytest.raises(ValueError, match="got 6"):
        cache.register_state(prompt, 6, slot)
    with pytest.raises(ValueError, match="got 20"):
        cache.register_state(prompt, 20, slot)
    with pytest.raises(ValueError, match="got 0"):
        cache.register_state(prompt, 0, slot)
    with pytest.raises(ValueError, match="got 17"):
        cache.register_blocks(prompt, [0, 1, 2, 3], 17)
    with pytest.raises(ValueError, match="need 4 blocks"):
        cache.register_blocks(prompt, [0, 1], 16)


def test_stats_count_admissions():
    server = SimulatedServer(make_cache())
    prompt = list(range(16))
    server.submit(prompt)
    server.submit(prompt)
    server.submit([1, 2, 3])
    assert server.cache.stats() == PrefixCacheStats(
        requests=3, hits=1, prompt_tokens=35, hit_tokens=12
    )


def run_workload(seed, num_requests, *, dcp, num_blocks, num_slots, coalesce):
    rng = random.Random(seed)
    cache = make_cache(num_blocks=num_blocks, num_slots=num_slots, dcp=dcp)
    server = SimulatedServer(cache, budget=4 * dcp * rng.randint(1, 3))
    bases = [[rng.randrange(3) for _ in range(60)] for _ in range(3)]
    for _ in range(num_requests):
        base = rng.choice(bases)
        prompt = base[: rng.randint(1, 60)] + [rng.randrange(3) for _ in range(rng.randint(0, 8))]
        server.submit(prompt, coalesce=coalesce)
        while len(server.running) > rng.randint(0, 3):
            server.finish(rng.randrange(len(server.running)))
    while server.running:
        server.finish(0)
    assert cache.blocks.usage() == PoolUsage(num_blocks, 0, cache.blocks.usage().cached)
    assert cache.states.usage().used == 0
    return server


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dcp=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(6, 40),
    num_slots=st.integers(3, 20),
    coalesce=st.booleans(),
)
def test_random_workload_hits_are_never_guesses(seed, dcp, num_blocks, num_slots, coalesce):
    server = run_workload(
        seed, 25, dcp=dcp, num_blocks=num_blocks, num_slots=num_slots, coalesce=coalesce
    )
    event("some hits" if any(server.hits) else "no hit")


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_workload_with_ample_memory_mostly_hits(dcp):
    server = run_workload(0, 60, dcp=dcp, num_blocks=200, num_slots=200, coalesce=True)
    assert sum(1 for p in server.hits if p) > 30
    assert server.cache.blocks.num_evictions == server.cache.states.num_evictions == 0
