"""MLA (multi-head latent attention) without positional rotation, over a paged latent cache.

Per token the cache keeps the latent ``rmsnorm(c_kv) | k_pe`` ([kv_lora + qk_rope]; k_pe is
one unrotated key part shared by all heads). With W_uk, W_uv the two halves of kv_b_proj:

    score[t, s] = scale * (q_nope[t] . (c_kv[s] W_uk) + q_pe[t] . k_pe[s])
    out[t]      = sum_s softmax(score)[t, s] * (c_kv[s] W_uv)

Prefill expands every key's latent through kv_b_proj (non-absorbed); decode folds W_uk into
the query and W_uv after the weighted sum (absorbed), so it reads only latents. Both are the
same function of the cache, up to rounding.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers.dsa_indexer import DSAIndexer
from glmjax.layers.norms import RMSNorm
from glmjax.layers.packing import sequence_ids
from glmjax.layers.paged_cache import MLACache, read_paged, write_paged
from glmjax.layers.projection import projection


class _Keys(NamedTuple):
    """A packed set of S keys: latents, DSA index keys, owning sequence and position."""

    latent: jax.Array  # [S, kv_lora + qk_rope]
    index: jax.Array | None  # [S, dsa_head_dim]
    seq: jax.Array  # int32 [S]
    pos: jax.Array  # int32 [S]
    valid: jax.Array  # bool [S]


def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis restricted to `mask`; fully masked rows give zeros."""
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.where(total > 0, total, 1)


