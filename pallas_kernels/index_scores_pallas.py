"""DSA index scores as one Pallas kernel lowered through Triton.

Grid: (row blocks, key blocks). A program owns one [block_r, block_s] tile of the output:
for each index head it multiplies the rows' queries of that head by the tile's keys, and
adds ``weight * relu(dot)`` to an fp32 accumulator held in registers, so the [R, H, S]
head scores never reach memory. A tile that no row of its block sees (the causal upper
half of a span, another sequence's keys) skips the head loop and is written as -inf.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tiles import dot_nt, iota, matmul_precision
from pallas_kernels.tuning import DeviceSpec, device_spec


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    """Static tiling (hashable: a jit static argument)."""

    block_r: int = 64
    block_s: int = 64
    num_warps: int = 4
    num_stages: int = 2


# Per compute capability major, for the indexer's head dim 128 (glm5.3-flash: 32 heads).
# From `python -m pallas_kernels.aot` (Triton 3.9), 128 x 128 tiles, 8 warps: H200 98,304 B
# shared, 220 registers; GB10 65,536 B of its 99 KB, 240 registers; no spills (4 warps at
# 64 x 128 reach 237-238). Speed: `python -m bench.sparse_attention` (row "select").
_TILE = IndexConfig(block_r=128, block_s=128, num_warps=8, num_stages=2)
TUNING = {12: _TILE, 9: _TILE, 10: _TILE, 8: _TILE}


def select_index_config(spec: DeviceSpec | None = None) -> IndexConfig:
    """The tuning table's entry for `spec` (default: this process's first device)."""
    spec = spec or device_spec()
    return TUNING.get(spec.compute_capability[0], TUNING[8])


def _index_kernel(span_ref, start_ref, end_ref, q_ref, w_ref, k_ref, o_ref, *, block_r,
                  block_s, num_heads, num_rows, num_keys, precision):
    """One [block_r, block_s] tile: sum over heads of weight * relu(q . k), -inf where a row
    does not see the key."""
    rb, sb = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(rb * block_r, block_r), pl.ds(sb * block_s, block_s)
    row_ok = rb * block_r + iota((block_r, 1), 0) < num_rows  # [BR, 1]
    col = sb * block_s + iota((1, block_s), 1)  # [1, BS]
    key_ok = sb * block_s + iota((block_s, 1), 0) < num_keys  # [BS, 1]
    lo, hi = span_ref[rb, 0], span_ref[rb, 1]  # the row block's keys: [lo, hi)
    # Integer arithmetic, not a bool: a loop bound from a scalar select lowers as i1.
    overlap = jnp.minimum(hi, (sb + 1) * block_s) - jnp.maximum(lo, sb * block_s)
    keys = plgpu.load(k_ref.at[cols, :], mask=key_ok, other=0)  # [BS, d]

    def head(h, acc):
        q = plgpu.load(q_ref.at[rows, h, :], mask=row_ok, other=0)  # [BR, d]
        w = plgpu.load(w_ref.at[rows, pl.ds(h, 1)], mask=row_ok, other=0)  # [BR, 1]
        return acc + w * jnp.maximum(dot_nt(q, keys, precision), 0)

    heads_seen = jnp.clip(overlap, 0, 1) * num_heads  # 0: no row sees the tile, skip it
    acc = lax.fori_loop(0, heads_seen, head,
                        jnp.zeros((block_r, block_s), jnp.float32))
    start, end = start_ref[rows, :], end_ref[rows, :]  # [BR, 1]
    out = jnp.where((col >= start) & (col < end), acc, -jnp.inf)
    plgpu.store(o_ref.at[rows, cols], out, mask=row_ok & (col < num_keys))


def _pad_rows(x, rows):
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def index_scores_pallas(q, weights, keys, key_start, key_end, *, config: IndexConfig,
                        interpret: bool):
    """q [R, H, d], weights fp32 [R, H], keys [S, d]; key_start, key_end int32 [R] inside
    [0, S]. Returns fp32 [R, S] (see `pallas_kernels.index_scores`)."""
    num_rows, num_heads, dim = q.shape
    num_keys, block_r, block_s = keys.shape[0], config.block_r, config.block_s
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"index head dim {dim} must be a power of two >= 16")
    row_blocks, key_blocks = -(-num_rows // block_r), -(-num_keys // block_s)
    padded_r, padded_s = row_blocks * block_r, key_blocks * block_s
    start = _pad_rows(key_start.astype(jnp.int32), padded_r)[:, None]
    end = _pad_rows(key_end.astype(jnp.int32), padded_r)[:, None]
    has = (end > start).reshape(row_blocks, block_r)
    span = jnp.stack([
        jnp.min(jnp.where(has, start.reshape(row_blocks, block_r), padded_s), axis=1),
        jnp.max(jnp.where(has, end.reshape(row_blocks, block_r), 0), axis=1)], axis=1)
    keys = keys.astype(q.dtype)
    weights = weights.astype(jnp.float32)
    if interpret:  # the interpreter clamps out-of-range windows; Triton masks them
        q, weights, keys = _pad_rows(q, padded_r), _pad_rows(weights, padded_r), _pad_rows(
            keys, padded_s)
    out_shape = (padded_r, padded_s) if interpret else (num_rows, num_keys)
    kernel = functools.partial(
        _index_kernel, block_r=block_r, block_s=block_s, num_heads=num_heads,
        num_rows=num_rows, num_keys=num_keys, precision=matmul_precision(q.dtype == jnp.float32))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(row_blocks, key_blocks),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="index_scores",
    )(span.astype(jnp.int32), start, end, q, weights, keys)
    return out[:num_rows, :num_keys]
