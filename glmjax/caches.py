"""Every cache the model's jitted steps read and return (donated): per KDA layer a state
pool, per MLA layer a paged latent cache, each in layer order."""

from __future__ import annotations

from typing import NamedTuple

from glmjax.config import ModelConfig
from glmjax.layers.paged_cache import MLACache
from glmjax.state_pool import StatePool


class Caches(NamedTuple):
    """The model's caches. The MTP head's own MLA cache is not here: the steps do not run it."""

    kda: tuple[StatePool, ...]  # one per KDA layer, in layer order
    mla: tuple[MLACache, ...]  # one per MLA layer, in layer order

    @classmethod
    def init(cls, config: ModelConfig, num_state_slots: int, num_kv_blocks: int) -> Caches:
        """Zeroed caches: `num_state_slots` KDA slots per layer, `num_kv_blocks` MLA blocks of
        `config.kv_block_size` tokens per layer."""
        kinds = config.layer_types
        return cls(
            tuple(StatePool.zeros(config, num_state_slots) for kind in kinds if kind == "kda"),
            tuple(MLACache.zeros(config, num_kv_blocks) for kind in kinds if kind == "mla"))

    @property
    def num_state_slots(self) -> int:
        return self.kda[0].num_slots if self.kda else 0
