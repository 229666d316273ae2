"""The KDA checkpointing scan as three Pallas passes lowered through Triton: the scan and
output passes here, the prep pass in `pallas_kernels.kda_prep`.

Pass 1, `pallas_kernels.kda_prep.chunk_prep` (small fully parallel programs per chunk slot
and head), turns each chunk of C tokens into W, U, Aqk, Qg, Kg and G (see that module).

Pass 2, `_recurrence_kernel` (grid: sequences x heads x value blocks), runs the
chunk-to-chunk recurrence in one program's `fori_loop`, with only the two matmuls the
recurrence depends on (with `KernelConfig.scan_segments` P > 1, the grid is sequences x P
segments x heads x value blocks, each segment starting from its entry state as
`pallas_kernels.kda_segments` computes it):

    store S (the chunk's entry state);   Vnew = U - W S;   S <- diag(exp(G_last)) S + Kg^T Vnew

and stores a snapshot whenever a checkpoint offset falls inside the chunk: at the chunk's
last row the S it carries on with (bit for bit the final state of a span cut there), before
it
    S_p = diag(exp(G_{p-1})) S_in + (k * exp(G_{p-1} - G) * [j < p])^T Vnew.

Pass 3, `_output_kernel` (grid: chunk slots x heads x value blocks, fully parallel):
    O = Qg S_entry + Aqk Vnew;
or, with `KernelConfig.fuse_output`, the scan computes O itself chunk by chunk and stores
neither the entry states nor Vnew.

Intermediates are fp32; on the fast path the matmul operands W, U, Aqk, Qg, Kg, Vnew and
the entry states are stored in bf16. Rows past a sequence's end are masked on every load,
so chunks never see the next sequence's rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda_chunks import ChunkSlots, ChunkTensors, chunk_slots, pad_rows, scan_grid
from pallas_kernels.kda_prep import chunk_prep
from pallas_kernels.kda_segments import combine_segments, segment_chunks, segment_transitions
from pallas_kernels.tiles import (
    dot,
    dot_tn,
    exp_function,
    iota,
    load_rows,
    matmul_precision,
    operand_dtype,
)
from pallas_kernels.tuning import KernelConfig


def _recurrence_kernel(cu_ref, first_slot_ref, offsets_ref, init_ref, k_ref, kg_ref,
                       gcum_ref, glast_ref, *refs, chunk, block_v, capacity, segments,
                       precision, fused, forms_w_u, prefetch, num_tokens, exp):
    """One segment x head x value block: the chunk-to-chunk scan with snapshots.

    Program axes: value block, then sequence n's segment s at n * segments + s, then head
    (`scan_grid`); init_ref [N segments, H, K, V] holds each segment's entry state (the
    initial states when segments == 1).
    refs start with W and U ([T', H, K], [T', H, V]), or with `forms_w_u` T, beta k
    exp(G), v and beta, from which each chunk's W = T (beta k exp(G)) and U = T diag(beta)
    v are formed here (the W/U pass's products, W in the operand dtype, U in fp32).
    Unfused (then: states, vnew, final, snap), stores each chunk's entry state (for the
    output pass) at its chunk slot and Vnew at the chunk's rows: only the two matmuls the
    recurrence depends on run here. Fused (then: qg, aqk, o, final, snap), computes the
    chunk's output O = Qg S_entry + Aqk Vnew from the same operand-dtype values the output
    pass would load, and stores nothing else per chunk; the last segment's programs also
    zero the rows past the last sequence, up to `num_tokens` (no fill of o before).
    Each snapshot is stored by the one segment holding its offset, zeros by segment 0 when
    the offset is inactive; the final state by the sequence's last non-empty segment.
    """
    w_u_refs, refs = (refs[:4], refs[4:]) if forms_w_u else (refs[:2], refs[2:])
    if fused:
        qg_ref, aqk_ref, o_ref, final_ref, snap_ref = refs
    else:
        states_ref, vnew_ref, final_ref, snap_ref = refs
    vb, index, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n, s = index // segments, index % segments
    start = cu_ref[n]
    seq_len = cu_ref[n + 1] - start
    first, end, last = segment_chunks((seq_len + chunk - 1) // chunk, s, segments)
    first_slot = first_slot_ref[n]
    head_k = k_ref.shape[-1]
    vcols = pl.ds(vb * block_v, block_v)
    rows_c = iota((chunk, 1), 0)
    offsets = [offsets_ref[n, c] for c in range(capacity)]
    operand = kg_ref.dtype

    for c in range(capacity):
        @pl.when((s == 0) & jnp.logical_not((offsets[c] >= 1) & (offsets[c] <= seq_len)))
        def _(c=c):
            snap_ref[n, c, h, :, vcols] = jnp.zeros((head_k, block_v), jnp.float32)

    def chunk_rows(i):
        n_valid = jnp.minimum(chunk, seq_len - i * chunk)
        return pl.ds(start + i * chunk, chunk), rows_c < n_valid, n_valid

    def unpipelined(i):
        """Chunk i's loads outside the pipeline's copies: G_last's row [K], beta v fp32
        [C, block_v] (None unless W and U are formed here). With `prefetch` the loop
        carries them, loaded one chunk ahead (`KernelConfig.scan_prefetch`); without,
        each chunk loads its own first."""
        rows, valid, _ = chunk_rows(i)
        # clamped: a sequence without chunks reads a row in range and never uses it
        g_last = glast_ref[jnp.minimum(first_slot + i, glast_ref.shape[0] - 1), h, :]  # [K]
        beta_v = None
        if forms_w_u:
            _, _, v_ref, beta_ref = w_u_refs
            beta_v = load_rows(beta_ref, rows, h, valid) * load_rows(v_ref, rows, h, valid,
                                                                       vcols)
        return g_last, beta_v

    def body(i, carry):
        if prefetch:
            state, (g_last, beta_v) = carry
            ahead = unpipelined(jnp.minimum(i + 1, end - 1))
        else:
            state, (g_last, beta_v) = carry, unpipelined(i)
        r0 = start + i * chunk
        rows, valid, n_valid = chunk_rows(i)

        def load(ref, cols):
            return plgpu.load(ref.at[rows, h, cols], mask=valid, other=0)

        # The chunk's own tiles arrive by the pipeline's copies, waited for at its start.
        # Products that need only S first, the output's store after the last product.
        state_op = state.astype(operand)
        if fused:
            q_state = dot(load(qg_ref, slice(None)), state_op, precision)
        if forms_w_u:
            t_ref, kb_ref = w_u_refs[:2]
            t = load(t_ref, slice(None))
            w = dot(t, load(kb_ref, slice(None)), precision).astype(operand)
            u = dot(t, beta_v.astype(operand), precision)
        else:
            w_ref, u_ref = w_u_refs
            w, u = load(w_ref, slice(None)), load(u_ref, vcols).astype(jnp.float32)
        v_new = u - dot(w, state_op, precision)
        v_new_op = v_new.astype(operand)
        kg = load(kg_ref, slice(None)).astype(operand)
        if fused:
            a_v = dot(load(aqk_ref, slice(None)), v_new_op, precision)
        k_v = dot_tn(kg, v_new_op, precision)
        if fused:
            plgpu.store(o_ref.at[rows, h, vcols], (q_state + a_v).astype(o_ref.dtype),
                        mask=valid)
        else:
            states_ref[first_slot + i, h, :, vcols] = state_op.astype(states_ref.dtype)
            plgpu.store(vnew_ref.at[rows, h, vcols], v_new.astype(vnew_ref.dtype), mask=valid)

        def inside(offset):
            """A snapshot offset's row inside this chunk (1..n_valid when it is)."""
            local = offset - i * chunk
            return local, (local >= 1) & (local <= n_valid)

        def snapshot(c, carry):
            """Snapshot c, if its offset falls inside this chunk before its last row: the
            state after the offset's row, from G at that row (loads only then; a loop, so
            its code exists once)."""
            local, store = inside(offsets_ref[n, c])

            @pl.when(store & (local < n_valid))
            def _():
                g_cum = load(gcum_ref, slice(None))
                k = load(k_ref, slice(None)).astype(jnp.float32)
                g_at = gcum_ref[r0 + local - 1, h, :]  # [K]: G at the offset's row
                k_dec = jnp.where(rows_c < local,
                                  k * exp(jnp.minimum(g_at[None, :] - g_cum, 0.0)), 0.0)
                snap_ref[n, c, h, :, vcols] = (exp(g_at)[:, None] * state
                                               + dot_tn(k_dec, v_new, precision))
            return carry

        # the offsets read before the loop: scalar loads here would stall every chunk
        within = [inside(o) for o in offsets]
        if capacity:
            @pl.when(functools.reduce(jnp.logical_or,
                                      [store & (local < n_valid) for local, store in within]))
            def _():
                lax.fori_loop(0, capacity, snapshot, 0)

        state = exp(g_last)[:, None] * state + k_v

        def snapshot_at_end(c, carry):
            """Snapshot c, if its offset is the chunk's last row: the state carried on, so
            that a span resumed from it continues bit for bit as this pass does (and as a
            span cut there ends). A loop of its own after the update, so that one state is
            live at a time (with the update between them: +12 B of spills at most, sm_90
            and sm_121, where storing the new state in the loop above spilled 272 B more
            in the segment scan)."""
            local, store = inside(offsets_ref[n, c])

            @pl.when(store & (local == n_valid))
            def _():
                snap_ref[n, c, h, :, vcols] = state
            return carry

        if capacity:
            @pl.when(functools.reduce(jnp.logical_or,
                                      [store & (local == n_valid) for local, store in within]))
            def _():
                lax.fori_loop(0, capacity, snapshot_at_end, 0)

        return (state, ahead) if prefetch else state

    state = init_ref[index, h, :, vcols]
    if prefetch:
        state, _ = lax.fori_loop(first, end, body, (state, unpipelined(first)))
    else:
        state = lax.fori_loop(first, end, body, state)

    @pl.when(s == last)
    def _():
        final_ref[n, h, :, vcols] = state

    if fused:
        @pl.when(index == pl.num_programs(1) - 1)
        def _():
            padding = cu_ref[cu_ref.shape[0] - 1]  # rows no sequence owns: [padding, T)

            def zero(i, carry):
                r0 = padding + i * chunk
                plgpu.store(o_ref.at[pl.ds(r0, chunk), h, vcols],
                            jnp.zeros((chunk, block_v), o_ref.dtype),
                            mask=rows_c + r0 < num_tokens)
                return carry

            lax.fori_loop(0, (num_tokens - padding + chunk - 1) // chunk, zero, 0)


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
        valid = iota((chunk, 1), 0) < clen
        rows = pl.ds(r0, chunk)

        def load(ref, cols):
            return plgpu.load(ref.at[rows, h, cols], mask=valid, other=0)

        state = states_ref[slot, h, :, vcols]
        out = (dot(load(qg_ref, slice(None)), state, precision)
               + dot(load(aqk_ref, slice(None)), load(vnew_ref, vcols), precision))
        plgpu.store(o_ref.at[rows, h, vcols], out.astype(o_ref.dtype), mask=valid)


def chunk_scan(tensors: ChunkTensors, k, v, beta, slots: ChunkSlots, cu_seqlens,
               segment_states, checkpoint_offsets, *, config: KernelConfig, interpret: bool,
               exact: bool, out_dtype=None):
    """Pass 2: the recurrence. k, v: [T', H, K], [T', H, V], beta [T', H] (read only when
    the scan forms W and U: `tensors.w` None), T' = T (GPU) or T + C (interpret mode);
    segment_states fp32 [N P, H, K, V]: each segment's entry state, P =
    config.scan_segments (the initial states when P = 1; `kda_segments`).

    Returns, unless config.fuse_output, entry_states [S, H, K, V] (each chunk slot's entry
    state, operand dtype) and v_new [T', H, V] (operand dtype) for the output pass; with
    it, o [T', H, V] in out_dtype (zero on rows past the last sequence; in interpret mode
    the last C rows, `pad_rows`' own, are left unwritten). Then final_states fp32
    [N, H, K, V] and snapshots fp32 [N, capacity, H, K, V].
    """
    rows, num_heads, head_k = k.shape
    head_v = v.shape[-1]
    num_seqs, capacity = checkpoint_offsets.shape
    block_v, segments, fused = config.block_v, config.scan_segments, config.fuse_output
    forms_w_u = tensors.w is None
    inter, f32 = operand_dtype(exact), jnp.float32
    warps, stages = ((config.scan_num_warps, config.scan_num_stages) if segments == 1 else
                     (config.segment_num_warps, config.segment_num_stages))
    per_chunk = ((jax.ShapeDtypeStruct((rows, num_heads, head_v), out_dtype),) if fused else
                 (jax.ShapeDtypeStruct((slots.start.shape[0], num_heads, head_k, head_v),
                                       inter),
                  jax.ShapeDtypeStruct((rows, num_heads, head_v), inter)))
    operands = [cu_seqlens, slots.first_slot, checkpoint_offsets, segment_states, k, tensors.kg,
                tensors.g_cum, tensors.g_last,
                *((tensors.t, tensors.kb, v, beta) if forms_w_u else (tensors.w, tensors.u))]
    if fused:
        operands += [tensors.qg, tensors.aqk]
    scan = pl.pallas_call(
        functools.partial(_recurrence_kernel, chunk=config.chunk_size, block_v=block_v,
                          capacity=capacity, segments=segments,
                          precision=matmul_precision(exact), fused=fused,
                          forms_w_u=forms_w_u, prefetch=config.scan_prefetch,
                          exp=exp_function(exact, interpret=interpret),
                          num_tokens=rows - config.chunk_size if interpret else rows),
        out_shape=(*per_chunk,
                   jax.ShapeDtypeStruct((num_seqs, num_heads, head_k, head_v), f32),
                   jax.ShapeDtypeStruct((num_seqs, capacity, num_heads, head_k, head_v), f32)),
        grid=scan_grid(num_seqs * segments, num_heads, head_v // block_v),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=("kda_segment_scan" if segments > 1 else
              "kda_chunk_scan_w_u" if forms_w_u else "kda_chunk_scan"),
    )
    return scan(*operands)


def chunk_output(tensors: ChunkTensors, entry_states, v_new, slots: ChunkSlots, *, out_dtype,
                 config: KernelConfig, interpret: bool, exact: bool):
    """Pass 3, chunk-parallel: o [T', H, V] in out_dtype, zero on rows no chunk owns."""
    rows, num_heads, head_v = v_new.shape
    block_v = min(config.output_block_v, head_v)  # both powers of two
    o_zero = jnp.zeros((rows, num_heads, head_v), out_dtype)
    output = pl.pallas_call(
        functools.partial(_output_kernel, chunk=config.chunk_size, block_v=block_v,
                          precision=matmul_precision(exact)),
        out_shape=jax.ShapeDtypeStruct((rows, num_heads, head_v), out_dtype),
        grid=(slots.start.shape[0], num_heads, head_v // block_v),
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(num_warps=config.output_num_warps,
                                             num_stages=config.output_num_stages),
        interpret=interpret,
        name="kda_chunk_output",
    )
    return output(slots.start, slots.length, tensors.qg, tensors.aqk, entry_states, v_new,
                  o_zero)


@functools.partial(jax.jit, static_argnames=("scale", "bounded_gates", "config", "interpret",
                                             "exact"))
def kda_prefill_pallas(q, k, v, g, beta, cu_seqlens, initial_states, checkpoint_offsets, *,
                       scale: float, bounded_gates: bool, config: KernelConfig,
                       interpret: bool, exact: bool):
    """Pallas implementation of `kda_prefill` (arguments already validated).

    exact: fp32 (IEEE) matmuls everywhere, for fp32 inputs; otherwise the large matmuls
    run with bf16 operands and fp32 accumulation.
    """
    chunk, num_tokens = config.chunk_size, q.shape[0]
    flags = dict(config=config, interpret=interpret, exact=exact)
    slots = chunk_slots(cu_seqlens, num_tokens, chunk, checkpoint_offsets)
    if interpret:  # the interpreter clamps out-of-range row windows; Triton masks them
        q, k, v, g, beta = (pad_rows(x, chunk) for x in (q, k, v, g, beta))
    tensors = chunk_prep(q, k, v, g, beta, slots, scale=scale, bounded_gates=bounded_gates,
                         **flags)
    segment_states = initial_states
    if config.scan_segments > 1:
        transitions = segment_transitions(tensors, slots, cu_seqlens, initial_states, **flags)
        segment_states = combine_segments(initial_states, transitions, config.scan_segments)
    scanned = chunk_scan(tensors, k, v, beta, slots, cu_seqlens, segment_states,
                         checkpoint_offsets, out_dtype=v.dtype, **flags)
    if config.fuse_output:
        o, final_states, snapshots = scanned
    else:
        entry_states, v_new, final_states, snapshots = scanned
        o = chunk_output(tensors, entry_states, v_new, slots, out_dtype=v.dtype, **flags)
    return o[:num_tokens], final_states, snapshots
