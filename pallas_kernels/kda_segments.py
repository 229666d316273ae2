"""The segment-parallel scan: each sequence's chunks split into P segments that run in
parallel (`KernelConfig.scan_segments`; docs/KERNEL.md, "The segment-parallel scan").

The chunk recurrence is affine in the state. With Vnew = U - W S,

    S' = diag(exp(G_last)) S + Kg^T (U - W S) = A_i S + B_i,
    A_i = diag(exp(G_last)) - Kg^T W   [K, K],    B_i = Kg^T U   [K, V],

so a segment maps its entry state to its end state by S_end = A_seg S_start + B_seg, with
A_seg = A_m ... A_1 and B_seg the end state of the segment scanned from zero. Both come
from one scan of the [K, K + V] matrix X = [A | B] from [I | 0], chunk by chunk:

    X <- diag(exp(G_last)) X + Kg^T ([0 | U] - W X)

the plain scan's step on K + V columns instead of V (`_transition_kernel`; segment 0 runs
only its V columns, from the sequence's initial state, which gives its end state
directly). `combine_segments` then walks the segments in order, S_{s+1} = A_s S_s + B_s
(P - 2 products of [K, K] x [K, V] per head), and the plain scan kernel
(`kda_pallas.chunk_scan`) runs every segment again from its entry state, storing the
chunk entry states, Vnew, the snapshots inside the segment and the final state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda_chunks import ChunkSlots, ChunkTensors, scan_grid
from pallas_kernels.tiles import dot, dot_tn, exp_function, iota, matmul_precision
from pallas_kernels.tuning import KernelConfig


def segment_chunks(num_chunks, segment, segments: int):
    """Sequence-local chunks [first, end) of `segment` (of `segments`) and the index of
    the sequence's last non-empty segment, for a sequence of `num_chunks` chunks (runtime
    int32 scalars). Segments hold ceil(num_chunks / segments) chunks (at least 1), so the
    trailing ones may be empty; a sequence of no chunks has segment 0 as its last."""
    length = jnp.maximum((num_chunks + segments - 1) // segments, 1)
    first = segment * length
    last = jnp.maximum(num_chunks - 1, 0) // length
    return first, jnp.minimum(first + length, num_chunks), last


def _transition_kernel(cu_ref, first_slot_ref, init_ref, w_ref, u_ref, kg_ref, glast_ref,
                       trans_ref, *, chunk, block_v, segments, precision, exp):
    """One column block of one segment's [A | B] for one head (segments 0..P-2).

    Column blocks below K / block_v are A's (from the identity, U ignored), the others
    B's (from zero, or from the sequence's initial state in segment 0, which skips A).
    Stores X at the end of the segment into trans_ref [N (P - 1), H, K, K + V] (fp32).
    """
    j, index, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # `scan_grid`
    n, s = index // (segments - 1), index % (segments - 1)
    start = cu_ref[n]
    seq_len = cu_ref[n + 1] - start
    first, end, _ = segment_chunks((seq_len + chunk - 1) // chunk, s, segments)
    first_slot = first_slot_ref[n]
    head_k = w_ref.shape[-1]
    key_blocks = head_k // block_v
    is_a = j < key_blocks
    vcols = pl.ds(jnp.maximum(j - key_blocks, 0) * block_v, block_v)
    rows_c = iota((chunk, 1), 0)
    operand = w_ref.dtype

    @pl.when(jnp.logical_not(is_a & (s == 0)))
    def _():
        eye = (iota((head_k, block_v), 0) == iota((head_k, block_v), 1) + j * block_v)
        init = jnp.where(s == 0, init_ref[n, h, :, vcols], 0.0)
        x0 = jnp.where(is_a, eye.astype(jnp.float32), init)

        def body(i, x):
            n_valid = jnp.minimum(chunk, seq_len - i * chunk)
            valid = rows_c < n_valid  # [C, 1]
            rows = pl.ds(start + i * chunk, chunk)
            w = plgpu.load(w_ref.at[rows, h, :], mask=valid, other=0)
            u = plgpu.load(u_ref.at[rows, h, vcols], mask=valid & jnp.logical_not(is_a),
                           other=0)
            v_new = u.astype(jnp.float32) - dot(w, x.astype(operand), precision)
            kg = plgpu.load(kg_ref.at[rows, h, :], mask=valid, other=0).astype(operand)
            g_last = glast_ref[first_slot + i, h, :]  # [K]
            return (exp(g_last)[:, None] * x
                    + dot_tn(kg, v_new.astype(operand), precision))

        trans_ref[index, h, :, pl.ds(j * block_v, block_v)] = lax.fori_loop(first, end, body,
                                                                            x0)


def segment_transitions(tensors: ChunkTensors, slots: ChunkSlots, cu_seqlens, initial_states,
                        *, config: KernelConfig, interpret: bool, exact: bool):
    """[A_s | B_s] of segments s = 0..P-2 of every sequence: fp32 [N (P - 1), H, K, K + V]
    (segment 0's A block is not formed; its B is its end state)."""
    rows, num_heads, head_k = tensors.w.shape
    head_v = tensors.u.shape[-1]
    num_seqs, segments, block_v = initial_states.shape[0], config.scan_segments, config.block_v
    transitions = pl.pallas_call(
        functools.partial(_transition_kernel, chunk=config.chunk_size, block_v=block_v,
                          segments=segments, precision=matmul_precision(exact),
                          exp=exp_function(exact, interpret=interpret)),
        out_shape=jax.ShapeDtypeStruct(
            (num_seqs * (segments - 1), num_heads, head_k, head_k + head_v), jnp.float32),
        grid=scan_grid(num_seqs * (segments - 1), num_heads, (head_k + head_v) // block_v),
        compiler_params=plgpu.CompilerParams(num_warps=config.segment_num_warps,
                                             num_stages=config.segment_num_stages),
        interpret=interpret,
        name="kda_segment_transition",
    )
    return transitions(cu_seqlens, slots.first_slot, initial_states, tensors.w, tensors.u,
                       tensors.kg, tensors.g_last)


def combine_segments(initial_states, transitions, segments: int):
    """Every segment's entry state, fp32 [N P, H, K, V] (sequence-major): S_0 the initial
    state, S_1 = B_0 (segment 0 scanned from it), S_{s+1} = A_s S_s + B_s. XLA, fp32
    products (P - 2 of them, [K, K] x [K, V] per sequence and head)."""
    num_seqs, num_heads, head_k, head_v = initial_states.shape
    trans = transitions.reshape(num_seqs, segments - 1, num_heads, head_k, head_k + head_v)
    states = [initial_states, trans[:, 0, :, :, head_k:]]
    for s in range(1, segments - 1):
        a, b = trans[:, s, :, :, :head_k], trans[:, s, :, :, head_k:]
        states.append(jnp.einsum("nhij,nhjv->nhiv", a, states[-1],
                                 precision=lax.Precision.HIGHEST) + b)
    return jnp.stack(states, axis=1).reshape(num_seqs * segments, num_heads, head_k, head_v)
