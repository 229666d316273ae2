"""The MTP (multi-token prediction) head, DeepSeek-V3 form, used to draft tokens.

For position t, with h_t the main model's final hidden state and e_{t+1} the embedding of the
token after t:

    h' = block(eh_proj([enorm(e_{t+1}) | hnorm(h_t)]))       # one MLA + MoE decoder block
    logits = lm_head(shared_head_norm(h'))                    # the main model's head

so the logits predict token t + 2. The embedding and head are the main model's, passed in.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers.block import DecoderBlock
from glmjax.layers.mhc import collapse_streams, expand_streams
from glmjax.layers.norms import RMSNorm
from glmjax.layers.packing import PackedBatch
from glmjax.layers.paged_cache import MLACache
from glmjax.layers.projection import projection


class MTP(nnx.Module):
    """One MTP layer with its own MLA cache."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        def norm():
            return RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                           param_dtype=config.param_dtype)

        self.num_streams = config.mhc_streams
        self.enorm, self.hnorm = norm(), norm()
        self.eh_proj = projection(config, 2 * config.hidden_size, config.hidden_size, rngs=rngs)
        self.block = DecoderBlock(config, "mla", dense_mlp=False, rngs=rngs)
        self.shared_head_norm = norm()

    def __call__(self, hidden: jax.Array, next_tokens: jax.Array,
                 embed: Callable[[jax.Array], jax.Array],
                 lm_head: Callable[[jax.Array], jax.Array], batch: PackedBatch,
                 cache: MLACache | None, *, decode: bool = False
                 ) -> tuple[jax.Array, jax.Array, MLACache | None]:
        """Args:
          hidden: [T, D], the main model's final hidden states.
          next_tokens: int32 [T], the token after each position.
          embed, lm_head: the main model's embedding and output head.
          batch, cache, decode: as for `DecoderBlock`.
        Returns:
          logits fp32 [T, vocab], the block's output hidden [T, D] (the next MTP step's
          input), and the updated cache.
        """
        h, cache = self.block_hidden(hidden, next_tokens, embed, batch, cache, decode=decode)
        return self.head(h, lm_head), h, cache

    def block_hidden(self, hidden: jax.Array, next_tokens: jax.Array,
                     embed: Callable[[jax.Array], jax.Array], batch: PackedBatch,
                     cache: MLACache | None, *, decode: bool = False
                     ) -> tuple[jax.Array, MLACache | None]:
        """The block's output hidden [T, D] and the cache, without the head (filling the
        cache over a prefill needs no [T, vocab] logits)."""
        with jax.named_scope("mtp"):
            e = self.enorm(embed(next_tokens).astype(hidden.dtype))
            h = self.eh_proj(jnp.concatenate([e, self.hnorm(hidden)], axis=-1))
            if self.num_streams is not None:
                h = expand_streams(h, self.num_streams)
            h, cache, _ = self.block(h, batch, cache, decode=decode)
            if self.num_streams is not None:
                h = collapse_streams(h)
            return h, cache

    def head(self, h: jax.Array, lm_head: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """[T, D] block output -> fp32 [T, vocab] logits of the token two ahead."""
        with jax.named_scope("mtp_head"):
            return lm_head(self.shared_head_norm(h)).astype(jnp.float32)
