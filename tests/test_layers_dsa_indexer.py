"""The DSA indexer inside MLA: dense when top-k covers the context, and the oracle's own
top-k selection otherwise, in continuation prefill and in decode; a ladder of continuations
selects what one coalesced span selects."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_layers_mla import (
    NUM_BLOCKS,
    NUM_SEQS,
    decode_case,
    make_config,
    make_layer,
    oracle,
    pack,
    prefill,
    random_block_table,
)
from test_layers_oracles import f64, rms_norm

from glmjax.layers.mla import MLA
from glmjax.layers.paged_cache import MLACache
from glmjax.layers.prefill_keys import PackedKeys


def indexer_select_oracle(layer: MLA, config, x, top_k):
    """[L, L] bool: for each query, its top_k causally visible keys by index score."""
    ind, x = layer.indexer, f64(x)
    length, heads, dim = x.shape[0], config.dsa_num_heads, config.dsa_head_dim
    q_latent = rms_norm(
        x @ f64(layer.q_a_proj.kernel), f64(layer.q_a_layernorm.weight), config.rms_norm_eps
    )
    q = (q_latent @ f64(ind.wq_b.kernel)).reshape(length, heads, dim)
    k = x @ f64(ind.wk.kernel)
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6) * f64(
        ind.k_norm.scale
    ) + f64(ind.k_norm.bias)
    w = x @ f64(ind.weights_proj.kernel) / np.sqrt(heads * dim)
    select = np.zeros((length, length), bool)
    for t in range(length):
        scores = [np.sum(w[t] * np.maximum(q[t] @ k[s], 0)) for s in range(t + 1)]
        select[t, np.argsort(-np.array(scores), kind="stable")[:top_k]] = True
    return select


def dsa_config(top_k):
    return make_config(dsa_top_k=top_k, dsa_num_heads=4, dsa_head_dim=32)


def test_top_k_covering_the_context_is_dense_attention(rng):
    config = dsa_config(top_k=64)  # longer than any context in the case
    decode_case(rng, config, make_layer(config, rng))


def test_top_k_selection_matches_oracle(rng):
    top_k = 3
    config = dsa_config(top_k)
    layer = make_layer(config, rng)
    decode_case(
        rng, config, layer, select=lambda seq: indexer_select_oracle(layer, config, seq, top_k)
    )


def test_select_keeps_at_most_top_k_visible_keys(rng):
    layer = make_layer(dsa_config(top_k=4), rng)
    q = jnp.asarray(rng.normal(size=(6, 4, 32)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(9, 32)), jnp.float32)
    visible = jnp.tril(jnp.ones((6, 9), bool))
    chosen = np.asarray(jax.jit(layer.indexer.select)(q, weights, keys, visible))
    np.testing.assert_array_equal(chosen.sum(-1), np.minimum(4, np.arange(1, 7)))
    assert not np.any(chosen & ~np.asarray(visible))


def test_select_is_the_visible_mask_wherever_top_k_covers_it(rng):
    """The indexer may be skipped exactly where no query sees more than top_k keys: there
    its selection is every visible key, whatever the scores (ties and all-zero included)."""
    top_k = 6
    layer = make_layer(dsa_config(top_k=top_k), rng)
    select = jax.jit(layer.indexer.select)  # one program for the 20 trials (op by op: ~90)
    for trial in range(20):
        queries, keys = 12, 40
        counts = rng.integers(0, top_k + 1, size=queries)
        visible = np.zeros((queries, keys), bool)
        for r, count in enumerate(counts):
            visible[r, rng.choice(keys, size=count, replace=False)] = True
        q = rng.normal(size=(queries, 4, 32)) * (trial % 2)  # odd trials only: all-zero scores
        weights = rng.normal(size=(queries, 4))
        chosen = select(jnp.asarray(q, jnp.float32), jnp.asarray(weights, jnp.float32),
                        jnp.asarray(rng.normal(size=(keys, 32)), jnp.float32),
                        jnp.asarray(visible))
        np.testing.assert_array_equal(chosen, visible)


def test_prefill_selection_is_lax_top_k_s_set(rng):
    """`MLA.select_keys` over packed keys (prefixes, an empty sequence, padding rows and
    queries, several query blocks) keeps exactly the keys lax.top_k keeps from the dense
    masked scores. Small integer inputs: many exact ties, decided by the lower index."""
    top_k = 5
    layer = make_layer(dsa_config(top_k=top_k), rng)
    layer.query_block = 8
    lens, prefixes = np.array([9, 0, 14, 1]), np.array([6, 3, 0, 11])
    cu_q = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens + prefixes)]).astype(np.int32)
    num_q, num_k = cu_q[-1] + 3, cu_k[-1] + 4
    seq = np.clip(np.searchsorted(cu_q, np.arange(num_q), side="right") - 1, 0, 3)
    valid = np.arange(num_q) < cu_q[-1]
    pos = np.where(valid, prefixes[seq] + np.arange(num_q) - cu_q[seq], 0)
    key_seq = np.clip(np.searchsorted(cu_k, np.arange(num_k), side="right") - 1, 0, 3)
    key_valid = np.arange(num_k) < cu_k[-1]
    keys = PackedKeys(None, jnp.asarray(rng.integers(-2, 3, (num_k, 32)), jnp.float32),
                      jnp.asarray(key_seq), jnp.asarray(np.arange(num_k) - cu_k[key_seq]),
                      jnp.asarray(key_valid))
    q = jnp.asarray(rng.integers(-1, 2, (num_q, 4, 32)), jnp.float32)
    w = jnp.asarray(rng.integers(0, 3, (num_q, 4)), jnp.float32)
    top = np.asarray(layer.select_keys((q, w), keys, jnp.asarray(cu_k), jnp.asarray(seq),
                                       jnp.asarray(pos), jnp.asarray(valid)))
    visible = ((key_seq[None] == seq[:, None]) & (keys.pos[None] <= pos[:, None])
               & key_valid[None] & valid[:, None])
    scores = jnp.einsum("rh,rhs->rs", w, jax.nn.relu(jnp.einsum("rhd,sd->rhs", q, keys.index)))
    _, expected = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), top_k)
    assert top.shape == (num_q, top_k)
    for t in range(num_q):
        want = [s for s in np.asarray(expected[t]) if visible[t, s]]
        assert sorted(top[t][top[t] >= 0]) == sorted(want), t
        assert (top[t][len(want):] == -1).all()


class AlwaysSelect(MLA):
    """MLA that never skips the indexer, to compare against the skip."""

    def _dense_or_selected(self, dense, selected, *args, **kwargs):
        return selected()


class PoisonedSelect(MLA):
    """MLA whose indexer path returns NaN: finite outputs prove the skip was taken."""

    def _attend_selected(self, q_nope, *args):
        return jnp.full((*q_nope.shape[:2], self.v_dim), jnp.nan, q_nope.dtype)


def test_skipping_the_indexer_equals_selecting(rng):
    """top_k equal to the longest context (8 cached + 12 new keys): the skip (dense flash
    attention) and the indexer's selection give the same outputs, and both the oracle's."""
    config = dsa_config(top_k=20)
    layer = make_layer(config, rng)
    selecting, poisoned = (nnx.eval_shape(lambda c=c: c(config, rngs=nnx.Rngs(0)))
                           for c in (AlwaysSelect, PoisonedSelect))
    nnx.update(selecting, nnx.state(layer))
    nnx.update(poisoned, nnx.state(layer))
    seqs = [rng.normal(size=(n, config.hidden_size)) for n in (20, 13, 9, 0)]
    table = random_block_table(rng)
    cache = MLACache.zeros(config, NUM_BLOCKS)
    x, cu = pack([s[:8] for s in seqs])
    _, cache = prefill(layer, x, cu, cache, table, jnp.zeros((NUM_SEQS,), jnp.int32))
    x, cu = pack([s[8:] for s in seqs])
    prefixes = jnp.array([8, 8, 8, 0], jnp.int32)  # the last row: no tokens
    y_skip, _ = prefill(layer, x, cu, cache, table, prefixes)
    y_select, _ = prefill(selecting, x, cu, cache, table, prefixes)
    np.testing.assert_array_equal(prefill(poisoned, x, cu, cache, table, prefixes)[0], y_skip)
    np.testing.assert_allclose(y_skip, y_select, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y_skip[cu[0]:cu[1]], oracle(layer, config, seqs[0])[8:],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation, batch_invariant", [
    ("reference", False), ("reference", True), ("pallas", False),
    pytest.param("pallas", True, marks=pytest.mark.gpu, id="pallas-gpu")])
def test_a_ladder_selects_what_one_coalesced_span_selects(rng, implementation,
                                                          batch_invariant):
    """Issue 18's greedy bar, in fp32: prompts prefilled as a ladder of shrinking chunks,
    each continuing its cached prefix (visible key range, the prefix's index keys from the
    cache, query positions), attend to the same top_k keys as one coalesced span. The
    indexer drops keys here (the dense output is far away), so a single differing key
    would move an output far beyond fp32 rounding. "pallas": the DSA kernels
    (`index_scores`, `select_top_k`, `sparse_attention`), interpreted on the CPU.
    batch_invariant: every sequence's keys packed at multiples of 128 rows, the rows
    between them nobody's."""
    config = dsa_config(top_k=5)
    layer = make_layer(config, rng)
    layer.dsa_implementation = implementation
    layer.batch_invariant = batch_invariant
    lens = (31, 22, 13, 0)  # capacity 40 each; an empty row
    seqs = [rng.normal(size=(n, config.hidden_size)) for n in lens]
    table = random_block_table(rng)

    def coalesced():
        return prefill(layer, *pack(seqs, 72), MLACache.zeros(config, NUM_BLOCKS), table,
                       jnp.zeros((NUM_SEQS,), jnp.int32))[0][:sum(lens)]

    # On a GPU XLA's fp32 matmuls would be TF32: rounding that can flip a selection.
    with jax.default_matmul_precision("highest"):
        cache, ladder = MLACache.zeros(config, NUM_BLOCKS), []
        for start, end in ((0, 16), (16, 24), (24, 28), (28, 40)):
            x, cu = pack([s[start:end] for s in seqs], 72)
            y, cache = prefill(layer, x, cu, cache, table,
                               jnp.asarray([min(start, n) for n in lens], jnp.int32))
            ladder.append([np.asarray(y[cu[n]:cu[n + 1]]) for n in range(NUM_SEQS)])
        ladder = np.concatenate([np.concatenate(chunk) for chunk in zip(*ladder)])
        selected = coalesced()
        np.testing.assert_allclose(ladder, selected, rtol=1e-5, atol=1e-6)
        if implementation == "reference":
            layer.indexer.top_k = max(lens)  # covers every context: dense
            dense = coalesced()
            assert np.max(np.abs(dense - selected)) > 1e-2 * np.max(np.abs(dense))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["glm-like", "kimi-like"])
