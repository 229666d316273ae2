"""`route_top_k`: the sigmoid router's choice of experts for each token (DeepSeek-V3 style).

    s      = sigmoid(logits)                         fp32 [T, E]
    chosen = top_k(s + correction_bias)              the bias steers the choice only
    w      = scaling * s[chosen] / (sum(s[chosen]) + 1e-20)

Ties go to the lower expert id, as `jax.lax.top_k`; a NaN score ranks below every number
(XLA's top-k on the CPU), so the ids are always k distinct experts. Two implementations behind one
signature: jax.numpy (`lax.top_k`, which XLA runs as a sort on a GPU) and a Pallas kernel
with one program per token that picks the k largest by k rounds of max over the row, for
the few rows of a decode step, where the sort and the gathers around it were four launches
a MoE layer (~8 us at one row on the H200). Both also take the logits as the fp32 partial
sums a decode step's weight stream leaves (`partial_sums`), added in `ordered_sum`'s order:
the Pallas kernel adds them itself, one launch fewer a layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import resolve_interpret
from pallas_kernels.moe_routing_pallas import route_top_k_pallas
from pallas_kernels.partials import ordered_sum

IMPLEMENTATIONS = ("pallas", "xla")


def route_top_k_reference(logits, bias, *, top_k: int, scaling: float):
    """The jax.numpy path: (weights fp32 [T, k], expert ids int32 [T, k])."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    _, experts = jax.lax.top_k(scores + bias.astype(jnp.float32), top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, experts.astype(jnp.int32)


def route_top_k(logits: jax.Array, bias: jax.Array, *, top_k: int, scaling: float,
                implementation: str = "xla", interpret: bool | None = None,
                partial_sums: bool = False):
    """Each token's top-k experts and combine weights.

    Args:
      logits: [T, E] router logits (fp32 preferred; any float dtype is upcast), or with
        `partial_sums` fp32 [S, T, E] whose `ordered_sum` over S are the logits.
      bias: fp32 [E], the correction bias added for the choice only.
      top_k: experts per token, 1..E; scaling: the routed scaling factor.
      implementation: "xla" (jax.numpy) or "pallas" (interpret mode by default on the CPU).

    Returns (weights fp32 [T, k], expert ids int32 [T, k]), the ids in descending order of
    s + bias.
    """
    shape = "[S, T, E]" if partial_sums else "[T, E]"
    if logits.ndim != 2 + partial_sums or bias.shape != logits.shape[-1:]:
        raise ValueError(f"logits must be {shape} and bias [E], got {logits.shape}, "
                         f"{bias.shape}")
    if partial_sums and logits.dtype != jnp.float32:
        raise ValueError(f"partial sums must be float32, got {logits.dtype}")
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k must be in 1..{logits.shape[-1]}, got {top_k}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if implementation == "xla":
        return route_top_k_reference(ordered_sum(logits) if partial_sums else logits, bias,
                                     top_k=top_k, scaling=scaling)
    partials = logits if partial_sums else logits[None]
    return route_top_k_pallas(partials.astype(jnp.float32), bias.astype(jnp.float32),
                              top_k=top_k, scaling=float(scaling),
                              interpret=resolve_interpret(interpret))
