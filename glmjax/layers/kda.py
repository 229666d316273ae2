"""The KDA (Kimi Delta Attention) layer: projections, short conv, gates, the checkpointing
scan of `pallas_kernels.kda_prefill`, gated output norm.

Parameter names follow the upstream Kimi-Linear ``KimiDeltaAttention`` except that the three
depthwise convolutions of q, k and v are one convolution over their concatenated channels
(identical maths: a depthwise conv is per channel), so one conv history per sequence covers
all three, as the state pool stores it (DESIGN section 3).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers.conv import ShortConvolution
from glmjax.layers.norms import GatedRMSNorm, l2_normalize
from glmjax.layers.projection import on_one_gpu, project_together, projection
from pallas_kernels import kda_decode, kda_prefill
from pallas_kernels.kda import MIN_GATE_LOWER_BOUND
from pallas_kernels.kda_conv import kda_conv
from pallas_kernels.kda_decode_fused import (
    DecodeLayerGates,
    DecodeLayerWeights,
    decay,
    kda_decode_fused,
)
from pallas_kernels.tuning import device_spec, use_fused_decode

if TYPE_CHECKING:
    from glmjax.sharding import ShardingPlan


class KDAState(NamedTuple):
    """Per-sequence KDA state; snapshots carry an extra capacity axis after N."""

    recurrent: jax.Array  # fp32 [N, H, K, V]
    conv: jax.Array  # [N, 3 * H * K, conv_kernel - 1], pre-conv q|k|v inputs, oldest first


class KDAResult(NamedTuple):
    y: jax.Array  # [T, D], zero on padding rows
    state: KDAState  # after each whole sequence
    snapshots: KDAState  # at each checkpoint offset: [N, capacity, ...]; zeros when inactive


def _dt_bias_init(key, shape, dtype):
    """Mamba's init: softplus^-1 of dt log-uniform in [1e-3, 0.1] (floor 1e-4), as fla."""
    log_dt = jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(0.1))
    dt = jnp.maximum(jnp.exp(log_dt), 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KDA(nnx.Module):
    """One KDA layer: over a packed batch (`__call__`), reading and returning states; or
    one token per row (`decode`), advancing the rows' states in the layer's pool in place."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        heads, dim, hidden = config.kda_num_heads, config.kda_head_dim, config.hidden_size
        linear = functools.partial(projection, config, rngs=rngs)
        self.num_heads, self.head_dim = heads, dim
        self.gate, self.gate_bound = config.kda_gate, config.kda_gate_bound
        self.backend = config.resolved_kda_backend()
        self.q_proj = linear(hidden, heads * dim)
        self.k_proj = linear(hidden, heads * dim)
        self.v_proj = linear(hidden, heads * dim)
        self.conv = ShortConvolution(config.conv_channels, config.conv_kernel,
                                     param_dtype=config.param_dtype, rngs=rngs)
        # Low-rank decay gate: rank = head_dim, per-channel output (upstream f_a / f_b).
        self.f_a_proj = linear(hidden, dim)
        self.f_b_proj = linear(dim, heads * dim)
        # Upstream init: A = U(1, 16) per head; kept fp32 like the upstream parameter.
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(
            rngs.params(), (heads,), jnp.float32, 1.0, 16.0)))
        self.dt_bias = nnx.Param(_dt_bias_init(rngs.params(), (heads * dim,), jnp.float32))
        self.b_proj = linear(hidden, heads)
        # Low-rank output gate (upstream g_a / g_b), applied by the sigmoid-gated norm.
        self.g_a_proj = linear(hidden, dim)
        self.g_b_proj = linear(dim, heads * dim)
        self.o_norm = GatedRMSNorm(dim, eps=config.rms_norm_eps, activation="sigmoid",
                                   param_dtype=config.param_dtype)
        self.o_proj = linear(heads * dim, hidden)

    def project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """x [T, D] -> (q, k, v) each [T, H K] (the conv's input channels in that order),
        f_a and g_a [T, K], beta fp32 [T, H]: the projections of the layer's input, in one
        weight-stream launch where they stream (decode)."""
        q, k, v, f_a, g_a, b = project_together(
            x, (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj,
                self.b_proj))
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        return (q, k, v), f_a, g_a, beta

    def decay(self, f_a: jax.Array) -> jax.Array:
        """Per-channel log-decay g <= 0, fp32 [T, H, K], from f_a = f_a_proj(x) [T, K]: the
        gate (`pallas_kernels.kda_decode_fused.decay`) of f_b(f_a) + dt_bias (GLM's bound:
        -5)."""
        f = self.f_b_proj(f_a).astype(jnp.float32) + self.dt_bias[...]
        f = f.reshape(f_a.shape[0], self.num_heads, self.head_dim)
        return decay(f, self.A_log[...], self.gate, self.gate_bound)

    def __call__(self, x: jax.Array, cu_seqlens: jax.Array, state: KDAState,
                 checkpoint_offsets: jax.Array, *, plan: ShardingPlan | None = None
                 ) -> KDAResult:
        """Args: x [T, D]; cu_seqlens int32 [N + 1]; state (initial, zeros for a cold start);
        checkpoint_offsets int32 [N, capacity] (1..len, -1 inactive; DESIGN section 3);
        plan: the mesh (None: one device). On a mesh the scan runs per device on its own
        heads (shard_map), so a Pallas kernel sees the per-device head count."""
        with jax.named_scope("kda"):
            tokens, shape = x.shape[0], (x.shape[0], self.num_heads, self.head_dim)
            parts, f_a, g_a, beta = self.project(x)
            # Scopes name the glue between the projections and the scan in a profile.
            with jax.named_scope("conv"):  # with the SiLU and q and k's norms
                q, k, v = kda_conv(parts, self.conv.weight[...], state.conv, cu_seqlens,
                                   heads=self.num_heads,
                                   implementation="pallas" if plan is None and on_one_gpu()
                                   else "xla")
                conv_history, conv_snapshots = self.conv.states(parts, cu_seqlens, state.conv,
                                                                checkpoint_offsets)
            with jax.named_scope("decay"):
                g = self.decay(f_a)
            # The kernel's tensor-core diagonal needs g >= a bound in [-5, 0).
            bounded = self.gate == "sigmoid_bound" and self.gate_bound >= MIN_GATE_LOWER_BOUND
            bound = self.gate_bound if bounded else None
            scan = functools.partial(kda_prefill, backend=self.backend, gate_lower_bound=bound)
            if plan is not None:
                s = plan.specs
                # check_vma off: a pallas_call does not declare how its outputs vary.
                scan = jax.shard_map(
                    scan, mesh=plan.mesh,
                    in_specs=(s.heads, s.heads, s.heads, s.heads, s.head_scalars, s.replicated,
                              s.kda_states, s.replicated),
                    out_specs=(s.heads, s.kda_states, s.kda_snapshots), check_vma=False)
            with jax.named_scope("kda_scan"):
                o, final, snapshots = scan(q, k, v, g, beta, cu_seqlens, state.recurrent,
                                           checkpoint_offsets)
            with jax.named_scope("out_norm"):
                gate = self.g_b_proj(g_a).reshape(shape)
                normed = self.o_norm(o, gate).reshape(tokens, -1)
            y = self.o_proj(normed)
            return KDAResult(y, KDAState(final, conv_history),
                             KDAState(snapshots, conv_snapshots))

    def decode(self, x: jax.Array, pool: KDAState, state_slots: jax.Array, *,
               plan: ShardingPlan | None = None) -> tuple[jax.Array, KDAState]:
        """One token per row, on the layer's state pool.

        Args: x [N, D]; pool: every slot's state (recurrent fp32 [S, H, K, V], conv
        [S, 3 H K, W - 1]), donated by the caller's jit: row n's slot is updated in place;
        state_slots int32 [N], checked by the caller (`glmjax.state_pool.decode_slots`):
        -1 marks a padding row, which reads zeros and writes nothing.
        state_slots may also be a chain int32 [J, R] with N = J R (speculative
        verification, `glmjax.speculative`): rows j R .. j R + R - 1 are token j of R
        sequences; before sub-step j > 0 the state of slot [j - 1, r] is copied to slot
        [j, r], which then advances by token j, so slot [j, r] ends holding the state after
        j + 1 tokens. The projections run once over all N rows; each sub-step is the
        one-token decode (same conv and kernel), so chained and plain decoding differ only
        as a matmul over more rows rounds (as plain decoding in another batch bucket).
        Returns y [N, D] and the pool.

        On one device, for few rows (`tuning.use_fused_decode`), everything between the
        input and output projections is one launch per sub-step
        (`pallas_kernels.kda_decode_fused`). Otherwise the conv, norms and gates are XLA
        ops around `kda_decode`; on a mesh the conv pool is sharded by channel, not by
        head, so the conv runs as XLA partitions it and the recurrence per device on its
        own heads (shard_map).
        """
        with jax.named_scope("kda_decode"):
            chain = state_slots.reshape(-1, state_slots.shape[-1])  # [J, R]
            width = chain.shape[1]
            parts, f_a, g_a, beta = self.project(x)
            fused = plan is None and use_fused_decode(device_spec(), num_rows=width,
                                                      num_heads=self.num_heads)
            if fused:  # one array [N, 3 H K + 2 K]: the partial sums end in one fusion
                inputs = jnp.concatenate([*parts, f_a, g_a], axis=-1)
                step = functools.partial(self._fused_step, beta=beta)
            else:
                inputs = jnp.concatenate(parts, axis=-1)  # [N, 3 H K]: a few rows
                step = functools.partial(self._per_op_step, g=self.decay(f_a), beta=beta,
                                         plan=plan)
            outputs = []
            for j in range(chain.shape[0]):
                part = slice(j * width, (j + 1) * width)
                if j:
                    pool = _copy_chain_slots(pool, chain[j - 1], chain[j])
                o, pool = step(inputs, part, pool, chain[j])
                outputs.append(o)
            o = jnp.concatenate(outputs) if len(outputs) > 1 else outputs[0]
            if not fused:
                gate = self.g_b_proj(g_a).reshape(o.shape)
                o = self.o_norm(o, gate).reshape(x.shape[0], -1)
            return self.o_proj(o), pool

    def _fused_step(self, inputs, part, pool, slots, *, beta):
        """Rows `part` of inputs [N, 3 H K + 2 K] (q | k | v | f_a | g_a) on one device:
        the gated, normed output [R, H V] and the pool."""
        dtype = inputs.dtype
        weights = DecodeLayerWeights(
            self.conv.weight[...], self.f_b_proj.kernel[...].astype(dtype),
            self.dt_bias[...], self.A_log[...], self.g_b_proj.kernel[...].astype(dtype),
            self.o_norm.weight[...])
        gates = DecodeLayerGates(self.gate, self.gate_bound, self.o_norm.eps)
        out, recurrent, conv = kda_decode_fused(
            inputs[part], beta[part], weights, slots, pool.recurrent, pool.conv, gates=gates,
            backend=self.backend)
        return out, KDAState(recurrent, conv)

    def _per_op_step(self, qkv, part, pool, slots, *, g, beta, plan):
        """Rows `part`, the conv and norms as XLA ops around `kda_decode` (on a mesh: per
        device on its own heads): the recurrence's output [R, H, V] (before the gated
        norm) and the pool."""
        width = slots.shape[0]
        step = functools.partial(kda_decode, backend=self.backend)
        if plan is not None:
            s = plan.specs
            step = jax.shard_map(
                step, mesh=plan.mesh,
                in_specs=(s.heads, s.heads, s.heads, s.heads, s.head_scalars, s.replicated,
                          s.kda_states),
                out_specs=(s.heads, s.kda_states), check_vma=False)
        mixed, conv_pool = self.conv.decode(qkv[part], pool.conv, slots)
        q, k, v = (p.reshape(width, self.num_heads, self.head_dim)
                   for p in jnp.split(mixed, 3, axis=-1))
        q, k = l2_normalize(q), l2_normalize(k)
        o, recurrent = step(q, k, v, g[part], beta[part], slots, pool.recurrent)
        return o, KDAState(recurrent, conv_pool)


def _copy_chain_slots(pool: KDAState, sources: jax.Array, destinations: jax.Array
                      ) -> KDAState:
    """Slot sources[r] -> destinations[r] (recurrent and conv) where both are >= 0; the
    caller's slots are checked (distinct, in range), so reads precede writes trivially."""
    num_slots = pool.recurrent.shape[0]
    copy = (sources >= 0) & (destinations >= 0)
    src = jnp.where(copy, sources, num_slots)
    dst = jnp.where(copy, destinations, num_slots)
    return KDAState(*(p.at[dst].set(p.at[src].get(mode="fill", fill_value=0), mode="drop")
                      for p in pool))
