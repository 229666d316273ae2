"""Rows a weight-stream launch (`pallas_kernels.stream_matmul`) forms itself from what an
earlier op left, so that forming them is no launch of its own, and their references:

- `RowNorm`: the RMSNorm of x [M, K] (`rms_norm`, the norm's one definition; the launch also
  returns the normed rows for the consumers that do not stream);
- `SwiGLURows`: ``swiglu(gate, up)`` of a SwiGLU MLP from the fp32 partial sums an earlier
  stream launch kept (`keep_partials`), each added in `ordered_sum`'s order and rounded to
  the products' dtype first, as the launch that made them would have returned them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.moe_experts import swiglu
from pallas_kernels.partials import ordered_sum


class RowNorm(NamedTuple):
    """An RMSNorm over the rows' last axis: weight [K] (any float dtype), eps."""

    weight: jax.Array
    eps: float


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x**2, -1) + eps)`` in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, norm: RowNorm) -> jax.Array:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last axis; fp32 math, x's dtype out."""
    return (rms_normalize(x, norm.eps) * norm.weight.astype(jnp.float32)).astype(x.dtype)


class SwiGLURows(NamedTuple):
    """gate and up as fp32 partial sums [S, M, K] (one S for both), `limit` the SwiGLU clamp
    (None: none), `dtype` the products' dtype (the rows' dtype)."""

    gate: jax.Array
    up: jax.Array
    limit: float | None
    dtype: Any

    @property
    def shape(self) -> tuple[int, int]:
        """[M, K] of the rows."""
        return self.gate.shape[1:]


def swiglu_rows(rows: SwiGLURows) -> jax.Array:
    """The rows [M, K] in `rows.dtype`: gate and up summed and rounded, their SwiGLU in
    fp32, rounded once."""
    gate, up = (ordered_sum(p).astype(rows.dtype).astype(jnp.float32)
                for p in (rows.gate, rows.up))
    return swiglu(gate, up, rows.limit).astype(rows.dtype)
