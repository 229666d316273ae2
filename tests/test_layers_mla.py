"""MLA against per-sequence dense causal attention in float64: packed prefill without a cache,
continuation over a shuffled paged cache, absorbed decode, and the paged cache itself."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_layers_oracles import cu_seqlens_of, f64, mla_oracle, random_module

from glmjax.config import ModelConfig
from glmjax.layers.mla import MLA
from glmjax.layers.paged_cache import MLACache, read_paged, write_paged

mla_module = sys.modules["glmjax.layers.mla"]  # its module, not the re-exported class
NUM_TOKENS, NUM_SEQS, BLOCK, BLOCKS_PER_SEQ, NUM_BLOCKS = 32, 4, 8, 5, 24

VARIANTS = {
    "glm-like": {},  # q_lora 128, no k_pe
    "kimi-like": {"q_lora_rank": None, "qk_rope_head_dim": 32},
}


def make_config(**changes) -> ModelConfig:
    return dataclasses.replace(ModelConfig.preset("tiny"), kv_block_size=BLOCK, **changes)


def make_layer(config, rng) -> MLA:
    return random_module(lambda: MLA(config, rngs=nnx.Rngs(0)), rng)


def mla_params(layer: MLA) -> dict:
    names = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    p = {
        name: f64(getattr(layer, name).kernel) for name in names if getattr(layer, name) is not None
    }
    p["kv_a_layernorm"] = f64(layer.kv_a_layernorm.weight)
    if layer.q_a_layernorm is not None:
        p["q_a_layernorm"] = f64(layer.q_a_layernorm.weight)
    return p


def oracle(layer: MLA, config: ModelConfig, x_seq, select=None):
    return mla_oracle(
        mla_params(layer),
        f64(x_seq),
        heads=config.mla_num_heads,
        nope=config.qk_nope_head_dim,
        rope=config.qk_rope_head_dim,
        v_dim=config.v_head_dim,
        kv_lora=config.kv_lora_rank,
        eps=config.rms_norm_eps,
        select=select,
    )


def random_block_table(rng):
    """Shuffled physical blocks; the last sequence has none (-1), as an inactive row."""
    table = rng.permutation(NUM_BLOCKS)[: NUM_SEQS * BLOCKS_PER_SEQ].reshape(NUM_SEQS, -1)
    table[-1] = -1
    return jnp.asarray(table, jnp.int32)


def pack(seqs, num_tokens=NUM_TOKENS):
    """Sequences [L_n, D] -> packed x [T, D] (zero padding) and cu_seqlens."""
    cu = cu_seqlens_of([len(s) for s in seqs])
    x = np.zeros((num_tokens, seqs[0].shape[1]), np.float32)
    x[: cu[-1]] = np.concatenate(seqs)
    return jnp.asarray(x), jnp.asarray(cu)


@nnx.jit
def prefill(layer, x, cu, cache, block_table, prefix_lens):
    return layer(x, cu, cache, block_table, prefix_lens)


@nnx.jit
def decode(layer, x, cache, block_table, context_lens):
    return layer.decode(x, cache, block_table, context_lens)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_packed_prefill_without_cache(rng, variant):
    config = make_config(**VARIANTS[variant])
    layer = make_layer(config, rng)
    seqs = [rng.normal(size=(n, config.hidden_size)) for n in (11, 0, 1, 17)]
    x, cu = pack(seqs)
    y, cache = nnx.jit(lambda m, x, cu: m(x, cu))(layer, x, cu)
    assert cache is None
    expected = np.concatenate([oracle(layer, config, s) for s in seqs if len(s)])
    np.testing.assert_allclose(y[: cu[-1]], expected, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(y)[int(cu[-1]) :])


def continuation_case(rng, config, layer, select=lambda seq: None):
    """Prefill prefixes into a paged cache, then the rest: both steps against the oracle,
    whose keys `select(seq)` ([L, L] or None: all) narrows.

    Returns the full sequences, the cache and the block table for a decode step."""
    lengths, prefixes = np.array([20, 13, 9, 0]), np.array([8, 0, 6, 0])  # 8: block boundary
    seqs = [rng.normal(size=(n, config.hidden_size)) for n in lengths]
    table = random_block_table(rng)
    cache = MLACache.zeros(config, NUM_BLOCKS)
    zeros = jnp.zeros((NUM_SEQS,), jnp.int32)
    x1, cu1 = pack([s[:p] for s, p in zip(seqs, prefixes)])
    y1, cache = prefill(layer, x1, cu1, cache, table, zeros)
    x2, cu2 = pack([s[p:] for s, p in zip(seqs, prefixes)])
    y2, cache = prefill(layer, x2, cu2, cache, table, jnp.asarray(prefixes, jnp.int32))
    for n, (s, p) in enumerate(zip(seqs, prefixes)):
        if not len(s):
            continue
        expected = oracle(layer, config, s, select(s))
        np.testing.assert_allclose(y1[cu1[n] : cu1[n + 1]], expected[:p], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y2[cu2[n] : cu2[n + 1]], expected[p:], rtol=1e-5, atol=1e-5)
    return seqs, cache, table


def decode_case(rng, config, layer, select=lambda seq: None, decode_fn=decode):
    """Continuation, then one decode token per sequence (the last row inactive), checked
    against the oracle and against the non-absorbed path on the same cache."""
    seqs, cache, table = continuation_case(rng, config, layer, select)
    new = rng.normal(size=(NUM_SEQS, config.hidden_size)).astype(np.float32)
    context = jnp.array([len(s) for s in seqs[:-1]] + [-1], jnp.int32)
    y, decoded_cache = decode_fn(layer, jnp.asarray(new), cache, table, context)
    for n, s in enumerate(seqs[:-1]):
        full = np.concatenate([s, new[n : n + 1]])
        expected = oracle(layer, config, full, select(full))[-1]
        np.testing.assert_allclose(y[n], expected, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(y[-1]))
    # The non-absorbed path over the same cache gives the same token (one-token sequences).
    y_expanded, expanded_cache = prefill(
        layer,
        jnp.zeros((NUM_TOKENS, config.hidden_size)).at[:NUM_SEQS].set(new),
        jnp.array([0, 1, 2, 3, 3], jnp.int32),
        cache,
        table,
        context,
    )
    np.testing.assert_allclose(y, y_expanded[:NUM_SEQS], rtol=1e-5, atol=1e-6)
    for decoded, expanded in zip(decoded_cache, expanded_cache):
        np.testing.assert_array_equal(decoded, expanded)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_continuation_and_absorbed_decode(rng, variant):
    config = make_config(**VARIANTS[variant])
    decode_case(rng, config, make_layer(config, rng))


@pytest.mark.parametrize("variant, batch_invariant",
                         [("glm-like", False), ("kimi-like", False), ("kimi-like", True)])
def test_continuation_through_the_flash_kernel(rng, variant, batch_invariant):
    """The same case with prefill attention in the Pallas kernel (interpret mode here);
    batch_invariant: each sequence's keys packed at multiples of 128 rows."""
    config = make_config(**VARIANTS[variant], mla_attention="pallas",
                         batch_invariant=batch_invariant)
    continuation_case(rng, config, make_layer(config, rng))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_absorbed_decode_through_the_kernels(rng, variant, monkeypatch):
    """The one-GPU decode path on the CPU (interpret mode): the per-head products in
    `head_matmul` and the attention in `mla_decode`'s kernel, against the same oracle."""
    calls = []
    monkeypatch.setattr(mla_module, "on_one_gpu", lambda: calls.append(1) or True)
    config = make_config(**VARIANTS[variant])
    # A jit of its own: the module's `decode` may hold a trace of the XLA path already.
    decode_case(rng, config, make_layer(config, rng), decode_fn=nnx.jit(MLA.decode))
    assert calls


