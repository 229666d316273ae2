"""The keys an MLA prefill attends to, packed per sequence: its cached prefix, then its span.

`sequence_keys` lays sequence n's keys out contiguously (rows cu_keys[n] : cu_keys[n + 1]):
the first prefix_lens[n] rows of its cached blocks, then its new tokens, so that attention
over them is the usual variable-length causal layout (`pallas_kernels.prefill_attention`)
and reads each sequence's prefix only up to its length.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glmjax.layers.packing import sequence_ids
from pallas_kernels.packing import sequence_rows


class CachedPrefix(NamedTuple):
    """Every sequence's cached blocks in position order (valid or not)."""

    latent: jax.Array  # [N, C, kv_lora + qk_rope], C = M * P
    index: jax.Array | None  # [N, C, dsa_head_dim]


class PackedKeys(NamedTuple):
    """A packed set of S keys: latents, DSA index keys, owning sequence and position."""

    latent: jax.Array  # [S, kv_lora + qk_rope]
    index: jax.Array | None  # [S, dsa_head_dim]
    seq: jax.Array  # int32 [S]
    pos: jax.Array  # int32 [S]
    valid: jax.Array  # bool [S]


def sequence_keys(prefix: CachedPrefix | None, latent, index_keys, cu_seqlens, prefix_lens,
                  *, align: int = 1) -> tuple[PackedKeys, jax.Array, jax.Array, jax.Array]:
    """Each sequence's keys packed contiguously: its used prefix, then its new tokens.

    Args:
      prefix: the cached blocks [N, C, ...] (None: no cache, no prefix); latent [T, L],
        index_keys [T, d_I] or None: the new tokens; cu_seqlens int32 [N + 1];
        prefix_lens int32 [N]; align (static): every sequence's region starts at a multiple
        of it (the padding after a sequence's keys belongs to nobody), so that its keys fall
        on the same attention key blocks whatever precedes it in the batch
        (`pallas_kernels.attention.INVARIANT_KEY_ALIGN`).
    Returns:
      the keys (S = N * C + T rows, or T without a cache, plus N * (align - 1); rows past
      the last sequence's keys are padding), cu_keys int32 [N + 1] (sequence n's region is
      rows cu_keys[n]:cu_keys[n + 1]), seqused int32 [N] (its keys are the region's first
      seqused[n] rows) and the prefix length each sequence attends to (prefix_lens clipped
      to [0, C]).
    """
    tokens, num_seqs = latent.shape[0], cu_seqlens.shape[0] - 1
    lens = jnp.diff(cu_seqlens)
    if prefix is None and align == 1:
        seq, valid = sequence_ids(cu_seqlens, tokens)
        pos = jnp.arange(tokens, dtype=jnp.int32) - cu_seqlens[seq]
        return (PackedKeys(latent, index_keys, seq, pos, valid), cu_seqlens, lens,
                jnp.zeros_like(prefix_lens))
    capacity = 0 if prefix is None else prefix.latent.shape[1]
    used = jnp.clip(prefix_lens, 0, capacity)
    seqused = (used + lens).astype(jnp.int32)
    region = -(-seqused // align) * align
    cu_keys = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                               jnp.cumsum(region).astype(jnp.int32)])
    seq, pos = sequence_rows(cu_keys, num_seqs * (capacity + align - 1) + tokens)
    valid = pos < seqused[seq]
    # Row of concat(prefix rows [N * C], new rows [T]) that holds each key.
    source = jnp.where(pos < used[seq], seq * capacity + pos,
                       num_seqs * capacity + cu_seqlens[seq] + pos - used[seq])
    source = jnp.where(valid, source, 0)

    def gather(cached, new):
        if new is None:
            return None
        if cached is not None:
            new = jnp.concatenate([cached.reshape(num_seqs * capacity, -1).astype(new.dtype),
                                   new])
        return new[source]

    return (PackedKeys(gather(None if prefix is None else prefix.latent, latent),
                       gather(None if prefix is None else prefix.index, index_keys),
                       seq, pos, valid), cu_keys, seqused, used)
