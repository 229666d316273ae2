"""An MLA layer's paged latent cache seen from the layer: the cached prefix it reads before
a prefill and the new latents (and DSA index keys) it writes, on one device or split by
token over the dcp ranks of a mesh (`glmjax.layers.mla` holds the layer)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from glmjax.layers.packing import sequence_ids
from glmjax.layers.paged_cache import (
    MLACache,
    gather_paged,
    read_paged,
    write_paged,
    write_paged_local,
)
from glmjax.layers.prefill_keys import CachedPrefix

if TYPE_CHECKING:
    from glmjax.sharding import ShardingPlan


class NewLatents(NamedTuple):
    """What an MLA prefill writes to its cache: the new tokens' rows."""

    latent: jax.Array  # [T, kv_lora + qk_rope]
    index_keys: jax.Array | None  # [T, dsa_head_dim] (DSA only)


def read_prefix(cache: MLACache, block_table: jax.Array, plan: ShardingPlan | None
                ) -> CachedPrefix:
    """Every sequence's cached blocks in position order (valid or not), [N, M * P, ...];
    on a mesh the latents are all-gathered over dcp (replicated result)."""
    if plan is None:
        latent = read_paged(cache.latent, block_table)  # [N, M * P, L]
    else:
        gather = functools.partial(gather_paged, layout=plan.layout, axis_name=plan.dcp_axis)
        # check_vma off: lax.all_gather types its result as varying, though every rank
        # ends with the same whole prefix.
        latent = jax.shard_map(
            gather, mesh=plan.mesh,
            in_specs=(plan.specs.mla_latent, plan.specs.replicated),
            out_specs=plan.specs.replicated, check_vma=False,
        )(cache.latent, block_table)
    index = (None if cache.index_keys is None
             else read_paged(cache.index_keys, block_table))
    return CachedPrefix(latent, index)


def write_prefill(cache: MLACache, block_table: jax.Array, cu_seqlens: jax.Array,
                  prefix_lens: jax.Array | None, new: NewLatents, plan: ShardingPlan | None
                  ) -> MLACache:
    """A prefill's new latents (`MLA.attend`) into the cache: span n's token i at position
    prefix_lens[n] + i (prefix_lens None: 0) of its blocks block_table[n] (int32 [N, M])."""
    tokens = new.latent.shape[0]
    if prefix_lens is None:
        prefix_lens = jnp.zeros((cu_seqlens.shape[0] - 1,), jnp.int32)
    seq, valid = sequence_ids(cu_seqlens, tokens)
    pos = prefix_lens[seq] + jnp.arange(tokens, dtype=jnp.int32) - cu_seqlens[seq]
    return write_latents(cache, block_table, seq, pos, valid, new, plan)


def write_latents(cache, block_table, seq, pos, valid, new: NewLatents, plan) -> MLACache:
    """New latents (and index keys) into the cache; on a mesh each dcp rank writes the
    latents it owns into its shard, and the replicated index keys go everywhere."""
    index = (None if new.index_keys is None
             else write_paged(cache.index_keys, block_table, seq, pos, new.index_keys, valid))
    if plan is None:
        return MLACache(write_paged(cache.latent, block_table, seq, pos, new.latent, valid),
                        index)

    def on_rank(pages, block_table, seq, pos, latent, valid):
        return write_paged_local(pages, block_table, seq, pos, latent, valid,
                                 layout=plan.layout, rank=lax.axis_index(plan.dcp_axis))

    specs = plan.specs
    pages = jax.shard_map(
        on_rank, mesh=plan.mesh,
        in_specs=(specs.mla_latent, *[specs.replicated] * 5), out_specs=specs.mla_latent,
    )(cache.latent, block_table, seq, pos, new.latent, valid)
    return MLACache(pages, index)
