"""Paged per-token caches addressed by a block table (the MLA latent and DSA key caches).

A cache is ``[num_blocks, block_size, ...]``. Token position p of sequence n lives in
physical block ``block_table[n, p // block_size]`` at row ``p % block_size``; a negative
block id means "no block". Writes to a missing block or past the table are dropped and reads
of a missing block return zeros, so padding and inactive rows never touch real blocks.

Under decode context parallelism (DESIGN section 5) the MLA latent cache of a block id is
spread over the dcp ranks by `DCPLayout`: each rank pages its own tokens, in its own order,
with blocks of ``block_size / dcp`` rows, so the functions above run unchanged on a rank's
shard once positions are mapped to local ones.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

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


@dataclasses.dataclass(frozen=True)
class DCPLayout:
    """Which dcp rank holds a token of the MLA latent cache, and where.

    Token t lives on rank ``(t // I) % dcp`` at local position
    ``(t // (I * dcp)) * I + t % I`` (I = `interleave`). When I divides a rank's block of
    P rows, a block id holds the same P * dcp consecutive tokens on every rank as one
    P * dcp block does on one device, so block tables, the allocator and copy-on-write
    are unchanged. Works on Python ints and int arrays alike.
    """

    dcp: int = 1
    interleave: int = 1

    def __post_init__(self):
        if self.dcp < 1 or self.interleave < 1:
            raise ValueError(f"dcp and interleave must be >= 1, got dcp={self.dcp}, "
                             f"interleave={self.interleave}")

    def check_block(self, block_size: int) -> int:
        """A rank's rows per block for global blocks of `block_size` tokens; ValueError
        unless dcp * interleave divides `block_size`."""
        if block_size % (self.dcp * self.interleave):
            raise ValueError(f"kv block of {block_size} tokens does not split into dcp="
                             f"{self.dcp} ranks of whole interleave={self.interleave} runs")
        return block_size // self.dcp

    def owner(self, t):
        return (t // self.interleave) % self.dcp

    def local_position(self, t):
        i = self.interleave
        return (t // (i * self.dcp)) * i + t % i

    def global_position(self, local, rank):
        """Inverse of (`owner`, `local_position`)."""
        i = self.interleave
        return ((local // i) * self.dcp + rank) * i + local % i

    def block_rows(self, block_size: int) -> jax.Array:
        """int32 [block_size]: the row of a global [..., block_size, ...] block array sharded
        over dcp (rank r holds rows r * P ... r * P + P - 1) that holds token offset u of
        the block. A fixed permutation: the same for every block."""
        rows_per_rank = self.check_block(block_size)
        u = jnp.arange(block_size, dtype=jnp.int32)
        return self.owner(u) * rows_per_rank + self.local_position(u)


def write_paged_local(pages: jax.Array, block_table: jax.Array, seq_ids: jax.Array,
                      positions: jax.Array, values: jax.Array, valid: jax.Array, *,
                      layout: DCPLayout, rank: jax.Array) -> jax.Array:
    """`write_paged` on dcp rank `rank`'s shard ([B, P, ...]): only the tokens the layout
    gives this rank, each at its local position."""
    mine = valid & (positions >= 0) & (layout.owner(positions) == rank)
    return write_paged(pages, block_table, seq_ids, layout.local_position(positions), values,
                       mine)


def gather_paged(pages: jax.Array, block_table: jax.Array, *, layout: DCPLayout,
                 axis_name: str) -> jax.Array:
    """Inside a shard_map over `axis_name` (the dcp ranks): every rank's shard of every
    sequence, all-gathered and put back in position order: [N, M * P * dcp, ...]."""
    local = read_paged(pages, block_table)  # [N, M * P, ...], local order
    every = lax.all_gather(local, axis_name)  # [dcp, N, M * P, ...]
    t = jnp.arange(local.shape[1] * layout.dcp, dtype=jnp.int32)
    return jnp.moveaxis(every[layout.owner(t), :, layout.local_position(t)], 0, 1)
