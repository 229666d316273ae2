"""Packed variable-length rows: N sequences in T rows, sequence n being rows
cu_seqlens[n]:cu_seqlens[n + 1]."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sequence_rows(cu_seqlens: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """Each row's sequence, int32 [T] in [0, N) (rows past cu_seqlens[N], padding, get N - 1),
    and its position in that sequence, int32 [T]. cu_seqlens: int32 [N + 1]; num_rows: T."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    # side="right" skips empty sequences: the last n with cu[n] <= t owns row t.
    seq = jnp.searchsorted(cu_seqlens, rows, side="right").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, cu_seqlens.shape[0] - 2)
    return seq, rows - cu_seqlens[seq]


def key_ends(cu_seqlens_k: jax.Array, seqused_k: jax.Array | None) -> jax.Array:
    """int32 [N]: the row after each sequence's last key (its region's end without
    `seqused_k`, the first seqused_k[n] rows of region n with it; never past the region)."""
    if seqused_k is None:
        return cu_seqlens_k[1:]
    return jnp.minimum(cu_seqlens_k[:-1] + jnp.maximum(seqused_k, 0), cu_seqlens_k[1:])
