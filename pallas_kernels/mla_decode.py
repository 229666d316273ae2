"""`mla_decode`: absorbed MLA attention of one query token per sequence over its paged latent
cache, the latents read where they lie (no gathered copy).

Per sequence n, head h, with c_t | pe_t the cached latent of position t:

    s_t   = scale * (q_abs[n, h] . c_t + q_pe[n, h] . pe_t)     t visible
    out   = sum_t softmax(s)_t c_t                              fp32 [C]
    lse   = log sum_t exp(s_t)                                  fp32 (-inf: nothing visible)

Position t is visible when t <= context_lens[n] and, where a `mask` is given (the DSA
indexer's choice), mask[n, t]. Position t of sequence n lives in block block_table[n, t // P]
at row t % P of `pages` [B, P, C + R]; a negative block id reads as zeros.

Two implementations behind one signature: jax.numpy (`mla_decode_reference`: the pages
gathered into [N, M P, C + R], then the masked softmax) and a Pallas kernel
(`mla_decode_pallas`) that splits each sequence's positions over programs (flash decoding)
and merges their partial results by their log-sum-exp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import resolve_interpret
from pallas_kernels.mla_decode_pallas import DecodeTiling, mla_decode_pallas, select_tiling

IMPLEMENTATIONS = ("pallas", "xla")


def visible_positions(context_lens, mask, width: int) -> jax.Array:
    """bool [N, width]: t <= context_lens[n] (and mask[n, t] when given)."""
    visible = jnp.arange(width)[None] <= context_lens[:, None]
    return visible if mask is None else visible & mask


def softmax_with_lse(scores: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax over the last axis restricted to `mask`, and its log-sum-exp (the last axis
    dropped). Fully masked rows give zeros and an LSE of -inf."""
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0)
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    lse = jnp.where(total > 0, peak + jnp.log(jnp.where(total > 0, total, 1)), -jnp.inf)
    return weights / jnp.where(total > 0, total, 1), lse[..., 0]


def latent_attention(q_abs: jax.Array, q_pe: jax.Array | None, latent: jax.Array,
                     mask: jax.Array, *, kv_lora: int, scale: float
                     ) -> tuple[jax.Array, jax.Array]:
    """Absorbed attention over gathered latents: q_abs [N, H, C] (q_nope W_uk), q_pe
    [N, H, R] (None when R = 0), latent [N, S, C + R], mask [N, S] -> output latent fp32
    [N, H, C] (before W_uv) and its log-sum-exp fp32 [N, H] (-inf where no key is visible).
    The dense form behind `mla_decode_reference`, and what a dcp rank runs on its shard."""
    c_kv = latent[..., :kv_lora].astype(q_abs.dtype)
    scores = jnp.einsum("nhc,nsc->nhs", q_abs, c_kv, preferred_element_type=jnp.float32)
    if q_pe is not None:
        k_pe = latent[..., kv_lora:].astype(q_pe.dtype)
        scores = scores + jnp.einsum("nhr,nsr->nhs", q_pe, k_pe,
                                     preferred_element_type=jnp.float32)
    probs, lse = softmax_with_lse(scores * scale, mask[:, None])
    out = jnp.einsum("nhs,nsc->nhc", probs.astype(c_kv.dtype), c_kv,
                     preferred_element_type=jnp.float32)
    return out, lse


def mla_decode_reference(q_abs, q_pe, pages, block_table, context_lens, mask=None, *,
                         scale: float):
    """The jax.numpy path: the pages gathered in position order (missing blocks as zeros),
    then `latent_attention`. (out fp32 [N, H, C], lse fp32 [N, H])."""
    num_blocks = pages.shape[0]
    blocks = jnp.where(block_table >= 0, block_table, num_blocks)
    latent = pages.at[blocks].get(mode="fill", fill_value=0)
    latent = latent.reshape(block_table.shape[0], -1, pages.shape[-1])  # [N, M P, C + R]
    visible = visible_positions(context_lens, mask, latent.shape[1])
    return latent_attention(q_abs, q_pe, latent, visible, kv_lora=q_abs.shape[-1],
                            scale=scale)


def _check(q_abs, q_pe, pages, block_table, context_lens, mask):
    if q_abs.ndim != 3:
        raise ValueError(f"q_abs must be [N, H, C], got shape {q_abs.shape}")
    rows, heads, kv_lora = q_abs.shape
    rope = 0 if q_pe is None else q_pe.shape[-1]
    if q_pe is not None and q_pe.shape[:2] != (rows, heads):
        raise ValueError(f"q_pe must be [{rows}, {heads}, R], got shape {q_pe.shape}")
    if pages.ndim != 3 or pages.shape[-1] != kv_lora + rope:
        raise ValueError(f"pages must be [B, P, {kv_lora + rope}], got shape {pages.shape}")
    if block_table.ndim != 2 or block_table.shape[0] != rows or block_table.dtype != jnp.int32:
        raise ValueError(f"block_table must be int32 [{rows}, M], got "
                         f"{block_table.dtype}{list(block_table.shape)}")
    if context_lens.shape != (rows,) or context_lens.dtype != jnp.int32:
        raise ValueError(f"context_lens must be int32 [{rows}], got "
                         f"{context_lens.dtype}{list(context_lens.shape)}")
    width = block_table.shape[1] * pages.shape[1]
    if mask is not None and (mask.shape != (rows, width) or mask.dtype != jnp.bool_):
        raise ValueError(f"mask must be bool [{rows}, {width}], got "
                         f"{mask.dtype}{list(mask.shape)}")


def mla_decode(q_abs, q_pe, pages, block_table, context_lens, mask=None, *, scale: float,
               implementation: str = "xla", interpret: bool | None = None,
               tiling: DecodeTiling | None = None):
    """Attention of one query per sequence over its paged latents.

    Args:
      q_abs: [N, H, C] queries absorbed into the latent space (q_nope W_uk); q_pe: [N, H, R]
        their rope part, or None (R = 0). Both in the cache's dtype.
      pages: [B, P, C + R] the latent cache; block_table: int32 [N, M];
      context_lens: int32 [N], the last visible position (-1: nothing, an inactive row);
      mask: optional bool [N, M P], a further selection (DSA);
      scale: the softmax scale.
      implementation: "xla" (jax.numpy) or "pallas" (interpret mode by default on the CPU);
      tiling: the Pallas launch's (default: `select_tiling`, the same for every batch).

    Returns (out fp32 [N, H, C], lse fp32 [N, H]): zeros and -inf where nothing is visible.
    """
    _check(q_abs, q_pe, pages, block_table, context_lens, mask)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if implementation == "xla":
        return mla_decode_reference(q_abs, q_pe, pages, block_table, context_lens, mask,
                                    scale=scale)
    tiling = tiling or select_tiling(pages.shape[1])
    return mla_decode_pallas(q_abs, q_pe, pages, block_table, context_lens, mask,
                             scale=float(scale), tiling=tiling,
                             interpret=resolve_interpret(interpret))
