"""`kda_decode_fused`: one token per row of a whole KDA layer between its input and output
projections, on the layer's two state pools, updated in place.

Per row n with slot s = state_slots[n] and head h (K = V = the head dim, W the conv width):

    x      = [q | k | v] channels of the input projection            [3 H K], pre-conv
    f_a, g_a = the gates' down-projections, after x in the same row    [K] each
    y_c    = silu(sum_j window_c[j] w_c[j]),  window = history[s] ++ x   (short conv)
    q, k   = l2norm(y_q[h]), l2norm(y_k[h]);  v = y_v[h]
    g      = decay(f_a W_fb[:, h] + dt_bias[h], A_log[h])               (KDA.decay)
    o      = kda_decode step of (q, k, v, g, beta) on recurrent[s, h]
    out[h] = norm_w * rmsnorm(o) * sigmoid(g_a W_gb[:, h])              (gated o_norm)

`KDA.decode` on one device: the conv, the norms, the gate projections (f_b, g_b: rank K) and
the recurrence in one launch where they took ~16 small XLA kernels and launches a layer.
The input projections arrive as one array [N, 3 H K + 2 K] (q | k | v | f_a | g_a): the
weight stream's partial sums of all five then end in one XLA fusion, where f_a's and g_a's
were a launch each beside q | k | v's concatenation (`bench.launches`, kimi's batch-1 step:
two launches a KDA layer).
A padding row (slot -1) reads zero state, writes none and outputs zeros; an invalid slot
vector refuses the whole call as `kda_decode` does (nothing written, zeros out).

Two implementations behind one signature: the Pallas kernel (`kda_decode_fused_pallas`)
and a jax.numpy reference that rounds where the layer's unfused path rounds (every
projection output and conv output to the activations' dtype).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.kda_decode import BACKENDS, checked_slots, kda_decode_reference
from pallas_kernels.kda_decode_fused_pallas import FusedDecodeShape, kda_decode_fused_pallas

GATES = ("softplus", "sigmoid_bound")
_HIGHEST = jax.lax.Precision.HIGHEST


class DecodeLayerWeights(NamedTuple):
    """The per-layer weights the fused step reads (H heads of dim K)."""

    conv: jax.Array  # [3 H K, W] depthwise taps over q | k | v channels, oldest tap first
    f_b: jax.Array  # [K, H K], the decay gate's up-projection
    dt_bias: jax.Array  # fp32 [H K]
    a_log: jax.Array  # fp32 [H]
    g_b: jax.Array  # [K, H K], the output gate's up-projection
    norm: jax.Array  # [K], the gated RMSNorm weight (shared by the heads)


class DecodeLayerGates(NamedTuple):
    """Static gate settings: `gate` in GATES, its bound (sigmoid_bound), the norms' eps."""

    gate: str
    gate_bound: float
    norm_eps: float
    l2_eps: float = 1e-6


def _check(inputs, beta, weights, state_slots, recurrent, conv, gates):
    rows = inputs.shape[0]
    if recurrent.ndim != 4 or recurrent.dtype != jnp.float32:
        raise ValueError(f"recurrent must be an fp32 pool [S, H, K, K], got "
                         f"{recurrent.dtype}{list(recurrent.shape)}")
    slots, heads, dim, dim_v = recurrent.shape
    if dim != dim_v or dim < 16 or dim & (dim - 1):
        raise ValueError(f"the head dims must be equal powers of two >= 16, got {dim}, {dim_v}")
    channels, width = weights.conv.shape
    expected = {
        "inputs": (inputs, (rows, 3 * heads * dim + 2 * dim)), "beta": (beta, (rows, heads)),
        "state_slots": (state_slots, (rows,)),
        "conv weight": (weights.conv, (3 * heads * dim, width)),
        "f_b": (weights.f_b, (dim, heads * dim)), "dt_bias": (weights.dt_bias, (heads * dim,)),
        "a_log": (weights.a_log, (heads,)), "g_b": (weights.g_b, (dim, heads * dim)),
        "norm": (weights.norm, (dim,)), "conv pool": (conv, (slots, channels, width - 1)),
    }
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if state_slots.dtype != jnp.int32:
        raise ValueError(f"state_slots must be int32, got {state_slots.dtype}")
    if width < 2:
        raise ValueError(f"the conv width must be >= 2, got {width}")
    if gates.gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gates.gate!r}")


def decay(f: jax.Array, a_log: jax.Array, gate: str, gate_bound: float) -> jax.Array:
    """Per-channel log-decay g <= 0 from f = f_b(f_a) + dt_bias, fp32 [N, H, K]; a_log [H]:

        softplus (Kimi):      g = -exp(A_log) * softplus(f)
        sigmoid_bound (GLM):  g = bound * sigmoid(exp(A_log) * f)
    """
    a = jnp.exp(a_log)[:, None]
    if gate == "softplus":
        return -a * jax.nn.softplus(f)
    return gate_bound * jax.nn.sigmoid(a * f)


