"""The per-head products of MLA's absorbed decode (`pallas_kernels.head_matmul`) as one
Pallas kernel lowered through Triton.

Grid (head, output column tile, row tile). A program multiplies one head's rows, a tile of
at most ROW_TILE rows (a power of two, at least the tensor cores' 16; rows past the real
ones masked on load and store), by that head's slice of the shared [C, H, W] weight, in
steps of `block_k` along the contracted dimension, into an fp32 [rows, block_n]
accumulator. The tiles depend on the shapes alone, never on the rows, so a row's sums run
in one order whatever the batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gmm_tuning import largest_dividing, pow2_at_least_16
from pallas_kernels.tiles import check_tile_sizes, dot, dot_nt, iota

ROW_TILE = 64  # most rows one program holds; more rows take more programs
BLOCK = 64  # the widest output and contraction tiles


@dataclasses.dataclass(frozen=True)
class HeadTiling:
    """Static tiling (hashable: a jit static argument)."""

    block_n: int  # output columns per program
    block_k: int  # contracted elements per step
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_tile_sizes(self, ("block_n", "block_k"))


def select_tiling(out_width: int, contracted: int) -> HeadTiling:
    """Tiles of up to BLOCK dividing the output width and the contracted dimension."""
    return HeadTiling(block_n=largest_dividing(BLOCK, out_width),
                      block_k=largest_dividing(BLOCK, contracted))


def row_tile(rows: int) -> int:
    return min(pow2_at_least_16(rows), ROW_TILE)


def _kernel(x_ref, w_ref, out_ref, *, transposed: bool, offset: int, tiling: HeadTiling):
    h, j, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm, bn, bk = row_tile(x_ref.shape[0]), tiling.block_n, tiling.block_k
    rows = pl.ds(r * bm, bm)
    valid = (r * bm + iota((bm,), 0) < x_ref.shape[0])[:, None]
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else lax.Precision.DEFAULT

    def body(i, acc):
        x = plgpu.load(x_ref.at[rows, h, pl.ds(i * bk, bk)], mask=valid, other=0)
        if transposed:  # [bn, bk] rows of the weight: out = x w^T
            w = w_ref[pl.ds(j * bn, bn), h, pl.ds(offset + i * bk, bk)]
            return acc + dot_nt(x, w, precision)
        w = w_ref[pl.ds(i * bk, bk), h, pl.ds(offset + j * bn, bn)]
        return acc + dot(x, w, precision)

    acc = lax.fori_loop(0, x_ref.shape[2] // bk, body, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(out_ref.at[rows, h, pl.ds(j * bn, bn)], acc, mask=valid)


@functools.partial(jax.jit, static_argnames=("transposed", "offset", "width", "tiling",
                                             "interpret"))
def head_matmul_pallas(x, w, *, transposed: bool, offset: int, width: int, tiling: HeadTiling,
                       interpret: bool):
    """The kernel (arguments checked by `head_matmul`): fp32 [N, H, width]."""
    rows, heads, _ = x.shape
    return pl.pallas_call(
        functools.partial(_kernel, transposed=transposed, offset=offset, tiling=tiling),
        out_shape=jax.ShapeDtypeStruct((rows, heads, width), jnp.float32),
        grid=(heads, width // tiling.block_n, pl.cdiv(rows, row_tile(rows))),
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                             num_stages=tiling.num_stages),
        interpret=interpret,
        name="head_matmul",
    )(x, w)
