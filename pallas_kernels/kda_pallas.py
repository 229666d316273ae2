"""The KDA checkpointing scan as three Pallas kernels lowered through Triton.

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

Pass 2, `_recurrence_kernel` (grid: sequences x heads x value blocks), runs the
chunk-to-chunk recurrence in one program's `fori_loop`, with only the two matmuls the
recurrence depends on:

    store S (the chunk's entry state);   Vnew = U - W S;   S <- diag(exp(G_last)) S + Kg^T Vnew

and stores a snapshot whenever a checkpoint offset falls inside the chunk:
    S_p = diag(exp(G_{p-1})) S_in + (k * exp(G_{p-1} - G) * [j < p])^T Vnew.

Pass 3, `_output_kernel` (grid: chunk slots x heads x value blocks, fully parallel):
    O = Qg S_entry + Aqk Vnew.

Intermediates are fp32; on the fast path the matmul operands W, U, Aqk, Qg, Kg, Vnew and
the entry states are stored in bf16. Rows past a sequence's end are masked on every load, so chunks
never see the next sequence's rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tuning import KernelConfig

SUB_CHUNK = 16  # rows per sub-chunk: the smallest tile a Triton dot accepts


def _dot(a, b, precision):
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _dot_tn(a, b, precision):
    """a^T @ b without materialising the transpose."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_nt(a, b, precision):
    """a @ b^T."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _invert_unit_lower(l_blk):
    """(I + L)^-1 for a strictly lower triangular [16, 16] L, as a product of matmuls.

    (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8) because L^16 = 0.
    """
    hi = lax.Precision.HIGHEST
    eye = (_iota(l_blk.shape, 0) == _iota(l_blk.shape, 1)).astype(jnp.float32)
    l2 = _dot(l_blk, l_blk, hi)
    l4 = _dot(l2, l2, hi)
    l8 = _dot(l4, l4, hi)
    inv = _dot(eye - l_blk, eye + l2, hi)
    inv = _dot(inv, eye + l4, hi)
    return _dot(inv, eye + l8, hi)


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
        sub_row = _iota((SUB_CHUNK, 1), 0)
        valid = sub_row + first < clen
        rows = pl.ds(chunk_start_ref[slot] + first, SUB_CHUNK)

        def load(ref):
            return plgpu.load(ref.at[rows, h, :], mask=valid, other=0).astype(f32)

        q, k = load(q_ref), load(k_ref)
        g_blk = lax.cumsum(load(g_ref), axis=0)  # G relative to the sub-chunk's start
        beta = plgpu.load(beta_ref.at[rows, pl.ds(h, 1)], mask=valid, other=0).astype(f32)
        cols = _iota((1, SUB_CHUNK), 1)
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
            valid = (_iota((rows, 1), 0) + first) < clen
            index = (pl.ds(r0 + first, rows), h, slice(None))
            if len(ref.shape) == 2:  # beta [T, H]: a [rows, 1] column
                index = (pl.ds(r0 + first, rows), pl.ds(h, 1))
            return plgpu.load(ref.at[index], mask=valid, other=0).astype(f32)

        def store(ref, first, value):
            rows = value.shape[0]
            valid = (_iota((rows, 1), 0) + first) < clen
            plgpu.store(ref.at[pl.ds(r0 + first, rows), h, :], value.astype(ref.dtype),
                        mask=valid)

        g_cum = lax.cumsum(load(g_ref, 0, chunk), axis=0)  # [C, K]
        rows_c = _iota((chunk, 1), 0)
        g_last = jnp.sum(jnp.where(rows_c == chunk - 1, g_cum, 0.0), axis=0, keepdims=True)
        store(qg_ref, 0, scale * load(q_ref, 0, chunk) * jnp.exp(g_cum))
        k = load(k_ref, 0, chunk)
        store(kg_ref, 0, k * jnp.exp(g_last - g_cum))
        store(gcum_ref, 0, g_cum)
        glast_ref[pl.ds(slot, 1), h, :] = g_last

        sub_row = _iota((SUB_CHUNK, 1), 0)
        cols_c = _iota((1, chunk), 1)
        cols_s = _iota((1, SUB_CHUNK), 1)
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
                a_rows = _dot_nt(q_blk * fall, k_rise, precision)   # [16, C]
                l_rows = _dot_nt(k_blk * fall, k_rise, precision)
            else:
                a_rows = l_rows = jnp.zeros((SUB_CHUNK, chunk), f32)

            def diagonal_column(j, acc, first=first, g_blk=g_blk, q_blk=q_blk, k_blk=k_blk):
                """Column j of the diagonal block, formed elementwise (exact for any decay)."""
                a_acc, l_acc, l_diag = acc
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
                return (a_acc, jnp.where(cols_c == first + j, l_col, l_acc),
                        jnp.where(cols_s == j, l_col, l_diag))

            identity_rows = (cols_c == sub_row + first).astype(f32)        # [16, C]: E_b
            # Block forward substitution: (I + L_bb) T_b = E_b - L_b,<b T_<b (the columns of
            # l_rows at and past block b meet rows of t_rows not solved yet: zeros).
            if separate_diagonal:
                a_rows = a_rows + _dot(load(diag_a_ref, first, SUB_CHUNK), identity_rows, hi)
                diagonal_inverse = load(diag_inv_ref, first, SUB_CHUNK)
            else:
                a_rows, l_rows, l_diag = lax.fori_loop(
                    0, SUB_CHUNK, diagonal_column,
                    (a_rows, l_rows, jnp.zeros((SUB_CHUNK, SUB_CHUNK), f32)))
                diagonal_inverse = _invert_unit_lower(beta_blk * l_diag)
            store(aqk_ref, first, scale * a_rows)
            rhs = identity_rows - _dot(beta_blk * l_rows, t_rows, hi)
            t_blk = _dot(diagonal_inverse, rhs, hi)   # [16, C]
            t_rows = t_rows + _dot_tn(identity_rows, t_blk, hi)

        beta = load(beta_ref, 0, chunk)  # [C, 1]
        store(w_ref, 0, _dot(t_rows, beta * k * jnp.exp(g_cum), precision))
        store(u_ref, 0, _dot(t_rows, beta * load(v_ref, 0, chunk), precision))


def _recurrence_kernel(cu_ref, first_slot_ref, offsets_ref, init_ref, k_ref, w_ref, u_ref,
                       kg_ref, gcum_ref, glast_ref,
                       states_ref, vnew_ref, final_ref, snap_ref, *, chunk, block_v, capacity,
                       precision):
    """One sequence x head x value block: the chunk-to-chunk scan with snapshots.

    Stores each chunk's entry state (for the output pass) at its chunk slot and Vnew at
    the chunk's rows; only the two matmuls the recurrence depends on run here.
    """
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = cu_ref[n]
    seq_len = cu_ref[n + 1] - start
    num_chunks = (seq_len + chunk - 1) // chunk
    first_slot = first_slot_ref[n]
    head_k = k_ref.shape[-1]
    vcols = pl.ds(vb * block_v, block_v)
    rows_c = _iota((chunk, 1), 0)
    offsets = [offsets_ref[n, c] for c in range(capacity)]
    operand = w_ref.dtype

    for c in range(capacity):
        snap_ref[n, c, h, :, vcols] = jnp.zeros((head_k, block_v), jnp.float32)

    def body(i, state):
        r0 = start + i * chunk
        n_valid = jnp.minimum(chunk, seq_len - i * chunk)
        valid = rows_c < n_valid  # [C, 1]
        rows = pl.ds(r0, chunk)

        def load(ref, cols):
            return plgpu.load(ref.at[rows, h, cols], mask=valid, other=0)

        state_op = state.astype(operand)
        states_ref[first_slot + i, h, :, vcols] = state_op.astype(states_ref.dtype)
        v_new = load(u_ref, vcols).astype(jnp.float32) - _dot(load(w_ref, slice(None)),
                                                             state_op, precision)
        plgpu.store(vnew_ref.at[rows, h, vcols], v_new.astype(vnew_ref.dtype), mask=valid)

        for c in range(capacity):
            local = offsets[c] - i * chunk

            @pl.when((local >= 1) & (local <= n_valid))
            def _(c=c, local=local):
                g_cum = load(gcum_ref, slice(None))
                k = load(k_ref, slice(None)).astype(jnp.float32)
                g_at = jnp.sum(jnp.where(rows_c == local - 1, g_cum, 0.0), axis=0)  # [K]
                before = rows_c < local
                k_dec = jnp.where(before, k * jnp.exp(jnp.minimum(g_at[None, :] - g_cum, 0.0)),
                                  0.0)
                snap = jnp.exp(g_at)[:, None] * state + _dot_tn(k_dec, v_new, precision)
                snap_ref[n, c, h, :, vcols] = snap

        g_last = glast_ref[first_slot + i, h, :]  # [K]
        kg = load(kg_ref, slice(None)).astype(operand)
        return jnp.exp(g_last)[:, None] * state + _dot_tn(kg, v_new.astype(operand), precision)

    state0 = init_ref[n, h, :, vcols]
    final_ref[n, h, :, vcols] = lax.fori_loop(0, num_chunks, body, state0)


def _output_kernel(chunk_start_ref, chunk_len_ref, qg_ref, aqk_ref, states_ref, vnew_ref,
                   o_in_ref, o_ref, *, chunk, block_v, precision):
    """One chunk x head x value block, in parallel: O = Qg S_entry + Aqk Vnew."""
    del o_in_ref  # aliased to o_ref: rows no sequence owns stay zero
    slot, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r0 = chunk_start_ref[slot]
    clen = chunk_len_ref[slot]
    vcols = pl.ds(vb * block_v, block_v)

    @pl.when(clen > 0)
    def _():
        valid = _iota((chunk, 1), 0) < clen
        rows = pl.ds(r0, chunk)

        def load(ref, cols):
            return plgpu.load(ref.at[rows, h, cols], mask=valid, other=0)

        state = states_ref[slot, h, :, vcols]
        out = (_dot(load(qg_ref, slice(None)), state, precision)
               + _dot(load(aqk_ref, slice(None)), load(vnew_ref, vcols), precision))
        plgpu.store(o_ref.at[rows, h, vcols], out.astype(o_ref.dtype), mask=valid)


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


def _operand_dtype(exact):
    # The fast path stores the matmul operands in bf16; states and accumulation stay fp32.
    return jnp.float32 if exact else jnp.bfloat16


def _precision(exact):
    return lax.Precision.HIGHEST if exact else lax.Precision.DEFAULT


def chunk_prep(q_p, k_p, v_p, g_p, beta_p, slots: ChunkSlots, *, scale: float,
               config: KernelConfig, interpret: bool, exact: bool) -> ChunkTensors:
    """Pass 1 over row-padded inputs ([T + C, H, ...], see `pad_rows`)."""
    padded, num_heads, head_k = q_p.shape
    head_v = v_p.shape[-1]
    chunk = config.chunk_size
    inter, f32 = _operand_dtype(exact), jnp.float32

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
                          precision=_precision(exact),
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


def chunk_scan(tensors: ChunkTensors, k_p, slots: ChunkSlots, cu_seqlens, initial_states,
               checkpoint_offsets, *, config: KernelConfig, interpret: bool, exact: bool):
    """Pass 2: the recurrence.

    Returns entry_states [S, H, K, V] (each chunk slot's entry state, operand dtype),
    v_new [T + C, H, V] (operand dtype), final_states fp32 [N, H, K, V] and snapshots
    fp32 [N, capacity, H, K, V].
    """
    padded, num_heads, head_k = k_p.shape
    head_v = tensors.u.shape[-1]
    num_seqs, capacity = checkpoint_offsets.shape
    block_v = config.block_v
    inter, f32 = _operand_dtype(exact), jnp.float32
    scan = pl.pallas_call(
        functools.partial(_recurrence_kernel, chunk=config.chunk_size, block_v=block_v,
                          capacity=capacity, precision=_precision(exact)),
        out_shape=(
            jax.ShapeDtypeStruct((slots.start.shape[0], num_heads, head_k, head_v), inter),
            jax.ShapeDtypeStruct((padded, num_heads, head_v), inter),
            jax.ShapeDtypeStruct((num_seqs, num_heads, head_k, head_v), f32),
            jax.ShapeDtypeStruct((num_seqs, capacity, num_heads, head_k, head_v), f32),
        ),
        grid=(num_seqs, num_heads, head_v // block_v),
        compiler_params=plgpu.CompilerParams(num_warps=config.scan_num_warps,
                                             num_stages=config.scan_num_stages),
        interpret=interpret,
        name="kda_chunk_scan",
    )
    return scan(cu_seqlens, slots.first_slot, checkpoint_offsets, initial_states, k_p,
                tensors.w, tensors.u, tensors.kg, tensors.g_cum, tensors.g_last)


def chunk_output(tensors: ChunkTensors, entry_states, v_new, slots: ChunkSlots, *, out_dtype,
                 config: KernelConfig, interpret: bool, exact: bool):
    """Pass 3, chunk-parallel: o [T + C, H, V] in out_dtype, zero on rows no chunk owns."""
    padded, num_heads, head_v = v_new.shape
    block_v = min(config.output_block_v, head_v)  # both powers of two
    o_zero = jnp.zeros((padded, num_heads, head_v), out_dtype)
    output = pl.pallas_call(
        functools.partial(_output_kernel, chunk=config.chunk_size, block_v=block_v,
                          precision=_precision(exact)),
        out_shape=jax.ShapeDtypeStruct((padded, num_heads, head_v), out_dtype),
        grid=(slots.start.shape[0], num_heads, head_v // block_v),
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(num_warps=config.output_num_warps,
                                             num_stages=config.output_num_stages),
        interpret=interpret,
        name="kda_chunk_output",
    )
    return output(slots.start, slots.length, tensors.qg, tensors.aqk, entry_states, v_new,
                  o_zero)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "exact"))
def kda_prefill_pallas(q, k, v, g, beta, cu_seqlens, initial_states, checkpoint_offsets, *,
                       scale: float, config: KernelConfig, interpret: bool, exact: bool):
    """Pallas implementation of `kda_prefill` (arguments already validated).

    exact: fp32 (IEEE) matmuls everywhere, for fp32 inputs; otherwise the large matmuls
    run with bf16 operands and fp32 accumulation.
    """
    chunk, num_tokens = config.chunk_size, q.shape[0]
    flags = dict(config=config, interpret=interpret, exact=exact)
    slots = chunk_slots(cu_seqlens, num_tokens, chunk)
    q_p, k_p, v_p, g_p, beta_p = (pad_rows(x, chunk) for x in (q, k, v, g, beta))
    tensors = chunk_prep(q_p, k_p, v_p, g_p, beta_p, slots, scale=scale, **flags)
    entry_states, v_new, final_states, snapshots = chunk_scan(
        tensors, k_p, slots, cu_seqlens, initial_states, checkpoint_offsets, **flags)
    o = chunk_output(tensors, entry_states, v_new, slots, out_dtype=v.dtype, **flags)
    return o[:num_tokens], final_states, snapshots
