"""Every cache the model's jitted steps read and return (donated): per KDA layer a state
pool, per MLA layer a paged latent cache, each in layer order. Also the two jitted copies
the serving loop runs around a step: state slots (resume / retain a KDA state) and KV
blocks (copy-on-write of a partly shared block)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from glmjax.config import ModelConfig
from glmjax.layers.paged_cache import MLACache
from glmjax.state_pool import StatePool, copy_slots


class Caches(NamedTuple):
    """The model's caches. The MTP head's MLA cache is there only for speculative decoding
    (`glmjax.speculative`); it shares the model's block ids and block tables."""

    kda: tuple[StatePool, ...]  # one per KDA layer, in layer order
    mla: tuple[MLACache, ...]  # one per MLA layer, in layer order
    mtp: tuple[MLACache, ...] = ()  # the drafting MTP layer's cache, or none

    @classmethod
    def init(cls, config: ModelConfig, num_state_slots: int, num_kv_blocks: int, *,
             mtp: bool = False) -> Caches:
        """Zeroed caches: `num_state_slots` KDA slots per layer, `num_kv_blocks` MLA blocks of
        `config.kv_block_size` tokens per layer (and for the first MTP layer with `mtp`)."""
        kinds = config.layer_types
        return cls(
            tuple(StatePool.zeros(config, num_state_slots) for kind in kinds if kind == "kda"),
            tuple(MLACache.zeros(config, num_kv_blocks) for kind in kinds if kind == "mla"),
            (MLACache.zeros(config, num_kv_blocks),) if mtp else ())

    @property
    def num_state_slots(self) -> int:
        return self.kda[0].num_slots if self.kda else 0


@functools.partial(jax.jit, donate_argnums=0)
def copy_state_slots(caches: Caches, sources: jax.Array, destinations: jax.Array
                     ) -> tuple[Caches, jax.Array]:
    """``glmjax.state_pool.copy_slots`` over every KDA pool (int32 [K] pairs, -1: none);
    returns the caches and the int32 [] `PoolStatus` (not OK: nothing copied)."""
    kda, status = copy_slots(caches.kda, sources, destinations)
    return caches._replace(kda=kda), status


@functools.partial(jax.jit, donate_argnums=0)
def copy_kv_blocks(caches: Caches, sources: jax.Array, destinations: jax.Array) -> Caches:
    """Copy MLA block ``sources[i]`` into ``destinations[i]`` in every MLA layer, latents and
    DSA index keys alike (int32 [K] pairs). A pair whose destination is outside
    [0, num_blocks) (-1: padding) is skipped; a source outside it copies zeros. All reads
    happen before any write."""

    def copy(pages: jax.Array) -> jax.Array:
        num_blocks = pages.shape[0]
        src = jnp.where((sources >= 0) & (sources < num_blocks), sources, num_blocks)
        dst = jnp.where((destinations >= 0) & (destinations < num_blocks), destinations,
                        num_blocks)
        return pages.at[dst].set(pages.at[src].get(mode="fill", fill_value=0), mode="drop")

    def copy_cache(c: MLACache) -> MLACache:
        return MLACache(copy(c.latent), None if c.index_keys is None else copy(c.index_keys))

    return Caches(caches.kda, tuple(map(copy_cache, caches.mla)),
                  tuple(map(copy_cache, caches.mtp)))
