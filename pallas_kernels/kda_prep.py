"""Pass 1 of the KDA checkpointing scan, and the chunk layout every pass shares.

Chunks: a packed batch is cut into chunks of C tokens, sequence by sequence; chunk slots
are numbered on the device from `cu_seqlens` (`chunk_slots`), so lengths are runtime
values. Inputs carry one chunk of zero rows at the end (`pad_rows`).

Pass 1 turns each chunk of C tokens into the matrices the recurrence needs (DESIGN
section 2), as small fully parallel programs (many share an SM and hide each other's
latency):

    G   = in-chunk inclusive cumsum of g                         [C, K]
    Aqk = scale * tril_incl(q_i k_j exp(G_i - G_j))              [C, C]
    T   = (I + L)^-1,  L = strict_tril(beta_i k_i k_j exp(G_i - G_j))
    W   = T diag(beta) (k * exp(G))                              [C, K]
    U   = T diag(beta) v                                         [C, V]
    Qg  = scale * q * exp(G),  Kg = k * exp(G_last - G)          [C, K]

1. `_intra_kernel` (grid: chunk slots x heads x 16-row blocks): G, Qg, Kg and the block's
   rows of Aqk and L. exp(G_i - G_j) is never formed as exp(G_i) * exp(-G_j) over a whole
   chunk: it is exp(G_i - R) * exp(R - G_j) with R = G just before the row block, so the
   columns left of the diagonal block are one [16, K] x [K, C] matmul with both factors
   <= 1. The diagonal 16 x 16 block:
   - bounded gates (`gate_lower_bound` b >= -5: g >= b everywhere): one more matmul, with
     R = G at the block's middle row, so both factors stay within exp(8 |b|) ~ e^40
     (products of factors near fp32's range ends would lose precision);
   - any decay (`gate_lower_bound=None`): from `_diagonal_kernel`, which forms the block
     elementwise with every exponent <= 0.
2. `_solve_kernel` (grid: chunk slots x heads): T by blocks, T_bb = (I + L_bb)^-1 and
   T_bc = -T_bb sum_{c <= m < b} L_bm T_mc, then W and U block row by block row.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tiles import dot, dot_nt, iota, matmul_precision, operand_dtype
from pallas_kernels.tuning import KernelConfig

SUB_CHUNK = 16  # rows per sub-chunk: the smallest tile a Triton dot accepts


def _invert_unit_lower(l_blk):
    """(I + L)^-1 for a strictly lower triangular [16, 16] L, as a product of matmuls.

    (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8) because L^16 = 0.
    """
    hi = lax.Precision.HIGHEST
    eye = (iota(l_blk.shape, 0) == iota(l_blk.shape, 1)).astype(jnp.float32)
    l2 = dot(l_blk, l_blk, hi)
    l4 = dot(l2, l2, hi)
    l8 = dot(l4, l4, hi)
    inv = dot(eye - l_blk, eye + l2, hi)
    inv = dot(inv, eye + l4, hi)
    return dot(inv, eye + l8, hi)


def _diagonal_kernel(chunk_start_ref, chunk_len_ref, q_ref, k_ref, g_ref, beta_ref, a_ref,
                     inv_ref, *, chunk):
    """One 16-row sub-chunk of one head: its diagonal [16, 16] block of Aqk (inclusive,
    before scale) and the inverse (I + diag(beta) L_bb)^-1 of its block of I + L, both
    stored at the sub-chunk's rows ([T_pad, H, 16], fp32).

    Formed column by column from register tiles, every exponent <= 0 (exact for any
    decay); small programs, so many share an SM and hide each other's latency.
    """
    sub, h = pl.program_id(0), pl.program_id(1)
    slot = sub // (chunk // SUB_CHUNK)
    first = (sub % (chunk // SUB_CHUNK)) * SUB_CHUNK
    clen = chunk_len_ref[slot]
    f32 = jnp.float32

    @pl.when(first < clen)
    def _():
        sub_row = iota((SUB_CHUNK, 1), 0)
        valid = sub_row + first < clen
        rows = pl.ds(chunk_start_ref[slot] + first, SUB_CHUNK)

        def load(ref):
            return plgpu.load(ref.at[rows, h, :], mask=valid, other=0).astype(f32)

        q, k = load(q_ref), load(k_ref)
        g_blk = lax.cumsum(load(g_ref), axis=0)  # G relative to the sub-chunk's start
        beta = plgpu.load(beta_ref.at[rows, pl.ds(h, 1)], mask=valid, other=0).astype(f32)
        cols = iota((1, SUB_CHUNK), 1)
        a_blk = l_blk = jnp.zeros((SUB_CHUNK, SUB_CHUNK), f32)
        for j in range(SUB_CHUNK):
            at_j = sub_row == j
            k_j = jnp.sum(jnp.where(at_j, k, 0.0), axis=0, keepdims=True)  # [1, K]
            g_j = jnp.sum(jnp.where(at_j, g_blk, 0.0), axis=0, keepdims=True)
            k_dec = k_j * jnp.exp(jnp.minimum(g_blk - g_j, 0.0))  # [16, K]
            a_col = jnp.sum(q * k_dec, axis=1, keepdims=True)  # [16, 1]
            l_col = jnp.sum(k * k_dec, axis=1, keepdims=True)
            a_blk = jnp.where(cols == j, jnp.where(sub_row >= j, a_col, 0.0), a_blk)
            l_blk = jnp.where(cols == j, jnp.where(sub_row > j, l_col, 0.0), l_blk)
        plgpu.store(a_ref.at[rows, h, :], a_blk, mask=valid)
        plgpu.store(inv_ref.at[rows, h, :], _invert_unit_lower(beta * l_blk), mask=valid)


def _intra_kernel(chunk_start_ref, chunk_len_ref, q_ref, k_ref, g_ref, beta_ref, *refs,
                  scale, chunk, precision, bounded):
    """Rows [16 b, 16 b + 16) of one chunk and head (b = program_id(2)): G, Qg, Kg, and
    the block's rows of Aqk (operand dtype, scaled) and L (fp32, beta folded in).

    Refs are whole arrays [T_pad, H, ...]; rows past the chunk's length load as zeros
    (g = 0 keeps G flat there, k = beta = 0 adds nothing). bounded: gates are bounded
    (diagonal blocks by matmul here); otherwise the diagonal blocks of Aqk come from
    `_diagonal_kernel` (one more input ref, [T_pad, H, 16]).
    """
    if not bounded:
        diag_a_ref, *refs = refs
    aqk_ref, l_ref, qg_ref, kg_ref, gcum_ref, glast_ref = refs
    slot, h, blk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r0 = chunk_start_ref[slot]
    clen = chunk_len_ref[slot]
    first = blk * SUB_CHUNK
    f32 = jnp.float32

    @pl.when(first < clen)
    def _():
        def load(ref, start, rows):
            """Rows [start, start + rows) of the chunk for this head, as fp32."""
            valid = (iota((rows, 1), 0) + start) < clen
            index = (pl.ds(r0 + start, rows), h, slice(None))
            if len(ref.shape) == 2:  # beta [T, H]: a [rows, 1] column
                index = (pl.ds(r0 + start, rows), pl.ds(h, 1))
            return plgpu.load(ref.at[index], mask=valid, other=0).astype(f32)

        def store(ref, value):
            valid = (iota((SUB_CHUNK, 1), 0) + first) < clen
            plgpu.store(ref.at[pl.ds(r0 + first, SUB_CHUNK), h, :], value.astype(ref.dtype),
                        mask=valid)

        rows_c = iota((chunk, 1), 0)
        g_chunk = load(g_ref, 0, chunk)                                     # [C, K]
        g_before = jnp.sum(jnp.where(rows_c < first, g_chunk, 0.0), axis=0, keepdims=True)
        g_last = jnp.sum(g_chunk, axis=0, keepdims=True)                    # [1, K]
        g_rise = lax.cumsum(load(g_ref, first, SUB_CHUNK), axis=0)         # G - g_before
        g_blk = g_before + g_rise                                           # [16, K]
        q_blk, k_blk = load(q_ref, first, SUB_CHUNK), load(k_ref, first, SUB_CHUNK)
        store(qg_ref, scale * q_blk * jnp.exp(g_blk))
        store(kg_ref, k_blk * jnp.exp(g_last - g_blk))
        store(gcum_ref, g_blk)

        @pl.when(blk == 0)
        def _():
            glast_ref[pl.ds(slot, 1), h, :] = g_last

        # Left of the diagonal block: exp(G_i - G_j) = exp(G_i - R) exp(R - G_j) with R = G
        # just before the block, both factors <= 1.
        g_chunk = lax.cumsum(g_chunk, axis=0)                               # G [C, K]
        keys_before = jnp.where(rows_c < first,
                                load(k_ref, 0, chunk) * jnp.exp(g_before - g_chunk), 0.0)
        q_dec, k_dec = q_blk * jnp.exp(g_rise), k_blk * jnp.exp(g_rise)
        a_rows = dot_nt(q_dec, keys_before, precision)                      # [16, C]
        l_rows = dot_nt(k_dec, keys_before, precision)
        position = iota((SUB_CHUNK, 1), 0) + first
        cols_c = iota((1, chunk), 1)
        placement = (cols_c == position).astype(f32)    # [16, C]: block column j -> first + j
        if bounded:
            # The diagonal block: R = G at the block's middle row, so both factors stay
            # within exp(8 |b|) (~e^40 at b = -5): no overflow, and no subnormal factor.
            sub_row = iota((SUB_CHUNK, 1), 0)
            g_mid = jnp.sum(jnp.where(sub_row == SUB_CHUNK // 2 - 1, g_rise, 0.0), axis=0,
                            keepdims=True)
            fall = jnp.exp(g_rise - g_mid)
            k_rise = k_blk * jnp.exp(g_mid - g_rise)
            a_diag = dot_nt(q_blk * fall, k_rise, precision)                # [16, 16]
            l_rows = l_rows + dot(dot_nt(k_blk * fall, k_rise, precision), placement,
                                  lax.Precision.HIGHEST)
        else:
            a_diag = load(diag_a_ref, first, SUB_CHUNK)
        a_rows = a_rows + dot(a_diag, placement, lax.Precision.HIGHEST)
        store(aqk_ref, jnp.where(cols_c <= position, scale * a_rows, 0.0))
        beta_blk = load(beta_ref, first, SUB_CHUNK)                         # [16, 1]
        store(l_ref, jnp.where(cols_c < position, beta_blk * l_rows, 0.0))


def _solve_kernel(chunk_start_ref, chunk_len_ref, k_ref, v_ref, beta_ref, gcum_ref, l_ref,
                  *refs, chunk, precision, exact_diagonal):
    """One chunk of one head: T = (I + L)^-1 by 16 x 16 blocks, then W and U.

    exact_diagonal: the inverses of the diagonal blocks come from `_diagonal_kernel` (one
    more input ref, [T_pad, H, 16]) instead of being formed here from L's diagonal blocks.
    """
    if exact_diagonal:
        diag_inv_ref, *refs = refs
    w_ref, u_ref = refs
    slot, h = pl.program_id(0), pl.program_id(1)
    r0 = chunk_start_ref[slot]
    clen = chunk_len_ref[slot]
    hi = lax.Precision.HIGHEST
    f32 = jnp.float32
    blocks = chunk // SUB_CHUNK

    @pl.when(clen > 0)
    def _():
        def rows(b):
            valid = (iota((SUB_CHUNK, 1), 0) + b * SUB_CHUNK) < clen
            return pl.ds(r0 + b * SUB_CHUNK, SUB_CHUNK), valid

        def load(ref, b, cols=slice(None)):
            """Row block b of this head, as fp32; beta [T, H] loads as a [16, 1] column."""
            index, valid = rows(b)
            at = ref.at[index, pl.ds(h, 1)] if len(ref.shape) == 2 else ref.at[index, h, cols]
            return plgpu.load(at, mask=valid, other=0).astype(f32)

        def l_block(b, c):
            return load(l_ref, b, pl.ds(c * SUB_CHUNK, SUB_CHUNK))

        t = {}
        for b in range(blocks):
            t[b, b] = (load(diag_inv_ref, b) if exact_diagonal
                       else _invert_unit_lower(l_block(b, b)))
            for c in range(b - 1, -1, -1):
                coupled = sum(dot(l_block(b, m), t[m, c], hi) for m in range(c, b))
                t[b, c] = -dot(t[b, b], coupled, hi)
        for b in range(blocks):
            w = u = 0.0
            for c in range(b + 1):
                beta = load(beta_ref, c)
                w = w + dot(t[b, c], beta * load(k_ref, c) * jnp.exp(load(gcum_ref, c)),
                            precision)
                u = u + dot(t[b, c], beta * load(v_ref, c), precision)
            index, valid = rows(b)
            plgpu.store(w_ref.at[index, h, :], w.astype(w_ref.dtype), mask=valid)
            plgpu.store(u_ref.at[index, h, :], u.astype(u_ref.dtype), mask=valid)


def _chunk_slots(cu_seqlens, num_slots, chunk):
    """Start row and length of every chunk, sequence by sequence, padded to num_slots.

    Returns (chunk_start, chunk_len) int32 [num_slots] (unused slots have length 0) and
    each sequence's first chunk slot, int32 [N].
    """
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    chunks_per_seq = (lens + chunk - 1) // chunk
    first = jnp.cumsum(chunks_per_seq) - chunks_per_seq
    slot = jnp.arange(num_slots, dtype=jnp.int32)
    seq = jnp.searchsorted(first + chunks_per_seq, slot, side="right").astype(jnp.int32)
    in_range = seq < lens.shape[0]
    seq_c = jnp.minimum(seq, lens.shape[0] - 1)
    local = slot - first[seq_c]
    start = cu_seqlens[seq_c] + local * chunk
    length = jnp.clip(cu_seqlens[seq_c + 1] - start, 0, chunk)
    return (jnp.where(in_range, start, 0).astype(jnp.int32),
            jnp.where(in_range, length, 0).astype(jnp.int32), first.astype(jnp.int32))


class ChunkSlots(NamedTuple):
    """Where the chunks are: slots are numbered sequence by sequence (see `chunk_slots`)."""

    start: jax.Array       # int32 [S]: first row of each chunk slot
    length: jax.Array      # int32 [S]: rows in the slot, 0 for unused slots
    first_slot: jax.Array  # int32 [N]: each sequence's first slot


class ChunkTensors(NamedTuple):
    """What the prep pass hands the scan, per padded row and head ([T + C, H, ...]).

    W, U, Aqk, Qg, Kg are stored in the operand dtype (bf16 on the fast path, fp32 when
    exact); G and G_last stay fp32.
    """

    w: jax.Array      # [T + C, H, K]
    u: jax.Array      # [T + C, H, V]
    aqk: jax.Array    # [T + C, H, C]
    qg: jax.Array     # [T + C, H, K]
    kg: jax.Array     # [T + C, H, K]
    g_cum: jax.Array  # [T + C, H, K] fp32
    g_last: jax.Array  # [S, H, K] fp32: G at each chunk slot's last row


def pad_rows(x, chunk):
    """Append one chunk of zero rows, so every chunk window [r0, r0 + C) is in bounds."""
    return jnp.pad(x, [(0, chunk)] + [(0, 0)] * (x.ndim - 1))


def chunk_slots(cu_seqlens, num_tokens, chunk) -> ChunkSlots:
    """ceil(T / C) + N chunk slots: enough for any split of T rows into N sequences."""
    num_slots = -(-num_tokens // chunk) + cu_seqlens.shape[0] - 1
    return ChunkSlots(*_chunk_slots(cu_seqlens, num_slots, chunk))


def chunk_prep(q_p, k_p, v_p, g_p, beta_p, slots: ChunkSlots, *, scale: float,
               gate_lower_bound: float | None, config: KernelConfig, interpret: bool,
               exact: bool) -> ChunkTensors:
    """Pass 1 over row-padded inputs ([T + C, H, ...], see `pad_rows`).

    gate_lower_bound: None for any decay (diagonal blocks elementwise, `_diagonal_kernel`),
    or the bound b in [-5, 0) the caller guarantees for every g (diagonal blocks on the
    tensor cores).
    """
    padded, num_heads, head_k = q_p.shape
    head_v = v_p.shape[-1]
    chunk = config.chunk_size
    inter, f32 = operand_dtype(exact), jnp.float32
    precision = matmul_precision(exact)
    exact_diagonal = gate_lower_bound is None
    num_slots = slots.start.shape[0]

    def rows_of(width, dtype):
        return jax.ShapeDtypeStruct((padded, num_heads, width), dtype)

    def params(num_warps):
        return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)

    diagonal_a, diagonal_inv = (), ()
    if exact_diagonal:
        diagonal = pl.pallas_call(
            functools.partial(_diagonal_kernel, chunk=chunk),
            out_shape=(rows_of(SUB_CHUNK, f32), rows_of(SUB_CHUNK, f32)),
            grid=(num_slots * (chunk // SUB_CHUNK), num_heads),
            compiler_params=params(config.diagonal_num_warps),
            interpret=interpret,
            name="kda_chunk_diagonal",
        )
        a, inv = diagonal(slots.start, slots.length, q_p, k_p, g_p, beta_p)
        diagonal_a, diagonal_inv = (a,), (inv,)
    intra = pl.pallas_call(
        functools.partial(_intra_kernel, scale=scale, chunk=chunk, precision=precision,
                          bounded=not exact_diagonal),
        out_shape=(rows_of(chunk, inter), rows_of(chunk, f32), rows_of(head_k, inter),
                   rows_of(head_k, inter), rows_of(head_k, f32),
                   jax.ShapeDtypeStruct((num_slots, num_heads, head_k), f32)),
        grid=(num_slots, num_heads, chunk // SUB_CHUNK),
        compiler_params=params(config.intra_num_warps),
        interpret=interpret,
        name="kda_chunk_intra",
    )
    aqk, l_mat, qg, kg, g_cum, g_last = intra(slots.start, slots.length, q_p, k_p, g_p,
                                              beta_p, *diagonal_a)
    solve = pl.pallas_call(
        functools.partial(_solve_kernel, chunk=chunk, precision=precision,
                          exact_diagonal=exact_diagonal),
        out_shape=(rows_of(head_k, inter), rows_of(head_v, inter)),
        grid=(num_slots, num_heads),
        compiler_params=params(config.solve_num_warps),
        interpret=interpret,
        name="kda_chunk_solve",
    )
    w, u = solve(slots.start, slots.length, k_p, v_p, beta_p, g_cum, l_mat, *diagonal_inv)
    return ChunkTensors(w, u, aqk, qg, kg, g_cum, g_last)
