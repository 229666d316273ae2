"""The absorbed MLA decode attention (`pallas_kernels.mla_decode`) as one Pallas kernel lowered
through Triton, plus the merge of its partial results.

Grid: (sequence, head block, split). A program takes `block_h` heads of one sequence and
one slice of `split` positions, and walks it in steps of `block_t` positions: each step
reads the positions' latents straight from their block ([block_t, C] and the rope part
[block_t, R]: a block holds whole steps), scores them against the heads' queries on the
tensor cores ([block_h, C] x [C, block_t]) and folds them into a running softmax (max,
sum, [block_h, C] fp32 accumulator). Splits past a sequence's last visible position run no
step. The programs' (accumulator, max, sum) are merged by their log-sum-exp in jax.numpy,
the sums over splits in `pallas_kernels.partials`' fixed order.

Batch invariance: a split is SPLIT_POSITIONS positions whatever the batch, the table width
or the device, and the merge's order depends on the splits alone, so a sequence's result
does not depend on the sequences beside it (MTP's verify runs N + 1 rows per sequence where
plain decoding runs one). The fixed split is a compromise: at one sequence of 8K positions
and 32 heads it gives 64 programs (about half the H200's SMs), at 64 sequences its fp32
partials add ~22% to the latent bytes read (each split writes [heads, C] fp32 for its
256 x (C + R) bf16 latents).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.partials import ordered_sum
from pallas_kernels.tiles import check_tile_sizes, dot_nt, iota

SPLIT_POSITIONS = 256  # positions per program (module doc: batch invariance)


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """Static tiling (hashable: a jit static argument)."""

    split: int  # positions per program, a multiple of block_t
    block_t: int = 32  # positions per step; divides the cache's block size
    block_h: int = 16  # heads per program (the tensor cores' minimum rows)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_tile_sizes(self, ("block_t", "block_h"))
        if self.split < self.block_t or self.split % self.block_t:
            raise ValueError(f"split {self.split} must be a positive multiple of block_t "
                             f"{self.block_t}")


def select_tiling(block_size: int) -> DecodeTiling:
    """Steps of 32 positions (16 for blocks of 16), heads in blocks of 16, splits of
    SPLIT_POSITIONS positions: one tiling for every batch, table width and device."""
    block_t = 32 if block_size % 32 == 0 else 16
    if block_size % block_t:
        raise ValueError(f"the cache's block size {block_size} must be a multiple of 16")
    return DecodeTiling(split=SPLIT_POSITIONS, block_t=block_t)


def _kernel(*refs, tiling: DecodeTiling, heads: int, kv_lora: int, rope: int, scale: float,
            masked: bool):
    refs = list(refs)
    table_ref, lens_ref, q_ref = refs[:3]
    qpe_ref = refs[3] if rope else None
    pages_ref = refs[3 + bool(rope)]
    mask_ref = refs[4 + bool(rope)] if masked else None
    out_ref, max_ref, sum_ref = refs[-3:]
    n, hb, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bh, bt = tiling.block_h, tiling.block_t
    block_size = pages_ref.shape[1]
    head_rows = pl.ds(hb * bh, bh)
    head_ok = (hb * bh + iota((bh,), 0)) < heads
    q = plgpu.load(q_ref.at[n, head_rows, :], mask=head_ok[:, None], other=0)
    q_pe = (plgpu.load(qpe_ref.at[n, head_rows, :], mask=head_ok[:, None], other=0)
            if rope else None)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    start = s * tiling.split
    end = jnp.minimum(start + tiling.split, lens_ref[n] + 1)  # past the last visible one
    steps = jnp.maximum(end - start + bt - 1, 0) // bt

    def body(i, carry):
        top, total, acc = carry
        t0 = start + i * bt
        block = table_ref[n, t0 // block_size]
        rows = pl.ds(t0 % block_size, bt)
        positions = t0 + iota((bt,), 0)
        visible = positions < end
        if masked:
            visible &= plgpu.load(mask_ref.at[n, pl.ds(t0, bt)], mask=visible, other=0) != 0
        present = (visible & (block >= 0))[:, None]
        page = jnp.maximum(block, 0)
        c_kv = plgpu.load(pages_ref.at[page, rows, pl.ds(0, kv_lora)], mask=present, other=0)
        scores = dot_nt(q, c_kv.astype(q.dtype), precision)
        if rope:
            k_pe = plgpu.load(pages_ref.at[page, rows, pl.ds(kv_lora, rope)], mask=present,
                              other=0)
            scores += dot_nt(q_pe, k_pe.astype(q_pe.dtype), precision)
        scores = jnp.where(visible[None, :], scores * scale, -jnp.inf)  # [bh, bt]
        new_top = jnp.maximum(top, jnp.max(scores, axis=1))
        shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)
        weights = jnp.exp(scores - shift[:, None])
        rescale = jnp.exp(top - shift)
        total = total * rescale + jnp.sum(weights, axis=1)
        acc = acc * rescale[:, None] + jnp.dot(weights.astype(q.dtype), c_kv.astype(q.dtype),
                                               precision=precision,
                                               preferred_element_type=jnp.float32)
        return new_top, total, acc

    init = (jnp.full((bh,), -jnp.inf, jnp.float32), jnp.zeros((bh,), jnp.float32),
            jnp.zeros((bh, kv_lora), jnp.float32))
    top, total, acc = lax.fori_loop(0, steps, body, init)
    plgpu.store(out_ref.at[n, s, head_rows, :], acc, mask=head_ok[:, None])
    plgpu.store(max_ref.at[n, s, head_rows], top, mask=head_ok)
    plgpu.store(sum_ref.at[n, s, head_rows], total, mask=head_ok)


@functools.partial(jax.jit, static_argnames=("scale", "tiling", "interpret"))
def mla_decode_pallas(q_abs, q_pe, pages, block_table, context_lens, mask, *, scale: float,
                      tiling: DecodeTiling, interpret: bool):
    """The kernel and the merge (arguments checked by `mla_decode`): (out fp32 [N, H, C],
    lse fp32 [N, H])."""
    rows, heads, kv_lora = q_abs.shape
    rope = 0 if q_pe is None else q_pe.shape[-1]
    if pages.shape[1] % tiling.block_t:
        raise ValueError(f"block_t {tiling.block_t} must divide the cache's block size "
                         f"{pages.shape[1]}")
    width = block_table.shape[1] * pages.shape[1]
    splits = -(-width // tiling.split)
    head_blocks = -(-heads // tiling.block_h)
    operands = [block_table, context_lens, q_abs] + ([q_pe] if rope else []) + [pages]
    operands += [] if mask is None else [mask.astype(jnp.int8)]
    acc, top, total = pl.pallas_call(
        functools.partial(_kernel, tiling=tiling, heads=heads, kv_lora=kv_lora, rope=rope,
                          scale=scale, masked=mask is not None),
        out_shape=(jax.ShapeDtypeStruct((rows, splits, heads, kv_lora), jnp.float32),
                   jax.ShapeDtypeStruct((rows, splits, heads), jnp.float32),
                   jax.ShapeDtypeStruct((rows, splits, heads), jnp.float32)),
        grid=(rows, head_blocks, splits),
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                             num_stages=tiling.num_stages),
        interpret=interpret,
        name="mla_decode",
    )(*operands)
    peak = jnp.max(top, axis=1)  # [N, H]
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weight = jnp.exp(top - peak[:, None])  # 0 for splits that saw nothing
    denominator = ordered_sum(weight * total, axis=1)
    safe = jnp.where(denominator > 0, denominator, 1.0)
    out = ordered_sum(weight[..., None] * acc, axis=1) / safe[..., None]
    lse = jnp.where(denominator > 0, peak + jnp.log(safe), -jnp.inf)
    return out, lse
