"""Flash attention over per-row key ranges as one Pallas kernel lowered through Triton.

Grid: (query blocks, heads). Query row t sees key rows [start[t], end[t]) (the op in
`pallas_kernels.attention` derives them from the packed spans). A program loops only over
the key blocks its rows can see: the union of their ranges, outside of which nothing is
loaded, so a packed batch costs what its sequences cost and the causal half above the
diagonal is skipped. Blocks that every row sees whole (the intersection of the ranges) run
without a mask; the edge blocks before and after them are masked per row.

Online softmax in base 2 (the scale folded with log2 e into each score's difference from the
running max, one `ex2.approx.ftz` per score: `tiles.exp2_ftz`, weights below 2^-126 are
zero), bf16 operands with fp32 accumulation (fp32 inputs: IEEE fp32 matmuls), output
divided once at the end.
Head dims that are not a power of two (MLA's qk 192 = nope 128 + rope 64) are split into
power-of-two column pieces whose dot products are summed, because Triton blocks must be
powers of two.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tiles import dot, dot_nt, exp2_ftz, iota, matmul_precision
from pallas_kernels.tuning import DeviceSpec, device_spec

LOG2_E = math.log2(math.e)
NEG_INIT = -1e30  # running max before any key: finite, so exp2(NEG_INIT - NEG_INIT) = 1
MIN_PIECE = 16  # narrowest column piece a Triton dot takes


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Static tiling (hashable: a jit static argument)."""

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2


# Per compute capability major, then by the widest head dim (qk or v) up to the key.
# sm_12x (GB10) has 99 KB of shared memory per block, sm_90/sm_100 227 KB, sm_80 163 KB.
# Shared memory, registers and spills come from `python -m pallas_kernels.aot`:
# GB10 qk 192 / v 128: 73,728 B, 168 registers; qk 256 / v 256: 69,632 B, 172 registers
# (64 x 64 blocks with 8 warps need 106,496 B there; 4 warps spill). H200, picked by
# `python -m bench.attention --sweep` (bench/results/attention_sweep_2026-12-02.json):
# qk 192 / v 128 at 128 x 128 (212,992 B, 228 registers; 8K causal 1.78 ms, 8 x 1K 0.40)
# and qk 256 / v 256 at 128 x 64 (196,608 B, 239 registers; 4.71 / 0.97 ms, where 64 x 64
# took 10.0 / 1.67), no spills. sm_100 shares sm_90's limits and table (not measured).
_SMALL = FlashConfig(block_q=64, block_k=64, num_warps=4, num_stages=2)
_HOPPER = {128: FlashConfig(128, 64, 8, 2), 192: FlashConfig(128, 128, 8, 2),
           256: FlashConfig(128, 64, 8, 2)}
TUNING = {
    12: {128: _SMALL, 192: FlashConfig(64, 64, 8, 2), 256: FlashConfig(64, 32, 8, 2)},
    9: _HOPPER,
    10: _HOPPER,
    8: {128: _SMALL, 192: FlashConfig(64, 64, 8, 2), 256: FlashConfig(64, 32, 8, 2)},
}


