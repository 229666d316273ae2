"""The ops of a decode / verify step as `bench.batch_invariance` runs them: each built at a
preset's shapes with fresh random inputs for `max_rows` rows, and called through the same
module or function the model calls, so each picks its implementation as the model does
(the weight stream, the Pallas kernels on one GPU; XLA and the references on a CPU).

An `Op` runs any subset of its rows as one batch: `inputs(indices)` gives the batch whose
row j is row indices[j] (its activations, its state slot, its cache blocks and context),
and row j's output depends on nothing but row indices[j]'s inputs, so the batch of rows
0..R-1 and the batch of row i alone must agree on row i wherever the op is batch-invariant.
Shared operands (the weights, the state pools, the paged caches) are the same for every
batch; each op draws its own inputs from `seed` and its own modules' weights. This module
holds the contract and the KDA and MoE ops; `bench.batch_invariance_step_ops` the rest and
`OPS`, every op by name.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers.kda import KDA, KDAState
from glmjax.layers.mla import MLA
from glmjax.layers.moe import MLP, MoE
from glmjax.layers.projection import on_one_gpu, project_together
from glmjax.xla_options import STEP_OPTIONS
from pallas_kernels.moe_experts import PER_ROW_COPIES
from pallas_kernels.tuning import device_spec, use_fused_decode


class Op(NamedTuple):
    """One op, ready to run on any subset of its `max_rows` rows."""

    program: Callable  # jitted (params, *inputs) -> {part: array [rows, ...]}
    params: Any  # the op's first argument: its modules' state (or None)
    inputs: Callable[[np.ndarray], tuple]  # int32 row indices -> the batch's inputs
    notes: Callable[[int], dict]  # rows -> what the op picks at that batch size


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the ops are built at: the preset, the rows, the MLA context, the small model."""

    config: ModelConfig  # the preset, its kv_block_size set to the run's block size
    max_rows: int
    context: int  # the MLA rows' context lengths are drawn in [context / 2, context)
    num_layers: int  # the decode_step op's model
    num_experts: int | None
    seed: int


def module_op(module: nnx.Module, call: Callable, inputs, notes=lambda rows: {}) -> Op:
    """An Op calling `call(module, *inputs)` in a jitted program taking the module's state
    as an argument (as the model's steps take theirs: no weight baked in as a constant)."""
    graphdef, state = nnx.split(module)

    def run(state, *args):
        return call(nnx.merge(graphdef, state), *args)

    return Op(jax.jit(run, compiler_options=STEP_OPTIONS), state, inputs, notes)


def rows_of(*batched):
    """inputs(indices) taking rows `indices` of each [max_rows, ...] array."""
    return lambda indices: tuple(a[jnp.asarray(indices)] for a in batched)


