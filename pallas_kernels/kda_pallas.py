"""The KDA checkpointing scan as two Pallas kernels lowered through Triton.

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
chunk-to-chunk recurrence in one program's `fori_loop`:

    Vnew = U - W S;   O = Qg S + Aqk Vnew;   S <- diag(exp(G_last)) S + Kg^T Vnew

and stores a snapshot whenever a checkpoint offset falls inside the chunk:
    S_p = diag(exp(G_{p-1})) S_in + (k * exp(G_{p-1} - G) * [j < p])^T Vnew.

All intermediates are fp32. Rows past a sequence's end are masked on every load, so chunks
never see the next sequence's rows.
"""

from __future__ import annotations

import functools

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


def _chunk_prep_kernel(chunk_start_ref, chunk_len_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                       w_ref, u_ref, aqk_ref, qg_ref, kg_ref, gcum_ref, glast_ref,
                       *, scale, chunk, precision):
    """One chunk of one head. Refs are whole arrays [T_pad, H, ...]; rows past the chunk's
    length load as zeros (g = 0 keeps G flat there, k = beta = 0 adds nothing)."""
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
        glast_ref[pl.ds(r0, 1), h, :] = g_last

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

            a_rows, l_rows, l_diag = lax.fori_loop(
                0, SUB_CHUNK, diagonal_column,
                (a_rows, l_rows, jnp.zeros((SUB_CHUNK, SUB_CHUNK), f32)))
            store(aqk_ref, first, scale * a_rows)
            # Block forward substitution: (I + L_bb) T_b = E_b - L_b,<b T_<b.
            identity_rows = (cols_c == sub_row + first).astype(f32)        # [16, C]
            rhs = identity_rows - _dot(beta_blk * l_rows, t_rows, hi)
            t_blk = _dot(_invert_unit_lower(beta_blk * l_diag), rhs, hi)   # [16, C]
            t_rows = t_rows + _dot_tn(identity_rows, t_blk, hi)

        beta = load(beta_ref, 0, chunk)  # [C, 1]
        store(w_ref, 0, _dot(t_rows, beta * k * jnp.exp(g_cum), precision))
        store(u_ref, 0, _dot(t_rows, beta * load(v_ref, 0, chunk), precision))


def _recurrence_kernel(cu_ref, offsets_ref, init_ref, k_ref, w_ref, u_ref, aqk_ref, qg_ref,
                       kg_ref, gcum_ref, glast_ref, o_in_ref,
                       o_ref, final_ref, snap_ref, *, chunk, block_v, capacity, precision):
    """One sequence x head x value block: the chunk-to-chunk scan with snapshots."""
    del o_in_ref  # aliased to o_ref: rows no sequence owns stay zero
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = cu_ref[n]
    seq_len = cu_ref[n + 1] - start
    num_chunks = (seq_len + chunk - 1) // chunk
    head_k = k_ref.shape[-1]
    vcols = pl.ds(vb * block_v, block_v)
    rows_c = _iota((chunk, 1), 0)
    offsets = [offsets_ref[n, c] for c in range(capacity)]

    for c in range(capacity):
        snap_ref[n, c, h, :, vcols] = jnp.zeros((head_k, block_v), jnp.float32)

    def body(i, state):
        r0 = start + i * chunk
        n_valid = jnp.minimum(chunk, seq_len - i * chunk)
        valid = rows_c < n_valid  # [C, 1]
        rows = pl.ds(r0, chunk)

        def load(ref, cols):
            return plgpu.load(ref.at[rows, h, cols], mask=valid, other=0)

        def mm(a, b):
            """Matmul with both operands in the stored dtype (bf16 on the fast path)."""
            return _dot(a.astype(w_ref.dtype), b.astype(w_ref.dtype), precision)

        v_new = load(u_ref, vcols).astype(jnp.float32) - mm(load(w_ref, slice(None)), state)
        out = mm(load(qg_ref, slice(None)), state) + mm(load(aqk_ref, slice(None)), v_new)
        plgpu.store(o_ref.at[rows, h, vcols], out.astype(o_ref.dtype), mask=valid)

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

        g_last = glast_ref[r0, h, :]  # [K]
        kg = load(kg_ref, slice(None)).astype(w_ref.dtype)
        return jnp.exp(g_last)[:, None] * state + _dot_tn(kg, v_new.astype(w_ref.dtype),
                                                          precision)

    state0 = init_ref[n, h, :, vcols]
    final_ref[n, h, :, vcols] = lax.fori_loop(0, num_chunks, body, state0)


