"""The fused KDA decode step (`pallas_kernels.kda_decode_fused`) as one Pallas kernel lowered
through Triton.

One program per (row, head). It reads the head's q, k and v channels of the input
projections (and the row's f_a and g_a after them) and their conv history at the row's
slot, runs the conv, the L2 norms, the decay and output gates' rank-K up-projections (as
[32, K] weight slices, fp32 broadcast-multiply-sum: one row is too thin for the tensor
cores), and the recurrence on the state one [K, 32] value block at a time, then the gated
RMSNorm over the head's output. The pools are aliased to outputs (`input_output_aliases`): the row's slot is
written in place. Every conv history value is read before a barrier and written after it,
since a 32-channel tile is replicated over the warps and one warp's store could otherwise
land before another's load.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


class FusedDecodeShape(NamedTuple):
    """Static parameters of one launch (hashable: a jit static argument)."""

    heads: int
    dim: int  # K = V
    width: int  # conv taps W
    gate: str  # "softplus" or "sigmoid_bound"
    gate_bound: float
    norm_eps: float
    l2_eps: float
    num_warps: int = 16


def _kernel(slots_ref, in_ref, beta_ref, taps_ref, fb_ref, dtb_ref, alog_ref, gb_ref, norm_ref,
            rec_in_ref, conv_in_ref, out_ref, rec_ref, conv_ref, *, shape: FusedDecodeShape,
            interpret: bool):
    del rec_in_ref, conv_in_ref  # aliased to rec_ref, conv_ref
    n, h = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[n]
    dim, heads, hist = shape.dim, shape.heads, shape.width - 1
    f32, dtype = jnp.float32, in_ref.dtype
    head = pl.ds(h * dim, dim)

    @pl.when(slot >= 0)
    def _():
        # Every load first: they are independent, so their latencies overlap; no store
        # comes before the barrier.
        def read(part):
            chans = pl.ds((part * heads + h) * dim, dim)
            window = [conv_ref[slot, chans, j].astype(dtype) for j in range(hist)]
            taps = [taps_ref[chans, j].astype(f32) for j in range(hist + 1)]
            return chans, window + [in_ref[n, chans]], taps

        conv_in = [read(part) for part in range(3)]  # q, k, v
        gates_at = 3 * heads * dim  # f_a, then g_a, after the q | k | v channels
        f_a = in_ref[n, pl.ds(gates_at, dim)].astype(f32)
        g_a = in_ref[n, pl.ds(gates_at + dim, dim)].astype(f32)
        f_b, g_b = fb_ref[:, head].astype(f32), gb_ref[:, head].astype(f32)
        bias, a_log = dtb_ref[head], alog_ref[h]
        beta = beta_ref[n, h].astype(f32)
        norm = norm_ref[...].astype(f32)
        state = rec_ref[slot, h, :, :]  # [K, V]
        if not interpret:  # (interpret mode runs a program's ops in order, one at a time)
            plgpu.debug_barrier()

        def mix(chans, window, taps):
            """The conv of one part's channels (the layer's tap order), SiLU, in dtype; the
            history shifted by the new input."""
            acc = jnp.zeros((dim,), f32)
            for tap, weight in zip(window, taps):
                acc = acc + tap.astype(f32) * weight
            for j in range(hist):
                conv_ref[slot, chans, j] = window[j + 1].astype(conv_ref.dtype)
            return (acc * jax.nn.sigmoid(acc)).astype(dtype).astype(f32)

        def l2(x):
            x = x * jax.lax.rsqrt(jnp.sum(x * x) + shape.l2_eps)
            return x.astype(dtype).astype(f32)

        def up(x, w):
            """x @ w (a rank-K gate projection), rounded to dtype as the layer's output."""
            return jnp.sum(x[:, None] * w, axis=0).astype(dtype).astype(f32)

        q, k, v = (mix(*part) for part in conv_in)
        q, k = l2(q), l2(k)
        f = up(f_a, f_b) + bias
        a = jnp.exp(a_log)
        if shape.gate == "softplus":
            g = -a * (jnp.maximum(f, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(f))))
        else:
            g = shape.gate_bound * jax.nn.sigmoid(a * f)
        state = jnp.exp(g)[:, None] * state
        error = v - jnp.sum(k[:, None] * state, axis=0)
        state = state + (beta * k)[:, None] * error[None, :]
        rec_ref[slot, h, :, :] = state
        o = (dim ** -0.5 * jnp.sum(q[:, None] * state, axis=0)).astype(dtype).astype(f32)
        rstd = jax.lax.rsqrt(jnp.sum(o * o) / dim + shape.norm_eps)
        y = o * rstd * norm * jax.nn.sigmoid(up(g_a, g_b))
        out_ref[n, head] = y.astype(out_ref.dtype)

    @pl.when(slot < 0)
    def _():
        out_ref[n, head] = jnp.zeros((dim,), out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("shape", "interpret"))
def kda_decode_fused_pallas(inputs, beta, weights, state_slots, recurrent, conv, *,
                            shape: FusedDecodeShape, interpret: bool):
    """The kernel (arguments checked and slots validated by `kda_decode_fused`; inputs
    [N, 3 H K + 2 K]). Returns out [N, H K] in inputs' dtype and the recurrent and conv
    pools."""
    rows = inputs.shape[0]
    call = pl.pallas_call(
        functools.partial(_kernel, shape=shape, interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((rows, shape.heads * shape.dim), inputs.dtype),
                   jax.ShapeDtypeStruct(recurrent.shape, recurrent.dtype),
                   jax.ShapeDtypeStruct(conv.shape, conv.dtype)),
        grid=(rows, shape.heads),
        input_output_aliases={9: 1, 10: 2},
        compiler_params=plgpu.CompilerParams(num_warps=shape.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode_fused",
    )
    return call(state_slots, inputs, beta, weights.conv, weights.f_b, weights.dt_bias,
                weights.a_log, weights.g_b, weights.norm, recurrent, conv)
