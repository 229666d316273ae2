"""The decoder block: a pre-norm mixer (KDA or MLA) and a pre-norm MLP / MoE, each inside a
residual (plain, or mHC streams when the config has them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
from flax import nnx

from glmjax.config import LayerType, ModelConfig
from glmjax.layers.kda import KDA, KDAState
from glmjax.layers.mhc import HyperConnection
from glmjax.layers.mla import MLA
from glmjax.layers.mla_cache import NewLatents
from glmjax.layers.moe import MLP, MoE
from glmjax.layers.norms import RMSNorm
from glmjax.layers.packing import PackedBatch
from glmjax.layers.paged_cache import MLACache
from glmjax.layers.prefill_keys import CachedPrefix

if TYPE_CHECKING:
    from glmjax.sharding import ShardingPlan

# A KDA layer's states; an MLA layer's cache, or (in the layer scan) its cached prefix,
# returned as the new tokens' latents (`glmjax.layers.mla_cache.NewLatents`).
LayerCache = KDAState | MLACache | CachedPrefix | NewLatents | None


class PlainResidual(nnx.Module):
    """``x + y``: the residual without mHC, with the `HyperConnection` interface."""

    def read(self, x: jax.Array) -> tuple[jax.Array, None]:
        return x, None

    def write(self, x: jax.Array, y: jax.Array, mixing: None) -> jax.Array:
        return x + y


def _residual(config: ModelConfig, rngs: nnx.Rngs) -> PlainResidual | HyperConnection:
    if config.mhc_streams is None:
        return PlainResidual()
    return HyperConnection(config.hidden_size, config.mhc_streams,
                           sinkhorn_iters=config.mhc_sinkhorn_iters, eps=config.rms_norm_eps,
                           rngs=rngs)


class DecoderBlock(nnx.Module):
    """One layer. The residual is [T, D], or [T, n, D] streams under mHC."""

    def __init__(self, config: ModelConfig, mixer: LayerType, *, dense_mlp: bool,
                 rngs: nnx.Rngs):
        def norm():
            return RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                           param_dtype=config.param_dtype)

        self.input_layernorm = norm()
        self.mixer = KDA(config, rngs=rngs) if mixer == "kda" else MLA(config, rngs=rngs)
        self.mixer_residual = _residual(config, rngs)
        self.post_attention_layernorm = norm()
        self.mlp = (MLP(config, config.intermediate_size, rngs=rngs) if dense_mlp
                    else MoE(config, rngs=rngs))
        self.mlp_residual = _residual(config, rngs)

    def __call__(self, residual: jax.Array, batch: PackedBatch, cache: LayerCache, *,
                 decode: bool = False, plan: ShardingPlan | None = None,
                 layer: jax.Array | int | None = None
                 ) -> tuple[jax.Array, LayerCache, KDAState | None]:
        """Returns the new residual, the mixer's new cache and (KDA) its snapshots.

        `cache` is a `KDAState` for KDA, an `MLACache` (or None: no cache) for MLA; in
        prefill also a `CachedPrefix`, which makes the MLA layer return its new tokens'
        latents instead of a cache (`MLA.attend`, for `glmjax.layer_scan`). With
        `decode`, every sequence has exactly one token, MLA attends in absorbed form, and
        KDA's `cache` is the layer's whole state pool, advanced in place at
        `batch.state_slots` (its snapshots are None).
        `plan`: the mesh the mixers and the routed experts run on (None: one device).
        `layer`: the entry of the MoE's stacked routed-expert weights this layer uses
        (`glmjax.layer_scan`); None: the weights are this layer's alone.
        """
        return self.with_mixer(
            residual, lambda x: self._mix(x, batch, cache, decode, plan), plan=plan,
            layer=layer)

    def with_mixer(self, residual: jax.Array, mix: Callable, *,
                   plan: ShardingPlan | None = None, layer: jax.Array | int | None = None):
        """The block with ``mix`` (the normed rows [T, D] -> y [T, D] and whatever else
        it returns) in the mixer's place: returns the new residual and mix's extras.
        (``glmjax.mixed`` runs prefill and decode rows through their own mixer paths.)
        `layer`: as `__call__`'s."""
        with jax.named_scope("decoder_block"):
            x, mixing = self.mixer_residual.read(residual)
            y, *extras = mix(self.input_layernorm(x))
            residual = self.mixer_residual.write(residual, y, mixing)
            x, mixing = self.mlp_residual.read(residual)
            x = self.post_attention_layernorm(x)
            y = self.mlp(x, plan=plan) if layer is None else self.mlp(x, plan=plan, layer=layer)
            return self.mlp_residual.write(residual, y, mixing), *extras

    def _mix(self, x, batch: PackedBatch, cache, decode, plan):
        if isinstance(self.mixer, KDA) and decode:
            y, pool = self.mixer.decode(x, cache, batch.state_slots, plan=plan)
            return y, pool, None
        if isinstance(self.mixer, KDA):
            out = self.mixer(x, batch.cu_seqlens, cache, batch.checkpoint_offsets, plan=plan)
            return out.y, out.state, out.snapshots
        if isinstance(cache, CachedPrefix):
            return (*self.mixer.attend(x, batch.cu_seqlens, cache, batch.prefix_lens, plan=plan),
                    None)
        if decode:
            y, cache = self.mixer.decode(x, cache, batch.block_table, batch.prefix_lens,
                                         plan=plan)
        else:
            y, cache = self.mixer(x, batch.cu_seqlens, cache, batch.block_table,
                                  batch.prefix_lens, plan=plan)
        return y, cache, None