def test_dsa_kernels_match_the_reference_path(rng, variant):
    """On a GPU: the prefill's DSA path through the Pallas kernels (`index_scores`,
    `select_top_k`, `sparse_attention`) against the jax.numpy ops, fp32, continuing cached
    prefixes."""
    changes = {} if variant == "glm-like" else {"qk_rope_head_dim": 32}
    base = dataclasses.replace(dsa_config(top_k=8), **changes)
    layers = {}
    for attention in ("reference", "pallas"):
        config = dataclasses.replace(base, mla_attention=attention)
        layers[attention] = nnx.eval_shape(lambda c=config: MLA(c, rngs=nnx.Rngs(0)))
    nnx.update(layers["pallas"], nnx.state(make_layer(base, rng)))
    nnx.update(layers["reference"], nnx.state(layers["pallas"]))
    seqs = [rng.normal(size=(n, base.hidden_size)) for n in (20, 13, 9, 0)]
    table = random_block_table(rng)
    x, cu = pack([s[:8] for s in seqs])
    x2, cu2 = pack([s[8:] for s in seqs])
    prefixes = jnp.array([8, 8, 8, 0], jnp.int32)
    outputs = {}
    # XLA's fp32 matmuls default to TF32 on a GPU; the kernels run fp32 operands at full
    # precision, so the jax.numpy path must too (its TF32 differed from them by 2.4e-4).
    with jax.default_matmul_precision("highest"):
        for attention, layer in layers.items():
            cache = MLACache.zeros(base, NUM_BLOCKS)
            _, cache = prefill(layer, x, cu, cache, table, jnp.zeros((NUM_SEQS,), jnp.int32))
            outputs[attention] = prefill(layer, x2, cu2, cache, table, prefixes)[0]
    np.testing.assert_allclose(outputs["pallas"], outputs["reference"], rtol=1e-4, atol=1e-5)


def test_cache_without_index_keys_is_refused(rng):
    config = dsa_config(top_k=4)
    layer = make_layer(config, rng)
    cache = MLACache(MLACache.zeros(config, 2).latent)
    with pytest.raises(ValueError, match="index_keys"):
        layer.decode(
            jnp.zeros((1, config.hidden_size)),
            cache,
            jnp.zeros((1, 1), jnp.int32),
            jnp.zeros((1,), jnp.int32),
        )
