"""DSA (DeepSeek Sparse Attention) lightning indexer: picks the top-k keys of each query.

Score of query t against key s (DeepSeek-V3.2's indexer, without rotation: this model
rotates nothing, and the Hadamard transform upstream only prepares fp8 quantisation, an
orthogonal map that leaves dot products unchanged):

    I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]),
    q = wq_b(q_latent) [H_I, d_I],  k = LayerNorm(wk(x)) [d_I],
    w = weights_proj(x) * H_I ** -0.5 * d_I ** -0.5.

Attention then keeps, per query, the `top_k` causally visible keys with the largest I.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers.projection import projection
from pallas_kernels.index_scores import index_scores
from pallas_kernels.top_k import select_top_k


class DSAIndexer(nnx.Module):
    """Index queries from the MLA query latent, one shared index key per token."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        heads, dim = config.dsa_num_heads, config.dsa_head_dim
        linear = functools.partial(projection, config, rngs=rngs)
        self.num_heads, self.head_dim, self.top_k = heads, dim, config.dsa_top_k
        self.wq_b = linear(config.q_lora_rank, heads * dim)
        self.wk = linear(config.hidden_size, dim)
        self.k_norm = nnx.LayerNorm(dim, epsilon=1e-6, dtype=config.dtype,
                                    param_dtype=config.param_dtype, rngs=rngs)
        self.weights_proj = linear(config.hidden_size, heads)

    def queries(self, x: jax.Array, q_latent: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D], q_latent [T, q_lora] -> q [T, H_I, d_I], head weights fp32 [T, H_I]."""
        q = self.wq_b(q_latent).reshape(x.shape[0], self.num_heads, self.head_dim)
        scale = (self.num_heads * self.head_dim) ** -0.5
        return q, self.weights_proj(x).astype(jnp.float32) * scale

    def keys(self, x: jax.Array) -> jax.Array:
        """x [T, D] -> index keys [T, d_I] (what the index-key cache stores)."""
        return self.k_norm(self.wk(x))

    def top_keys(self, q: jax.Array, weights: jax.Array, keys: jax.Array,
                 visible: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each query's `top_k` highest-scoring keys.

        Args:
          q [R, H_I, d_I], weights [R, H_I]: R queries.
          keys: [S, d_I] shared by all queries (packed prefill) or [R, S, d_I] per query
            (decode).
          visible: bool [R, S], the causal mask.
        Returns:
          int32 [R, min(top_k, S)] key indices and bool [R, min(top_k, S)]: whether each is
          visible (a query with fewer visible keys than top_k gets invisible fillers). The
          set is lax.top_k's (ties: the lower index), selected without a sort
          (`select_top_k`); each row lists its visible keys first, in ascending index.
        """
        with jax.named_scope("dsa_indexer"):
            pattern = "rhd,sd->rhs" if keys.ndim == 2 else "rhd,rsd->rhs"
            dots = jnp.einsum(pattern, q, keys, preferred_element_type=jnp.float32)
            scores = jnp.einsum("rh,rhs->rs", weights, jax.nn.relu(dots))
            scores = jnp.where(visible, scores, -jnp.inf)
            top = select_top_k(scores, min(self.top_k, scores.shape[-1]))
            return top, jnp.take_along_axis(visible, top, axis=-1)

    def top_keys_in_ranges(self, q: jax.Array, weights: jax.Array, keys: jax.Array,
                           key_start: jax.Array, key_end: jax.Array, *,
                           implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
        """`top_keys` of packed queries whose visible keys are a row range each.

        Args:
          q [R, H_I, d_I], weights [R, H_I]: R queries; keys [S, d_I] shared by all.
          key_start, key_end: int32 [R]; query r sees keys [key_start[r], key_end[r]).
          implementation: `pallas_kernels.index_scores`'s and `select_top_k`'s (None: by
            device).
        Returns:
          as `top_keys`.
        """
        with jax.named_scope("dsa_indexer"):
            scores = index_scores(q, weights, keys, key_start, key_end,
                                  implementation=implementation)  # [R, S], -inf: not seen
            top = select_top_k(scores, min(self.top_k, scores.shape[-1]), lengths=key_end,
                               implementation=implementation)  # -inf from key_end on
            return top, (top >= key_start[:, None]) & (top < key_end[:, None])

    def select(self, q: jax.Array, weights: jax.Array, keys: jax.Array,
               visible: jax.Array) -> jax.Array:
        """Narrow the visibility mask to each query's top-k keys (arguments as `top_keys`).

        Returns:
          bool [R, S]: visible and among the query's `top_k` highest scores.
        """
        top, keep = self.top_keys(q, weights, keys, visible)
        rows = jnp.arange(visible.shape[0])[:, None]
        return jnp.zeros(visible.shape, bool).at[rows, top].set(keep)
