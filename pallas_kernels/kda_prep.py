"""Pass 1 of the KDA checkpointing scan, and the chunk layout every pass shares.

Chunks: a packed batch is cut into chunks of C tokens, sequence by sequence; chunk slots
are numbered on the device from `cu_seqlens` (`chunk_slots`), so lengths are runtime
values. Inputs carry one chunk of zero rows at the end (`pad_rows`).

Pass 1, `_chunk_prep_kernel` (grid: chunk slots x heads, fully parallel), turns each
chunk of C tokens into the matrices the recurrence needs (DESIGN section 2):

    G   = in-chunk inclusive cumsum of g                         [C, K]
    Aqk = scale * tril_incl(q_i k_j exp(G_i - G_j))              [C, C]
    T   = (I + L)^-1,  L = strict_tril(beta_i k_i k_j exp(G_i - G_j))
    W   = T diag(beta) (k * exp(G))                              [C, K]
    U   = T diag(beta) v                                         [C, V]
    Qg  = scale * q * exp(G),  Kg = k * exp(G_last - G)          [C, K]

exp(G_i - G_j) is never formed as exp(G_i) * exp(-G_j) over a whole chunk: the chunk is
cut into sub-chunks of 16 rows; blocks below the diagonal use the sub-chunk boundary as the
reference point (both factors <= 1) and diagonal blocks are formed elementwise.

`KernelConfig.separate_diagonal` moves the diagonal blocks (and the inverses of the
diagonal blocks of I + L) into their own small-program pass, `_diagonal_kernel`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tiles import dot, dot_nt, dot_tn, iota, matmul_precision, operand_dtype
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


def _chunk_prep_kernel(chunk_start_ref, chunk_len_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                       *refs, scale, chunk, precision, separate_diagonal):
    """One chunk of one head. Refs are whole arrays [T_pad, H, ...]; rows past the chunk's
    length load as zeros (g = 0 keeps G flat there, k = beta = 0 adds nothing).

    separate_diagonal: the diagonal blocks of Aqk and the inverses of the diagonal blocks of
    I + L come from `_diagonal_kernel` (two more input refs, [T_pad, H, 16]) instead of a
    loop over their columns here.
    """
    if separate_diagonal:
        diag_a_ref, diag_inv_ref, *refs = refs
    w_ref, u_ref, aqk_ref, qg_ref, kg_ref, gcum_ref, glast_ref = refs
    slot, h = pl.program_id(0), pl.program_id(1)
    r0 = chunk_start_ref[slot]
    clen = chunk_len_ref[slot]
    head_k = q_ref.shape[-1]
    hi = lax.Precision.HIGHEST
    f32 = jnp.float32

    @pl.when(clen > 0)
    def _():
        def load(ref, first, rows):
            """Rows [first, first + rows) of the chunk for this head, as fp32."""
            valid = (iota((rows, 1), 0) + first) < clen
            index = (pl.ds(r0 + first, rows), h, slice(None))
            if len(ref.shape) == 2:  # beta [T, H]: a [rows, 1] column
                index = (pl.ds(r0 + first, rows), pl.ds(h, 1))
            return plgpu.load(ref.at[index], mask=valid, other=0).astype(f32)

        def store(ref, first, value):
            rows = value.shape[0]
            valid = (iota((rows, 1), 0) + first) < clen
            plgpu.store(ref.at[pl.ds(r0 + first, rows), h, :], value.astype(ref.dtype),
                        mask=valid)

        g_cum = lax.cumsum(load(g_ref, 0, chunk), axis=0)  # [C, K]
        rows_c = iota((chunk, 1), 0)
        g_last = jnp.sum(jnp.where(rows_c == chunk - 1, g_cum, 0.0), axis=0, keepdims=True)
        store(qg_ref, 0, scale * load(q_ref, 0, chunk) * jnp.exp(g_cum))
        k = load(k_ref, 0, chunk)
        store(kg_ref, 0, k * jnp.exp(g_last - g_cum))
        store(gcum_ref, 0, g_cum)
        glast_ref[pl.ds(slot, 1), h, :] = g_last

        sub_row = iota((SUB_CHUNK, 1), 0)
        cols_c = iota((1, chunk), 1)
        cols_s = iota((1, SUB_CHUNK), 1)
        t_rows = jnp.zeros((chunk, chunk), f32)  # rows of T = (I + L)^-1 solved so far
        for blk in range(chunk // SUB_CHUNK):
            first = blk * SUB_CHUNK
            # The reference point is G just before this sub-chunk: both factors below are
            # <= 1 whatever the decay.
            g_ref_pt = jnp.sum(jnp.where(rows_c == first - 1, g_cum, 0.0), axis=0,
                               keepdims=True)
            g_blk = g_ref_pt + lax.cumsum(load(g_ref, first, SUB_CHUNK), axis=0)  # [16, K]
            q_blk = load(q_ref, first, SUB_CHUNK)
            k_blk = load(k_ref, first, SUB_CHUNK)
            beta_blk = load(beta_ref, first, SUB_CHUNK)  # [16, 1]
            if blk:
                k_rise = jnp.where(rows_c < first,
                                   k * jnp.exp(jnp.minimum(g_ref_pt - g_cum, 0.0)), 0.0)
                fall = jnp.exp(g_blk - g_ref_pt)
                a_rows = dot_nt(q_blk * fall, k_rise, precision)   # [16, C]
                l_rows = dot_nt(k_blk * fall, k_rise, precision)
            else:
                a_rows = l_rows = jnp.zeros((SUB_CHUNK, chunk), f32)

            def diagonal_column(j, acc, first=first, g_blk=g_blk, q_blk=q_blk, k_blk=k_blk):
                """Column j of the diagonal block, formed elementwise (exact for any decay):
                into Aqk's rows in place, into L's diagonal block apart (l_rows needs none
                of it: those columns meet rows of t_rows not solved yet)."""
                a_acc, l_diag = acc
                row_ok = jnp.full((1, head_k), first + j < clen)
                k_j = plgpu.load(k_ref.at[pl.ds(r0 + first + j, 1), h, :], mask=row_ok,
                                 other=0).astype(f32)
                g_j = jnp.sum(jnp.where(sub_row == j, g_blk, 0.0), axis=0, keepdims=True)
                decay = jnp.exp(jnp.minimum(g_blk - g_j, 0.0))
                a_col = jnp.sum(q_blk * k_j * decay, axis=1, keepdims=True)  # [16, 1]
                l_col = jnp.sum(k_blk * k_j * decay, axis=1, keepdims=True)
                a_acc = jnp.where(cols_c == first + j, jnp.where(sub_row >= j, a_col, 0.0),
                                  a_acc)
                l_col = jnp.where(sub_row > j, l_col, 0.0)
                return a_acc, jnp.where(cols_s == j, l_col, l_diag)

            identity_rows = (cols_c == sub_row + first).astype(f32)        # [16, C]: E_b
            # Block forward substitution: (I + L_bb) T_b = E_b - L_b,<b T_<b (the columns of
            # l_rows at and past block b meet rows of t_rows not solved yet: zeros).
            if separate_diagonal:
                a_rows = a_rows + dot(load(diag_a_ref, first, SUB_CHUNK), identity_rows, hi)
                diagonal_inverse = load(diag_inv_ref, first, SUB_CHUNK)
            else:
                a_rows, l_diag = lax.fori_loop(
                    0, SUB_CHUNK, diagonal_column,
                    (a_rows, jnp.zeros((SUB_CHUNK, SUB_CHUNK), f32)))
                diagonal_inverse = _invert_unit_lower(beta_blk * l_diag)
            store(aqk_ref, first, scale * a_rows)
            rhs = identity_rows - dot(beta_blk * l_rows, t_rows, hi)
            t_blk = dot(diagonal_inverse, rhs, hi)   # [16, C]
            t_rows = t_rows + dot_tn(identity_rows, t_blk, hi)

        beta = load(beta_ref, 0, chunk)  # [C, 1]
        store(w_ref, 0, dot(t_rows, beta * k * jnp.exp(g_cum), precision))
        store(u_ref, 0, dot(t_rows, beta * load(v_ref, 0, chunk), precision))


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
               config: KernelConfig, interpret: bool, exact: bool) -> ChunkTensors:
    """Pass 1 over row-padded inputs ([T + C, H, ...], see `pad_rows`)."""
    padded, num_heads, head_k = q_p.shape
    head_v = v_p.shape[-1]
    chunk = config.chunk_size
    inter, f32 = operand_dtype(exact), jnp.float32

    def rows_of(width, dtype):
        return jax.ShapeDtypeStruct((padded, num_heads, width), dtype)

    num_slots = slots.start.shape[0]
    diagonal_blocks = ()
    if config.separate_diagonal:
        diagonal = pl.pallas_call(
            functools.partial(_diagonal_kernel, chunk=chunk),
            out_shape=(rows_of(SUB_CHUNK, f32), rows_of(SUB_CHUNK, f32)),
            grid=(num_slots * (chunk // SUB_CHUNK), num_heads),
            compiler_params=plgpu.CompilerParams(num_warps=config.diagonal_num_warps,
                                                 num_stages=1),
            interpret=interpret,
            name="kda_chunk_diagonal",
        )
        diagonal_blocks = diagonal(slots.start, slots.length, q_p, k_p, g_p, beta_p)
    prep = pl.pallas_call(
        functools.partial(_chunk_prep_kernel, scale=scale, chunk=chunk,
                          precision=matmul_precision(exact),
                          separate_diagonal=config.separate_diagonal),
        out_shape=ChunkTensors(rows_of(head_k, inter), rows_of(head_v, inter),
                               rows_of(chunk, inter), rows_of(head_k, inter),
                               rows_of(head_k, inter), rows_of(head_k, f32),
                               jax.ShapeDtypeStruct((num_slots, num_heads, head_k), f32)),
        grid=(num_slots, num_heads),
        compiler_params=plgpu.CompilerParams(num_warps=config.prep_num_warps,
                                             num_stages=config.prep_num_stages),
        interpret=interpret,
        name="kda_chunk_prep",
    )
    return ChunkTensors(*prep(slots.start, slots.length, q_p, k_p, v_p, g_p, beta_p,
                              *diagonal_blocks))