def kda_decode_fused_reference(inputs, beta, weights: DecodeLayerWeights, state_slots,
                               recurrent, conv, *, gates: DecodeLayerGates):
    """The jax.numpy path (slots already checked)."""
    f32, dtype = jnp.float32, inputs.dtype
    rows = inputs.shape[0]
    _, heads, dim, _ = recurrent.shape
    qkv, f_a, g_a = jnp.split(inputs, [3 * heads * dim, 3 * heads * dim + dim], axis=-1)
    index = jnp.where(state_slots >= 0, state_slots, conv.shape[0])  # fill / drop
    window = jnp.concatenate([conv.at[index].get(mode="fill", fill_value=0).astype(dtype),
                              qkv[:, :, None]], axis=-1)  # [N, C, W]
    taps = weights.conv.astype(f32)
    acc = jnp.zeros(qkv.shape, f32)
    for j in range(window.shape[-1]):
        acc = acc + window[:, :, j].astype(f32) * taps[:, j]
    mixed = jax.nn.silu(acc).astype(dtype).reshape(rows, 3, heads, dim)

    def l2(x):
        x = x.astype(f32)
        return (x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + gates.l2_eps)).astype(dtype)

    def up(x, w):  # a rank-K gate projection, rounded as the layer's projection output
        return jnp.dot(x.astype(f32), w.astype(f32), precision=_HIGHEST).astype(dtype)

    f = up(f_a, weights.f_b).astype(f32) + weights.dt_bias
    g = decay(f.reshape(rows, heads, dim), weights.a_log, gates.gate, gates.gate_bound)
    o, recurrent = kda_decode_reference(l2(mixed[:, 0]), l2(mixed[:, 1]), mixed[:, 2], g, beta,
                                        state_slots, recurrent, scale=dim ** -0.5)
    o = o.astype(dtype).astype(f32)
    gate = up(g_a, weights.g_b).astype(f32).reshape(rows, heads, dim)
    normed = o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + gates.norm_eps)
    out = normed * weights.norm.astype(f32) * jax.nn.sigmoid(gate)
    out = jnp.where((state_slots >= 0)[:, None, None], out, 0.0)
    conv = conv.at[index].set(window[:, :, 1:].astype(conv.dtype), mode="drop")
    return out.astype(dtype).reshape(rows, heads * dim), recurrent, conv


def kda_decode_fused(inputs, beta, weights: DecodeLayerWeights, state_slots, recurrent, conv,
                     *, gates: DecodeLayerGates, backend: str = "pallas",
                     interpret: bool | None = None, num_warps: int = 16):
    """One KDA token per row, the layer's conv and recurrent state advanced in their pools.

    Args:
      inputs: [N, 3 H K + 2 K], the q | k | v projections (pre-conv) then the gates'
        down-projections f_a and g_a, in the activations' dtype; beta: [N, H] in (0, 1),
        any float.
      weights: the layer's (`DecodeLayerWeights`).
      state_slots: int32 [N], each row's slot in both pools; -1: a padding row.
      recurrent: fp32 [S, H, K, K]; conv: [S, 3 H K, W - 1] (oldest first). Donate both to
        the enclosing jit: the rows' slots are written in place.
      gates: the decay's form and the norms' eps (`DecodeLayerGates`, static).
      backend: "pallas" (the kernel; interpret mode by default on the CPU) or "reference".

    Returns:
      out [N, H K] in inputs' dtype (zeros on padding rows), ready for the output projection;
      the recurrent and conv pools (only the rows' slots changed). A slot outside [-1, S) or
      a slot given to two rows refuses the call: pools unchanged, every output row zeros.
    """
    _check(inputs, beta, weights, state_slots, recurrent, conv, gates)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    slots = checked_slots(state_slots, recurrent.shape[0])
    if backend == "reference":
        return kda_decode_fused_reference(inputs, beta, weights, slots, recurrent, conv,
                                          gates=gates)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    _, heads, dim, _ = recurrent.shape
    shape = FusedDecodeShape(heads=heads, dim=dim, width=weights.conv.shape[1],
                             gate=gates.gate, gate_bound=float(gates.gate_bound),
                             norm_eps=float(gates.norm_eps), l2_eps=float(gates.l2_eps),
                             num_warps=num_warps)
    return kda_decode_fused_pallas(inputs, beta, weights, slots, recurrent, conv,
                                   shape=shape, interpret=bool(interpret))
