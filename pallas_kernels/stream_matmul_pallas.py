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


def _kernel(x_ref, *refs, config: StreamConfig, starts: tuple[int, ...]):
    """Program `pid` of weight i (starts[i] <= pid < starts[i + 1]): one column tile, one
    K split."""
    count = len(config.tilings)
    w_refs, out_refs = refs[:count], refs[count:]
    pid = pl.program_id(0)
    tile_rows = padded_rows(x_ref.shape[0])
    tile = pl.ds(0, tile_rows)
    valid = (iota((tile_rows,), 0) < x_ref.shape[0])[:, None]
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else lax.Precision.DEFAULT

    for tiling, w_ref, out_ref, start, end in zip(config.tilings, w_refs, out_refs, starts,
                                                  starts[1:]):
        @pl.when((pid >= start) & (pid < end))
        def _(tiling=tiling, w_ref=w_ref, out_ref=out_ref, start=start):
            bn, bk = tiling.block_n, tiling.block_k
            local = pid - start
            n, split = local // tiling.splits, local % tiling.splits
            steps = w_ref.shape[0] // (tiling.splits * bk)
            cols = pl.ds(n * bn, bn)

            def body(j, acc):
                ks = pl.ds((split * steps + j) * bk, bk)
                x = plgpu.load(x_ref.at[tile, ks], mask=valid, other=0)
                return acc + jnp.dot(x, w_ref[ks, cols], precision=precision,
                                     preferred_element_type=jnp.float32)

            acc = lax.fori_loop(0, steps, body, jnp.zeros((tile_rows, bn), jnp.float32))
            target = (out_ref.at[tile, cols] if tiling.splits == 1
                      else out_ref.at[split, tile, cols])
            plgpu.store(target, acc.astype(out_ref.dtype), mask=valid)


@functools.partial(jax.jit, static_argnames=("config", "out_dtypes", "keep_partials",
                                             "interpret"))
def stream_matmul_pallas(x, weights, *, config: StreamConfig, out_dtypes: tuple | None = None,
                         keep_partials: tuple = (), interpret: bool):
    """The kernel (operands and tiling already checked by `pallas_kernels.stream_matmul`).

    Args: x [M, K]; weights: tuple of [K, N_i] in x's dtype; config: one tiling per weight;
    out_dtypes: each product's dtype (None: x.dtype); keep_partials: indices of fp32
    products returned as their partial sums [splits, M, N_i], not added.
    Returns a tuple of [M, N_i] (or partials).
    """
    out_dtypes = out_dtypes or (x.dtype,) * len(weights)
    rows, _ = x.shape
    counts = [t.programs(w.shape[1]) for t, w in zip(config.tilings, weights)]
    starts = tuple(itertools.accumulate(counts, initial=0))
    partials = pl.pallas_call(
        functools.partial(_kernel, config=config, starts=starts),
        out_shape=tuple(jax.ShapeDtypeStruct((rows, w.shape[1]), dtype) if t.splits == 1
                        else jax.ShapeDtypeStruct((t.splits, rows, w.shape[1]), jnp.float32)
                        for t, w, dtype in zip(config.tilings, weights, out_dtypes)),
        grid=(starts[-1],),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="stream_matmul",
    )(x, *weights)
    return tuple((p[None] if t.splits == 1 else p) if i in keep_partials
                 else p if t.splits == 1 else ordered_sum(p).astype(dtype)
                 for i, (t, p, dtype) in enumerate(zip(config.tilings, partials, out_dtypes)))

