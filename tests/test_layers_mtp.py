"""The MTP head (embedding + hidden -> MLA/mHC/MoE block -> shared head) against the
composed float64 oracles, in packed prefill over a paged cache and in a decode step."""

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_layers_block import block_oracle, packed_mla_oracle
from test_layers_oracles import cu_seqlens_of, f64, random_module, rms_norm

from glmjax.config import ModelConfig
from glmjax.layers.block import PackedBatch
from glmjax.layers.mtp import MTP
from glmjax.layers.paged_cache import MLACache

NUM_TOKENS, BLOCK = 24, 8


def mtp_oracle(mtp, config, embed, lm_head, hidden, tokens, cu):
    eps = config.rms_norm_eps
    e = rms_norm(f64(embed.embedding)[tokens], f64(mtp.enorm.weight), eps)
    h = rms_norm(f64(hidden), f64(mtp.hnorm.weight), eps)
    u = np.concatenate([e, h], axis=1) @ f64(mtp.eh_proj.kernel)
    streams = np.repeat(u[:, None], config.mhc_streams, axis=1)
    out = block_oracle(mtp.block, config, streams, packed_mla_oracle(mtp.block, config, cu))
    return rms_norm(out.mean(1), f64(mtp.shared_head_norm.weight), eps) @ f64(lm_head.kernel)


def test_mtp_prefill_then_decode(rng):
    config = dataclasses.replace(ModelConfig.preset("tiny"), kv_block_size=BLOCK)
    mtp = random_module(lambda: MTP(config, rngs=nnx.Rngs(0)), rng)
    embed = random_module(
        lambda: nnx.Embed(config.vocab_size, config.hidden_size, rngs=nnx.Rngs(0)), rng
    )
    lm_head = random_module(
        lambda: nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, rngs=nnx.Rngs(0)),
        rng,
    )
    lengths = np.array([9, 0, 13])
    hidden = rng.normal(size=(lengths.sum() + 3, config.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, config.vocab_size, size=len(hidden)).astype(np.int32)
    table = jnp.asarray(rng.permutation(9).reshape(3, 3), jnp.int32)
    cache = MLACache.zeros(config, 9)

    @nnx.jit(static_argnames="decode")
    def run(mtp, embed, lm_head, hidden, tokens, batch, cache, decode):
        return mtp(hidden, tokens, embed, lm_head, batch, cache, decode=decode)

    # Prefill all but the last token of each sequence (and the empty one).
    cu = cu_seqlens_of(lengths - np.array([1, 0, 1]))
    rows = np.concatenate([np.arange(0, 8), np.arange(9, 21)])
    x = np.zeros((NUM_TOKENS, config.hidden_size), np.float32)
    x[: len(rows)] = hidden[rows]
    t = np.zeros(NUM_TOKENS, np.int32)
    t[: len(rows)] = tokens[rows]
    batch = PackedBatch(
        jnp.asarray(cu), jnp.zeros(3, jnp.int32), table, jnp.full((3, 1), -1, jnp.int32)
    )
    logits, _, cache = run(mtp, embed, lm_head, jnp.asarray(x), jnp.asarray(t), batch, cache, False)
    full_cu = cu_seqlens_of(lengths)
    expected = mtp_oracle(
        mtp, config, embed, lm_head, hidden[: full_cu[-1]], tokens[: full_cu[-1]], full_cu
    )
    np.testing.assert_allclose(logits[: len(rows)], expected[rows], rtol=1e-4, atol=1e-4)
    # Decode the last token of sequences 0 and 2; sequence 1 is inactive.
    last = np.array([8, 0, 21])
    context = jnp.array([8, -1, 12], jnp.int32)
    batch = PackedBatch(
        jnp.arange(4, dtype=jnp.int32), context, table, jnp.full((3, 1), -1, jnp.int32)
    )
    logits, _, _ = run(
        mtp,
        embed,
        lm_head,
        jnp.asarray(hidden[last]),
        jnp.asarray(tokens[last]),
        batch,
        cache,
        True,
    )
    np.testing.assert_allclose(np.asarray(logits)[[0, 2]], expected[[8, 21]], rtol=1e-4, atol=1e-4)