def select_flash_config(*, head_qk: int, head_v: int, operand_bytes: int = 2,
                        spec: DeviceSpec | None = None) -> FlashConfig:
    """The tuning table's entry for `spec` (default: this process's first device) and the
    head dims; fp32 operands halve the key block to stay inside the same shared memory."""
    spec = spec or device_spec()
    table = TUNING.get(spec.compute_capability[0], TUNING[8])
    widest = max(head_qk, head_v)
    fits = [dim for dim in sorted(table) if dim >= widest]
    if not fits:
        raise ValueError(f"no flash attention tiling for head dims qk={head_qk}, "
                         f"v={head_v} (at most {max(table)})")
    config = table[fits[0]]
    if operand_bytes > 2:
        config = dataclasses.replace(config, block_k=max(16, config.block_k // 2))
    return config


def head_pieces(dim: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) power-of-two column pieces covering [0, dim), widest first."""
    if dim % MIN_PIECE:
        raise ValueError(f"head dim {dim} must be a multiple of {MIN_PIECE}")
    pieces, offset = [], 0
    for bit in reversed(range(dim.bit_length())):
        if dim & (1 << bit):
            pieces.append((offset, 1 << bit))
            offset += 1 << bit
    return tuple(pieces)


def block_schedule(start, end, *, block_q: int, block_k: int) -> jax.Array:
    """Per query block, int32 [num_blocks, 4]: key blocks [lo, a) masked, [a, b) unmasked,
    [b, hi) masked. start, end: int32 [num_blocks * block_q, 1] row ranges (empty: none)."""
    has = (end > start).reshape(-1, block_q)
    start, end = start.reshape(-1, block_q), end.reshape(-1, block_q)
    big = jnp.iinfo(jnp.int32).max
    any_row = jnp.any(has, axis=1)
    lo = jnp.where(any_row, jnp.min(jnp.where(has, start, big), axis=1) // block_k, 0)
    hi = jnp.where(any_row, -(-jnp.max(jnp.where(has, end, 0), axis=1) // block_k), 0)
    max_start = jnp.max(jnp.where(has, start, 0), axis=1)
    min_end = jnp.min(jnp.where(has, end, big), axis=1)
    a = jnp.clip(-(-max_start // block_k), lo, hi)
    # A row without keys (padding) must see nothing: no unmasked blocks in its query block.
    b = jnp.where(jnp.all(has, axis=1), jnp.clip(min_end // block_k, a, hi), a)
    return jnp.stack([lo, a, b, hi], axis=1).astype(jnp.int32)


def _flash_kernel(schedule_ref, start_ref, end_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                  block_q, block_k, qk_pieces, v_pieces, scale_log2, num_queries, num_keys,
                  precision, exp2):
    """One query block x head: online softmax over the key blocks its rows can see."""
    # Last query blocks first: under a causal mask they see the most keys, so the longest
    # programs start early and the short ones fill the tail of the launch.
    qb, h = pl.num_programs(0) - 1 - pl.program_id(0), pl.program_id(1)
    rows = pl.ds(qb * block_q, block_q)
    row_ok = qb * block_q + iota((block_q, 1), 0) < num_queries  # [BQ, 1]
    start, end = start_ref[rows, :], end_ref[rows, :]  # [BQ, 1]
    q = [plgpu.load(q_ref.at[rows, h, pl.ds(off, width)], mask=row_ok, other=0)
         for off, width in qk_pieces]

    def step(kb, carry, *, masked):
        m, total, acc = carry
        keys = pl.ds(kb * block_k, block_k)
        if masked:
            key_ok = kb * block_k + iota((block_k, 1), 0) < num_keys  # [BK, 1]

            def load(ref, off, width):
                return plgpu.load(ref.at[keys, h, pl.ds(off, width)], mask=key_ok, other=0)
        else:
            def load(ref, off, width):
                return ref[keys, h, pl.ds(off, width)]
        s = dot_nt(q[0], load(k_ref, *qk_pieces[0]), precision)
        for q_piece, piece in zip(q[1:], qk_pieces[1:]):
            s = s + dot_nt(q_piece, load(k_ref, *piece), precision)
        if masked:  # [BQ, BK]
            cols = kb * block_k + iota((1, block_k), 1)
            s = jnp.where((cols >= start) & (cols < end), s, -jnp.inf)
        # Unscaled max, scaled differences: no multiply feeds an add, so no fused
        # multiply-add rounds differently in the masked and unmasked blocks, and a row's
        # bits do not depend on which kind its key blocks are (the batch around it).
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = exp2((s - m_new) * scale_log2)
        alpha = exp2((m - m_new) * scale_log2)
        total = total * alpha + jnp.sum(p, axis=1, keepdims=True)
        p = p.astype(v_ref.dtype)
        acc = tuple(a * alpha + dot(p, load(v_ref, *piece), precision)
                    for a, piece in zip(acc, v_pieces))
        return m_new, total, acc

    lo, a, b, hi = (schedule_ref[qb, i] for i in range(4))
    carry = (jnp.full((block_q, 1), NEG_INIT, jnp.float32), jnp.zeros((block_q, 1), jnp.float32),
             tuple(jnp.zeros((block_q, width), jnp.float32) for _, width in v_pieces))
    carry = lax.fori_loop(lo, a, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
    m, total, acc = lax.fori_loop(b, hi, functools.partial(step, masked=True), carry)

    seen = total > 0
    inv = 1 / jnp.where(seen, total, 1)
    for a_piece, (off, width) in zip(acc, v_pieces):
        plgpu.store(o_ref.at[rows, h, pl.ds(off, width)], (a_piece * inv).astype(o_ref.dtype),
                    mask=row_ok)
    lse = jnp.where(seen, (m * scale_log2 + jnp.log2(jnp.where(seen, total, 1))) / LOG2_E,
                    -jnp.inf)
    plgpu.store(lse_ref.at[rows, pl.ds(h, 1)], lse, mask=row_ok)


def _pad_rows(x, rows):
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def flash_attention_pallas(q, k, v, key_start, key_end, *, scale: float, config: FlashConfig,
                           interpret: bool):
    """q [T, H, D], k [S, H, D], v [S, H, Dv]; key_start, key_end int32 [T]: row t attends
    to key rows [key_start[t], key_end[t]) (validated ranges inside [0, S]).

    Returns o [T, H, Dv] in q's dtype (zero on rows without keys) and lse fp32 [T, H].
    """
    num_queries, num_heads, head_qk = q.shape
    num_keys, head_v = k.shape[0], v.shape[-1]
    block_q, block_k = config.block_q, config.block_k
    num_blocks = -(-num_queries // block_q)
    padded_q = num_blocks * block_q
    start = _pad_rows(key_start.astype(jnp.int32), padded_q)[:, None]
    end = _pad_rows(key_end.astype(jnp.int32), padded_q)[:, None]
    schedule = block_schedule(start, end, block_q=block_q, block_k=block_k)
    if interpret:  # the interpreter clamps out-of-range row windows; Triton masks them
        q = _pad_rows(q, padded_q)
        padded_k = -(-num_keys // block_k) * block_k
        k, v = _pad_rows(k, padded_k), _pad_rows(v, padded_k)
    out_rows = q.shape[0]
    kernel = functools.partial(
        _flash_kernel, block_q=block_q, block_k=block_k, qk_pieces=head_pieces(head_qk),
        v_pieces=head_pieces(head_v), scale_log2=scale * LOG2_E, num_queries=num_queries,
        num_keys=num_keys, precision=matmul_precision(q.dtype == jnp.float32),
        exp2=jnp.exp2 if interpret else exp2_ftz)
    o, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((out_rows, num_heads, head_v), q.dtype),
                   jax.ShapeDtypeStruct((out_rows, num_heads), jnp.float32)),
        grid=(num_blocks, num_heads),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="flash_attention",
    )(schedule, start, end, q, k, v)
    return o[:num_queries], lse[:num_queries]
