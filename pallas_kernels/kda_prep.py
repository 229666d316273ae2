"""Pass 1 of the KDA checkpointing scan.

Chunks: a packed batch is cut into chunks of C tokens, sequence by sequence; chunk slots
are numbered on the device from `cu_seqlens` (`pallas_kernels.kda_chunks`, the layout
every pass shares), so lengths are runtime values. In interpret mode inputs carry one
chunk of zero rows at the end (`kda_chunks.pad_rows`), T' = T + C rows; on the GPU masked
loads need none, T' = T.

Pass 1 turns each chunk of C tokens into the matrices the recurrence needs (DESIGN
section 2), in fully parallel programs:

    G   = in-chunk inclusive cumsum of g                         [C, K]
    Aqk = scale * tril_incl(q_i k_j exp(G_i - G_j))              [C, C]
    T   = (I + L)^-1,  L = strict_tril(beta_i k_i k_j exp(G_i - G_j))
    W   = T diag(beta) (k * exp(G))                              [C, K]
    U   = T diag(beta) v                                         [C, V]
    Qg  = scale * q * exp(G),  Kg = k * exp(G_last - G)          [C, K]

1. The diagonal 16 x 16 blocks of Aqk and L, and T's diagonal blocks T_bb = (I + L_bb)^-1
   (by forward substitution), one program per sub-chunk and head (`_inverse_kernel`), over
   slices of the key dimension: by matmul, exp(G_i - G_j) = exp(G_i - M) exp(M - G_j)
   with M = G at the sub-chunk's middle row, while both factors stay within e^+-42. With a
   gate bound (`kda_prefill`'s `gate_lower_bound` b >= -5: g >= b everywhere) they always
   do; for any decay (`gate_lower_bound=None`) the spread is checked, and a sub-chunk
   whose decays spread wider is summed key by key instead (`_blocks_by_keys`, every
   exponent <= 0).
2. `_chunk_prep_kernel`, one program per chunk and head: G, Qg, Kg, beta k exp(G), the
   blocks below the diagonal, by pairs (b, c) and slices of the key dimension, keeping
   only [16, BK] tiles live, and T's merge. exp(G_i - G_j) is never formed as
   exp(G_i) * exp(-G_j) over a whole chunk: exp(G_i - E_{b-1}) * exp(E_{b-1} - E_c) *
   exp(E_c - G_j) with E_c = G at block c's last row (every factor <= 1; the first on the
   row side, shared by all of row block b's pairs, the other two on the key side), each
   exponent built from block-local cumsums and block totals.
   T_bc = -T_bb sum_{c <= m < b} L_bm T_mc (fp32 values; TF32 products on the fast path).
   The diagonal work, which every program used to run serially after its loop (the
   substitution) or inside it (20 accumulators where 12 remain), runs in the first
   kernel's 4x more, smaller programs, as fla splits it.
3. `_w_u_kernel`: W and U, two [C, C] x [C, *] matmuls per chunk.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda_chunks import ChunkSlots, ChunkTensors
from pallas_kernels.tiles import (
    dot,
    dot_nt,
    exp_base,
    iota,
    load_rows,
    matmul_precision,
    operand_dtype,
)
from pallas_kernels.tuning import SUB_CHUNK, KernelConfig

# The widest |G_i - M| (natural log) a diagonal block's products take: factors within
# e^+-42 are normal fp32 (and TF32) numbers, and the pairs above the diagonal, which the
# masks discard, stay below e^84 a term. A gate bound b >= -5 keeps it <= 40.
MAX_FACTOR_LOG = 42.0


def _row_of(x, row):
    """Row `row` of a [R, C] tile as [1, C] (a masked sum over the rows)."""
    return jnp.sum(jnp.where(iota((x.shape[0], 1), 0) == row, x, 0.0), axis=0, keepdims=True)


def _invert_by_substitution(l_blk):
    """(I + L)^-1 of a strictly lower triangular [16, 16] fp32 L, by forward substitution.

    X starts as I; step j subtracts L[:, j] x X[j, :] from every row (rows <= j are
    untouched, L being strictly lower), after which row j + 1 is final. A 16-step loop of
    elementwise updates in fp32: short code, no matmul rounding (when the prep kernel ran
    it, its code was 7,512 SASS instructions with products, 5,544 with this; sm_90).
    """
    rows, cols = iota(l_blk.shape, 0), iota(l_blk.shape, 1)

    def step(j, x):
        l_col = jnp.sum(jnp.where(cols == j, l_blk, 0.0), axis=1, keepdims=True)  # [16, 1]
        return x - l_col * _row_of(x, j)

    return lax.fori_loop(0, rows.shape[0], step, (rows == cols).astype(jnp.float32))


def _blocks_by_keys(load_qkg, head_k, exp):
    """A sub-chunk's diagonal blocks of Aqk and L ([16, 16] fp32 each, unmasked) for any
    decay: key j at a time, the decay from key j to row i summed from g_{j + 1} .. g_i
    alone (a masked cumsum: no difference of large cumsums), every exponent <= 0.
    `load_qkg(cols)` gives the sub-chunk's q, k and g ([16, 16] fp32 tiles of the key
    columns `cols`, g in the base of `exp`), read 16 columns at a time so that few
    registers stay live. 16 steps of elementwise work a 16-column piece, where the
    products are two dots: for the sub-chunks whose decays spread too wide for those."""
    row, col = iota((SUB_CHUNK, 1), 0), iota((1, SUB_CHUNK), 1)

    def piece(index, sums):
        q, k, g = load_qkg(pl.ds(pl.multiple_of(index * SUB_CHUNK, SUB_CHUNK), SUB_CHUNK))

        def key(j, sums):
            decay = exp(jnp.minimum(lax.cumsum(jnp.where(row > j, g, 0.0), axis=0), 0.0))
            keys = jnp.where(row >= j, decay, 0.0) * _row_of(k, j)        # [16, 16]
            at = col == j
            return (sums[0] + jnp.where(at, jnp.sum(q * keys, axis=1, keepdims=True), 0.0),
                    sums[1] + jnp.where(at, jnp.sum(k * keys, axis=1, keepdims=True), 0.0))

        return lax.fori_loop(0, SUB_CHUNK, key, sums)

    zeros = jnp.zeros((SUB_CHUNK, SUB_CHUNK), jnp.float32)
    return lax.fori_loop(0, head_k // SUB_CHUNK, piece, (zeros, zeros))


def _inverse_kernel(chunk_start_ref, chunk_len_ref, q_ref, k_ref, g_ref, beta_ref, a_ref,
                    t_ref, *, chunk, block_k, scale, precision, checked, base):
    """One sub-chunk (16 rows) of one head: its diagonal block of Aqk (scaled, inclusive,
    operand dtype) and T_bb = (I + beta L_bb)^-1 (fp32), both stored at the block's rows
    ([T', H, 16]; column c is the sub-chunk's row c).

    The blocks come from two products per slice of `block_k` key columns,
    exp(G_i - G_j) = exp(G_i - M) exp(M - G_j) with M = G at the sub-chunk's middle row,
    which holds while every |G_i - M| is at most `MAX_FACTOR_LOG` (both factors normal
    fp32 numbers: no overflow, no subnormal). Under a gate bound b >= -5 it always is (7
    and 8 rows either side of M; g of the sub-chunk's first row is left out, as no pair of
    the block decays by it), so the bounded path runs the products alone
    (`checked=False`). For any decay (`checked=True`) the loop also tracks the widest
    |G_i - M|, and a sub-chunk and head whose decays spread wider are summed again key by
    key (`_blocks_by_keys`, exact for any decay): a branch that typical decays never take
    (a decay of -5.25 a token on average over 8 rows is the least that takes it).
    """
    g_scale, exp = base
    p, h = pl.program_id(0), pl.program_id(1)
    blocks = chunk // SUB_CHUNK
    slot, b = p // blocks, p % blocks
    n_valid = chunk_len_ref[slot] - b * SUB_CHUNK
    row, col = iota((SUB_CHUNK, 1), 0), iota((1, SUB_CHUNK), 1)
    f32 = jnp.float32

    @pl.when(n_valid > 0)
    def _():
        rows = pl.ds(chunk_start_ref[slot] + b * SUB_CHUNK, SUB_CHUNK)
        valid = row < n_valid

        def load(ref, cols=slice(None)):
            return load_rows(ref, rows, h, valid, cols)

        def load_qkg(cols):
            """q, k and g (scaled to the base of `exp`; the first row's left out)."""
            g = jnp.where(row == 0, 0.0, load(g_ref, cols) * g_scale)
            return load(q_ref, cols), load(k_ref, cols), g

        def key_slice(index, carry):
            """The slice's products added to the sums; when `checked`, the widest
            |G_i - M| so far carried too (a max by axis: Triton's reductions)."""
            q, k, g = load_qkg(pl.ds(pl.multiple_of(index * block_k, block_k), block_k))
            rise = lax.cumsum(g, axis=0)
            mid = _row_of(rise, SUB_CHUNK // 2 - 1)
            centred, keys = exp(rise - mid), k * exp(mid - rise)
            wider = ((jnp.maximum(carry[2], jnp.max(jnp.max(jnp.abs(rise - mid), axis=0),
                                                    axis=0)),) if checked else ())
            return (carry[0] + dot_nt(q * centred, keys, precision),
                    carry[1] + dot_nt(k * centred, keys, precision), *wider)

        zeros = jnp.zeros((SUB_CHUNK, SUB_CHUNK), f32)
        head_k = q_ref.shape[-1]
        carry = (zeros, zeros, jnp.float32(0.0)) if checked else (zeros, zeros)
        a_bb, l_bb, *spread = lax.fori_loop(0, head_k // block_k, key_slice, carry)
        if checked:
            a_bb, l_bb = lax.cond(spread[0] <= MAX_FACTOR_LOG * g_scale, lambda: (a_bb, l_bb),
                                  lambda: _blocks_by_keys(load_qkg, head_k, exp))
        t_bb = _invert_by_substitution(jnp.where(col < row, load(beta_ref) * l_bb, 0.0))
        plgpu.store(a_ref.at[rows, h, :],
                    jnp.where(col <= row, scale * a_bb, 0.0).astype(a_ref.dtype), mask=valid)
        plgpu.store(t_ref.at[rows, h, :], t_bb, mask=valid)


def _chunk_prep_kernel(chunk_start_ref, chunk_len_ref, snapshot_ref, q_ref, k_ref, g_ref,
                       beta_ref, a_diag_ref, t_diag_ref, *refs, scale, chunk, block_k,
                       precision, base):
    """One chunk of one head: G (fp32, stored only where `snapshot_ref` [S] marks the
    slot), Qg, Kg, Aqk (scaled), beta k exp(G) and T = (I + L)^-1 (the last five in the
    operand dtype), by 16 x 16 blocks and key slices of `block_k` columns.

    Refs are whole arrays [T', H, ...]; rows past the chunk's length load as zeros
    (g = 0 keeps G flat there, k = beta = 0 adds nothing). The diagonal blocks of Aqk and
    of T come from `_inverse_kernel` (a_diag_ref, t_diag_ref [T', H, 16]).
    """
    aqk_ref, t_ref, qg_ref, kg_ref, gcum_ref, glast_ref, kb_ref = refs
    # Decays in the base of `exp` (`tiles.exp_base`): g is scaled as it loads, G back as
    # it is stored.
    g_scale, exp = base
    slot, h = pl.program_id(0), pl.program_id(1)
    r0 = chunk_start_ref[slot]
    clen = chunk_len_ref[slot]
    blocks = chunk // SUB_CHUNK
    f32 = jnp.float32
    sub_row = iota((SUB_CHUNK, 1), 0)

    def block_io(start, length):
        """load and store of row block b of this head, in the chunk of `length` rows at
        row `start`; loads are fp32, and beta [T, H] loads as a [16, 1] column."""
        def rows(b):
            return pl.ds(start + b * SUB_CHUNK, SUB_CHUNK), (sub_row + b * SUB_CHUNK) < length

        def load(ref, b, cols=slice(None)):
            index, valid = rows(b)
            return load_rows(ref, index, h, valid, cols)

        def store(ref, b, value, cols=slice(None)):
            index, valid = rows(b)
            plgpu.store(ref.at[index, h, cols], value.astype(ref.dtype), mask=valid)

        return load, store

    @pl.when(clen > 0)
    def _():
        load, store = block_io(r0, clen)

        # Blocks (b, c) of Aqk and L below the diagonal: one [16, 16] product per pair,
        # which every warp of the program runs in full (a [16, 16] tile is one warp's).
        pairs = [(b, c) for b in range(blocks) for c in range(b)]

        def key_slice(index, sums):
            """One slice of `block_k` key columns: G, Qg, Kg and beta k exp(G) stored (the
            last is W's right-hand side, in the operation order `_w_u_kernel` used when it
            formed it from G itself), its part of every product added to `sums` (Aqk's
            then L's, [16, 16] per pair).
            A loop, not unrolled: the kernel's code stays small."""
            a_blk, l_blk = (dict(zip(pairs, part)) for part in sums)
            # The chunk's start and length read again in the loop, so that the row offsets
            # and masks are formed in it: from values read before it, Triton hoisted them
            # out as [16, 16] tensors per row block and layout and held them through the
            # loop (sm_90 at 2 warps x 32 columns: 592 -> 40 B of spills).
            load, store = block_io(chunk_start_ref[slot], chunk_len_ref[slot])
            cols = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
            # The slice's loads first: interleaved with the stores and barriers below, each
            # waited out its latency alone (ncu, H100: half the kernel's stall samples on
            # instructions reading a loaded tile). 144 B of spills (offline) for it.
            g_in = [load(g_ref, c, cols) for c in range(blocks)]
            q_in = [load(q_ref, b, cols) for b in range(blocks)]
            k_in = [load(k_ref, b, cols) for b in range(blocks)]
            # Every exponent below comes from block-local cumsums ("rise": G minus G just
            # before the block) and block totals, never from differences of whole-chunk G.
            rise = [lax.cumsum(x * g_scale, axis=0) for x in g_in]
            total = [_row_of(x, SUB_CHUNK - 1) for x in rise]             # [1, BK] each
            before, after = [0.0], [0.0]   # G just before block b; sum of g after block b
            for c in range(blocks):
                before.append(before[-1] + total[c])
                after.insert(0, after[0] + total[blocks - 1 - c])
            glast_ref[pl.ds(slot, 1), h, cols] = before[-1] * (1 / g_scale)
            k_fall = []  # k_c exp(E_c - G_c), E_c = G at block c's last row: <= 1
            for b in range(blocks):
                q_b, k_b = q_in[b], k_in[b]
                g_b = before[b] + rise[b]

                @pl.when(snapshot_ref[slot] != 0)  # the scan reads G only there
                def _(b=b, g_b=g_b):
                    store(gcum_ref, b, g_b * (1 / g_scale), cols)

                fall = exp(rise[b])
                q_fall, k_rise = q_b * fall, k_b * fall
                # exp(G) = exp(G before the block) exp(rise), both <= 1: where one
                # underflows, so does exp(G).
                grow = 1.0 if b == 0 else exp(before[b])                      # [1, BK]
                store(qg_ref, b, scale * grow * q_fall, cols)
                store(kb_ref, b, load(beta_ref, b) * grow * k_rise, cols)
                # exp(G_i - G_j) = exp(G_i - E_{b-1}) exp(E_{b-1} - G_j), both <= 1; the
                # second is k_fall's exp(E_c - G_j) times exp(the totals of the blocks
                # between), so every row block's operands serve all its pairs.
                for c in range(b):
                    keys = k_fall[c] if c == b - 1 else k_fall[c] * exp(sum(total[c + 1:b]))
                    a_blk[b, c] += dot_nt(q_fall, keys, precision)
                    l_blk[b, c] += dot_nt(k_rise, keys, precision)
                k_fall.append(k_b * exp(total[b] - rise[b]))
                # Kg = k exp(G_last - G) = k_fall exp(the totals of the blocks after b).
                store(kg_ref, b, k_fall[b] * exp(after[b + 1]) if b < blocks - 1 else k_fall[b],
                      cols)
            return tuple(a_blk.values()), tuple(l_blk.values())

        no_sums = (jnp.zeros((SUB_CHUNK, SUB_CHUNK), f32),) * len(pairs)
        sums = lax.fori_loop(0, q_ref.shape[-1] // block_k, key_slice, (no_sums, no_sums))
        a_blk, l_blk = (dict(zip(pairs, part)) for part in sums)

        zeros = jnp.zeros((SUB_CHUNK, SUB_CHUNK), f32)
        t = {(b, b): load(t_diag_ref, b) for b in range(blocks)}
        for b in range(blocks):
            beta_b = load(beta_ref, b)                                         # [16, 1]
            for c in range(blocks):
                a_bc = (scale * a_blk[b, c] if c < b else
                        load(a_diag_ref, b) if c == b else zeros)
                store(aqk_ref, b, a_bc, pl.ds(c * SUB_CHUNK, SUB_CHUNK))
            # T = (I + L)^-1 by blocks: T_bc = -T_bb sum_{c <= m < b} L_bm T_mc, at the
            # pass's precision (TF32 products on the fast path, as fla's merge; IEEE when
            # exact). Emulated TF32 left the bf16 errors unchanged to three digits.
            l_row = {c: beta_b * l_blk[b, c] for c in range(b)}
            for c in range(b - 1, -1, -1):
                coupled = sum(dot(l_row[m], t[m, c], precision) for m in range(c, b))
                t[b, c] = -dot(t[b, b], coupled, precision)
            for c in range(blocks):
                store(t_ref, b, t[b, c] if c <= b else zeros, pl.ds(c * SUB_CHUNK, SUB_CHUNK))


def _w_u_kernel(chunk_start_ref, chunk_len_ref, kb_ref, v_ref, beta_ref, t_ref,
                w_ref, u_ref, *, chunk, precision):
    """One chunk of one head: W = T (beta k exp(G)), U = T diag(beta) v.

    T comes stored in the operand dtype and the right-hand sides are rounded to it, so the
    products run on bf16 tensor cores on the fast path (fla does the same with its
    inverse); the exact path keeps fp32 and IEEE products."""
    slot, h = pl.program_id(0), pl.program_id(1)
    r0 = chunk_start_ref[slot]
    clen = chunk_len_ref[slot]

    @pl.when(clen > 0)
    def _():
        valid = iota((chunk, 1), 0) < clen
        rows = pl.ds(r0, chunk)

        def load(ref):
            return load_rows(ref, rows, h, valid)

        op = w_ref.dtype  # bf16 operands on the fast path, fp32 when exact
        t, beta = load(t_ref).astype(op), load(beta_ref)
        w = dot(t, load(kb_ref).astype(op), precision)
        u = dot(t, (beta * load(v_ref)).astype(op), precision)
        plgpu.store(w_ref.at[rows, h, :], w.astype(w_ref.dtype), mask=valid)
        plgpu.store(u_ref.at[rows, h, :], u.astype(u_ref.dtype), mask=valid)


class ChunkMatrices(NamedTuple):
    """What `chunk_matrices` hands `chunk_w_u`, per row and head ([T', H, ...])."""

    aqk: jax.Array     # [T', H, C] operand dtype
    t: jax.Array       # [T', H, C] operand dtype: T = (I + L)^-1, by chunk rows
    qg: jax.Array      # [T', H, K] operand dtype
    kg: jax.Array      # [T', H, K] operand dtype
    g_cum: jax.Array   # [T', H, K] fp32
    g_last: jax.Array  # [S, H, K] fp32
    kb: jax.Array      # [T', H, K] operand dtype: beta k exp(G), W's right-hand side


def _rows_of(x, width, dtype):
    return jax.ShapeDtypeStruct((*x.shape[:2], width), dtype)


def _params(num_warps, num_stages=1):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def chunk_matrices(q, k, g, beta, slots: ChunkSlots, *, scale: float,
                   bounded_gates: bool, config: KernelConfig, interpret: bool,
                   exact: bool) -> ChunkMatrices:
    """Pass 1a over [T', H, K] inputs: the diagonal blocks (`_inverse_kernel`; any decay,
    `bounded_gates=False`: with its check of the decays' spread), then G, Qg, Kg, Aqk and T
    (`_chunk_prep_kernel`)."""
    num_heads, head_k = q.shape[1:]
    chunk = config.chunk_size
    inter, f32 = operand_dtype(exact), jnp.float32
    num_slots = slots.start.shape[0]
    precision, base = matmul_precision(exact), exp_base(exact, interpret=interpret)
    inverse = pl.pallas_call(
        functools.partial(_inverse_kernel, chunk=chunk,
                          block_k=min(config.inverse_block_k, head_k), scale=scale,
                          precision=precision, checked=not bounded_gates, base=base),
        out_shape=(_rows_of(q, SUB_CHUNK, inter), _rows_of(q, SUB_CHUNK, f32)),
        grid=(num_slots * (chunk // SUB_CHUNK), num_heads),
        compiler_params=_params(config.inverse_num_warps, config.inverse_num_stages),
        interpret=interpret,
        name="kda_chunk_inverse" if bounded_gates else "kda_chunk_inverse_checked",
    )
    diagonal_blocks = inverse(slots.start, slots.length, q, k, g, beta)
    prep = pl.pallas_call(
        functools.partial(_chunk_prep_kernel, scale=scale, chunk=chunk,
                          block_k=min(config.prep_block_k, head_k), precision=precision,
                          base=base),
        out_shape=ChunkMatrices(
            _rows_of(q, chunk, inter), _rows_of(q, chunk, inter), _rows_of(q, head_k, inter),
            _rows_of(q, head_k, inter), _rows_of(q, head_k, f32),
            jax.ShapeDtypeStruct((num_slots, num_heads, head_k), f32),
            _rows_of(q, head_k, inter)),
        grid=(num_slots, num_heads),
        compiler_params=_params(config.prep_num_warps, config.prep_num_stages),
        interpret=interpret,
        name="kda_chunk_prep",
    )
    return ChunkMatrices(*prep(slots.start, slots.length, slots.snapshot, q, k, g, beta,
                               *diagonal_blocks))


def chunk_w_u(matrices: ChunkMatrices, v, beta, slots: ChunkSlots, *,
              config: KernelConfig, interpret: bool, exact: bool) -> ChunkTensors:
    """Pass 1b: W and U from T (`_w_u_kernel`); returns everything the scan needs."""
    inter = operand_dtype(exact)
    w_u = pl.pallas_call(
        functools.partial(_w_u_kernel, chunk=config.chunk_size,
                          precision=matmul_precision(exact)),
        out_shape=(_rows_of(matrices.kb, matrices.kb.shape[-1], inter),
                   _rows_of(v, v.shape[-1], inter)),
        grid=(slots.start.shape[0], v.shape[1]),
        compiler_params=_params(config.w_u_num_warps),
        interpret=interpret,
        name="kda_chunk_w_u",
    )
    w, u = w_u(slots.start, slots.length, matrices.kb, v, beta, matrices.t)
    m = matrices
    return ChunkTensors(w, u, m.aqk, m.qg, m.kg, m.g_cum, m.g_last)


def chunk_prep(q, k, v, g, beta, slots: ChunkSlots, *, scale: float,
               bounded_gates: bool, config: KernelConfig, interpret: bool,
               exact: bool) -> ChunkTensors:
    """Pass 1 over inputs of T' rows ([T', H, ...], see `pad_rows`): without the W/U
    kernel where the scan forms W and U (`config.scan_forms_w_u`).

    bounded_gates: the caller guarantees g >= b, b in [-5, 0) (`kda_prefill`'s
    `gate_lower_bound`): the diagonal blocks' products unchecked; otherwise each key
    slice's decays are checked first (`_inverse_kernel`). The kernels do not depend on b
    itself.
    """
    flags = dict(config=config, interpret=interpret, exact=exact)
    m = chunk_matrices(q, k, g, beta, slots, scale=scale, bounded_gates=bounded_gates,
                       **flags)
    if config.scan_forms_w_u:
        return ChunkTensors(None, None, m.aqk, m.qg, m.kg, m.g_cum, m.g_last, m.t, m.kb)
    return chunk_w_u(m, v, beta, slots, **flags)
