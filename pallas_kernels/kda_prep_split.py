"""Pass 1 of the KDA checkpointing scan, split design (`KernelConfig.prep_design="split"`).

What `pallas_kernels.kda_prep` hands the scan (`ChunkTensors`: W, U, Aqk, Qg, Kg, G_last;
DESIGN section 2; g in place of G, below), from two kernels instead of a per-chunk kernel
that loops over key slices and a W/U kernel:

1. `_intra_kernel` (`kda_prep_intra`), one program per 16-row sub-chunk b and head (1 warp
   by default: a [16, 16] product fills one warp, and more warps only repeat it), over
   slices of `intra_block_k` key columns (a loop carrying 2 x C / 16 [16, 16] sums):
   - row block b of Aqk and of L (beta_b L_bc): the earlier blocks c < b one
     [16, BK] x [BK, 16] product each for Aqk and L, under `lax.cond(c < b)`. Reference:
     G just before block b, so exp(G_i - G_j) = exp(G_i - E) exp(E - G_j) with both
     factors <= 1, every exponent from block-local cumsums and block totals, as in the
     fused design;
   - the diagonal block: bounded gates by two more products with the reference at the
     block's middle row (factors within exp(8 |b|)); any decay by halving segments
     (`_diagonal_by_levels`: four levels of masked products, every exponent <= 0);
   - T_bb = (I + beta L_bb)^-1 by forward substitution, stored in place of L_bb;
   - Qg, Kg and `kb` = beta k exp(G) (operand dtype: the right-hand side of W, so that
     the solve reads no fp32 G), and G_last (by sub-chunk 0). G itself is not stored:
     `ChunkTensors.g_cum` is g, which the scan sums over a chunk where it takes a snapshot.
2. `_solve_kernel` (`kda_prep_solve`), one program per chunk and head: T by 16 x 16 blocks,
   T_bc = -T_bb sum_{c <= m < b} L_bm T_mc (TF32 products on the fast path, IEEE fp32 when
   exact, as the fused design), then W = T kb and U = T diag(beta) v by row blocks,
   W_b = sum_{c <= b} T_bc kb_c: [16, 16] x [16, K] products on the operand dtype (bf16 on
   the fast path: T rounded as the fused design's W/U rounds it), only the lower blocks.

On the fast path the exponentials are `exp2` of exponents scaled by log2(e) (one multiply
and one MUFU instruction instead of libdevice's accurate `expf`); when exact, `exp`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda_prep import (
    SUB_CHUNK,
    ChunkSlots,
    ChunkTensors,
    invert_by_substitution,
)
from pallas_kernels.tiles import dot, dot_nt, iota, load_rows, matmul_precision, operand_dtype
from pallas_kernels.tuning import KernelConfig

LOG2_E = math.log2(math.e)


def _exponential(exact):
    """exp: IEEE `exp` when exact, else `exp2(x log2 e)` (~2 ulp, far below bf16's step)."""
    return jnp.exp if exact else (lambda x: jnp.exp2(x * LOG2_E))


def _row_of(x, row):
    """Row `row` of a [16, N] tile as [1, N]."""
    return jnp.sum(jnp.where(iota((x.shape[0], 1), 0) == row, x, 0.0), axis=0, keepdims=True)


def _diagonal_by_levels(q, k, g, rise, precision, exp):
    """The diagonal [16, 16] blocks of Aqk (inclusive, before scale) and L (strict, before
    beta) of one sub-chunk for any decay, on [16, BK] slices: q, k fp32, g the gates, rise
    their cumsum from the sub-chunk's start.

    Every pair i > j is in one segment of 2h rows (h = 8, 4, 2, 1) with i in its upper
    half and j in its lower half; its factor is exp(G_i - E) exp(E - G_j), E = G at the
    lower half's last row, both exponents <= 0 (any decay). So four levels of two masked
    [16, BK] x [BK, 16] products (Aqk's, L's) and q . k on the diagonal replace a 16-step
    column loop. At h = 1, E is row i - 1: the q-side exponent is g_i itself.
    """
    rows, cols = iota((SUB_CHUNK, 1), 0), iota((1, SUB_CHUNK), 1)
    a_blk = jnp.where(cols == rows, jnp.sum(q * k, axis=1, keepdims=True), 0.0)
    l_blk = jnp.zeros_like(a_blk)
    half = SUB_CHUNK // 2
    while half:
        segment = 2 * half
        upper = rows % segment >= half  # [16, 1]
        if half == 1:
            q_side, k_side = jnp.where(upper, exp(g), 0.0), jnp.where(upper, 0.0, k)
        else:
            ref = jnp.zeros_like(rise)  # E, row by row
            for start in range(0, SUB_CHUNK, segment):
                inside = (rows >= start) & (rows < start + segment)
                ref = jnp.where(inside, _row_of(rise, start + half - 1), ref)
            q_side = jnp.where(upper, exp(jnp.minimum(rise - ref, 0.0)), 0.0)
            k_side = jnp.where(upper, 0.0, k * exp(jnp.minimum(ref - rise, 0.0)))
        same = rows // segment == cols // segment
        a_blk += jnp.where(same, dot_nt(q * q_side, k_side, precision), 0.0)
        l_blk += jnp.where(same, dot_nt(k * q_side, k_side, precision), 0.0)
        half //= 2
    return a_blk, l_blk


def _intra_kernel(chunk_start_ref, chunk_len_ref, q_ref, k_ref, g_ref, beta_ref,
                  aqk_ref, m_ref, qg_ref, kg_ref, kb_ref, glast_ref, *,
                  scale, chunk, block_k, precision, bounded, exact):
    """Sub-chunk b of one chunk of one head (see the module docstring).

    Refs are whole arrays [T', H, ...]; rows past the chunk's length load as zeros
    (g = 0 keeps G flat there, k = beta = 0 adds nothing) and are not stored. Stores row
    block b of Aqk [T', H, C] (operand dtype, scaled, zeros above the diagonal) and of
    M [T', H, C] (fp32: beta_b L_bc for c < b, T_bb at c = b, nothing above), and the
    block's rows of Qg, Kg, kb (operand dtype); G_last [S, H, K] (fp32). G itself is not
    stored: the scan sums g over the chunk where it takes a snapshot.
    """
    sub, h = pl.program_id(0), pl.program_id(1)
    blocks = chunk // SUB_CHUNK
    slot, b = sub // blocks, sub % blocks
    r0, clen = chunk_start_ref[slot], chunk_len_ref[slot]
    f32 = jnp.float32
    exp = _exponential(exact)
    sub_row, col = iota((SUB_CHUNK, 1), 0), iota((1, SUB_CHUNK), 1)
    zeros = jnp.zeros((SUB_CHUNK, SUB_CHUNK), f32)

    def rows(c):
        return pl.ds(r0 + c * SUB_CHUNK, SUB_CHUNK), sub_row + c * SUB_CHUNK < clen

    def load(ref, c, cols=slice(None)):
        index, valid = rows(c)
        return load_rows(ref, index, h, valid, cols)

    def store(ref, value, cols=slice(None)):
        index, valid = rows(b)
        plgpu.store(ref.at[index, h, cols], value.astype(ref.dtype), mask=valid)

    def block_cols(c):
        start = c * SUB_CHUNK if isinstance(c, int) else pl.multiple_of(c * SUB_CHUNK, SUB_CHUNK)
        return pl.ds(start, SUB_CHUNK)

    def key_slice(index, sums):
        """One slice of `block_k` key columns: Qg, Kg, kb stored, its part of the
        blocks (b, c) of Aqk and L added to `sums` (Aqk's, L's: one [16, 16] per earlier
        block c < blocks - 1, then the diagonal block). A loop, not unrolled."""
        a_sums, l_sums = list(sums[0]), list(sums[1])
        cols = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
        q, k, g = load(q_ref, b, cols), load(k_ref, b, cols), load(g_ref, b, cols)
        rise = lax.cumsum(g, axis=0)  # G minus G just before block b
        total = _row_of(rise, SUB_CHUNK - 1)
        fall = exp(rise)                                  # <= 1
        q_fall, k_fall = q * fall, k * fall

        def pair(c, between):
            """Block (b, c); `between` is the sum of g over blocks c + 1 .. b - 1, so G just
            before block b minus G_j is between + total_c - rise_c(j) <= 0."""
            rise_c = lax.cumsum(load(g_ref, c, cols), axis=0)
            total_c = _row_of(rise_c, SUB_CHUNK - 1)
            keys = load(k_ref, c, cols) * exp(between + total_c - rise_c)
            return (dot_nt(q_fall, keys, precision), dot_nt(k_fall, keys, precision),
                    between + total_c)

        between = jnp.zeros_like(total)
        for c in range(blocks - 2, -1, -1):  # only c < b contribute
            a_bc, l_bc, between = lax.cond(c < b, functools.partial(pair, c),
                                           lambda x: (zeros, zeros, x), between)
            a_sums[c] += a_bc
            l_sums[c] += l_bc
        if bounded:
            # Reference G at the block's middle row: both factors within exp(8 |b|).
            mid = _row_of(rise, SUB_CHUNK // 2 - 1)
            centred, keys = exp(rise - mid), k * exp(mid - rise)
            a_bb = dot_nt(q * centred, keys, precision)
            l_bb = dot_nt(k * centred, keys, precision)
        else:
            a_bb, l_bb = _diagonal_by_levels(q, k, g, rise, precision, exp)
        a_sums[-1] += a_bb
        l_sums[-1] += l_bb

        after = jnp.zeros_like(total)  # the sum of g over blocks after b
        for c in range(1, blocks):
            after = lax.cond(
                c > b, lambda x, c=c: x + jnp.sum(load(g_ref, c, cols), axis=0, keepdims=True),
                lambda x: x, after)
        decay = exp(between + rise)  # G; `between` now sums all blocks before b
        store(qg_ref, scale * q * decay, cols)
        store(kb_ref, load(beta_ref, b) * k * decay, cols)
        store(kg_ref, k * exp(after + total - rise), cols)

        @pl.when(b == 0)
        def _():
            glast_ref[pl.ds(slot, 1), h, cols] = total + after

        return tuple(a_sums), tuple(l_sums)

    @pl.when(b * SUB_CHUNK < clen)
    def _():
        no_sums = (zeros,) * blocks
        a_sums, l_sums = lax.fori_loop(0, q_ref.shape[-1] // block_k, key_slice,
                                       (no_sums, no_sums))
        beta = load(beta_ref, b)  # [16, 1]
        for c in range(blocks - 1):
            @pl.when(c < b)
            def _(c=c):
                store(aqk_ref, scale * a_sums[c], block_cols(c))
                store(m_ref, beta * l_sums[c], block_cols(c))
        store(aqk_ref, scale * jnp.where(col <= sub_row, a_sums[-1], 0.0), block_cols(b))
        store(m_ref, invert_by_substitution(jnp.where(col < sub_row, beta * l_sums[-1], 0.0)),
              block_cols(b))
        index, valid = rows(b)
        above = iota((1, chunk), 1) >= (b + 1) * SUB_CHUNK
        plgpu.store(aqk_ref.at[index, h, :], jnp.zeros((SUB_CHUNK, chunk), aqk_ref.dtype),
                    mask=valid & above)


def _solve_kernel(chunk_start_ref, chunk_len_ref, m_ref, kb_ref, v_ref, beta_ref,
                  w_ref, u_ref, *, chunk, precision):
    """One chunk of one head: T by blocks from M, then W = T kb, U = T diag(beta) v
    ([T', H, K] and [T', H, V], operand dtype), by row blocks."""
    slot, h = pl.program_id(0), pl.program_id(1)
    r0, clen = chunk_start_ref[slot], chunk_len_ref[slot]
    blocks = chunk // SUB_CHUNK
    sub_row = iota((SUB_CHUNK, 1), 0)
    op = w_ref.dtype  # bf16 operands on the fast path, fp32 when exact

    def rows(b):
        return pl.ds(r0 + b * SUB_CHUNK, SUB_CHUNK), sub_row + b * SUB_CHUNK < clen

    def load(ref, b, cols=slice(None)):
        index, valid = rows(b)
        return load_rows(ref, index, h, valid, cols)

    def store(ref, b, value):
        index, valid = rows(b)
        plgpu.store(ref.at[index, h, :], value.astype(ref.dtype), mask=valid)

    @pl.when(clen > 0)
    def _():
        m = {(b, c): load(m_ref, b, pl.ds(c * SUB_CHUNK, SUB_CHUNK))
             for b in range(blocks) for c in range(b + 1)}
        t = {}
        for b in range(blocks):
            t[b, b] = m[b, b]
            for c in range(b - 1, -1, -1):
                coupled = sum(dot(m[b, j], t[j, c], precision) for j in range(c, b))
                t[b, c] = -dot(t[b, b], coupled, precision)
        kb = [load(kb_ref, c).astype(op) for c in range(blocks)]
        bv = [(load(beta_ref, c) * load(v_ref, c)).astype(op) for c in range(blocks)]
        for b in range(blocks):
            t_b = [t[b, c].astype(op) for c in range(b + 1)]
            store(w_ref, b, sum(dot(t_b[c], kb[c], precision) for c in range(b + 1)))
            store(u_ref, b, sum(dot(t_b[c], bv[c], precision) for c in range(b + 1)))


class SplitMatrices(NamedTuple):
    """What `chunk_matrices` hands `chunk_w_u`, per row and head ([T', H, ...])."""

    aqk: jax.Array     # [T', H, C] operand dtype
    m: jax.Array       # [T', H, C] fp32: beta L below the diagonal blocks, T_bb on them
    qg: jax.Array      # [T', H, K] operand dtype
    kg: jax.Array      # [T', H, K] operand dtype
    kb: jax.Array      # [T', H, K] operand dtype: beta k exp(G)
    g_last: jax.Array  # [S, H, K] fp32
    g: jax.Array       # [T', H, K]: the gates as given (for the scan's snapshots)


def _rows_of(x, width, dtype):
    return jax.ShapeDtypeStruct((*x.shape[:2], width), dtype)


def chunk_matrices(q, k, g, beta, slots: ChunkSlots, *, scale: float, bounded_gates: bool,
                   config: KernelConfig, interpret: bool, exact: bool) -> SplitMatrices:
    """`kda_prep_intra` over [T', H, K] inputs (see `kda_prep.chunk_prep`)."""
    head_k, chunk = q.shape[-1], config.chunk_size
    inter, f32 = operand_dtype(exact), jnp.float32
    num_slots = slots.start.shape[0]
    intra = pl.pallas_call(
        functools.partial(_intra_kernel, scale=scale, chunk=chunk,
                          block_k=min(config.intra_block_k, head_k),
                          precision=matmul_precision(exact), bounded=bounded_gates,
                          exact=exact),
        out_shape=(
            _rows_of(q, chunk, inter), _rows_of(q, chunk, f32), _rows_of(q, head_k, inter),
            _rows_of(q, head_k, inter), _rows_of(q, head_k, inter),
            jax.ShapeDtypeStruct((num_slots, q.shape[1], head_k), f32)),
        grid=(num_slots * (chunk // SUB_CHUNK), q.shape[1]),
        compiler_params=plgpu.CompilerParams(num_warps=config.intra_num_warps, num_stages=1),
        interpret=interpret,
        name="kda_prep_intra",
    )
    return SplitMatrices(*intra(slots.start, slots.length, q, k, g, beta), g=g)


def chunk_w_u(matrices: SplitMatrices, k, v, beta, slots: ChunkSlots, *,
              config: KernelConfig, interpret: bool, exact: bool) -> ChunkTensors:
    """`kda_prep_solve`: T, then W and U; returns everything the scan needs."""
    del k  # the split design reads kb = beta k exp(G) instead
    inter = operand_dtype(exact)
    solve = pl.pallas_call(
        functools.partial(_solve_kernel, chunk=config.chunk_size,
                          precision=matmul_precision(exact)),
        out_shape=(_rows_of(v, matrices.kb.shape[-1], inter), _rows_of(v, v.shape[-1], inter)),
        grid=(slots.start.shape[0], v.shape[1]),
        compiler_params=plgpu.CompilerParams(num_warps=config.solve_num_warps, num_stages=1),
        interpret=interpret,
        name="kda_prep_solve",
    )
    w, u = solve(slots.start, slots.length, matrices.m, matrices.kb, v, beta)
    m = matrices
    return ChunkTensors(w, u, m.aqk, m.qg, m.kg, m.g, m.g_last)
