"""The KDA layer against a float64 NumPy oracle: projections, conv, gates, a token-by-token
recurrence, gated output norm; on packed batches with awkward lengths and offsets."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_layers_oracles import (
    conv_oracle,
    cu_seqlens_of,
    f64,
    kda_recurrence_oracle,
    random_lengths,
    random_module,
    rms_norm,
    sigmoid,
    softplus,
)

from glmjax.config import ModelConfig
from glmjax.layers import kda as kda_module
from glmjax.layers.kda import KDA, KDAState

NUM_TOKENS, NUM_SEQS, CAPACITY = 29, 4, 4


def kernel(linear):
    return f64(linear.kernel)


def kda_oracle(layer: KDA, config: ModelConfig, x, cu, state: KDAState, offsets):
    """(y [T, D], final KDAState, snapshot KDAState) from the formulas in float64."""
    tokens, heads, dim = x.shape[0], config.kda_num_heads, config.kda_head_dim
    x = f64(x)
    qkv = np.concatenate(
        [x @ kernel(layer.q_proj), x @ kernel(layer.k_proj), x @ kernel(layer.v_proj)], axis=1
    )
    mixed, conv_final, conv_snaps = conv_oracle(
        qkv, f64(layer.conv.weight), cu, state.conv, offsets
    )
    q, k, v = (part.reshape(tokens, heads, dim) for part in np.split(mixed, 3, axis=1))
    q, k = (a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + 1e-6) for a in (q, k))
    f = x @ kernel(layer.f_a_proj) @ kernel(layer.f_b_proj) + f64(layer.dt_bias)
    f = f.reshape(q.shape)
    a = np.exp(f64(layer.A_log))[:, None]
    if config.kda_gate == "softplus":
        g = -a * softplus(f)
    else:
        g = config.kda_gate_bound * sigmoid(a * f)
    beta = sigmoid(x @ kernel(layer.b_proj))
    o, final, snaps = kda_recurrence_oracle(
        q, k, v, g, beta, cu, state.recurrent, offsets, scale=dim**-0.5
    )
    gate = (x @ kernel(layer.g_a_proj) @ kernel(layer.g_b_proj)).reshape(o.shape)
    y = rms_norm(o, f64(layer.o_norm.weight), config.rms_norm_eps) * sigmoid(gate)
    return (
        y.reshape(tokens, -1) @ kernel(layer.o_proj),
        KDAState(final, conv_final),
        KDAState(snaps, conv_snaps),
    )


def random_batch(rng, config, *, cold):
    lengths = random_lengths(rng, NUM_SEQS, NUM_TOKENS - 2, include=(0, 1))
    cu = cu_seqlens_of(lengths)
    offsets = np.full((NUM_SEQS, CAPACITY), -1, np.int32)
    for n, length in enumerate(lengths):
        picks = [1, length, min(2, length), rng.integers(1, length + 1) if length else 0]
        offsets[n] = [p if 1 <= p <= length else -1 for p in picks]
    heads, dim = config.kda_num_heads, config.kda_head_dim
    recurrent = rng.normal(size=(NUM_SEQS, heads, dim, dim)).astype(np.float32) * 0.3
    conv = rng.normal(size=(NUM_SEQS, config.conv_channels, config.conv_kernel - 1))
    state = KDAState(recurrent, conv.astype(np.float32))
    if cold:
        state = KDAState(np.zeros_like(state.recurrent), np.zeros_like(state.conv))
    x = rng.normal(size=(NUM_TOKENS, config.hidden_size)).astype(np.float32)
    return x, cu, state, offsets


@nnx.jit
def run(layer, x, cu, state, offsets):
    return layer(x, cu, state, offsets)


def check_layer_against_oracle(rng, config, *, cold, call=run):
    """One random batch through the jitted layer (`call`: a fresh jit where a test patches
    what the layer calls, since `run` reuses its traces); output, final and snapshot states
    (the recurrent state and the conv history) against the oracle."""
    layer = random_module(lambda: KDA(config, rngs=nnx.Rngs(0)), rng)
    x, cu, state, offsets = random_batch(rng, config, cold=cold)
    out = call(
        layer,
        jnp.asarray(x),
        jnp.asarray(cu),
        KDAState(*map(jnp.asarray, state)),
        jnp.asarray(offsets),
    )
    y, final, snaps = kda_oracle(layer, config, x, cu, state, offsets)
    np.testing.assert_allclose(out.y, y, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(out.state.recurrent, final.recurrent, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.state.conv, final.conv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.snapshots.recurrent, snaps.recurrent, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.snapshots.conv, snaps.conv, rtol=1e-5, atol=1e-5)
    assert out.state.recurrent.dtype == jnp.float32
    assert not np.any(np.asarray(out.y)[cu[-1] :])  # padding rows


@pytest.mark.parametrize(
    "gate, cold", [("sigmoid_bound", False), ("sigmoid_bound", True), ("softplus", False)]
)
def test_kda_layer_matches_oracle(rng, gate, cold):
    config = dataclasses.replace(ModelConfig.preset("tiny"), kda_gate=gate)
    check_layer_against_oracle(rng, config, cold=cold)


def test_pallas_scan_in_the_layer(rng):
    """The layer on the Pallas kernel (interpret mode here) with a gate bound below -5: the
    kernel's any-decay path matches the oracle. (A bound in [-5, 0) takes its bounded-gate
    path: `test_conv_kernel_in_the_layer`, at -5.)"""
    config = dataclasses.replace(
        ModelConfig.preset("tiny"), kda_gate_bound=-8.0, kda_backend="pallas"
    )
    check_layer_against_oracle(rng, config, cold=False)


def test_conv_kernel_in_the_layer(rng, monkeypatch):
    """On one GPU the conv, its SiLU and q and k's norms run as the `kda_conv` kernel
    (interpret mode here); the layer, on the Pallas scan's bounded-gate path (bound -5, the
    tiny preset's), still matches the oracle, states and snapshots too."""
    monkeypatch.setattr(kda_module, "on_one_gpu", lambda: True)
    implementations, real = [], kda_module.kda_conv

    def recorded(*args, **kwargs):
        implementations.append(kwargs["implementation"])
        return real(*args, **kwargs)

    monkeypatch.setattr(kda_module, "kda_conv", recorded)
    config = dataclasses.replace(ModelConfig.preset("tiny"), kda_gate_bound=-5.0,
                                 kda_backend="pallas")
    check_layer_against_oracle(rng, config, cold=False,
                               call=nnx.jit(lambda layer, *inputs: layer(*inputs)))
    assert implementations == ["pallas"]


