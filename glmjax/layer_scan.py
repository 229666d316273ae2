"""Repeated layer groups scanned, not unrolled: a deep model's prefill compiles one group.

Both presets repeat one group of ``full_attn_interval`` layers (3 KDA + 1 MLA). With
``config.scan_layers`` the longest run of whole groups after the dense-MLP layers
(`layer_plan`) keeps its parameters stacked per group position, a leading [G] axis on
every array (`HybridModel.layer_groups[j]` holds position j of every group), and prefill
runs the run as one `jax.lax.scan` whose body is one group (`scan_prefill`). The layers
before and after it (dense MLP layers, a tail that is not a whole group) stay unrolled in
`HybridModel.layers`. Decode runs the groups' layers one by one (`block_at`). The routed
experts' weights (most of the parameters) are never sliced per layer: the MoE addresses
one layer's experts inside the whole stack (`glmjax.layers.moe.MoE`, ``layer``).

The caches keep their per-layer layout (`glmjax.caches.Caches`): the scan carries the
residual only. Its inputs are each layer's small per-sequence KDA states and each MLA
layer's cached prefix (read before the scan, as an unrolled MLA layer reads it before it
writes); its outputs are the KDA states and snapshots and the MLA layers' new latents,
written into each layer's cache after the scan (`glmjax.layers.mla_cache.write_prefill`).

Checkpoints hold one tensor per layer: `stack_params` / `unstack_params` convert the
parameters of the unrolled model (``layers.{i}....``) to the scanned one's and back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers.block import DecoderBlock, LayerCache
from glmjax.layers.mla_cache import read_prefix, write_prefill
from glmjax.layers.packing import PackedBatch
from glmjax.layers.paged_cache import MLACache

if TYPE_CHECKING:
    from glmjax.sharding import ShardingPlan

GROUPS = "layer_groups"  # the HybridModel attribute holding the stacked group positions


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Layers [start, start + group_size * num_groups) run as `num_groups` scanned groups;
    the others are unrolled. num_groups 0: nothing is scanned."""

    num_layers: int
    start: int
    group_size: int
    num_groups: int

    @property
    def stop(self) -> int:
        return self.start + self.group_size * self.num_groups

    @property
    def unrolled(self) -> tuple[int, ...]:
        """The unrolled layers, in order: `HybridModel.layers[k]` is layer unrolled[k]."""
        return tuple(i for i in range(self.num_layers) if not self.start <= i < self.stop)

    def group_layers(self, position: int) -> tuple[int, ...]:
        """The layer at `position` of each group, in group order."""
        return tuple(self.start + g * self.group_size + position
                     for g in range(self.num_groups))


def layer_plan(config: ModelConfig) -> LayerPlan:
    """Which layers `config`'s model scans: the longest run of at least two whole groups
    of ``full_attn_interval`` layers with the same kinds, all with MoE (the earliest of
    equally long runs); none without ``config.scan_layers``."""
    kinds, size = config.layer_types, config.full_attn_interval
    best = LayerPlan(config.num_layers, 0, size, 0)
    if not config.scan_layers:
        return best
    for start in range(config.first_dense_layers, config.first_dense_layers + size):
        groups = 0
        while (start + (groups + 1) * size <= config.num_layers
               and kinds[start + groups * size:start + (groups + 1) * size]
               == kinds[start:start + size]):
            groups += 1
        if groups >= 2 and groups > best.num_groups:
            best = LayerPlan(config.num_layers, start, size, groups)
    return best


ROUTED_EXPERTS = ("w_gate", "w_up", "w_down")


def _routed_expert(path, _) -> bool:
    """nnx filter: the MoE's routed-expert weights, which stay stacked inside the scan
    (`glmjax.layers.moe.MoE` addresses one layer's experts in the stack by `layer`)."""
    return path[-1] in ROUTED_EXPERTS


def stack_blocks(blocks: Sequence[DecoderBlock]) -> DecoderBlock:
    """One block whose every array is the blocks' arrays stacked on a new leading axis."""
    graphdef, *_ = nnx.split(blocks[0])
    return nnx.merge(graphdef, _stack([nnx.split(block)[1] for block in blocks]))


def block_at(stacked: DecoderBlock, index: int) -> DecoderBlock:
    """Entry `index` of a stacked block, its routed experts' weights left stacked: call it
    with ``layer=index``."""
    graphdef, experts, rest = nnx.split(stacked, _routed_expert, ...)
    return nnx.merge(graphdef, experts, jax.tree.map(lambda a: a[index], rest))


