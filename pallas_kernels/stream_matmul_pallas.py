"""The weight-stream product as one Pallas kernel lowered through Triton (the op and the
tiling rule: `pallas_kernels.stream_matmul`).

Grid: one axis, the concatenation of each weight's programs. Weight i's programs are its
(column tile, K split) pairs, the split fastest; a program runs its split's k steps into an
fp32 [padded rows, block_n] accumulator and stores it as partial sum `split` of an fp32
[splits, rows, N_i] output, which the wrapper adds in a fixed order
(`pallas_kernels.partials`) and casts to the product's output dtype (x's, or fp32); a
weight of one split stores its [rows, N_i] result in that dtype directly. The tiles hold a
power of two of at least 16 rows (the tensor cores' minimum): x's rows beyond its real ones
are masked on load (read as zeros) and on store, so no padded copy of x is made.

With a row norm (`norm_sum_squares` and `norm_weight` given) the launch multiplies the normed
rows x / sqrt(mean(x**2) + eps) * weight instead of x (each row's sum of squares computed
before, by XLA): each program scales every x tile as it loads it. The programs of weight 0's first
column tile, whose splits cover K once between them, also store the normed tiles: the normed
rows [M, K] in x's dtype, the launch's first output, for the consumers of the same rows that
do not stream (the routed experts). (A first version summed each row's squares in every
program before its k loop: ~9 us more a launch on an H100, more than the two XLA launches
it saved.)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gmm_tuning import pow2_at_least_16
from pallas_kernels.partials import ordered_sum
from pallas_kernels.tiles import check_tile_sizes, iota


@dataclasses.dataclass(frozen=True)
class StreamTiling:
    """How one weight [K, N] is cut: column tiles of block_n, `splits` slices of K, each
    read in block_k steps (K = splits x steps x block_k)."""

    block_n: int
    block_k: int
    splits: int

    def __post_init__(self):
        check_tile_sizes(self, ("block_n", "block_k"))
        if self.splits < 1:
            raise ValueError(f"splits must be >= 1, got {self.splits}")

    def programs(self, n: int) -> int:
        """Programs of a [K, n] weight: column tiles x splits."""
        return n // self.block_n * self.splits


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """Static tiling of one launch (hashable: a jit static argument): one StreamTiling per
    weight, and the launch's warps and pipeline stages."""

    tilings: tuple[StreamTiling, ...]
    num_warps: int = 4
    num_stages: int = 4


def padded_rows(rows: int) -> int:
    """The rows a launch computes: a power of two, at least the tensor cores' minimum 16."""
    return pow2_at_least_16(rows)