def test_resume_from_snapshot_equals_cold_run(rng):
    """Prefill [0, L) retaining a snapshot at p, then [p, L) from it == the one pass.

    Same shapes as above (one real sequence, the others empty) so nothing recompiles."""
    config = ModelConfig.preset("tiny")
    layer = random_module(lambda: KDA(config, rngs=nnx.Rngs(0)), rng)
    length, split = 23, 9
    x = jnp.asarray(rng.normal(size=(NUM_TOKENS, config.hidden_size)), jnp.float32)
    _, _, zeros, _ = random_batch(rng, config, cold=True)
    no_checkpoints = np.full((NUM_SEQS, CAPACITY), -1, np.int32)
    full = run(
        layer,
        x,
        jnp.array([0] + [length] * NUM_SEQS, jnp.int32),
        zeros,
        jnp.asarray(no_checkpoints).at[0, 2].set(split),
    )
    retained = KDAState(*(s[:, 2] for s in full.snapshots))
    tail_x = jnp.roll(x, -split, axis=0)
    tail = run(
        layer,
        tail_x,
        jnp.array([0] + [length - split] * NUM_SEQS, jnp.int32),
        retained,
        jnp.asarray(no_checkpoints),
    )
    np.testing.assert_allclose(tail.y[: length - split], full.y[split:length], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(
        tail.state.recurrent[0], full.state.recurrent[0], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(tail.state.conv[0], full.state.conv[0])


def with_backend(layer: KDA, backend: str) -> KDA:
    twin = nnx.clone(layer)
    twin.backend = backend
    return twin


def test_bf16_layer_tracks_oracle(rng):
    """In bf16 (the real presets' dtype) the layer stays within bf16 rounding of the oracle
    on the same weights, keeps fp32 recurrent states, and conv histories follow the
    activation dtype."""
    dtype = jnp.bfloat16
    config = dataclasses.replace(ModelConfig.preset("tiny"), dtype=dtype, param_dtype=dtype)
    layer = random_module(lambda: KDA(config, rngs=nnx.Rngs(0)), rng)
    x, cu, state, offsets = random_batch(rng, config, cold=False)
    x, state = (
        np.asarray(jnp.asarray(x, dtype)),
        KDAState(state.recurrent, np.asarray(jnp.asarray(state.conv, dtype))),
    )
    out = run(
        layer,
        jnp.asarray(x),
        jnp.asarray(cu),
        KDAState(*map(jnp.asarray, state)),
        jnp.asarray(offsets),
    )
    assert (out.y.dtype, out.state.conv.dtype, out.snapshots.conv.dtype) == (dtype,) * 3
    assert out.state.recurrent.dtype == out.snapshots.recurrent.dtype == jnp.float32
    y, final, _ = kda_oracle(layer, config, x, cu, state, offsets)
    for got, want in ((out.y, y), (out.state.recurrent, final.recurrent)):
        scale = np.abs(want).max()  # measured: 0.6% (y) and 1.3% (states) of the maximum
        np.testing.assert_allclose(np.asarray(got, np.float32) / scale, want / scale, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_backend_matches_reference_backend(rng, dtype):
    """On the GPU the layer's default backend is the Pallas kernel; it must agree with the
    jax.numpy reference scan inside the same layer (IEEE fp32 matmuls for fp32)."""
    config = dataclasses.replace(ModelConfig.preset("tiny"), dtype=dtype, param_dtype=dtype)
    layer = random_module(lambda: KDA(config, rngs=nnx.Rngs(0)), rng)
    assert layer.backend == "pallas"
    x, cu, state, offsets = random_batch(rng, config, cold=False)
    args = (
        jnp.asarray(x, dtype),
        jnp.asarray(cu),
        KDAState(jnp.asarray(state.recurrent), jnp.asarray(state.conv, dtype)),
        jnp.asarray(offsets),
    )
    with jax.default_matmul_precision("highest"):
        got = run(layer, *args)
        want = run(with_backend(layer, "reference"), *args)
    tol = 1e-5 if dtype == jnp.float32 else 5e-3
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.abs(b.astype(jnp.float32)).max()) or 1.0
        np.testing.assert_allclose(
            np.asarray(a, np.float32) / scale, np.asarray(b, np.float32) / scale, atol=tol
        )


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per-op"])
@pytest.mark.parametrize(
    "gate, backend",
    [("sigmoid_bound", "reference"), ("softplus", "reference"), ("sigmoid_bound", "pallas"),
     ("softplus", "pallas")],
)
def test_decode_on_the_pool_matches_oracle(rng, monkeypatch, gate, backend, fused):
    """One token per row on a pool (Pallas in interpret mode here), on both one-device
    paths (`tuning.use_fused_decode`): each real row's output and its slot's new recurrent
    state and conv history match the oracle run on one-token sequences from that slot;
    padding rows and every other slot stay bit-identical (the slots nobody names hold NaN,
    so a stray read would show)."""
    monkeypatch.setattr(kda_module, "use_fused_decode", lambda *a, **k: fused)
    config = dataclasses.replace(ModelConfig.preset("tiny"), kda_gate=gate, kda_backend=backend)
    layer = random_module(lambda: KDA(config, rngs=nnx.Rngs(0)), rng)
    num_slots, slots = 7, np.array([4, -1, 0, 6, -1], np.int32)
    real = slots >= 0
    heads, dim, channels = config.kda_num_heads, config.kda_head_dim, config.conv_channels
    recurrent = np.full((num_slots, heads, dim, dim), np.nan, np.float32)
    conv = np.full((num_slots, channels, config.conv_kernel - 1), np.nan, np.float32)
    recurrent[slots[real]] = 0.3 * rng.normal(size=(real.sum(), heads, dim, dim))
    conv[slots[real]] = rng.normal(size=(real.sum(), channels, config.conv_kernel - 1))
    x = rng.normal(size=(len(slots), config.hidden_size)).astype(np.float32)
    y, pool = nnx.jit(lambda *a: a[0].decode(*a[1:]))(  # traced afresh: `fused` holds
        layer, jnp.asarray(x), KDAState(jnp.asarray(recurrent), jnp.asarray(conv)),
        jnp.asarray(slots),
    )
    rows = int(real.sum())
    want_y, final, _ = kda_oracle(
        layer, config, x[real], np.arange(rows + 1, dtype=np.int32),
        KDAState(recurrent[slots[real]], conv[slots[real]]), np.full((rows, 1), -1, np.int32),
    )
    np.testing.assert_allclose(np.asarray(y)[real], want_y, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(pool.recurrent[slots[real]], final.recurrent, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(pool.conv[slots[real]], final.conv, rtol=1e-5, atol=1e-5)
    others = np.setdiff1d(np.arange(num_slots), slots)
    for got, before in ((pool.recurrent, recurrent), (pool.conv, conv)):
        np.testing.assert_array_equal(np.asarray(got)[others].view(np.uint32),
                                      before[others].view(np.uint32))
