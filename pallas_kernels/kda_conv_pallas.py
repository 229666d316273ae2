"""The KDA prefill conv (`pallas_kernels.kda_conv`) as one Pallas kernel lowered through
Triton.

One launch per part (q, k, v), each reading that part's projection output as it is (a
q | k | v concatenation ahead of the conv was a copy of every input: 1.9 ms of kimi's 8K
step), one program per block of `block_rows` rows and one head: K channels. For each of the
W taps it loads the block's rows shifted by the tap, each row from the input when the tap
lies inside the row's sequence and from the sequence's history rows otherwise (two masked
row gathers: the history load is empty except on a sequence's first W - 1 rows), so every
row runs the same sums whatever schedule brought it (a span's first rows and a
continuation's alike). Then SiLU, the rounding to the input's dtype, and for q and k the
row's L2 norm over the head.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tiles import exp_function, iota


class ConvTiling(NamedTuple):
    """Rows a program and its warps. 16 x 4 was the fastest of six tilings at every case of
    `python -m bench.kda_conv --sweep` on the H100 (32 and 64 heads, 8K and 32K tokens:
    0.269 ms against 0.291 at 32 x 8, kimi's 8K layer; docs/KERNEL.md, fourteenth session)."""

    block_rows: int = 16
    num_warps: int = 4


class ConvShape(NamedTuple):
    """Static parameters of one launch (hashable: a jit static argument)."""

    heads: int
    dim: int  # K, channels of one head
    width: int  # W
    num_seqs: int
    l2_eps: float
    tiling: ConvTiling = ConvTiling()


def _kernel(cu_ref, seq_ref, pos_ref, x_ref, w_ref, hist_ref, out_ref, *, shape: ConvShape,
            normalize: bool, interpret: bool):
    i, head = pl.program_id(0), pl.program_id(1)
    num_tokens, dim, hist = x_ref.shape[0], shape.dim, shape.width - 1
    rows = i * shape.tiling.block_rows + iota((shape.tiling.block_rows,), 0)
    in_range = rows < num_tokens
    valid = in_range & (rows < cu_ref[shape.num_seqs])
    seq = plgpu.load(seq_ref.at[rows], mask=in_range, other=0)
    pos = plgpu.load(pos_ref.at[rows], mask=in_range, other=0)
    cols = head * dim + iota((dim,), 0)
    f32 = jnp.float32
    acc = jnp.zeros((shape.tiling.block_rows, dim), f32)
    for j in range(hist + 1):
        rel = pos - hist + j  # the tap's position in the row's sequence
        inside = valid & (rel >= 0)
        tap = plgpu.load(x_ref.at[jnp.where(inside, rows - hist + j, 0)[:, None], cols[None, :]],
                         mask=inside[:, None], other=0).astype(f32)
        if hist:
            before = valid & (rel < 0)
            from_history = plgpu.load(
                hist_ref.at[jnp.where(before, seq * hist + rel + hist, 0)[:, None],
                            cols[None, :]],
                mask=before[:, None], other=0).astype(f32)
            tap = jnp.where(before[:, None], from_history, tap)
        acc = acc + tap * w_ref[j, pl.ds(head * dim, dim)][None, :]
    # SiLU as acc / (1 + exp(-acc)): in base 2 on the fast path, 9 SASS instructions an
    # element where `acc * sigmoid(acc)` took 19 (sm_90, pip Triton; the exp is one MUFU,
    # `tiles.exp2_ftz`).
    exp = exp_function(x_ref.dtype == jnp.float32, interpret=interpret)
    y = jnp.where(valid[:, None], acc / (1 + exp(-acc)), 0.0).astype(x_ref.dtype)
    if normalize:
        yf = y.astype(f32)
        y = (yf * jax.lax.rsqrt(jnp.sum(yf * yf, axis=1) + shape.l2_eps)[:, None]
             ).astype(x_ref.dtype)
    plgpu.store(out_ref.at[rows[:, None], cols[None, :]], y, mask=in_range[:, None])


@functools.partial(jax.jit, static_argnames=("shape", "interpret"))
def kda_conv_pallas(parts, taps, history_rows, cu_seqlens, seq, pos, *, shape: ConvShape,
                    interpret: bool):
    """The kernel (arguments checked by `kda_conv`): parts, the q, k, v inputs, each
    [T, H K]; taps fp32 [W, 3 H K]; history_rows [N (W - 1), 3 H K] in the inputs' dtype (at
    least one row: a zero row when W = 1); cu_seqlens int32 [N + 1]; seq, pos int32 [T]
    (each row's sequence and position in it). Returns q, k, v [T, H K] in the inputs'
    dtype."""
    num_tokens, width = parts[0].shape
    if history_rows.shape[0] == 0:  # W = 1: nothing is read from it, but a ref needs a row
        history_rows = jnp.zeros((1, history_rows.shape[1]), parts[0].dtype)
    out = jax.ShapeDtypeStruct((num_tokens, width), parts[0].dtype)
    grid = (pl.cdiv(num_tokens, shape.tiling.block_rows), shape.heads)
    params = plgpu.CompilerParams(num_warps=shape.tiling.num_warps, num_stages=1)
    return tuple(
        pl.pallas_call(functools.partial(_kernel, shape=shape, normalize=index < 2,
                                         interpret=interpret),
                       out_shape=out, grid=grid, compiler_params=params,
                       interpret=interpret, name="kda_conv",
                       )(cu_seqlens, seq, pos, x, taps[:, index * width:(index + 1) * width],
                         history_rows[:, index * width:(index + 1) * width])
        for index, x in enumerate(parts))
