"""Packed depthwise causal conv1d against a per-sequence, per-token loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_layers_oracles import conv_oracle, cu_seqlens_of, random_lengths

from glmjax.layers.conv import causal_conv1d, conv_decode
from glmjax.layers.packing import sequence_ids

NUM_TOKENS, NUM_SEQS, CHANNELS, WIDTH, CAPACITY = 37, 5, 24, 4, 4

conv = jax.jit(causal_conv1d)


def random_offsets(rng, lengths):
    """Per row: 1, the length, one below the kernel reach, a random one; -1 where invalid."""
    rows = []
    for length in lengths:
        picks = [1, length, min(2, length), int(rng.integers(1, length + 1)) if length else 1]
        rows.append([p if 1 <= p <= length and rng.random() > 0.15 else -1 for p in picks])
    return np.array(rows, np.int32)


@pytest.mark.parametrize("case", range(6))
def test_conv_matches_loop(rng, case):
    lengths = random_lengths(rng, NUM_SEQS, NUM_TOKENS - case, include=(0, 1, 2))
    cu = cu_seqlens_of(lengths)
    x = rng.normal(size=(NUM_TOKENS, CHANNELS)).astype(np.float32)
    weight = rng.normal(size=(CHANNELS, WIDTH)).astype(np.float32)
    history = rng.normal(size=(NUM_SEQS, CHANNELS, WIDTH - 1)).astype(np.float32)
    if case == 0:
        history[:] = 0  # cold start
    offsets = random_offsets(rng, lengths)
    y, final, snaps = conv(x, weight, jnp.asarray(cu), history, jnp.asarray(offsets))
    y_ref, final_ref, snaps_ref = conv_oracle(x, weight, cu, history, offsets)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final, final_ref, rtol=0, atol=0)
    np.testing.assert_allclose(snaps, snaps_ref, rtol=0, atol=0)
    assert not np.any(np.asarray(y)[cu[-1] :])  # padding rows are zero


def test_snapshot_before_kernel_reach_reads_history():
    """A checkpoint at p = 1 or 2 (< W - 1) mixes initial history and new inputs."""
    x = np.arange(1, 6, dtype=np.float32)[:, None]  # one channel: 1, 2, 3, 4, 5
    history = np.array([[[-3.0, -2.0, -1.0]]], np.float32)
    offsets = np.array([[1, 2, 5, -1]], np.int32)
    _, final, snaps = conv(
        x,
        np.ones((1, WIDTH), np.float32),
        jnp.array([0, 5], jnp.int32),
        history,
        jnp.asarray(offsets),
    )
    np.testing.assert_array_equal(snaps[0, :, 0], [[-2, -1, 1], [-1, 1, 2], [3, 4, 5], [0, 0, 0]])
    np.testing.assert_array_equal(final[0, 0], [3, 4, 5])


def test_sequence_ids_skip_empty_sequences():
    seq, valid = sequence_ids(jnp.array([0, 0, 3, 3, 4], jnp.int32), 6)
    np.testing.assert_array_equal(seq, [1, 1, 1, 3, 3, 3])
    np.testing.assert_array_equal(valid, [1, 1, 1, 1, 0, 0])


def test_conv_is_one_compile_for_all_lengths(rng):
    """Lengths and offsets are runtime values: a new layout does not retrace."""
    before = conv._cache_size()
    for _ in range(3):
        cu = cu_seqlens_of(random_lengths(rng, NUM_SEQS, NUM_TOKENS))
        conv(
            np.zeros((NUM_TOKENS, CHANNELS), np.float32),
            np.zeros((CHANNELS, WIDTH), np.float32),
            jnp.asarray(cu),
            np.zeros((NUM_SEQS, CHANNELS, WIDTH - 1), np.float32),
            jnp.full((NUM_SEQS, CAPACITY), -1, jnp.int32),
        )
    assert conv._cache_size() - before <= 1


def test_decode_step_equals_one_token_sequences(rng):
    """conv_decode on a pool == causal_conv1d on one-token sequences from the same
    histories, bit for bit; padding rows (-1) and unnamed slots are left alone."""
    slots = np.array([3, -1, 0, 5], np.int32)
    pool = rng.normal(size=(6, CHANNELS, WIDTH - 1)).astype(np.float32)
    x = rng.normal(size=(len(slots), CHANNELS)).astype(np.float32)
    weight = rng.normal(size=(CHANNELS, WIDTH)).astype(np.float32)
    y, new_pool = jax.jit(conv_decode)(x, weight, jnp.asarray(pool), jnp.asarray(slots))
    real = slots >= 0
    history = np.where(real[:, None, None], pool[np.maximum(slots, 0)], 0)
    y_ref, final, _ = conv(x, weight, jnp.arange(len(slots) + 1, dtype=jnp.int32), history,
                           jnp.full((len(slots), 1), -1, jnp.int32))
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(np.asarray(new_pool)[slots[real]], np.asarray(final)[real])
    untouched = np.setdiff1d(np.arange(6), slots)
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], pool[untouched])
