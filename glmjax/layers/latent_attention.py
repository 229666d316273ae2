"""Absorbed MLA attention over latents as DCP uses it: the attention itself
(`pallas_kernels.mla_decode.latent_attention`, re-exported), the merge of the dcp ranks'
partial results, the DSA selection as one dcp rank sees it, and a helper that maps a function
over blocks of query rows (`glmjax.layers.mla` holds the layer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from glmjax.layers.paged_cache import DCPLayout
from pallas_kernels.mla_decode import latent_attention

__all__ = ["in_query_blocks", "latent_attention", "merge_partial_attention",
           "owned_top_k_mask"]


def merge_partial_attention(out: jax.Array, lse: jax.Array, axis_name: str) -> jax.Array:
    """Inside a shard_map: exact attention from each rank's attention over its own keys.

    Args:
      out: fp32 [N, H, C], this rank's softmax-weighted output over its keys.
      lse: fp32 [N, H], their log-sum-exp (-inf: no visible key on this rank).
    Returns:
      fp32 [N, H / ranks, C]: sum_r exp(lse_r) out_r / sum_r exp(lse_r) for this rank's
      slice of the heads (reduce-scattered over `axis_name`).
    """
    peak = lax.pmax(lse, axis_name)
    weight = jnp.exp(lse - jnp.where(jnp.isfinite(peak), peak, 0))  # 0 where lse = -inf
    num = lax.psum_scatter(out * weight[..., None], axis_name, scatter_dimension=1, tiled=True)
    den = lax.psum_scatter(weight, axis_name, scatter_dimension=1, tiled=True)
    return num / jnp.where(den > 0, den, 1)[..., None]


def owned_top_k_mask(top: jax.Array, keep: jax.Array, *, layout: DCPLayout, rank: jax.Array,
                     local_len: int) -> jax.Array:
    """The DSA selection as this rank sees it: bool [R, local_len], True at the local
    position of every selected global position `top` [R, k] that `keep` and the rank owns.
    Positions owned by other ranks are dropped, never read as local rows."""
    mine = keep & (top >= 0) & (layout.owner(top) == rank)
    local = jnp.where(mine, layout.local_position(top), local_len)  # local_len: dropped
    rows = jnp.arange(top.shape[0])[:, None]
    return jnp.zeros((top.shape[0], local_len), bool).at[rows, local].set(True, mode="drop")


def in_query_blocks(fn, block: int, *rows):
    """``fn(*rows)`` over the leading (query) axis of every array in `rows`, `block` rows at
    a time (rows padded with zeros past the end; fn must treat them as invalid)."""
    num = jax.tree.leaves(rows)[0].shape[0]
    if num <= block:
        return fn(*rows)
    pad = -num % block

    def blocks(x):  # explicit sizes: x may have a zero-width axis (no rope part)
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(x.shape[0] // block, block, *x.shape[1:])

    out = lax.map(lambda args: fn(*args), jax.tree.map(blocks, rows))
    return out.reshape(out.shape[0] * block, *out.shape[2:])[:num]