def _stack(trees: Sequence[Any]) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def scan_prefill(groups: Sequence[DecoderBlock], x: jax.Array, batch: PackedBatch,
                 caches: Sequence[Sequence[LayerCache]], *, plan: ShardingPlan | None
                 ) -> tuple[jax.Array, list[list[tuple[LayerCache, Any]]]]:
    """Prefill through the scanned groups.

    Args:
      groups: `HybridModel.layer_groups`, one stacked block per group position.
      x: the residual entering the first group, [T, D] (or [T, n, D] under mHC).
      caches: caches[j][g], the cache of group g's layer at position j, as
        `DecoderBlock` takes it in prefill (KDA: initial states; MLA: its cache or None).
    Returns:
      the residual after the last group and, per position j and group g, what the layer's
      block returns after x: (its new cache, its KDA snapshots or None).
    """
    prefixes = []
    for column in caches:
        if isinstance(column[0], MLACache):
            column = [read_prefix(cache, batch.block_table, plan) for cache in column]
        prefixes.append(None if column[0] is None else _stack(column))
    graphdefs, experts, params = zip(*(nnx.split(block, _routed_expert, ...)
                                       for block in groups), strict=True)
    num_groups = len(caches[0])

    def group(x, per_group):
        index, params, inputs = per_group
        outputs = []
        for graphdef, whole, layer_params, cache in zip(graphdefs, experts, params, inputs,
                                                        strict=True):
            if plan is not None:
                x = plan.constrain(x, plan.specs.tokens)
            block = nnx.merge(graphdef, whole, layer_params)
            x, cache, snapshots = block(x, batch, cache, plan=plan, layer=index)
            outputs.append((cache, snapshots))
        return x, outputs

    x, stacked = jax.lax.scan(group, x, (jnp.arange(num_groups, dtype=jnp.int32), params,
                                         prefixes))
    results = []
    for column, (outs, snapshots) in zip(caches, stacked, strict=True):
        per_layer = []
        for g, cache in enumerate(column):
            out = jax.tree.map(lambda a, g=g: a[g], outs)
            if isinstance(cache, MLACache):
                out = write_prefill(cache, batch.block_table, batch.cu_seqlens,
                                    batch.prefix_lens, out, plan)
            per_layer.append((out, jax.tree.map(lambda a, g=g: a[g], snapshots)))
        results.append(per_layer)
    return x, results


StackFn = Callable[[str, Sequence[Any]], Any]  # (dotted scanned path, per-layer leaves)


def _stack_leaves(path: str, trees: Sequence[Any], stack: StackFn) -> Any:
    if isinstance(trees[0], dict):
        return {key: _stack_leaves(f"{path}.{key}", [tree[key] for tree in trees], stack)
                for key in trees[0]}
    return stack(path, trees)


def stack_params(unrolled: dict, config: ModelConfig, stack: StackFn | None = None) -> dict:
    """The parameters of the unrolled model (``nnx.to_pure_dict``: ``layers`` keyed 0 ..
    num_layers - 1) as those of `config`'s scanned model: the unrolled layers renumbered,
    each group position's layers stacked by ``stack(dotted path, leaves)`` (default
    ``jnp.stack``). Leaves are stacked one at a time, so a `stack` that frees its inputs
    holds at most one stacked leaf more than the model."""
    stack = stack or (lambda _, leaves: jnp.stack(leaves))
    plan = layer_plan(config)
    if not plan.num_groups:
        return unrolled
    layers = unrolled["layers"]
    out = {key: value for key, value in unrolled.items() if key != "layers"}
    out["layers"] = {k: layers[i] for k, i in enumerate(plan.unrolled)}
    out[GROUPS] = {j: _stack_leaves(f"{GROUPS}.{j}",
                                    [layers[i] for i in plan.group_layers(j)], stack)
                   for j in range(plan.group_size)}
    return out


def unstack_params(scanned: dict, config: ModelConfig) -> dict:
    """The inverse of `stack_params`: one entry per layer under ``layers``."""
    plan = layer_plan(config)
    if not plan.num_groups:
        return scanned
    unrolled = scanned["layers"]
    layers = {i: unrolled[k] for k, i in enumerate(plan.unrolled)}
    for j, stacked in scanned[GROUPS].items():
        for g, i in enumerate(plan.group_layers(j)):
            layers[i] = jax.tree.map(lambda a, g=g: a[g], stacked)
    out = {key: value for key, value in scanned.items() if key != GROUPS}
    out["layers"] = {i: layers[i] for i in range(config.num_layers)}
    return out
