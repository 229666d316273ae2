"""The fused KDA decode step (`pallas_kernels.kda_decode_fused`) as one Pallas kernel lowered
through Triton.

One program per (row, head). It reads the head's q, k and v channels of the input
projection and their conv history at the row's slot, runs the conv, the L2 norms, the
decay and output gates' rank-K up-projections (as [32, K] weight slices, fp32
broadcast-multiply-sum: one row is too thin for the tensor cores), and the recurrence on
the state one [K, 32] value block at a time, then the gated RMSNorm over the head's
output. The pools are aliased to outputs (`input_output_aliases`): the row's slot is
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

BLOCK = 32  # value columns per state tile; rows of K per gate-projection slice


class FusedDecodeShape(NamedTuple):
    """Static parameters of one launch (hashable: a jit static argument)."""

    heads: int
    dim: int  # K = V
    width: int  # conv taps W
    gate: str  # "softplus" or "sigmoid_bound"
    gate_bound: float
    norm_eps: float
    l2_eps: float
    num_warps: int = 4


def _kernel(slots_ref, qkv_ref, fa_ref, ga_ref, beta_ref, taps_ref, fb_ref, dtb_ref, alog_ref,
            gb_ref, norm_ref, rec_in_ref, conv_in_ref, out_ref, rec_ref, conv_ref, *,
            shape: FusedDecodeShape, interpret: bool):
    del rec_in_ref, conv_in_ref  # aliased to rec_ref, conv_ref
    n, h = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[n]
    dim, heads, hist = shape.dim, shape.heads, shape.width - 1
    blocks = dim // BLOCK
    f32, dtype = jnp.float32, qkv_ref.dtype
    head_cols = pl.ds(h * dim, dim)

    @pl.when(slot >= 0)
    def _():
        # Phase 1: every conv input and history value of the head's channels, read.
        def read(c0, size):
            chans = pl.ds(c0, size)
            window = [conv_ref[slot, chans, j].astype(dtype) for j in range(hist)]
            return chans, window + [qkv_ref[n, chans]]

        q_in, k_in = read(h * dim, dim), read((heads + h) * dim, dim)
        v_in = [read((2 * heads + h) * dim + i * BLOCK, BLOCK) for i in range(blocks)]
        if not interpret:  # (interpret mode runs a program's ops in order, one at a time)
            plgpu.debug_barrier()

        def mix(chans, window):
            """The conv of one channel range (the layer's tap order), SiLU, in dtype; its
            history shifted by the new input."""
            acc = jnp.zeros(window[0].shape, f32)
            for j, tap in enumerate(window):
                acc = acc + tap.astype(f32) * taps_ref[chans, j].astype(f32)
            for j in range(hist):
                conv_ref[slot, chans, j] = window[j + 1].astype(conv_ref.dtype)
            return (acc * jax.nn.sigmoid(acc)).astype(dtype).astype(f32)

        def l2(x):
            x = x * jax.lax.rsqrt(jnp.sum(x * x) + shape.l2_eps)
            return x.astype(dtype).astype(f32)

        q, k = l2(mix(*q_in)), l2(mix(*k_in))

        def up(x_ref, w_ref, cols, size):
            """x_ref[n] @ w_ref[:, cols] (rank-K gate projection), rounded to dtype."""
            acc = jnp.zeros((size,), f32)
            for i in range(blocks):
                rows = pl.ds(i * BLOCK, BLOCK)
                acc = acc + jnp.sum(x_ref[n, rows].astype(f32)[:, None]
                                    * w_ref[rows, cols].astype(f32), axis=0)
            return acc.astype(dtype).astype(f32)

        f = up(fa_ref, fb_ref, head_cols, dim) + dtb_ref[head_cols]
        a = jnp.exp(alog_ref[h])
        if shape.gate == "softplus":
            g = -a * (jnp.maximum(f, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(f))))
        else:
            g = shape.gate_bound * jax.nn.sigmoid(a * f)
        decay = jnp.exp(g)[:, None]
        beta = beta_ref[n, h].astype(f32)
        scale = dim ** -0.5

        outs, gates, sumsq = [], [], jnp.zeros((), f32)
        for i in range(blocks):
            vcols = pl.ds(i * BLOCK, BLOCK)
            v = mix(*v_in[i])
            state = decay * rec_ref[slot, h, :, vcols]  # [K, BLOCK]
            error = v - jnp.sum(k[:, None] * state, axis=0)
            state = state + (beta * k)[:, None] * error[None, :]
            rec_ref[slot, h, :, vcols] = state
            o = (scale * jnp.sum(q[:, None] * state, axis=0)).astype(dtype).astype(f32)
            outs.append(o)
            gates.append(up(ga_ref, gb_ref, pl.ds(h * dim + i * BLOCK, BLOCK), BLOCK))
            sumsq = sumsq + jnp.sum(o * o)
        rstd = jax.lax.rsqrt(sumsq / dim + shape.norm_eps)
        for i, (o, gate) in enumerate(zip(outs, gates)):
            vcols = pl.ds(i * BLOCK, BLOCK)
            y = o * rstd * norm_ref[vcols].astype(f32) * jax.nn.sigmoid(gate)
            out_ref[n, pl.ds(h * dim + i * BLOCK, BLOCK)] = y.astype(out_ref.dtype)

    @pl.when(slot < 0)
    def _():
        out_ref[n, head_cols] = jnp.zeros((dim,), out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("shape", "interpret"))
def kda_decode_fused_pallas(qkv, f_a, g_a, beta, weights, state_slots, recurrent, conv, *,
                            shape: FusedDecodeShape, interpret: bool):
    """The kernel (arguments checked and slots validated by `kda_decode_fused`).
    Returns out [N, H K] in qkv's dtype and the recurrent and conv pools."""
    rows = qkv.shape[0]
    if shape.dim % BLOCK:
        raise ValueError(f"the head dim {shape.dim} must be a multiple of {BLOCK}")
    call = pl.pallas_call(
        functools.partial(_kernel, shape=shape, interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((rows, shape.heads * shape.dim), qkv.dtype),
                   jax.ShapeDtypeStruct(recurrent.shape, recurrent.dtype),
                   jax.ShapeDtypeStruct(conv.shape, conv.dtype)),
        grid=(rows, shape.heads),
        input_output_aliases={11: 1, 12: 2},
        compiler_params=plgpu.CompilerParams(num_warps=shape.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode_fused",
    )
    return call(state_slots, qkv, f_a, g_a, beta, weights.conv, weights.f_b, weights.dt_bias,
                weights.a_log, weights.g_b, weights.norm, recurrent, conv)