def _kernel(x_ref, *refs, config: StreamConfig, starts: tuple[int, ...], normed: bool,
            eps: float):
    """Program `pid` of weight i (starts[i] <= pid < starts[i + 1]): one column tile, one
    K split. With a row norm the refs are (sum of squares, norm weight, weights..., normed
    rows, outputs...)."""
    count = len(config.tilings)
    if normed:
        squares_ref, norm_ref, w_refs, normed_ref, out_refs = (
            refs[0], refs[1], refs[2:count + 2], refs[count + 2], refs[count + 3:])
    else:
        w_refs, out_refs = refs[:count], refs[count:]
    pid = pl.program_id(0)
    tile_rows = padded_rows(x_ref.shape[0])
    tile = pl.ds(0, tile_rows)
    valid = (iota((tile_rows,), 0) < x_ref.shape[0])[:, None]
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else lax.Precision.DEFAULT
    scale = None
    if normed:  # `rms_scale`'s math: rsqrt(sum / K + eps)
        squares = plgpu.load(squares_ref.at[tile], mask=valid[:, 0], other=0.0)[:, None]
        scale = lax.rsqrt(squares / x_ref.shape[1] + eps)

    for i, (tiling, w_ref, out_ref, start, end) in enumerate(
            zip(config.tilings, w_refs, out_refs, starts, starts[1:])):
        @pl.when((pid >= start) & (pid < end))
        def _(i=i, tiling=tiling, w_ref=w_ref, out_ref=out_ref, start=start):
            bn, bk = tiling.block_n, tiling.block_k
            local = pid - start
            n, split = local // tiling.splits, local % tiling.splits
            steps = w_ref.shape[0] // (tiling.splits * bk)
            cols = pl.ds(n * bn, bn)

            def body(j, acc):
                ks = pl.ds((split * steps + j) * bk, bk)
                x = plgpu.load(x_ref.at[tile, ks], mask=valid, other=0)
                if normed:  # RMSNorm's fp32 math in rms_norm's order
                    x = (x.astype(jnp.float32) * scale
                         * norm_ref[ks].astype(jnp.float32)[None, :]).astype(x_ref.dtype)
                    if i == 0:
                        @pl.when(n == 0)
                        def _():
                            plgpu.store(normed_ref.at[tile, ks], x, mask=valid)
                return acc + jnp.dot(x, w_ref[ks, cols], precision=precision,
                                     preferred_element_type=jnp.float32)

            acc = lax.fori_loop(0, steps, body, jnp.zeros((tile_rows, bn), jnp.float32))
            target = (out_ref.at[tile, cols] if tiling.splits == 1
                      else out_ref.at[split, tile, cols])
            plgpu.store(target, acc.astype(out_ref.dtype), mask=valid)


@functools.partial(jax.jit, static_argnames=("config", "out_dtypes", "eps", "keep_partials",
                                             "interpret"))
def stream_matmul_pallas(x, weights, *, config: StreamConfig, out_dtypes: tuple | None = None,
                         norm_sum_squares=None, norm_weight=None, eps: float = 0.0,
                         keep_partials: tuple = (), interpret: bool):
    """The kernel (operands and tiling already checked by `pallas_kernels.stream_matmul`).

    Args: x [M, K]; weights: tuple of [K, N_i] in x's dtype; config: one tiling per weight;
    out_dtypes: each product's dtype (None: x.dtype); norm_sum_squares fp32 [M] (each row's
    sum of x**2), norm_weight [K] (any float dtype) and eps: multiply the normed rows
    x / sqrt(sum / K + eps) * weight (None: x itself);
    keep_partials: indices
    of fp32 products returned as their partial sums [splits, M, N_i], not added.
    Returns a tuple of [M, N_i] (or partials), after the normed rows [M, K] in x's dtype
    with a norm.
    """
    out_dtypes = out_dtypes or (x.dtype,) * len(weights)
    rows, k = x.shape
    counts = [t.programs(w.shape[1]) for t, w in zip(config.tilings, weights)]
    starts = tuple(itertools.accumulate(counts, initial=0))
    out_shape = tuple(jax.ShapeDtypeStruct((rows, w.shape[1]), dtype) if t.splits == 1
                      else jax.ShapeDtypeStruct((t.splits, rows, w.shape[1]), jnp.float32)
                      for t, w, dtype in zip(config.tilings, weights, out_dtypes))
    normed = norm_weight is not None
    norm_args = (norm_sum_squares, norm_weight) if normed else ()
    if normed:
        out_shape = (jax.ShapeDtypeStruct((rows, k), x.dtype), *out_shape)
    outputs = pl.pallas_call(
        functools.partial(_kernel, config=config, starts=starts, normed=normed, eps=eps),
        out_shape=out_shape,
        grid=(starts[-1],),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="stream_matmul",
    )(x, *norm_args, *weights)
    rows_out, partials = (outputs[:1], outputs[1:]) if normed else ((), outputs)
    return rows_out + tuple(
        (p[None] if t.splits == 1 else p) if i in keep_partials
        else p if t.splits == 1 else ordered_sum(p).astype(dtype)
        for i, (t, p, dtype) in enumerate(zip(config.tilings, partials, out_dtypes)))

