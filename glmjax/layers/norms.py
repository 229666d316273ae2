"""RMSNorm, the gated RMSNorm of the KDA output, and the L2 norm of KDA queries and keys."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.kda_conv import l2_normalize as l2_normalize  # the one L2 norm

GateActivation = Literal["sigmoid", "silu"]


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x**2, -1) + eps)`` in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last axis; fp32 math, x's dtype out."""

    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return (rms_normalize(x, self.eps) * self.weight[...].astype(jnp.float32)
                ).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """``RMSNorm(x) * act(gate)`` with act = sigmoid (Kimi's KDA output norm) or SiLU.

    Exactly: ``y = weight * x / sqrt(mean(x**2, -1) + eps) * act(gate)``, all in fp32, x's
    dtype out. x and gate have the same shape; the norm and weight span the last axis
    (one head's V channels in KDA), so the weight is shared by all heads.
    """

    def __init__(self, dim: int, *, eps: float, activation: GateActivation = "sigmoid",
                 param_dtype=jnp.float32):
        if activation not in ("sigmoid", "silu"):
            raise ValueError(f"activation must be 'sigmoid' or 'silu', got {activation!r}")
        self.eps = eps
        self.activation = activation
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        act = jax.nn.sigmoid if self.activation == "sigmoid" else jax.nn.silu
        y = (rms_normalize(x, self.eps) * self.weight[...].astype(jnp.float32)
             * act(gate.astype(jnp.float32)))
        return y.astype(x.dtype)
