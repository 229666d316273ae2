"""Feed-forward layers: the dense SwiGLU MLP and the sigmoid-routed MoE (DeepSeek-V3 style).

Routing of token x over E experts, top-k:

    s = sigmoid(x W_router)                      # fp32 [E]
    chosen = top_k(s + correction_bias)          # the bias steers selection only
    w = routed_scaling_factor * s[chosen] / sum(s[chosen])
    y = sum_{e in chosen} w_e * expert_e(x) + shared_expert(x)

Grouped top-k is not implemented: both real presets use one expert group. Routed experts run
as grouped GEMMs over the token copies sorted by expert (`pallas_kernels.moe_experts`), on
the implementation `config.moe_backend` names or the device's default.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers.projection import on_one_gpu, project_together, projection
from pallas_kernels.gmm import default_implementation
from pallas_kernels.moe_experts import routed_experts, swiglu
from pallas_kernels.moe_routing import route_top_k

if TYPE_CHECKING:
    from glmjax.sharding import ShardingPlan

__all__ = ["MLP", "MoE", "swiglu"]


class MLP(nnx.Module):
    """SwiGLU MLP ``down(swiglu(gate(x), up(x)))``; x [T, D] -> [T, D]."""

    def __init__(self, config: ModelConfig, intermediate_size: int, *,
                 limit: float | None = None, rngs: nnx.Rngs):
        linear = functools.partial(projection, config, rngs=rngs)
        self.limit = limit
        self.gate_proj = linear(config.hidden_size, intermediate_size)
        self.up_proj = linear(config.hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, config.hidden_size)

    def __call__(self, x: jax.Array, *, plan: ShardingPlan | None = None) -> jax.Array:
        """x [T, D] -> [T, D]; XLA partitions the projections on a mesh (`plan` unused)."""
        del plan
        with jax.named_scope("mlp"):
            return self.down(*project_together(x, (self.gate_proj, self.up_proj)))

    def down(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """The down projection of swiglu(gate, up) (gate and up already projected)."""
        return self.down_proj(swiglu(gate, up, self.limit))


class MoE(nnx.Module):
    """Routed experts plus shared experts; the swiglu limit applies to both."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        hidden, inter, experts = (config.hidden_size, config.moe_intermediate_size,
                                  config.num_experts)
        self.num_experts, self.top_k = experts, config.num_experts_per_token
        self.scaling = config.routed_scaling_factor
        self.limit = config.swiglu_limit
        self.backend = config.moe_backend or default_implementation()
        # fp32 logits: bf16 x bf16 products are exact in fp32, accumulated in fp32.
        self.router = projection(config, hidden, experts, rngs=rngs, out_dtype=jnp.float32)
        self.e_score_correction_bias = nnx.Param(jnp.zeros((experts,), jnp.float32))
        init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                    in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.w_gate = nnx.Param(init(rngs.params(), (experts, hidden, inter), config.param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (experts, hidden, inter), config.param_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (experts, inter, hidden), config.param_dtype))
        self.shared_experts = MLP(config, inter * config.num_shared_experts,
                                  limit=config.swiglu_limit, rngs=rngs)

    def route(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Router logits fp32 [T, E], or the weight stream's partial sums of them [S, T, E]
        -> combine weights fp32 [T, k] and expert ids int32 [T, k]
        (`pallas_kernels.moe_routing`: the Pallas kernel on one GPU, for decode rows and
        prefill alike, where XLA sorts every row; XLA's top-k on a mesh or a CPU)."""
        implementation = "pallas" if on_one_gpu() else "xla"
        return route_top_k(logits, self.e_score_correction_bias[...], top_k=self.top_k,
                           scaling=self.scaling, implementation=implementation,
                           partial_sums=logits.ndim == 3)

    def __call__(self, x: jax.Array, *, plan: ShardingPlan | None = None,
                 layer: jax.Array | int | None = None) -> jax.Array:
        """x [T, D] -> [T, D]. On a mesh (`plan`) a Pallas or tokamax grouped GEMM runs per
        device on its slice of the intermediate (shard_map; XLA cannot partition a custom
        kernel and would gather every expert's weights), ragged_dot is left to XLA.

        `layer`: when the routed experts' weights are stacked over G layers ([G, E, D, I],
        as `glmjax.layer_scan` leaves them), the entry (int32 [] or int) this layer uses;
        None: they are [E, D, I]."""
        with jax.named_scope("moe"):
            shared = self.shared_experts
            with jax.named_scope("shared_experts"):  # with the router: one launch if they stream
                gate, up, logits = project_together(
                    x, (shared.gate_proj, shared.up_proj, self.router), partials=(self.router,))
            with jax.named_scope("router"):
                weights, experts = self.route(logits)
            with jax.named_scope("routed_experts"):
                routed = self._routed(x, weights, experts, plan, layer)
            with jax.named_scope("shared_experts"):
                return routed + shared.down(gate, up)

    def _routed(self, x, weights, experts, plan, layer):
        stacks = (self.w_gate[...], self.w_up[...], self.w_down[...])
        if layer is not None:
            # Layer `layer`'s experts are groups layer * E ... of the stacks seen as G * E
            # experts (a free reshape): slicing them out would copy every expert's weights
            # before a Pallas kernel, each step.
            experts = experts + layer * stacks[0].shape[1]
            stacks = tuple(w.reshape(-1, *w.shape[2:]) for w in stacks)
        experts_fn = functools.partial(routed_experts, limit=self.limit,
                                       implementation=self.backend,
                                       active_experts=self.num_experts)
        routed = experts_fn
        if plan is not None and self.backend != "ragged_dot":
            s = plan.specs

            def per_device(*args):  # fp32 partial sums of the down projection over TP
                partial = experts_fn(*args, out_dtype=jnp.float32)
                return jax.lax.psum(partial, s.expert_column[2]).astype(x.dtype)

            # check_vma off: a pallas_call does not declare how its outputs vary.
            routed = jax.shard_map(
                per_device, mesh=plan.mesh,
                in_specs=(s.tokens, s.tokens, s.tokens, s.expert_column, s.expert_column,
                          s.expert_row),
                out_specs=s.tokens, check_vma=False)
        return routed(x, weights, experts, *stacks)
