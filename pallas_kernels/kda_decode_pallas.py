"""The KDA decode step as one Pallas kernel lowered through Triton.

One program per (row, head, value block) of `block_v` columns reads the row's state tile
S [K, block_v] from the pool at the row's slot, advances it by the row's token (DESIGN
section 2) and writes it back to the same place; the pool is aliased to the output
(`input_output_aliases`), so under a jit that donates it no slot other than the rows' own
is read or written, and nothing is copied:

    S <- diag(exp(g)) S;   S <- S + beta k (v - S^T k)^T;   o = scale S^T q

Each program reads its state once and writes it once: the kernel is bound by that traffic
(2 x 4 K V bytes per row and head), so the math stays elementwise with fp32 reductions over
K, never a matmul (one token is a matrix-vector product, too thin for the tensor cores).
A padding row (slot -1) reads and writes no state; its output is zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tuning import DecodeConfig


def _decode_kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, states_in_ref,
                   o_ref, states_ref, *, block_v, scale):
    """One row x head x value block: one token of the recurrence on the pool, in place."""
    del states_in_ref  # aliased to states_ref
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[n]
    vcols = pl.ds(vb * block_v, block_v)

    @pl.when(slot >= 0)
    def _():
        f32 = jnp.float32
        q, k, g = (ref[n, h, :].astype(f32) for ref in (q_ref, k_ref, g_ref))  # [K]
        v = v_ref[n, h, vcols].astype(f32)  # [BV]
        beta = beta_ref[n, h].astype(f32)
        state = jnp.exp(g)[:, None] * states_ref[slot, h, :, vcols]  # [K, BV]
        error = v - jnp.sum(k[:, None] * state, axis=0)  # v - S^T k, [BV]
        state = state + (beta * k)[:, None] * error[None, :]
        states_ref[slot, h, :, vcols] = state
        o_ref[n, h, vcols] = (scale * jnp.sum(q[:, None] * state, axis=0)).astype(o_ref.dtype)

    @pl.when(slot < 0)
    def _():
        o_ref[n, h, vcols] = jnp.zeros((block_v,), o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def kda_decode_pallas(q, k, v, g, beta, state_slots, states, *, scale: float,
                      config: DecodeConfig, interpret: bool):
    """Pallas implementation of `kda_decode` (arguments validated, slots already checked:
    each in [-1, S), no slot >= 0 twice). Returns o [N, H, V] in v.dtype and the pool."""
    rows, num_heads, _ = q.shape
    head_v = v.shape[-1]
    step = pl.pallas_call(
        functools.partial(_decode_kernel, block_v=config.block_v, scale=scale),
        out_shape=(jax.ShapeDtypeStruct((rows, num_heads, head_v), v.dtype),
                   jax.ShapeDtypeStruct(states.shape, states.dtype)),
        grid=(rows, num_heads, head_v // config.block_v),
        input_output_aliases={6: 1},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode",
    )
    return step(state_slots, q, k, v, g, beta, states)