def test_decode_inactive_row_leaves_cache_untouched(rng):
    config = make_config()
    layer = make_layer(config, rng)
    table = random_block_table(rng)
    cache = MLACache(
        jnp.asarray(rng.normal(size=(NUM_BLOCKS, BLOCK, config.kv_lora_rank)), jnp.float32)
    )
    context = jnp.array([-1, 3, 39, 40], jnp.int32)  # inactive, valid, last slot, past the table
    _, new_cache = decode(layer, jnp.zeros((NUM_SEQS, config.hidden_size)), cache, table, context)
    changed = np.argwhere(np.any(np.asarray(new_cache.latent != cache.latent), axis=-1))
    np.testing.assert_array_equal(changed, [[table[1, 0], 3], [table[2, 4], 7]])


def test_paged_write_then_read_round_trip(rng):
    pages = jnp.zeros((6, 4, 3))
    table = jnp.array([[4, 1, -1], [0, 5, 2]], jnp.int32)
    seq = jnp.array([0, 0, 0, 1, 1, 0, 1], jnp.int32)
    pos = jnp.array([0, 5, 9, 11, 2, 8, -1], jnp.int32)  # 9: no block, 8: block -1, -1: none
    values = jnp.asarray(rng.normal(size=(7, 3)), jnp.float32)
    valid = jnp.array([1, 1, 1, 1, 1, 1, 1], bool)
    read = np.asarray(read_paged(write_paged(pages, table, seq, pos, values, valid), table))
    expected = np.zeros((2, 12, 3), np.float32)
    expected[0, 0], expected[0, 5], expected[1, 11], expected[1, 2] = np.asarray(values)[
        [0, 1, 3, 4]
    ]
    np.testing.assert_array_equal(read, expected)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_updates_the_donated_cache_without_copying_it(rng, variant):
    """The model's steps donate the caches: the prefill's write into the latent pool must
    happen in place, after the read of the prefix. Without the ordering XLA scheduled the
    write first and copied the whole pool twice to keep the old values for the read (on
    the CPU as on the H200): every MLA layer moved its pool four times a prefill step."""
    config = make_config(**VARIANTS[variant])
    graph, state = nnx.split(make_layer(config, rng))
    cache = MLACache.zeros(config, NUM_BLOCKS)

    def step(state, cache, x, cu, block_table, prefix_lens):
        return nnx.merge(graph, state)(x, cu, cache, block_table, prefix_lens)

    x, cu = pack([np.ones((n, config.hidden_size), np.float32) for n in (9, 5, 7, 3)])
    hlo = jax.jit(step, donate_argnums=1).lower(
        state, cache, x, cu, random_block_table(rng), jnp.zeros((NUM_SEQS,), jnp.int32)
    ).compile().as_text()
    pool = f"f32[{','.join(map(str, cache.latent.shape))}]"
    copies = [line.strip() for line in hlo.splitlines() if pool in line and " copy(" in line]
    assert not copies, copies
