"""`kda_decode`: one token per row of KDA on a state pool, updated in place.

The recurrence of DESIGN section 2 for a single token, reading each row's fp32 state from
the pool `states [S, H, K, V]` at its slot and writing the new state back to that slot:

    S <- diag(exp(g)) S;   S <- S + beta k (v - S^T k)^T;   o = scale S^T q

Two implementations behind one signature: the Pallas kernel (`kda_decode_pallas`, aliasing
the pool to its output) and a jax.numpy path (a gather at the slots, the step, a scatter
back: XLA updates a donated pool in place too). Refusal is part of the contract: an invalid
slot vector writes nothing, so a kernel never addresses memory outside the pool and two
rows never race on one slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda_decode_pallas import kda_decode_pallas
from pallas_kernels.tuning import DecodeConfig, device_spec, select_decode_config

BACKENDS = ("pallas", "reference")
_HIGHEST = jax.lax.Precision.HIGHEST


def _check_shapes(q, k, v, g, beta, state_slots, states):
    """Static shape and dtype checks (slot values are checked under jit: `checked_slots`)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [N, H, K], got shape {q.shape}")
    rows, num_heads, head_k = q.shape
    if v.ndim != 3:
        raise ValueError(f"v must be [N, H, V], got shape {v.shape}")
    head_v = v.shape[-1]
    expected = {
        "k": (k, (rows, num_heads, head_k)),
        "g": (g, (rows, num_heads, head_k)),
        "v": (v, (rows, num_heads, head_v)),
        "beta": (beta, (rows, num_heads)),
        "state_slots": (state_slots, (rows,)),
    }
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if state_slots.dtype != jnp.int32:
        raise ValueError(f"state_slots must be int32, got {state_slots.dtype}")
    if (states.ndim != 4 or tuple(states.shape[1:]) != (num_heads, head_k, head_v)
            or states.dtype != jnp.float32 or states.shape[0] < 1):
        raise ValueError(f"states must be a float32 pool [S >= 1, {num_heads}, {head_k}, "
                         f"{head_v}], got {states.dtype}{list(states.shape)}")
    for name, dim in (("K", head_k), ("V", head_v)):
        if dim < 16 or dim & (dim - 1):
            raise ValueError(f"head dim {name}={dim} must be a power of two >= 16")


def checked_slots(state_slots: jax.Array, num_slots: int) -> jax.Array:
    """`state_slots` if every slot is in [-1, num_slots) and no slot >= 0 repeats, else all
    -1 (the whole step refused: nothing read or written). int32 [N]."""
    ordered = jnp.sort(state_slots)
    duplicate = jnp.any((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0))
    out_of_range = jnp.any((state_slots < -1) | (state_slots >= num_slots))
    return jnp.where(duplicate | out_of_range, jnp.int32(-1), state_slots)


def kda_decode_reference(q, k, v, g, beta, state_slots, states, *, scale: float):
    """The jax.numpy path of `kda_decode` (slots already checked): fp32 math at full
    precision; a gather with fill (padding rows read zeros) and a scatter with drop
    (padding rows write nothing) at the slot axis only."""
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    real = state_slots >= 0
    index = jnp.where(real, state_slots, states.shape[0])  # out of range: fill / drop
    state = jnp.exp(g)[..., None] * states.at[index].get(mode="fill", fill_value=0)
    error = v - jnp.einsum("nhk,nhkv->nhv", k, state, precision=_HIGHEST)
    state = state + (beta[..., None] * k)[..., None] * error[:, :, None, :]
    o = scale * jnp.einsum("nhk,nhkv->nhv", q, state, precision=_HIGHEST)
    o = jnp.where(real[:, None, None], o, 0.0)
    return o, states.at[index].set(state, mode="drop")


def kda_decode(q, k, v, g, beta, state_slots, states, *, scale=None, backend="pallas",
               interpret=None, config: DecodeConfig | None = None):
    """One KDA token per row, each row's state advanced in its pool slot.

    Args:
      q, k: [N, H, K] (L2-normalised by the caller); v: [N, H, V]; g: [N, H, K] log-decay
        (<= 0; any value, a single step never forms exp(-g)); beta: [N, H] in (0, 1). Any
        float dtype; the math is fp32.
      state_slots: int32 [N], the pool slot holding row n's state; -1 for a padding row.
      states: fp32 [S, H, K, V], the pool. Donate it to the enclosing jit: both backends
        then write the rows' slots in place and read no other slot.
      backend: "pallas" (the kernel; interpret mode by default on the CPU) or "reference"
        (jax.numpy).
      config: tiling override; by default picked from the device by `select_decode_config`.

    Returns:
      o [N, H, V] in v.dtype (zeros on padding rows) and the pool: slot state_slots[n]
      holds row n's state after its token, every other slot is unchanged bit for bit.
      A slot outside [-1, S) or a slot given to two rows refuses the whole call: the pool
      comes back unchanged and every output row is zeros (callers that must tell the
      difference check the slots first, as `glmjax.state_pool.decode_slots` does).
    """
    _check_shapes(q, k, v, g, beta, state_slots, states)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    rows, num_heads, head_k = q.shape
    head_v = v.shape[-1]
    scale = float(head_k ** -0.5 if scale is None else scale)
    slots = checked_slots(state_slots, states.shape[0])
    if backend == "reference":
        o, states = kda_decode_reference(q, k, v, g, beta, slots, states, scale=scale)
        return o.astype(v.dtype), states
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if config is None:
        config = select_decode_config(device_spec(), num_rows=rows, num_heads=num_heads,
                                      head_k=head_k, head_v=head_v)
    if head_v % config.block_v or config.block_v & (config.block_v - 1):
        raise ValueError(f"the decode kernel's value block {config.block_v} must be a power "
                         f"of two dividing V={head_v}")
    return kda_decode_pallas(q, k, v, g, beta, slots, states, scale=scale, config=config,
                             interpret=bool(interpret))
