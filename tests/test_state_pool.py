"""glmjax.state_pool against a NumPy oracle of the transaction rules, on many generated slot
layouts: a valid step writes exactly its destinations; any invalid one writes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.batch import PrefillBatch
from glmjax.layers.kda import KDAState
from glmjax.state_pool import (
    PoolStatus,
    StatePool,
    commit_prefill,
    copy_slots,
    decode_slots,
    read_states,
    slot_index,
)

NUM_SLOTS, NUM_SEQS, CAPACITY, NUM_TOKENS, NUM_LAYERS = 16, 3, 4, 16, 2
STATE_SHAPE, CONV_SHAPE = (2, 3, 3), (5, 3)  # [H, K, V], [C, W - 1]


def random_pools(rng):
    return tuple(
        StatePool(
            jnp.asarray(rng.normal(size=(NUM_SLOTS, *STATE_SHAPE)), jnp.float32),
            jnp.asarray(rng.normal(size=(NUM_SLOTS, *CONV_SHAPE)), jnp.float32),
        )
        for _ in range(NUM_LAYERS)
    )


def random_states(rng, *lead):
    return KDAState(
        jnp.asarray(rng.normal(size=(*lead, *STATE_SHAPE)), jnp.float32),
        jnp.asarray(rng.normal(size=(*lead, *CONV_SHAPE)), jnp.float32),
    )


def batch_of(lengths, slots, has_initial, offsets, dests, cu=None):
    cu = np.concatenate([[0], np.cumsum(lengths)]) if cu is None else cu
    return PrefillBatch(
        token_ids=jnp.zeros(NUM_TOKENS, jnp.int32),
        positions=jnp.zeros(NUM_TOKENS, jnp.int32),
        cu_seqlens=jnp.asarray(cu, jnp.int32),
        state_slots=jnp.asarray(slots, jnp.int32),
        has_initial=jnp.asarray(has_initial, bool),
        checkpoint_offsets=jnp.asarray(offsets, jnp.int32),
        checkpoint_slots=jnp.asarray(dests, jnp.int32),
        block_tables=jnp.full((NUM_SEQS, 1), -1, jnp.int32),
        prefix_lens=jnp.zeros(NUM_SEQS, jnp.int32),
    )


def random_valid_batch(rng):
    """Distinct destinations, offsets in 1..len, padding rows with slot -1."""
    lengths = rng.integers(0, NUM_TOKENS // NUM_SEQS + 1, NUM_SEQS)
    free = list(rng.permutation(NUM_SLOTS))
    slots, has_initial = np.full(NUM_SEQS, -1), np.zeros(NUM_SEQS, bool)
    offsets, dests = np.full((NUM_SEQS, CAPACITY), -1), np.full((NUM_SEQS, CAPACITY), -1)
    for n, length in enumerate(lengths):
        if length == 0 and rng.random() < 0.5:
            continue  # padding row
        slots[n], has_initial[n] = free.pop(), rng.random() < 0.5
        for c in range(CAPACITY):
            if length and rng.random() < 0.6:
                offsets[n, c], dests[n, c] = rng.integers(1, length + 1), free.pop()
    return lengths, slots, has_initial, offsets, dests


def expected_status(lengths, slots, has_initial, offsets, dests, cu=None):
    """The rules of PoolStatus, written out per row and slot; the lowest failing code."""
    cu = np.concatenate([[0], np.cumsum(lengths)]) if cu is None else np.asarray(cu)
    lengths = np.diff(cu)
    failed = set()
    if cu[0] != 0 or (lengths < 0).any() or cu[-1] > NUM_TOKENS:
        failed.add(PoolStatus.BAD_CU_SEQLENS)
    for s in [*slots, *np.ravel(dests)]:
        if not -1 <= s < NUM_SLOTS:
            failed.add(PoolStatus.SLOT_OUT_OF_RANGE)
    written = []
    for n in range(NUM_SEQS):
        if slots[n] == -1 and (lengths[n] > 0 or has_initial[n]):
            failed.add(PoolStatus.MISSING_RUNNING_SLOT)
        written += [slots[n]] if slots[n] >= 0 else []
        for c in range(CAPACITY):
            p, d = offsets[n, c], dests[n, c]
            if p != -1 and not 1 <= p <= lengths[n]:
                failed.add(PoolStatus.OFFSET_OUT_OF_RANGE)
            if p != -1 and d == -1:
                failed.add(PoolStatus.OFFSET_WITHOUT_DESTINATION)
            if p == -1 and d != -1:
                failed.add(PoolStatus.DESTINATION_WITHOUT_OFFSET)
            written += [d] if d >= 0 else []
    if len(written) != len(set(written)):
        failed.add(PoolStatus.DUPLICATE_DESTINATION)
    return min(failed, default=PoolStatus.OK)


def corrupt(rng, lengths, slots, has_initial, offsets, dests):
    """One random fault (some draws are harmless; the oracle decides)."""
    slots, has_initial, offsets, dests = (x.copy() for x in (slots, has_initial, offsets, dests))
    n, c = rng.integers(NUM_SEQS), rng.integers(CAPACITY)
    fault = rng.integers(8)
    if fault == 0:
        slots[n] = rng.choice([-2, NUM_SLOTS, NUM_SLOTS + 5, -1])
    elif fault == 1:
        dests[n, c] = rng.choice([-3, NUM_SLOTS, 2**31 - 1])
    elif fault == 2:
        dests[n, c] = rng.choice(np.concatenate([slots, dests.ravel()]))
    elif fault == 3:
        offsets[n, c] = rng.choice([0, -2, lengths[n] + 1, -1])
    elif fault == 4:
        dests[n, c] = -1
    elif fault == 5:
        has_initial[n], slots[n] = True, -1
    elif fault == 6:
        slots[n] = slots[(n + 1) % NUM_SEQS]
    else:
        offsets[n, c], dests[n, c] = rng.integers(1, lengths[n] + 2), rng.integers(NUM_SLOTS)
    return lengths, slots, has_initial, offsets, dests


def expected_pools(pools, slots, dests, finals, snaps):
    out = []
    for pool, final, snap in zip(pools, finals, snaps):
        rec, conv = np.array(pool.recurrent), np.array(pool.conv)
        for n, s in enumerate(slots):
            if s >= 0:
                rec[s], conv[s] = final.recurrent[n], final.conv[n]
            for c, d in enumerate(dests[n]):
                if d >= 0:
                    rec[d], conv[d] = snap.recurrent[n, c], snap.conv[n, c]
        out.append((rec, conv))
    return out


def assert_pools_equal(actual, expected):
    for pool, (rec, conv) in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(pool.recurrent), rec)
        np.testing.assert_array_equal(np.asarray(pool.conv), conv)


commit = jax.jit(commit_prefill)


def test_commit_prefill_is_all_or_nothing(rng):
    seen = set()
    for case in range(300):
        meta = random_valid_batch(rng)
        if case % 3:
            meta = corrupt(rng, *meta)
        lengths, slots, has_initial, offsets, dests = meta
        pools = random_pools(rng)
        finals = [random_states(rng, NUM_SEQS) for _ in range(NUM_LAYERS)]
        snaps = [random_states(rng, NUM_SEQS, CAPACITY) for _ in range(NUM_LAYERS)]
        new_pools, status = commit(pools, batch_of(*meta), finals, snaps)
        want = expected_status(*meta)
        assert int(status) == want, (case, meta)
        seen.add(want)
        if want == PoolStatus.OK:
            assert_pools_equal(new_pools, expected_pools(pools, slots, dests, finals, snaps))
        else:
            assert_pools_equal(
                new_pools, [(np.asarray(p.recurrent), np.asarray(p.conv)) for p in pools]
            )
    assert seen == set(PoolStatus) - {PoolStatus.BAD_CU_SEQLENS}


@pytest.mark.parametrize("cu", [[1, 2, 3, 4], [0, 5, 3, 6], [0, 4, 8, NUM_TOKENS + 1]])
def test_bad_cu_seqlens_is_refused(rng, cu):
    slots, none = np.array([0, 1, 2]), np.full((NUM_SEQS, CAPACITY), -1)
    pools = random_pools(rng)
    new_pools, status = commit(
        pools,
        batch_of(None, slots, [False] * 3, none, none, cu=cu),
        [random_states(rng, NUM_SEQS)] * NUM_LAYERS,
        [random_states(rng, NUM_SEQS, CAPACITY)] * NUM_LAYERS,
    )
    assert int(status) == PoolStatus.BAD_CU_SEQLENS
    assert_pools_equal(new_pools, [(np.asarray(p.recurrent), np.asarray(p.conv)) for p in pools])


def test_read_states_gives_zeros_without_initial(rng):
    pools = random_pools(rng)
    states = jax.jit(read_states)(
        pools, jnp.array([4, -1, 7], jnp.int32), jnp.array([True, False, False])
    )
    for pool, state in zip(pools, states):
        np.testing.assert_array_equal(state.recurrent[0], pool.recurrent[4])
        np.testing.assert_array_equal(state.conv[0], pool.conv[4])
        assert not np.any(state.recurrent[1:]) and not np.any(state.conv[1:])


def test_decode_slots_pass_valid_slots_and_refuse_the_rest():
    for slots, code in (
        ([5, -1, 2], PoolStatus.OK),
        ([-1, -1, -1], PoolStatus.OK),
        ([5, 5, 2], PoolStatus.DUPLICATE_DESTINATION),
        ([5, NUM_SLOTS, 2], PoolStatus.SLOT_OUT_OF_RANGE),
        ([5, -2, 2], PoolStatus.SLOT_OUT_OF_RANGE),
    ):
        run_slots, status = jax.jit(decode_slots, static_argnums=1)(
            jnp.array(slots, jnp.int32), NUM_SLOTS
        )
        assert int(status) == code, slots
        want = slots if code == PoolStatus.OK else [-1, -1, -1]
        np.testing.assert_array_equal(run_slots, want)
        assert run_slots.dtype == jnp.int32


def test_copy_slots(rng):
    pools = random_pools(rng)
    new_pools, status = jax.jit(copy_slots)(
        pools, jnp.array([3, 4, -1], jnp.int32), jnp.array([4, 9, -1], jnp.int32)
    )
    assert int(status) == PoolStatus.OK
    for pool, new in zip(pools, new_pools):
        want = np.array(pool.conv)
        want[4], want[9] = pool.conv[3], pool.conv[4]  # reads happen before writes
        np.testing.assert_array_equal(new.conv, want)
    for src, dst, code in (
        ([3, 4], [9, 9], PoolStatus.DUPLICATE_DESTINATION),
        ([-1, 4], [1, 9], PoolStatus.MISSING_RUNNING_SLOT),
        ([3, 4], [1, NUM_SLOTS], PoolStatus.SLOT_OUT_OF_RANGE),
    ):
        new_pools, status = jax.jit(copy_slots)(
            pools, jnp.array(src, jnp.int32), jnp.array(dst, jnp.int32)
        )
        assert int(status) == code
        assert_pools_equal(
            new_pools, [(np.asarray(p.recurrent), np.asarray(p.conv)) for p in pools]
        )


def test_slot_indexing_of_pools_past_2_to_the_31_elements():
    """A pool of 70,000 slots of [4, 128, 128] has 4.6e9 elements: a flattened int32 offset
    of the last slot would overflow. The update is lowered (never allocated) and its scatters
    and gathers must index the slot axis alone with int32 slot ids."""
    num_slots, heads, dim, channels = 70_000, 4, 128, 1536
    assert num_slots * heads * dim * dim > 2**31
    pool = StatePool(
        jax.ShapeDtypeStruct((num_slots, heads, dim, dim), jnp.float32),
        jax.ShapeDtypeStruct((num_slots, channels, 3), jnp.float32),
    )
    final = KDAState(
        jax.ShapeDtypeStruct((2, heads, dim, dim), jnp.float32),
        jax.ShapeDtypeStruct((2, channels, 3), jnp.float32),
    )
    snap = KDAState(
        jax.ShapeDtypeStruct((2, CAPACITY, heads, dim, dim), jnp.float32),
        jax.ShapeDtypeStruct((2, CAPACITY, channels, 3), jnp.float32),
    )
    i32 = jax.ShapeDtypeStruct((2,), jnp.int32)
    batch = PrefillBatch(
        jax.ShapeDtypeStruct((64,), jnp.int32),
        jax.ShapeDtypeStruct((64,), jnp.int32),
        jax.ShapeDtypeStruct((3,), jnp.int32),
        i32,
        jax.ShapeDtypeStruct((2,), bool),
        jax.ShapeDtypeStruct((2, CAPACITY), jnp.int32),
        jax.ShapeDtypeStruct((2, CAPACITY), jnp.int32),
        jax.ShapeDtypeStruct((2, 1), jnp.int32),
        i32,
    )

    out_pools, status = jax.eval_shape(commit_prefill, (pool,), batch, (final,), (snap,))
    assert out_pools[0].recurrent.shape == pool.recurrent.shape and status.dtype == jnp.int32

    hlo = jax.jit(commit_prefill).lower((pool,), batch, (final,), (snap,)).as_text()
    scatters = hlo.split('"stablehlo.scatter"')[1:]
    assert len(scatters) == 2  # recurrent and conv, each in one scatter
    for op in scatters:
        assert "scatter_dims_to_operand_dims = [0]" in op
        signature = op[op.index("}) : (") :].splitlines()[0]
        # N + N * capacity int32 slot ids, one index per slot
        assert signature.split(", ")[1] == "tensor<10x1xi32>", signature

    read_hlo = jax.jit(read_states).lower((pool,), i32, batch.has_initial).as_text()
    gathers = [line for line in read_hlo.splitlines() if "gather" in line]
    assert gathers and all("start_index_map = [0]" in line for line in gathers)

    last = num_slots - 1
    index = slot_index(
        jnp.array([last, -1, 5], jnp.int32), jnp.array([True, True, False]), num_slots
    )
    assert index.dtype == jnp.int32
    np.testing.assert_array_equal(index, [last, num_slots, num_slots])


def test_pool_size_limit():
    from glmjax.config import ModelConfig

    with pytest.raises(ValueError, match="num_slots"):
        StatePool.zeros(ModelConfig.tiny(), 0)
