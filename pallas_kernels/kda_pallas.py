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
                       *, scale, chunk, block_k, block_v, precision):
    """One chunk of one head. Refs are whole arrays [T_pad, H, ...]."""
    slot, h = pl.program_id(0), pl.program_id(1)
    r0 = chunk_start_ref[slot]
    clen = chunk_len_ref[slot]
    num_sub = chunk // SUB_CHUNK
    head_k = q_ref.shape[-1]
    head_v = v_ref.shape[-1]
    sub_rows = _iota((SUB_CHUNK, 1), 0)
    sub_i, sub_j = _iota((SUB_CHUNK, SUB_CHUNK), 0), _iota((SUB_CHUNK, SUB_CHUNK), 1)

    @pl.when(clen > 0)
    def _():
        def rows(blk):
            return pl.ds(r0 + blk * SUB_CHUNK, SUB_CHUNK)

        def row_mask(blk):
            return (sub_rows + blk * SUB_CHUNK) < clen  # [16, 1]

        def load_kslice(ref, blk, kk):
            x = plgpu.load(ref.at[rows(blk), h, pl.ds(kk * block_k, block_k)],
                           mask=row_mask(blk), other=0)
            return x.astype(jnp.float32)

        betas = []
        for blk in range(num_sub):
            b = plgpu.load(beta_ref.at[rows(blk), pl.ds(h, 1)], mask=row_mask(blk), other=0)
            betas.append(b.astype(jnp.float32))  # [16, 1]

        def cum_g(kk):
            """In-chunk inclusive cumsum of g per sub-chunk, and the carry before each."""
            cums, carries, carry = [], [], jnp.zeros((1, block_k), jnp.float32)
            for blk in range(num_sub):
                g_blk = load_kslice(g_ref, blk, kk)
                carries.append(carry)
                cums.append(carry + lax.cumsum(g_blk, axis=0))
                carry = carry + jnp.sum(g_blk, axis=0, keepdims=True)
            return cums, carries, carry

        # Pass over key slices: accumulate the [16, 16] blocks of Aqk and L, and emit the
        # per-key-channel outputs (Qg, Kg, G, G_last) for this slice.
        zero_blk = jnp.zeros((SUB_CHUNK, SUB_CHUNK), jnp.float32)
        aqk = {(i, j): zero_blk for i in range(num_sub) for j in range(i + 1)}
        lkk = {(i, j): zero_blk for i in range(num_sub) for j in range(i + 1)}
        for kk in range(head_k // block_k):
            gs, carries, g_last = cum_g(kk)
            qs = [load_kslice(q_ref, blk, kk) for blk in range(num_sub)]
            ks = [load_kslice(k_ref, blk, kk) for blk in range(num_sub)]
            for i in range(num_sub):
                g_ref_pt = carries[i]
                q_dec = qs[i] * jnp.exp(gs[i] - g_ref_pt)
                k_dec = ks[i] * jnp.exp(gs[i] - g_ref_pt)
                for j in range(i):
                    k_rise = ks[j] * jnp.exp(g_ref_pt - gs[j])
                    aqk[i, j] += _dot_nt(q_dec, k_rise, precision)
                    lkk[i, j] += _dot_nt(k_dec, k_rise, precision)
                diff = gs[i][:, None, :] - gs[i][None, :, :]  # [16, 16, BK], <= 0 below diag
                decay = jnp.exp(jnp.minimum(diff, 0.0))
                aqk[i, i] += jnp.sum(qs[i][:, None, :] * ks[i][None, :, :] * decay, axis=2)
                lkk[i, i] += jnp.sum(ks[i][:, None, :] * ks[i][None, :, :] * decay, axis=2)
            kcols = pl.ds(kk * block_k, block_k)
            for blk in range(num_sub):
                mask = row_mask(blk)
                plgpu.store(qg_ref.at[rows(blk), h, kcols], scale * qs[blk] * jnp.exp(gs[blk]),
                            mask=mask)
                plgpu.store(kg_ref.at[rows(blk), h, kcols],
                            ks[blk] * jnp.exp(g_last - gs[blk]), mask=mask)
                plgpu.store(gcum_ref.at[rows(blk), h, kcols], gs[blk], mask=mask)
            glast_ref[pl.ds(r0, 1), h, kcols] = g_last

        # T = (I + L)^-1 by block forward substitution over the 16-row sub-chunks.
        hi = lax.Precision.HIGHEST
        tinv = {}
        for i in range(num_sub):
            strict = sub_j < sub_i
            l_ii = jnp.where(strict, betas[i] * lkk[i, i], 0.0)
            tinv[i, i] = _invert_unit_lower(l_ii)
            for j in range(i):
                acc = zero_blk
                for m in range(j, i):
                    acc += _dot(betas[i] * lkk[i, m], tinv[m, j], hi)
                tinv[i, j] = -_dot(tinv[i, i], acc, hi)
            for j in range(i + 1):
                blk_val = aqk[i, j] if j < i else jnp.where(sub_j <= sub_i, aqk[i, i], 0.0)
                plgpu.store(aqk_ref.at[rows(i), h, pl.ds(j * SUB_CHUNK, SUB_CHUNK)],
                            scale * blk_val, mask=row_mask(i))
            for j in range(i + 1, num_sub):
                plgpu.store(aqk_ref.at[rows(i), h, pl.ds(j * SUB_CHUNK, SUB_CHUNK)], zero_blk,
                            mask=row_mask(i))

        # W = T diag(beta) (k * exp(G)) and U = T diag(beta) v, slice by slice.
        for kk in range(head_k // block_k):
            gs, _, _ = cum_g(kk)
            kb = [betas[j] * load_kslice(k_ref, j, kk) * jnp.exp(gs[j]) for j in range(num_sub)]
            for i in range(num_sub):
                w_blk = sum(_dot(tinv[i, j], kb[j], precision) for j in range(i + 1))
                plgpu.store(w_ref.at[rows(i), h, pl.ds(kk * block_k, block_k)], w_blk,
                            mask=row_mask(i))
        for vv in range(head_v // block_v):
            vcols = pl.ds(vv * block_v, block_v)
            vb = [betas[j] * plgpu.load(v_ref.at[rows(j), h, vcols], mask=row_mask(j),
                                        other=0).astype(jnp.float32) for j in range(num_sub)]
            for i in range(num_sub):
                u_blk = sum(_dot(tinv[i, j], vb[j], precision) for j in range(i + 1))
                plgpu.store(u_ref.at[rows(i), h, vcols], u_blk, mask=row_mask(i))


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
            return plgpu.load(ref.at[rows, h, cols], mask=valid, other=0).astype(jnp.float32)

        w = load(w_ref, slice(None))
        qg = load(qg_ref, slice(None))
        kg = load(kg_ref, slice(None))
        u = load(u_ref, vcols)
        aqk = load(aqk_ref, slice(None))
        v_new = u - _dot(w, state, precision)  # [C, BV]
        out = _dot(qg, state, precision) + _dot(aqk, v_new, precision)
        plgpu.store(o_ref.at[rows, h, vcols], out.astype(o_ref.dtype), mask=valid)

        for c in range(capacity):
            local = offsets[c] - i * chunk

            @pl.when((local >= 1) & (local <= n_valid))
            def _(c=c, local=local):
                g_cum = load(gcum_ref, slice(None))
                k = load(k_ref, slice(None))
                g_at = jnp.sum(jnp.where(rows_c == local - 1, g_cum, 0.0), axis=0)  # [K]
                before = rows_c < local
                k_dec = jnp.where(before, k * jnp.exp(jnp.minimum(g_at[None, :] - g_cum, 0.0)),
                                  0.0)
                snap = jnp.exp(g_at)[:, None] * state + _dot_tn(k_dec, v_new, precision)
                snap_ref[n, c, h, :, vcols] = snap

        g_last = glast_ref[r0, h, :]  # [K]
        return jnp.exp(g_last)[:, None] * state + _dot_tn(kg, v_new, precision)

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
    prep_shapes = (
        jax.ShapeDtypeStruct((padded, num_heads, head_k), f32),   # W
        jax.ShapeDtypeStruct((padded, num_heads, head_v), f32),   # U
        jax.ShapeDtypeStruct((padded, num_heads, chunk), f32),    # Aqk
        jax.ShapeDtypeStruct((padded, num_heads, head_k), f32),   # Qg
        jax.ShapeDtypeStruct((padded, num_heads, head_k), f32),   # Kg
        jax.ShapeDtypeStruct((padded, num_heads, head_k), f32),   # G
        jax.ShapeDtypeStruct((padded, num_heads, head_k), f32),   # G_last at chunk rows
    )
    prep = pl.pallas_call(
        functools.partial(_chunk_prep_kernel, scale=scale, chunk=chunk,
                          block_k=config.prep_block_k, block_v=config.prep_block_v,
                          precision=precision),
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
