"""DSA sparse attention over latents as one Pallas kernel lowered through Triton.

Grid: (queries, head blocks). A program holds one query's absorbed rows for `block_h` heads
([block_h, L]: heads are the matmul's M dimension, the MQA form) and walks that query's
selected latent rows `block_k` at a time: it gathers them by index ([block_k, L], the
same rows for every head), scores them, and accumulates the softmax-weighted c_kv part
(the first kv_lora columns) with an online softmax in base 2. Only the key blocks up to the
row's last valid index are visited; invalid entries inside them are masked.

Latent widths that are not a power of two (kimi's 512 + 64) are split into power-of-two
column pieces whose dot products are summed; the value pieces are the c_kv pieces of the
same loaded rows. Exponentials by one `ex2.approx.ftz` each (`tiles.exp2_ftz`; weights
below 2^-126 are zero), as in the flash kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention_pallas import LOG2_E, NEG_INIT, head_pieces
from pallas_kernels.tiles import dot, dot_nt, exp2_ftz, matmul_precision
from pallas_kernels.tuning import DeviceSpec, device_spec


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """Static tiling (hashable: a jit static argument)."""

    block_h: int = 16
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2


# Per compute capability major. All 64 heads of glm5.3-flash (latent 512) in one program, so
# each selected row is gathered once per query. H200: 64 x 64, 8 warps, 3 stages, picked by
# a sweep at 32K (bench/results/sparse_op_sweep_32K_2026-12-02.json: 38.0 ms, 238 TFLOP/s,
# where 64 x 32 took 51.1 and 16 warps or 128-row blocks were slower or did not fit); it
# needs 197,120 B and spills 104 B on sm_90 (`python -m pallas_kernels.aot`). sm_80 (163 KB)
# keeps 64 x 32 (131,200 B, no spills). GB10: 64 x 16, 8 warps, 84,032 B of its 99 KB, 224
# registers (64 x 32 needs 102,528 B). Speed: `python -m bench.sparse_attention`.
MIN_BLOCK_H = 16  # a Triton dot's smallest M
_HOPPER = SparseConfig(block_h=64, block_k=64, num_warps=8, num_stages=3)
TUNING = {
    12: SparseConfig(block_h=64, block_k=16, num_warps=8, num_stages=2),
    9: _HOPPER,
    10: _HOPPER,
    8: SparseConfig(block_h=64, block_k=32, num_warps=8, num_stages=2),
}


def select_sparse_config(*, num_heads: int, spec: DeviceSpec | None = None) -> SparseConfig:
    """The tuning table's entry for `spec` (default: this process's first device), its head
    block narrowed to the power of two covering `num_heads` when fewer, but not below
    MIN_BLOCK_H (the kernel pads the heads up to a multiple of the block)."""
    spec = spec or device_spec()
    config = TUNING.get(spec.compute_capability[0], TUNING[8])
    cover = max(MIN_BLOCK_H, 1 << (num_heads - 1).bit_length())
    return dataclasses.replace(config, block_h=min(config.block_h, cover))


def latent_pieces(kv_lora: int, rope: int) -> tuple[tuple[int, int], ...]:
    """Power-of-two column pieces of a latent row: c_kv's, then the rope part's."""
    return head_pieces(kv_lora) + tuple((kv_lora + off, width)
                                        for off, width in (head_pieces(rope) if rope else ()))


def _sparse_kernel(blocks_ref, idx_ref, q_ref, latent_ref, o_ref, lse_ref, *, block_h,
                   block_k, pieces, num_v_pieces, scale_log2, num_keys, precision, exp2):
    """One query x head block: online softmax over its selected latent rows."""
    t, heads = pl.program_id(0), pl.ds(pl.program_id(1) * block_h, block_h)
    q = [q_ref[t, heads, pl.ds(off, width)] for off, width in pieces]  # [BH, w] each

    def step(kb, carry):
        m, total, acc = carry
        idx = idx_ref[t, pl.ds(kb * block_k, block_k)]  # [BK]
        ok = (idx >= 0) & (idx < num_keys)
        rows = jnp.where(ok, idx, 0)
        kv = [latent_ref[rows, pl.ds(off, width)] for off, width in pieces]  # [BK, w]
        s = dot_nt(q[0], kv[0], precision)
        for q_piece, kv_piece in zip(q[1:], kv[1:]):
            s = s + dot_nt(q_piece, kv_piece, precision)
        s = jnp.where(ok[None, :], s * scale_log2, -jnp.inf)  # [BH, BK]
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = exp2(s - m_new)
        alpha = exp2(m - m_new)
        total = total * alpha + jnp.sum(p, axis=1, keepdims=True)
        p = p.astype(kv[0].dtype)
        acc = tuple(a * alpha + dot(p, v, precision) for a, v in zip(acc, kv[:num_v_pieces]))
        return m_new, total, acc

    carry = (jnp.full((block_h, 1), NEG_INIT, jnp.float32),
             jnp.zeros((block_h, 1), jnp.float32),
             tuple(jnp.zeros((block_h, width), jnp.float32)
                   for _, width in pieces[:num_v_pieces]))
    m, total, acc = lax.fori_loop(0, blocks_ref[t], step, carry)
    seen = total > 0
    inv = 1 / jnp.where(seen, total, 1)
    for a, (off, width) in zip(acc, pieces[:num_v_pieces]):
        o_ref[t, heads, pl.ds(off, width)] = (a * inv).astype(o_ref.dtype)
    lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, total, 1))) / LOG2_E, -jnp.inf)
    lse_ref[pl.ds(t, 1), heads] = lse.reshape(1, block_h)


@functools.partial(jax.jit, static_argnames=("kv_lora", "scale", "config", "interpret"))
def sparse_attention_pallas(q, latent, indices, *, kv_lora: int, scale: float,
                            config: SparseConfig, interpret: bool):
    """q [T, H, L], latent [S, L], indices int32 [T, K] (outside [0, S): no key).

    Returns o [T, H, kv_lora] in q's dtype (zero on rows without keys) and lse fp32 [T, H].
    """
    num_queries, num_heads, width = q.shape
    num_keys, block_h, block_k = latent.shape[0], config.block_h, config.block_k
    padded_h = -(-num_heads // block_h) * block_h  # zero query heads, sliced off after
    q = jnp.pad(q, ((0, 0), (0, padded_h - num_heads), (0, 0)))
    pad = -indices.shape[1] % block_k
    indices = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    valid = (indices >= 0) & (indices < num_keys)
    last = jnp.max(jnp.where(valid, jnp.arange(1, indices.shape[1] + 1), 0), axis=1)
    blocks = (-(-last // block_k)).astype(jnp.int32)  # [T] key blocks each row visits
    pieces = latent_pieces(kv_lora, width - kv_lora)
    kernel = functools.partial(
        _sparse_kernel, block_h=block_h, block_k=block_k, pieces=pieces,
        num_v_pieces=len(head_pieces(kv_lora)), scale_log2=scale * LOG2_E, num_keys=num_keys,
        precision=matmul_precision(q.dtype == jnp.float32),
        exp2=jnp.exp2 if interpret else exp2_ftz)
    o, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((num_queries, padded_h, kv_lora), q.dtype),
                   jax.ShapeDtypeStruct((num_queries, padded_h), jnp.float32)),
        grid=(num_queries, padded_h // block_h),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="sparse_attention",
    )(blocks, indices, q, latent.astype(q.dtype))
    return o[:, :num_heads], lse[:, :num_heads]
