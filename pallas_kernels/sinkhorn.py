"""`sinkhorn`: mHC's doubly stochastic projection (`glmjax.layers.mhc`) of exp(logits) over
each token's [n, n] matrix:

    m = exp(logits - max(logits))            per token
    repeat iters times:  m <- m / rowsum(m);  m <- m / colsum(m)

so columns sum to 1 exactly and rows to within the iteration's error. Two implementations
behind one signature: jax.numpy (a `fori_loop` of XLA reductions) and a Pallas kernel that
holds a block of tokens' matrices in registers through every iteration. The H200 program of
glm5.3-flash compiled deviceless (docs/PERFORMANCE.md, "Kernel launches per step") runs the
jax.numpy loop as a while loop of five launches an iteration: 20 iterations in each of the
90 mHC reads of a step, ~9,000 launches of a few microseconds each, in every prefill and
decode step alike; the kernel is one launch a read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import resolve_interpret
from pallas_kernels.sinkhorn_pallas import sinkhorn_pallas

IMPLEMENTATIONS = ("pallas", "xla")


def sinkhorn_reference(logits: jax.Array, iters: int) -> jax.Array:
    """The jax.numpy path: fp32 [T, n, n] -> fp32 [T, n, n]."""
    def step(_, m):
        m = m / jnp.sum(m, axis=-1, keepdims=True)
        return m / jnp.sum(m, axis=-2, keepdims=True)

    m = jnp.exp(logits - jnp.max(logits, axis=(-2, -1), keepdims=True))
    return jax.lax.fori_loop(0, iters, step, m)


def sinkhorn(logits: jax.Array, iters: int, *, implementation: str = "xla",
             interpret: bool | None = None) -> jax.Array:
    """Each token's doubly stochastic matrix.

    Args:
      logits: fp32 [T, n, n].
      iters: row-then-column normalisations, >= 0.
      implementation: "xla" (jax.numpy) or "pallas" (n a power of two; interpret mode by
        default on the CPU).

    Returns fp32 [T, n, n].
    """
    if logits.ndim != 3 or logits.shape[1] != logits.shape[2] or logits.dtype != jnp.float32:
        raise ValueError(f"logits must be fp32 [T, n, n], got {logits.dtype} {logits.shape}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    n = logits.shape[1]
    if implementation == "pallas" and n & (n - 1):
        raise ValueError(f"the Pallas sinkhorn takes n a power of two, got n = {n}")
    if implementation == "xla":
        return sinkhorn_reference(logits, iters)
    return sinkhorn_pallas(logits, iters=iters, interpret=resolve_interpret(interpret))