def _chunk_slots(cu_seqlens, num_slots, chunk):
    """Start row and length of every chunk, sequence by sequence, padded to num_slots.

    Returns (chunk_start, chunk_len), int32 [num_slots]; unused slots have length 0.
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
            jnp.where(in_range, length, 0).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "exact"))
def kda_prefill_pallas(q, k, v, g, beta, cu_seqlens, initial_states, checkpoint_offsets, *,
                       scale: float, config: KernelConfig, interpret: bool, exact: bool):
    """Pallas implementation of `kda_prefill` (arguments already validated).

    exact: fp32 (IEEE) matmuls everywhere, for fp32 inputs; otherwise the large matmuls
    run as tf32 with fp32 accumulation.
    """
    num_tokens, num_heads, head_k = q.shape
    head_v = v.shape[-1]
    num_seqs, capacity = checkpoint_offsets.shape
    chunk = config.chunk_size
    precision = lax.Precision.HIGHEST if exact else lax.Precision.DEFAULT
    # Every chunk window [r0, r0 + C) stays inside the padded arrays.
    padded = num_tokens + chunk

    def pad(x):
        return jnp.pad(x, [(0, chunk)] + [(0, 0)] * (x.ndim - 1))

    q_p, k_p, v_p, g_p, beta_p = (pad(x) for x in (q, k, v, g, beta))
    num_slots = -(-num_tokens // chunk) + num_seqs
    chunk_start, chunk_len = _chunk_slots(cu_seqlens, num_slots, chunk)

    f32 = jnp.float32
    # The fast path stores the matmul operands of the scan in bf16 (the state stays fp32).
    inter = f32 if exact else jnp.bfloat16
    prep_shapes = (
        jax.ShapeDtypeStruct((padded, num_heads, head_k), inter),   # W
        jax.ShapeDtypeStruct((padded, num_heads, head_v), inter),   # U
        jax.ShapeDtypeStruct((padded, num_heads, chunk), inter),    # Aqk
        jax.ShapeDtypeStruct((padded, num_heads, head_k), inter),   # Qg
        jax.ShapeDtypeStruct((padded, num_heads, head_k), inter),   # Kg
        jax.ShapeDtypeStruct((padded, num_heads, head_k), f32),   # G
        jax.ShapeDtypeStruct((padded, num_heads, head_k), f32),   # G_last at chunk rows
    )
    prep = pl.pallas_call(
        functools.partial(_chunk_prep_kernel, scale=scale, chunk=chunk, precision=precision),
        out_shape=prep_shapes,
        grid=(num_slots, num_heads),
        compiler_params=plgpu.CompilerParams(num_warps=config.prep_num_warps,
                                             num_stages=config.prep_num_stages),
        interpret=interpret,
        name="kda_chunk_prep",
    )
    w, u, aqk, qg, kg, gcum, glast = prep(chunk_start, chunk_len, q_p, k_p, v_p, g_p, beta_p)

    block_v = config.block_v
    o_zero = jnp.zeros((padded, num_heads, head_v), v.dtype)
    scan = pl.pallas_call(
        functools.partial(_recurrence_kernel, chunk=chunk, block_v=block_v, capacity=capacity,
                          precision=precision),
        out_shape=(
            jax.ShapeDtypeStruct((padded, num_heads, head_v), v.dtype),
            jax.ShapeDtypeStruct((num_seqs, num_heads, head_k, head_v), f32),
            jax.ShapeDtypeStruct((num_seqs, capacity, num_heads, head_k, head_v), f32),
        ),
        grid=(num_seqs, num_heads, head_v // block_v),
        input_output_aliases={11: 0},
        compiler_params=plgpu.CompilerParams(num_warps=config.scan_num_warps,
                                             num_stages=config.scan_num_stages),
        interpret=interpret,
        name="kda_chunk_scan",
    )
    o, final_states, snapshots = scan(cu_seqlens, checkpoint_offsets, initial_states, k_p, w, u,
                                      aqk, qg, kg, gcum, glast, o_zero)
    return o[:num_tokens], final_states, snapshots
