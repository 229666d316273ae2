"""The Sinkhorn projection (`pallas_kernels.sinkhorn`) as one Pallas kernel lowered through
Triton: each program loads BLOCK_TOKENS tokens' [n, n] matrices (rows past the end masked)
and runs every iteration on them in registers, in the jax.numpy path's order of
operations. Tokens are independent: a token's result does not depend on the tokens beside
it (batch invariance).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tiles import iota

BLOCK_TOKENS = 32  # tokens a program: 512 fp32 values at n = 4, 16 a thread at 1 warp


def _kernel(logits_ref, out_ref, *, iters: int):
    n = logits_ref.shape[1]
    rows = pl.program_id(0) * BLOCK_TOKENS + iota((BLOCK_TOKENS,), 0)
    valid = (rows < logits_ref.shape[0])[:, None, None]
    at = (rows[:, None, None], iota((1, n, 1), 1), iota((1, 1, n), 2))
    logits = plgpu.load(logits_ref.at[at], mask=valid, other=0.0)
    peak = jnp.max(jnp.max(logits, axis=2, keepdims=True), axis=1, keepdims=True)
    m = jnp.exp(logits - peak)
    for _ in range(iters):
        m = m / jnp.sum(m, axis=2, keepdims=True)
        m = m / jnp.sum(m, axis=1, keepdims=True)
    plgpu.store(out_ref.at[at], m, mask=valid)


@functools.partial(jax.jit, static_argnames=("iters", "interpret"))
def sinkhorn_pallas(logits, *, iters: int, interpret: bool):
    """logits fp32 [T, n, n], n a power of two (checked by `sinkhorn`) -> fp32 [T, n, n]."""
    return pl.pallas_call(
        functools.partial(_kernel, iters=iters),
        out_shape=jax.ShapeDtypeStruct(logits.shape, jnp.float32),
        grid=(pl.cdiv(logits.shape[0], BLOCK_TOKENS),),
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="sinkhorn",
    )(logits)