class MLA(nnx.Module):
    """MLA with optional query LoRA and optional DSA indexer (upstream DeepSeek names)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        hidden, heads = config.hidden_size, config.mla_num_heads
        self.num_heads, self.kv_lora = heads, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = (config.qk_nope_head_dim, config.qk_rope_head_dim,
                                            config.v_head_dim)
        self.scale = (self.nope + self.rope) ** -0.5
        q_dim = heads * (self.nope + self.rope)
        linear = functools.partial(projection, config, rngs=rngs)
        norm = functools.partial(RMSNorm, eps=config.rms_norm_eps, param_dtype=config.param_dtype)
        if config.q_lora_rank is None:
            self.q_proj = linear(hidden, q_dim)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = linear(hidden, config.q_lora_rank)
            self.q_a_layernorm = norm(config.q_lora_rank)
            self.q_b_proj = linear(config.q_lora_rank, q_dim)
        self.kv_a_proj_with_mqa = linear(hidden, self.kv_lora + self.rope)
        self.kv_a_layernorm = norm(self.kv_lora)
        self.kv_b_proj = linear(self.kv_lora, heads * (self.nope + self.v_dim))
        self.o_proj = linear(heads * self.v_dim, hidden)
        self.indexer = None if config.dsa_top_k is None else DSAIndexer(config, rngs=rngs)

    def __call__(self, x: jax.Array, cu_seqlens: jax.Array, cache: MLACache | None = None,
                 block_table: jax.Array | None = None, prefix_lens: jax.Array | None = None
                 ) -> tuple[jax.Array, MLACache | None]:
        """Prefill a packed batch, causal within each sequence.

        Args:
          x: [T, D]; cu_seqlens: int32 [N + 1].
          cache, block_table (int32 [N, M]), prefix_lens (int32 [N]): with a cache, sequence
            n continues after prefix_lens[n] cached tokens, attends to them, and its new
            tokens are written at positions prefix_lens[n] + i. Without one, there is no
            prefix and nothing is written.
        Returns:
          y [T, D] (zero on padding rows) and the updated cache.
        """
        with jax.named_scope("mla_prefill"):
            tokens, num_seqs = x.shape[0], cu_seqlens.shape[0] - 1
            if prefix_lens is None:
                prefix_lens = jnp.zeros((num_seqs,), jnp.int32)
            seq, valid = sequence_ids(cu_seqlens, tokens)
            pos = prefix_lens[seq] + jnp.arange(tokens, dtype=jnp.int32) - cu_seqlens[seq]
            q_nope, q_pe, q_latent = self._queries(x)
            latent, index_keys = self._latent(x), self._index_keys(x)
            keys = _Keys(latent, index_keys, seq, pos, valid)
            if cache is not None:
                self._check_cache(cache)
                keys = _concat(self._cached_prefix(cache, block_table, prefix_lens), keys)
                cache = self._write(cache, block_table, seq, pos, valid, latent, index_keys)
            mask = ((keys.seq[None] == seq[:, None]) & (keys.pos[None] <= pos[:, None])
                    & keys.valid[None] & valid[:, None])  # [T, S]
            if self.indexer is not None:
                mask = self.indexer.select(*self.indexer.queries(x, q_latent), keys.index, mask)
            out = self._attend_expanded(q_nope, q_pe, keys.latent, mask)
            return self.o_proj(out.reshape(tokens, -1)), cache

    def decode(self, x: jax.Array, cache: MLACache, block_table: jax.Array,
               context_lens: jax.Array) -> tuple[jax.Array, MLACache]:
        """One new token per sequence, at position context_lens[n] (-1: inactive row).

        Args: x [N, D]; cache; block_table int32 [N, M]; context_lens int32 [N].
        Returns: y [N, D] (zero on inactive rows) and the cache with the new latents.
        """
        with jax.named_scope("mla_decode"):
            self._check_cache(cache)
            num_seqs = x.shape[0]
            q_nope, q_pe, q_latent = self._queries(x)
            cache = self._write(cache, block_table, jnp.arange(num_seqs, dtype=jnp.int32),
                                context_lens, context_lens >= 0, self._latent(x),
                                self._index_keys(x))
            latent = read_paged(cache.latent, block_table)  # [N, S, L]
            mask = jnp.arange(latent.shape[1])[None] <= context_lens[:, None]  # [N, S]
            if self.indexer is not None:
                mask = self.indexer.select(*self.indexer.queries(x, q_latent),
                                           read_paged(cache.index_keys, block_table), mask)
            out = self._attend_absorbed(q_nope, q_pe, latent, mask)
            return self.o_proj(out.reshape(num_seqs, -1)), cache

    def _queries(self, x):
        """x [T, D] -> q_nope [T, H, nope], q_pe [T, H, rope], q latent [T, q_lora] or None."""
        if self.q_proj is None:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        else:
            q_latent, q = None, self.q_proj(x)
        q = q.reshape(x.shape[0], self.num_heads, self.nope + self.rope)
        return q[..., :self.nope], q[..., self.nope:], q_latent

    def _latent(self, x):
        """x [T, D] -> cached latent [T, kv_lora + rope] = rmsnorm(c_kv) | k_pe."""
        kv = self.kv_a_proj_with_mqa(x)
        return jnp.concatenate([self.kv_a_layernorm(kv[:, :self.kv_lora]),
                                kv[:, self.kv_lora:]], axis=-1)

    def _index_keys(self, x):
        return None if self.indexer is None else self.indexer.keys(x)

    def _check_cache(self, cache: MLACache):
        if (cache.index_keys is None) != (self.indexer is None):
            raise ValueError("an MLA layer with a DSA indexer needs cache.index_keys, and one "
                             "without must not have them")

    def _cached_prefix(self, cache, block_table, prefix_lens) -> _Keys:
        """The cached prefix of every sequence as packed keys, [N * M * P]."""
        latent = read_paged(cache.latent, block_table)  # [N, M * P, L]
        num_seqs, span = latent.shape[:2]
        seq = jnp.repeat(jnp.arange(num_seqs, dtype=jnp.int32), span)
        pos = jnp.tile(jnp.arange(span, dtype=jnp.int32), num_seqs)
        index = (None if cache.index_keys is None else
                 read_paged(cache.index_keys, block_table).reshape(num_seqs * span, -1))
        return _Keys(latent.reshape(num_seqs * span, -1), index, seq, pos,
                     pos < prefix_lens[seq])

    def _write(self, cache, block_table, seq, pos, valid, latent, index_keys) -> MLACache:
        return MLACache(
            write_paged(cache.latent, block_table, seq, pos, latent, valid),
            None if index_keys is None
            else write_paged(cache.index_keys, block_table, seq, pos, index_keys, valid))

    def _attend_expanded(self, q_nope, q_pe, latent, mask):
        """Non-absorbed: q [T, H, *], latent [S, L], mask [T, S] -> [T, H, v]."""
        kv = self.kv_b_proj(latent[:, :self.kv_lora].astype(q_nope.dtype))
        kv = kv.reshape(latent.shape[0], self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        scores = (jnp.einsum("thd,shd->hts", q_nope, k_nope, preferred_element_type=jnp.float32)
                  + jnp.einsum("thr,sr->hts", q_pe, latent[:, self.kv_lora:].astype(q_pe.dtype),
                               preferred_element_type=jnp.float32))
        probs = masked_softmax(scores * self.scale, mask[None])
        return jnp.einsum("hts,shv->thv", probs.astype(v.dtype), v,
                          preferred_element_type=jnp.float32).astype(q_nope.dtype)

    def _attend_absorbed(self, q_nope, q_pe, latent, mask):
        """Absorbed: q [N, H, *], latent [N, S, L], mask [N, S] -> [N, H, v]."""
        w = self.kv_b_proj.kernel[...].astype(q_nope.dtype).reshape(
            self.kv_lora, self.num_heads, self.nope + self.v_dim)
        w_uk, w_uv = w[..., :self.nope], w[..., self.nope:]
        c_kv = latent[..., :self.kv_lora].astype(q_nope.dtype)
        k_pe = latent[..., self.kv_lora:].astype(q_pe.dtype)
        q_latent = jnp.einsum("nhd,chd->nhc", q_nope, w_uk, preferred_element_type=jnp.float32)
        scores = (jnp.einsum("nhc,nsc->nhs", q_latent.astype(c_kv.dtype), c_kv,
                             preferred_element_type=jnp.float32)
                  + jnp.einsum("nhr,nsr->nhs", q_pe, k_pe, preferred_element_type=jnp.float32))
        probs = masked_softmax(scores * self.scale, mask[:, None])
        out_latent = jnp.einsum("nhs,nsc->nhc", probs.astype(c_kv.dtype), c_kv,
                                preferred_element_type=jnp.float32)
        return jnp.einsum("nhc,chv->nhv", out_latent.astype(w_uv.dtype), w_uv,
                          preferred_element_type=jnp.float32).astype(q_nope.dtype)


def _concat(a: _Keys, b: _Keys) -> _Keys:
    return _Keys(*(None if x is None else jnp.concatenate([x, y]) for x, y in zip(a, b)))
