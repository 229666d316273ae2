"""Chunk slots of the KDA prefill: where each sequence's chunks lie in the packed rows, and
the per-row tensors the prep pass (`pallas_kernels.kda_prep`) hands the scan
(`pallas_kernels.kda_pallas`, `kda_segments`).

Slots are numbered sequence by sequence; a sequence of L rows takes ceil(L / C) slots, and
ceil(T / C) + N slots hold any split of T rows into N sequences (unused slots have length
0), so the slot count is static.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


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
    snapshot: jax.Array    # int32 [S]: 1 where the scan reads G (the slot holds a snapshot)


class ChunkTensors(NamedTuple):
    """What the prep pass hands the scan, per row and head ([T', H, ...]).

    W, U, Aqk, Qg, Kg, T and beta k exp(G) are stored in the operand dtype (bf16 on the
    fast path, fp32 when exact); G and G_last stay fp32. G is stored only in the slots
    marked `snapshot` (the scan reads it nowhere else); other rows of it are left
    unwritten. Either W and U (the W/U pass ran) or T and beta k exp(G) (the scan forms
    W = T (beta k exp(G)) and U = T diag(beta) v itself, `KernelConfig.scan_forms_w_u`);
    the other two are None.
    """

    w: jax.Array | None  # [T', H, K]
    u: jax.Array | None  # [T', H, V]
    aqk: jax.Array    # [T', H, C]
    qg: jax.Array     # [T', H, K]
    kg: jax.Array     # [T', H, K]
    g_cum: jax.Array  # [T', H, K] fp32
    g_last: jax.Array  # [S, H, K] fp32: G at each chunk slot's last row
    t: jax.Array | None = None   # [T', H, C]: T = (I + L)^-1, by chunk rows
    kb: jax.Array | None = None  # [T', H, K]: beta k exp(G), W's right-hand side


def pad_rows(x, chunk):
    """Append one chunk of zero rows, so every chunk window [r0, r0 + C) is in bounds
    (interpret mode only: on the GPU, Triton masks the rows past T)."""
    return jnp.pad(x, [(0, chunk)] + [(0, 0)] * (x.ndim - 1))


def chunk_slots(cu_seqlens, num_tokens, chunk, checkpoint_offsets=None) -> ChunkSlots:
    """ceil(T / C) + N chunk slots: enough for any split of T rows into N sequences.

    checkpoint_offsets: int32 [N, capacity] (`kda_prefill`'s): the slots holding an active
    one (1 <= offset <= length) are marked `snapshot`; None marks every slot."""
    num_slots = -(-num_tokens // chunk) + cu_seqlens.shape[0] - 1
    start, length, first = _chunk_slots(cu_seqlens, num_slots, chunk)
    if checkpoint_offsets is None:
        return ChunkSlots(start, length, first, jnp.ones((num_slots,), jnp.int32))
    lens = (cu_seqlens[1:] - cu_seqlens[:-1])[:, None]
    active = (checkpoint_offsets >= 1) & (checkpoint_offsets <= lens)
    slot = first[:, None] + (jnp.maximum(checkpoint_offsets, 1) - 1) // chunk
    snapshot = jnp.zeros((num_slots,), jnp.int32).at[jnp.where(active, slot, num_slots)].set(
        1, mode="drop")
    return ChunkSlots(start, length, first, snapshot)


def scan_grid(num_programs: int, num_heads: int, column_blocks: int) -> tuple[int, int, int]:
    """The launch grid of a scan over (sequence or segment, head, column block) programs:
    column blocks first, the axis CUDA dispatches fastest, so the programs of one
    sequence and head, which read the same chunk tiles (Qg, Kg, W or T, ...), run in the
    same wave and share those reads in L2. With sequences first (until 2026-12-07), four
    8K sequences x 32 heads ran each head's four value blocks in four different waves of
    an H100's 132 SMs: the scan moved 4.94 GB for 4x the 0.42 GB of one 8K sequence
    (ncu, `bench/results/kda_times_4x8K_h100_2026-12-07.csv`)."""
    return column_blocks, num_programs, num_heads
