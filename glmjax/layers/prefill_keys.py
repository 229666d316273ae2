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


def sequence_keys(prefix: CachedPrefix | None, latent, index_keys, cu_seqlens, prefix_lens
                   ) -> tuple[PackedKeys, jax.Array, jax.Array]:
    """Each sequence's keys packed contiguously: its used prefix, then its new tokens.

    Args:
      prefix: the cached blocks [N, C, ...] (None: no cache, no prefix); latent [T, L],
        index_keys [T, d_I] or None: the new tokens; cu_seqlens int32 [N + 1];
        prefix_lens int32 [N].
    Returns:
      the keys (S = N * C + T rows, or T without a cache; rows past the last sequence are
      padding), cu_keys int32 [N + 1] (sequence n's keys are rows cu_keys[n]:cu_keys[n + 1])
      and the prefix length each sequence attends to (prefix_lens clipped to [0, C]).
    """
    tokens = latent.shape[0]
    if prefix is None:
        seq, valid = sequence_ids(cu_seqlens, tokens)
        pos = jnp.arange(tokens, dtype=jnp.int32) - cu_seqlens[seq]
        return (PackedKeys(latent, index_keys, seq, pos, valid), cu_seqlens,
                jnp.zeros_like(prefix_lens))
    num_seqs, capacity = prefix.latent.shape[:2]
    used = jnp.clip(prefix_lens, 0, capacity)
    cu_keys = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                               jnp.cumsum(used + jnp.diff(cu_seqlens)).astype(jnp.int32)])
    seq, valid = sequence_ids(cu_keys, num_seqs * capacity + tokens)
    pos = jnp.arange(seq.shape[0], dtype=jnp.int32) - cu_keys[seq]
    # Row of concat(prefix rows [N * C], new rows [T]) that holds each key.
    source = jnp.where(pos < used[seq], seq * capacity + pos,
                       num_seqs * capacity + cu_seqlens[seq] + pos - used[seq])
    source = jnp.where(valid, source, 0)

    def gather(cached, new):
        return None if new is None else jnp.concatenate(
            [cached.reshape(num_seqs * capacity, -1).astype(new.dtype), new])[source]

    return (PackedKeys(gather(prefix.latent, latent), gather(prefix.index, index_keys), seq, pos,
                  valid), cu_keys, used)
