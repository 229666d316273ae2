"""The packed variable-length batch the layers read: N sequences in T rows, by cu_seqlens."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.packing import sequence_rows


class PackedBatch(NamedTuple):
    """What the layers read about one step's packed batch of N sequences."""

    cu_seqlens: jax.Array  # int32 [N + 1]: sequence n is rows cu_seqlens[n]:cu_seqlens[n + 1]
    prefix_lens: jax.Array  # int32 [N], tokens already cached (decode: the new token's position)
    block_table: jax.Array  # int32 [N, M], MLA cache blocks (-1: none)
    checkpoint_offsets: jax.Array  # int32 [N, capacity], KDA snapshot offsets (-1: inactive)
    # decode: int32 [N], KDA pool slots (-1: padding); or a chain [J, R] (`KDA.decode`)
    state_slots: jax.Array | None = None


def sequence_ids(cu_seqlens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Sequence of each packed row and whether the row is real (not padding).

    Args:
      cu_seqlens: int32 [N + 1]. num_tokens: T (static).
    Returns:
      seq_ids int32 [T] in [0, N) (padding rows get N - 1) and valid bool [T].
    """
    seq_ids, _ = sequence_rows(cu_seqlens, num_tokens)
    return seq_ids, jnp.arange(num_tokens, dtype=jnp.int32) < cu_seqlens[-1]
