"""Tests for serving.state_slots."""

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from serving.lru_pool import PoolExhaustedError, PoolUsage
from serving.state_slots import StateKey, StateSlotAllocator


def key(position, prefix=b"p"):
    return StateKey(prefix + position.to_bytes(4, "little"), position)


def test_running_slots_are_freed_not_cached():
    states = StateSlotAllocator(3)
    running = states.allocate(2)
    assert states.usage() == PoolUsage(total=3, used=2, cached=0)
    states.free(running)
    assert states.usage() == PoolUsage(total=3, used=0, cached=0)
    assert states.num_evictions == 0


def test_retained_slot_is_findable_after_release_until_evicted():
    states = StateSlotAllocator(2)
    (slot,) = states.allocate()
    assert states.retain(slot, key(512))
    assert states.retain(slot, key(512))  # same state again: no-op
    states.free([slot])
    assert states.find(key(512)) == slot
    assert states.usage() == PoolUsage(total=2, used=0, cached=1)
    (other,) = states.allocate()
    assert other != slot  # a free slot goes before a retained one
    assert states.allocate() == [slot]
    assert states.find(key(512)) is None
    assert states.num_evictions == 1


def test_retaining_a_state_twice_keeps_the_first_slot():
    states = StateSlotAllocator(2)
    first, second = states.allocate(2)
    assert states.retain(first, key(1024))
    assert not states.retain(second, key(1024))
    states.free([first, second])
    assert states.find(key(1024)) == first
    assert states.usage() == PoolUsage(total=2, used=0, cached=1)


def test_pinned_retained_slot_is_never_evicted():
    states = StateSlotAllocator(2)
    a, b = states.allocate(2)
    states.retain(a, key(512))
    states.retain(b, key(1024))
    states.free([a, b])
    states.pin([states.find(key(1024))])
    assert states.allocate() == [a]
    with pytest.raises(PoolExhaustedError):
        states.allocate()
    assert states.find(key(1024)) == b
    assert states.refcount(b) == 1


def test_eviction_order_is_least_recently_released():
    states = StateSlotAllocator(4)
    slots = states.allocate(4)
    for position, slot in zip((512, 1024, 1536, 2048), slots):
        states.retain(slot, key(position))
    states.free([slots[2], slots[0], slots[3], slots[1]])
    states.pin([slots[2]])
    states.free([slots[2]])  # used again: now the most recent
    assert states.allocate(4) == [slots[0], slots[3], slots[1], slots[2]]
    assert all(states.find(key(p)) is None for p in (512, 1024, 1536, 2048))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.retain(0, key(0)), "position >= 1, got 0"),
        (lambda s: s.retain(1, key(512)), "id 1 is unreferenced"),
        (lambda s: s.retain(9, key(512)), "id 9 is outside"),
        (lambda s: s.free([1]), "id 1 has 0 references"),
        (lambda s: s.pin([1]), "id 1 is free"),
        (lambda s: s.retain(0, key(1024)), "slot 0 already retains the state at position 512"),
    ],
)
def test_bad_arguments_raise_value_error(call, message):
    states = StateSlotAllocator(3)
    states.allocate()
    states.retain(0, key(512))
    with pytest.raises(ValueError, match=message):
        call(states)


def test_constructor_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_slots must be >= 1, got 0"):
        StateSlotAllocator(0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["run", "retain", "finish"]), st.integers(0, 7)), max_size=60
    )
)
def test_random_workload_never_hands_out_a_slot_in_use(ops):
    """Running slots and pinned retained slots survive any mix of allocations."""
    states = StateSlotAllocator(5)
    running = []  # slots a request is using
    pinned = {}  # retained slot -> its key, pinned by a request
    positions = iter(range(512, 10**6, 512))
    for op, pick in ops:
        in_use = set(running) | set(pinned)
        if op == "run":
            if states.num_allocatable == 0:
                with pytest.raises(PoolExhaustedError):
                    states.allocate()
                continue
            (slot,) = states.allocate()
            assert slot not in in_use
            running.append(slot)
        elif op == "retain" and states.num_allocatable:
            (slot,) = states.allocate()
            assert slot not in in_use
            state = key(next(positions))
            states.retain(slot, state)
            states.free([slot])
            if pick % 2 and states.find(state) is not None:
                states.pin([slot])
                pinned[slot] = state
        elif op == "finish" and (running or pinned):
            everything = running + list(pinned)
            slot = everything[pick % len(everything)]
            states.free([slot])
            if slot in pinned:
                del pinned[slot]
            else:
                running.remove(slot)
        for slot, state in pinned.items():
            assert states.find(state) == slot
        assert states.usage().used == len(running) + len(pinned)
    states.free(running + list(pinned))
    assert states.usage().used == 0