def normal(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def keys(seed: int, name: str, count: int) -> list[jax.Array]:
    """`count` keys of op `name`: each op draws its own inputs."""
    return list(jax.random.split(jax.random.fold_in(jax.random.key(seed), sum(map(ord, name))),
                                 count))


@functools.cache
def kda_layer(config: ModelConfig, seed: int) -> KDA:
    return KDA(config, rngs=nnx.Rngs(seed))


@functools.cache
def moe_layer(config: ModelConfig, seed: int) -> MoE:
    return MoE(config, rngs=nnx.Rngs(seed + 1))


@functools.cache
def mla_layer(config: ModelConfig, seed: int) -> MLA:
    return MLA(config, rngs=nnx.Rngs(seed + 2))


def kda_pools(config: ModelConfig, rows: int, key) -> KDAState:
    """A KDA layer's pool of `rows` slots, random states (slot i: row i's)."""
    heads, dim = config.kda_num_heads, config.kda_head_dim
    k1, k2 = jax.random.split(key)
    return KDAState(normal(k1, (rows, heads, dim, dim), jnp.float32, 0.05),
                    normal(k2, (rows, config.conv_channels, config.conv_kernel - 1),
                           config.dtype))


def kda_notes(layer: KDA):
    return lambda rows: {"stream": layer.q_proj.streams(rows), "backend": layer.backend,
                         "fused_decode": use_fused_decode(device_spec(), num_rows=rows,
                                                          num_heads=layer.num_heads)}


def kda_in(s: Shapes) -> Op:
    """`KDA.project`: the six input projections in one `project_together` launch."""
    c, layer = s.config, kda_layer(s.config, s.seed)
    (k,) = keys(s.seed, "kda_in", 1)
    x = normal(k, (s.max_rows, c.hidden_size), c.dtype)
    def project(m, x):
        (q, k, v), f_a, g_a, beta = m.project(x)
        return dict(q=q, k=k, v=v, f_a=f_a, g_a=g_a, beta=beta)

    return module_op(layer, project, rows_of(x), kda_notes(layer))


def kda_o_proj(s: Shapes) -> Op:
    """The KDA output projection [H K] -> [D]."""
    c, layer = s.config, kda_layer(s.config, s.seed)
    (k,) = keys(s.seed, "kda_o_proj", 1)
    x = normal(k, (s.max_rows, c.kda_num_heads * c.kda_head_dim), c.dtype)
    return module_op(layer, lambda m, x: {"y": m.o_proj(x)}, rows_of(x),
                     lambda rows: {"stream": layer.o_proj.streams(rows)})


def kda_step_inputs(s: Shapes, name: str, x_width: int | None):
    """inputs(indices) of a KDA decode op: the batched activations (x [R, x_width] when
    given, else qkv, f_a, g_a, beta), then the pools and the rows' slots."""
    c = s.config
    hk, ks = c.kda_num_heads * c.kda_head_dim, keys(s.seed, name, 6)
    pools = kda_pools(c, s.max_rows, ks[0])
    if x_width:
        batched = (normal(ks[1], (s.max_rows, x_width), c.dtype),)
    else:
        batched = (normal(ks[1], (s.max_rows, 3 * hk), c.dtype),
                   normal(ks[2], (s.max_rows, c.kda_head_dim), c.dtype),
                   normal(ks[3], (s.max_rows, c.kda_head_dim), c.dtype),
                   jax.nn.sigmoid(normal(ks[4], (s.max_rows, c.kda_num_heads), jnp.float32)))
    return lambda indices: (*rows_of(*batched)(indices), pools,
                            jnp.asarray(indices, jnp.int32))


def with_slots(out: dict, pool: KDAState, slots) -> dict:
    """`out` and each row's slot of the updated pool."""
    return out | {"recurrent": pool.recurrent[slots], "conv": pool.conv[slots]}


def kda_fused_step(s: Shapes) -> Op:
    """`kda_decode_fused` as `KDA.decode` calls it on one device (every row count, also
    where the model takes the per-op path: `fused_decode` in the notes)."""
    layer = kda_layer(s.config, s.seed)

    def call(m, qkv, f_a, g_a, beta, pool, slots):
        inputs = jnp.concatenate([qkv, f_a, g_a], axis=-1)
        out, pool = m._fused_step(inputs, slice(None), pool, slots, beta=beta)
        return with_slots({"out": out}, pool, slots)

    return module_op(layer, call, kda_step_inputs(s, "kda_fused_step", None), kda_notes(layer))


def kda_decode_layer(s: Shapes) -> Op:
    """`KDA.decode`: the whole layer, one token per row, its pool advanced."""
    layer = kda_layer(s.config, s.seed)

    def call(m, x, pool, slots):
        y, pool = m.decode(x, pool, slots)
        return with_slots({"y": y}, pool, slots)

    return module_op(layer, call, kda_step_inputs(s, "kda_layer", s.config.hidden_size),
                     kda_notes(layer))


def moe_in(s: Shapes) -> Op:
    """The MoE layer's shared gate and up with the fp32-out router, as `MoE.__call__`
    runs them (one `project_together`)."""
    c, moe = s.config, moe_layer(s.config, s.seed)
    (k,) = keys(s.seed, "moe_in", 1)
    x = normal(k, (s.max_rows, c.hidden_size), c.dtype)

    def call(m, x):
        shared = m.shared_experts
        gate, up, logits = project_together(x, (shared.gate_proj, shared.up_proj, m.router))
        return {"shared_gate": gate, "shared_up": up, "router_logits": logits}

    return module_op(moe, call, rows_of(x), lambda rows: {
        "stream": moe.shared_experts.gate_proj.streams(rows),
        "router_stream": moe.router.streams(rows)})


def router(s: Shapes) -> Op:
    """`MoE.route`: top-k of the sigmoid scores and the combine weights."""
    c, moe = s.config, moe_layer(s.config, s.seed)
    (k,) = keys(s.seed, "router", 1)
    logits = normal(k, (s.max_rows, c.num_experts), jnp.float32, 2.0)
    return module_op(moe, lambda m, z: dict(zip(("weights", "experts"), m.route(z))),
                     rows_of(logits), lambda rows: {"pallas": on_one_gpu()})


def routed_experts(s: Shapes) -> Op:
    """The routed experts (`MoE._routed`, one device), each row's own expert choice."""
    c, moe = s.config, moe_layer(s.config, s.seed)
    k1, k2, k3 = keys(s.seed, "routed_experts", 3)
    x = normal(k1, (s.max_rows, c.hidden_size), c.dtype)
    order = jnp.argsort(jax.random.uniform(k2, (s.max_rows, c.num_experts)), axis=-1)
    experts = order[:, :c.num_experts_per_token].astype(jnp.int32)
    weights = jax.nn.softmax(normal(k3, experts.shape, jnp.float32), axis=-1)
    per_row = lambda rows: {  # noqa: E731
        "backend": moe.backend,
        "per_row_schedule": rows * c.num_experts_per_token <= PER_ROW_COPIES}
    return module_op(moe, lambda m, x, w, e: {"y": m._routed(x, w, e, None, None)},
                     rows_of(x, weights, experts), per_row)


def moe_whole(s: Shapes) -> Op:
    """`MoE.__call__`: projections, routing, routed and shared experts."""
    c, moe = s.config, moe_layer(s.config, s.seed)
    (k,) = keys(s.seed, "moe_layer", 1)
    x = normal(k, (s.max_rows, c.hidden_size), c.dtype)
    return module_op(moe, lambda m, x: {"y": m(x)}, rows_of(x), lambda rows: {
        "backend": moe.backend,
        "per_row_schedule": rows * c.num_experts_per_token <= PER_ROW_COPIES})


def shared_down(s: Shapes) -> Op:
    """The shared experts' down projection of swiglu(gate, up)."""
    c, moe = s.config, moe_layer(s.config, s.seed)
    k1, k2 = keys(s.seed, "shared_down", 2)
    width = c.moe_intermediate_size * c.num_shared_experts
    gate, up = (normal(k, (s.max_rows, width), c.dtype) for k in (k1, k2))
    return module_op(moe, lambda m, g, u: {"y": m.shared_experts.down(g, u)}, rows_of(gate, up),
                     lambda rows: {"stream": moe.shared_experts.down_proj.streams(rows)})


def dense_mlp(s: Shapes) -> Op:
    """The dense SwiGLU MLP of the first layers (`config.intermediate_size`)."""
    c = s.config
    if not c.first_dense_layers:
        raise ValueError(f"{c.name} has no dense MLP layer")
    mlp = MLP(c, c.intermediate_size, limit=c.swiglu_limit, rngs=nnx.Rngs(s.seed + 3))
    (k,) = keys(s.seed, "dense_mlp", 1)
    x = normal(k, (s.max_rows, c.hidden_size), c.dtype)
    return module_op(mlp, lambda m, x: {"y": m(x)}, rows_of(x), lambda rows: {
        "stream": mlp.gate_proj.streams(rows), "down_stream": mlp.down_proj.streams(rows)})
