"""The chunked jax.numpy oracle against the fp64 token-by-token recurrence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda_chunked_reference, kda_recurrent_reference

C = 64  # default chunk size

# name: (lengths, num_tokens, checkpoint_offsets, K = V)
CASES = {
    "len1": ([1], 128, [[1, -1, 1, -1]], 16),
    "len63": ([63], 128, [[63, 1, 62, -1]], 16),
    "len64": ([64], 128, [[64, 63, 1, 64]], 16),
    "len65": ([65], 128, [[64, 65, 1, 63]], 16),
    "len200-cap2": ([200], 256, [[129, 128]], 32),
    "packed-empty-padded": (
        [63, 0, 200, 65, 1],
        400,
        [[1, 63, 32, -1], [-1, -1, -1, -1], [127, 64, 200, 65], [65, 64, -1, 1], [1, 1, -1, -1]],
        16,
    ),
    "cap1-no-padding": ([64, 192], 256, [[64], [129]], 16),
    "len1000-dim64": ([1000], 1024, [[640, 999, 1000, 321]], 64),
}


def make_inputs(rng, lengths, num_tokens, offsets, *, heads=2, dim=16, decay=None):
    """Packed batch as ``kda_prefill`` takes it, fp32 NumPy: q, k unit rows, beta in (0, 1),
    log-decay ``g`` from ``decay(shape)`` (default uniform in [-1, 0]), random initial states.
    """
    shape = (num_tokens, heads, dim)

    def unit_rows():
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    g = rng.uniform(-1.0, 0.0, shape) if decay is None else decay(shape)
    batch = dict(
        q=unit_rows(),
        k=unit_rows(),
        v=rng.standard_normal(shape),
        g=g,
        beta=rng.uniform(0.0, 1.0, shape[:2]),
        initial_states=0.5 * rng.standard_normal((len(lengths), heads, dim, dim)),
    )
    batch = {name: x.astype(np.float32) for name, x in batch.items()}
    batch["cu_seqlens"] = np.cumsum([0, *lengths], dtype=np.int32)
    batch["checkpoint_offsets"] = np.asarray(offsets, np.int32)
    return batch


def random_metadata(rng, num_seqs, num_tokens, capacity):
    """Random lengths (some zero, total <= num_tokens) and valid offsets, repeats allowed."""
    cuts = np.sort(rng.integers(0, num_tokens + 1, num_seqs))
    lengths = np.diff(cuts, prepend=0)
    offsets = [
        [
            int(rng.integers(1, length + 1)) if length and rng.random() < 0.8 else -1
            for _ in range(capacity)
        ]
        for length in lengths
    ]
    return np.cumsum([0, *lengths], dtype=np.int32), np.asarray(offsets, np.int32)


def assert_rel_close(actual, expected, rtol, name):
    """``||actual - expected|| <= rtol * ||expected||`` (Frobenius), in float64."""
    actual = np.asarray(actual, np.float64)
    error = np.linalg.norm(actual - expected)
    bound = rtol * np.linalg.norm(expected)
    assert error <= bound, f"{name}: ||diff|| = {error:.3e} > {bound:.3e}"


def check_against_recurrence(batch, *, scale=None, chunk_size=C, rtol_o=1e-5, rtol_states=1e-5):
    """Run both oracles on ``batch`` and compare every output."""
    o, final_states, snapshots = kda_chunked_reference(**batch, scale=scale, chunk_size=chunk_size)
    want_o, want_final, want_snapshots = kda_recurrent_reference(**batch, scale=scale)
    num_tokens, heads, dim_k = batch["q"].shape
    num_seqs, capacity = batch["checkpoint_offsets"].shape
    dim_v = batch["v"].shape[-1]

    assert o.shape == (num_tokens, heads, dim_v) and o.dtype == batch["v"].dtype
    assert final_states.shape == (num_seqs, heads, dim_k, dim_v)
    assert snapshots.shape == (num_seqs, capacity, heads, dim_k, dim_v)
    assert final_states.dtype == snapshots.dtype == jnp.float32
    for name, x in (("o", o), ("final_states", final_states), ("snapshots", snapshots)):
        assert np.isfinite(np.asarray(x, np.float32)).all(), f"{name} is not finite"
    assert not np.asarray(o[batch["cu_seqlens"][-1] :], np.float32).any(), "padding rows"
    inactive = batch["checkpoint_offsets"] == -1
    assert not np.asarray(snapshots)[inactive].any(), "inactive snapshots must be zero"

    assert_rel_close(o, want_o, rtol_o, "o")
    assert_rel_close(final_states, want_final, rtol_states, "final_states")
    assert_rel_close(snapshots, want_snapshots, rtol_states, "snapshots")


def test_recurrence_matches_hand_computation(rng):
    # Sequence 0: one token from a zero state. Sequence 1: one token with k = 0 (decay only).
    batch = make_inputs(rng, [1, 1], 2, [[1], [1]], heads=1, dim=4)
    batch["initial_states"][0] = 0.0
    batch["k"][1] = 0.0
    o, final_states, snapshots = kda_recurrent_reference(**batch)

    q, k, v, g, beta = (batch[name][:, 0].astype(np.float64) for name in "q k v g beta".split())
    s0 = beta[0] * np.outer(k[0], v[0])
    s1 = np.exp(g[1])[:, None] * batch["initial_states"][1, 0]
    np.testing.assert_allclose(final_states[:, 0], [s0, s1], rtol=1e-12)
    np.testing.assert_allclose(snapshots[:, 0], final_states, rtol=0)
    scale = 4**-0.5
    np.testing.assert_allclose(o[:, 0], [scale * s0.T @ q[0], scale * s1.T @ q[1]], rtol=1e-12)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_chunked_matches_recurrence(rng, case):
    lengths, num_tokens, offsets, dim = case
    check_against_recurrence(make_inputs(rng, lengths, num_tokens, offsets, dim=dim))


DECAYS = {
    "lower-bound": lambda rng, shape: np.full(shape, -5.0),
    "mixed-channels": lambda rng, shape: np.where(
        rng.random(shape) < 0.5, -5.0, rng.uniform(-0.05, 0.0, shape)
    ),
    "beyond-bound": lambda rng, shape: np.where(
        rng.random(shape) < 0.2, -20.0, rng.uniform(-5.0, 0.0, shape)
    ),
}


@pytest.mark.parametrize("decay", DECAYS.values(), ids=DECAYS.keys())
def test_strong_decay_is_finite_and_accurate(rng, decay):
    batch = make_inputs(
        rng,
        [200, 65],
        300,
        [[1, 64, 130, 200], [65, 64, 63, -1]],
        decay=lambda shape: decay(rng, shape),
    )
    check_against_recurrence(batch)



def test_decays_carry_no_cancellation_error(rng):
    """The model's bounded gate (-5 sigmoid(x), here with wide x: many tokens near -5): the
    cumulative log-decay reaches ~ -300 inside a chunk, so a decay formed as a difference of
    two cumulative sums, exp(G_i - G_j), would be off by ~eps * 300 in its exponent (max
    relative error of the snapshots 1e-5 that way); formed from the gates between j and i,
    it is as accurate as the rest: within 1e-6 of the fp64 recurrence, elementwise max."""
    batch = make_inputs(rng, [200], 256, [[64, 100, 150, 200]], dim=64,
                        decay=lambda shape: -5.0 / (1.0 + np.exp(-3.0 * rng.standard_normal(shape))))
    got = kda_chunked_reference(**batch)
    want = kda_recurrent_reference(**batch)
    for name, actual, expected in zip(("o", "final", "snapshots"), got, want, strict=True):
        error = np.max(np.abs(np.asarray(actual, np.float64) - expected)) / np.max(np.abs(expected))
        assert error <= 1e-6, f"{name}: max relative error {error:.2e}"

def test_bf16_inputs(rng):
    batch = make_inputs(rng, [63, 0, 130], 256, [[63, 1, -1, 62], [-1] * 4, [65, 128, 130, 2]])
    for name in ("q", "k", "v", "g", "beta"):
        batch[name] = jnp.asarray(batch[name], jnp.bfloat16)
    # The recurrence sees the same bf16-rounded inputs; only o's bf16 rounding remains.
    check_against_recurrence(batch, rtol_o=5e-3)


def test_scale_and_chunk_size(rng):
    batch = make_inputs(rng, [40, 17], 64, [[16, 17], [1, 17]])
    check_against_recurrence(batch, scale=0.5, chunk_size=16)


def test_new_lengths_and_offsets_do_not_retrace(rng):
    traces = 0

    def prefill(*args):
        nonlocal traces
        traces += 1
        return kda_chunked_reference(*args)

    prefill = jax.jit(prefill)
    batch = make_inputs(rng, [1, 1, 1], 256, [[1] * 4] * 3)
    names = ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_states", "checkpoint_offsets")
    for _ in range(3):
        batch["cu_seqlens"], batch["checkpoint_offsets"] = random_metadata(rng, 3, 256, 4)
        got = prefill(*(batch[name] for name in names))
        want = kda_recurrent_reference(**batch)
        for name, actual, expected in zip(("o", "final", "snapshots"), got, want, strict=True):
            assert_rel_close(actual, expected, 1e-5, name)
    assert traces == 1
