"""The router's top-k (`pallas_kernels.moe_routing`) as one Pallas kernel lowered through
Triton: one program per token holds its E scores (padded to a power of two with -inf) and
takes the maximum k times, each time the lowest id holding it, which it then masks out. Its
logits arrive as S >= 1 fp32 partial sums, added in `ordered_sum`'s order (S = 1: the
logits themselves).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gmm_tuning import pow2_at_least_16
from pallas_kernels.partials import sum_in_order
from pallas_kernels.tiles import iota


def _kernel(logits_ref, bias_ref, weights_ref, ids_ref, *, top_k: int, scaling: float):
    t = pl.program_id(0)
    num_experts = logits_ref.shape[2]
    width = pow2_at_least_16(num_experts)
    lanes = iota((width,), 0)
    real = lanes < num_experts
    # (the partial's index as an int32: a Python int beside the program id fails in
    # interpret mode)
    logits = sum_in_order(plgpu.load(logits_ref.at[jnp.int32(s), t, pl.ds(0, width)], mask=real,
                                     other=0.0)
                          for s in range(logits_ref.shape[0]))
    bias = plgpu.load(bias_ref.at[pl.ds(0, width)], mask=real, other=0.0)
    scores = jax.nn.sigmoid(logits)
    # A NaN ranks below every number (it would make every round's max NaN and match no
    # lane); the lanes not taken yet keep each round's id a real, new expert even when
    # what is left is all -inf.
    choice = jnp.where(real & ~jnp.isnan(scores + bias), scores + bias, -jnp.inf)
    left = real
    slot_count = 1 << (top_k - 1).bit_length()  # a power of two: Triton's block sizes
    slots = iota((slot_count,), 0)
    picked = jnp.zeros((slot_count,), jnp.float32)
    ids = jnp.zeros((slot_count,), jnp.int32)
    for j in range(top_k):
        best = jnp.max(jnp.where(left, choice, -jnp.inf))
        expert = jnp.min(jnp.where(left & (choice == best), lanes, width))
        hit = lanes == expert
        picked = jnp.where(slots == j, jnp.sum(jnp.where(hit, scores, 0.0)), picked)
        ids = jnp.where(slots == j, expert, ids)
        left = left & ~hit
    out = pl.ds(0, slot_count)
    used = slots < top_k
    plgpu.store(weights_ref.at[t, out], picked / (jnp.sum(picked) + 1e-20) * scaling, mask=used)
    plgpu.store(ids_ref.at[t, out], ids, mask=used)


@functools.partial(jax.jit, static_argnames=("top_k", "scaling", "interpret"))
def route_top_k_pallas(logits, bias, *, top_k: int, scaling: float, interpret: bool):
    """logits: fp32 [S, T, E] partial sums (S = 1: the logits), bias fp32 [E] (checked by
    `route_top_k`) -> (weights fp32 [T, k], ids int32 [T, k])."""
    tokens = logits.shape[1]
    return pl.pallas_call(
        functools.partial(_kernel, top_k=top_k, scaling=scaling),
        out_shape=(jax.ShapeDtypeStruct((tokens, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((tokens, top_k), jnp.int32)),
        grid=(tokens,),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="route_top_k",
    )(logits, bias)
