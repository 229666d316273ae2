"""Paged per-token caches addressed by a block table (the MLA latent and DSA key caches).

A cache is ``[num_blocks, block_size, ...]``. Token position p of sequence n lives in
physical block ``block_table[n, p // block_size]`` at row ``p % block_size``; a negative
block id means "no block". Writes to a missing block or past the table are dropped and reads
of a missing block return zeros, so padding and inactive rows never touch real blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glmjax.config import ModelConfig


class MLACache(NamedTuple):
    """One MLA layer's paged caches."""

    latent: jax.Array  # [num_blocks, block_size, kv_lora + qk_rope]: rms-normed c_kv | k_pe
    index_keys: jax.Array | None = None  # [num_blocks, block_size, dsa_head_dim] (DSA only)

    @classmethod
    def zeros(cls, config: ModelConfig, num_blocks: int) -> MLACache:
        """An empty cache of `num_blocks` blocks in the config's activation dtype."""
        shape = (num_blocks, config.kv_block_size)
        latent = jnp.zeros((*shape, config.kv_lora_rank + config.qk_rope_head_dim), config.dtype)
        if config.dsa_top_k is None:
            return cls(latent)
        return cls(latent, jnp.zeros((*shape, config.dsa_head_dim), config.dtype))


def write_paged(pages: jax.Array, block_table: jax.Array, seq_ids: jax.Array,
                positions: jax.Array, values: jax.Array, valid: jax.Array) -> jax.Array:
    """Store ``values[i]`` at position ``positions[i]`` of sequence ``seq_ids[i]``.

    Args:
      pages: [B, P, ...]. block_table: int32 [N, M]. seq_ids, positions: int32 [T].
      values: [T, ...]. valid: bool [T]; rows that are False are not written.
    """
    num_blocks, block_size = pages.shape[:2]
    slot = positions // block_size
    in_table = valid & (positions >= 0) & (slot < block_table.shape[1])
    block = block_table[seq_ids, jnp.clip(slot, 0, block_table.shape[1] - 1)]
    # An index of num_blocks is out of range, so mode="drop" skips the row; a negative one
    # would wrap around to a real block, hence the explicit remap.
    block = jnp.where(in_table & (block >= 0), block, num_blocks)
    return pages.at[block, positions % block_size].set(values.astype(pages.dtype), mode="drop")


def read_paged(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """Every block of every sequence, in position order: [N, M * P, ...] (zeros if missing)."""
    num_blocks, block_size = pages.shape[:2]
    blocks = jnp.where(block_table >= 0, block_table, num_blocks)
    gathered = pages.at[blocks].get(mode="fill", fill_value=0)  # [N, M, P, ...]
    return gathered.reshape(block_table.shape[0], -1, *pages.shape[2:])
