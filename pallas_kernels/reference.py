"""Oracles for the checkpointing KDA prefill scan (DESIGN.md sections 2 and 3).

Both functions implement the full ``kda_prefill`` contract:

- ``q``, ``k``, ``g``: ``[T, H, K]``; ``v``: ``[T, H, V]``; ``beta``: ``[T, H]``; any float
  dtype (math runs in fp64 or fp32 regardless).
- ``cu_seqlens``: int32 ``[N + 1]``; sequence n is rows ``cu_seqlens[n] : cu_seqlens[n + 1]``,
  rows past ``cu_seqlens[N]`` are padding and produce zero output.
- ``initial_states``: fp32 ``[N, H, K, V]``.
- ``checkpoint_offsets``: int32 ``[N, capacity]``; entry ``p`` in 1..len_n asks for the state
  after the first ``p`` tokens of sequence n, -1 leaves that snapshot zero.
- Returns ``(o [T, H, V], final_states [N, H, K, V], snapshots [N, capacity, H, K, V])``.

Neither oracle validates metadata; see ``validation.validate_checkpoint_metadata``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

_HIGHEST = jax.lax.Precision.HIGHEST


def kda_recurrent_reference(
    q, k, v, g, beta, cu_seqlens, initial_states, checkpoint_offsets, *, scale=None
):
    """Token-by-token KDA recurrence in float64 NumPy on the host.

    Per head and token: ``S <- diag(exp(g_t)) S``, then
    ``S <- S + beta_t k_t (v_t - S^T k_t)^T`` and ``o_t = scale * S^T q_t``.

    Returns float64 NumPy arrays ``o [T, H, V]`` (callers cast), ``final_states
    [N, H, K, V]`` and ``snapshots [N, capacity, H, K, V]``.
    """
    q, k, v, g, beta, states = (
        np.asarray(x).astype(np.float64) for x in (q, k, v, g, beta, initial_states)
    )
    cu_seqlens = np.asarray(cu_seqlens).astype(np.int64)
    offsets = np.asarray(checkpoint_offsets).astype(np.int64)
    num_tokens, num_heads, dim_k = q.shape
    scale = dim_k**-0.5 if scale is None else float(scale)

    o = np.zeros((num_tokens, num_heads, v.shape[-1]))
    snapshots = np.zeros((offsets.shape[0], offsets.shape[1], *states.shape[1:]))
    for n in range(len(cu_seqlens) - 1):
        start, end = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        s = states[n]  # [H, K, V]
        for t in range(start, end):
            s = np.exp(g[t])[:, :, None] * s
            error = v[t] - np.einsum("hk,hkv->hv", k[t], s)
            s = s + beta[t][:, None, None] * k[t][:, :, None] * error[:, None, :]
            o[t] = scale * np.einsum("hk,hkv->hv", q[t], s)
            snapshots[n, offsets[n] == t - start + 1] = s
        states[n] = s
    return o, states, snapshots


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def kda_chunked_reference(
    q,
    k,
    v,
    g,
    beta,
    cu_seqlens,
    initial_states,
    checkpoint_offsets,
    *,
    scale=None,
    chunk_size=64,
):
    """Chunked (WY-form) KDA scan in fp32 jax.numpy; same contract as ``kda_prefill``.

    Jitted; only the shapes and ``chunk_size`` are static, so new lengths and offsets reuse
    the compiled program. Each sequence is gathered into ``ceil(T / C)`` chunks of
    ``C = chunk_size`` rows (zero-padded, which passes the state through unchanged) and
    scanned chunk by chunk, vmapped over sequences and heads. Decay factors are only ever
    formed as ``exp(G_i - G_j)`` with ``i >= j``, so decays of -5 per token and below stay
    finite.

    Returns ``o [T, H, V]`` in ``v.dtype``, ``final_states`` fp32 ``[N, H, K, V]`` and
    ``snapshots`` fp32 ``[N, capacity, H, K, V]``.
    """
    num_tokens, _, dim_k = q.shape
    scale = dim_k**-0.5 if scale is None else scale
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    num_chunks = -(-num_tokens // chunk_size)

    def to_chunks(x):  # [T, H, ...] -> [N, H, num_chunks, C, ...] fp32
        x = _gather_sequences(x.astype(jnp.float32), cu_seqlens, num_chunks * chunk_size)
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(*x.shape[:2], num_chunks, chunk_size, *x.shape[3:])

    scan = functools.partial(_scan_sequence, scale=scale)
    scan = jax.vmap(scan, in_axes=(0, 0, 0, 0, 0, 0, None))  # heads
    scan = jax.vmap(scan, in_axes=(0, 0, 0, 0, 0, 0, 0))  # sequences
    o_chunks, final_states, snapshots = scan(
        to_chunks(q),
        to_chunks(k),
        to_chunks(v),
        to_chunks(g),
        to_chunks(beta),
        initial_states.astype(jnp.float32),
        checkpoint_offsets.astype(jnp.int32),
    )
    # [N, H, num_chunks, C, V] -> [N, num_chunks * C, H, V]
    o_padded = jnp.moveaxis(o_chunks.reshape(*o_chunks.shape[:2], -1, o_chunks.shape[-1]), 1, 2)
    o = _scatter_sequences(o_padded, cu_seqlens, num_tokens)
    return o.astype(v.dtype), final_states, jnp.moveaxis(snapshots, 2, 1)


def _gather_sequences(x, cu_seqlens, max_len):
    """Packed rows ``[T, ...]`` -> ``[N, max_len, ...]``, zero past each sequence's end."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [N]
    local = jnp.arange(max_len, dtype=jnp.int32)
    rows = jnp.clip(cu_seqlens[:-1, None] + local, 0, x.shape[0] - 1)  # [N, max_len]
    valid = (local < lengths[:, None]).reshape(*rows.shape, *([1] * (x.ndim - 1)))
    return jnp.where(valid, x[rows], 0.0)


def _scatter_sequences(x, cu_seqlens, num_tokens):
    """Inverse of ``_gather_sequences``: ``[N, max_len, ...]`` -> packed ``[T, ...]``."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # side="right" skips zero-length sequences that share a start with the next one.
    seq = jnp.clip(jnp.searchsorted(cu_seqlens, t, side="right") - 1, 0, x.shape[0] - 1)
    pos = jnp.clip(t - cu_seqlens[seq], 0, x.shape[1] - 1)
    valid = (t < cu_seqlens[-1]).reshape(-1, *([1] * (x.ndim - 2)))
    return jnp.where(valid, x[seq, pos], 0.0)


def _scan_sequence(q, k, v, g, beta, state, offsets, *, scale):
    """Scan one (sequence, head) over its chunks.

    Args: ``q``, ``k``, ``g`` ``[num_chunks, C, K]``; ``v`` ``[num_chunks, C, V]``; ``beta``
    ``[num_chunks, C]``; ``state`` ``[K, V]``; ``offsets`` int32 ``[capacity]``.
    Returns ``o [num_chunks, C, V]``, the final state ``[K, V]`` and snapshots
    ``[capacity, K, V]``; all fp32.
    """
    chunk_size = q.shape[1]
    snap_chunk = jnp.where(offsets > 0, (offsets - 1) // chunk_size, -1)  # [capacity]
    snap_row = jnp.maximum(offsets - 1, 0) % chunk_size  # last token inside the snapshot

    def step(carry, xs):
        s_in, snapshots = carry
        index, q_c, k_c, v_c, g_c, beta_c = xs
        o_c, v_new, gates, decay = _chunk_outputs(q_c, k_c, v_c, g_c, beta_c, s_in, scale)
        state_at = functools.partial(_state_at_row, gates=gates, decay=decay, k=k_c,
                                     v_new=v_new, s_in=s_in)
        taken = jax.vmap(state_at)(snap_row)  # [capacity, K, V]
        snapshots = jnp.where((snap_chunk == index)[:, None, None], taken, snapshots)
        return (state_at(chunk_size - 1), snapshots), o_c

    carry = (state, jnp.zeros((offsets.shape[0], *state.shape), jnp.float32))
    xs = (jnp.arange(q.shape[0]), q, k, v, g, beta)
    (final_state, snapshots), o = jax.lax.scan(step, carry, xs)
    return o, final_state, snapshots


def _chunk_outputs(q, k, v, g, beta, s_in, scale):
    """One chunk of the WY form: ``q``, ``k``, ``g`` ``[C, K]``, ``v`` ``[C, V]``, ``beta [C]``,
    entering state ``s_in [K, V]``.

    Returns ``o [C, V]``, ``v_new = U - W S [C, V]``, the in-chunk cumulative log-decay
    ``G [C, K]`` and the decays ``exp(G_i - G_j)`` (i >= j, else 0) ``[C, C, K]``.
    """
    chunk_size, dim_k = k.shape
    gates = jnp.cumsum(g, axis=0)  # G, non-increasing
    rows = jnp.arange(chunk_size)
    causal = rows[:, None] >= rows[None, :]
    # G_i - G_j for i >= j as the sum of g over (j, i] alone: the same value, but a
    # difference of two long cumulative sums would carry their rounding error (eps |G_i|,
    # not eps |G_i - G_j|) into every decay. The masked entries become exp(-inf) = 0.
    between = jnp.where(rows[:, None, None] > rows[None, :, None], g[:, None, :], 0.0)
    diff = jnp.cumsum(between, axis=0)  # [C, C, K]: entry (i, j) sums g over (j, i]
    decay = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))

    kk = jnp.einsum("id,jd,ijd->ij", k, k, decay, precision=_HIGHEST)
    lower = jnp.where(rows[:, None] > rows[None, :], beta[:, None] * kk, 0.0)  # L
    rhs = beta[:, None] * jnp.concatenate([k * jnp.exp(gates), v], axis=1)
    wu = solve_triangular(jnp.eye(chunk_size) + lower, rhs, lower=True, unit_diagonal=True)
    w, u = wu[:, :dim_k], wu[:, dim_k:]
    v_new = u - jnp.dot(w, s_in, precision=_HIGHEST)

    q = scale * q
    aqk = jnp.einsum("id,jd,ijd->ij", q, k, decay, precision=_HIGHEST)
    o = jnp.dot(q * jnp.exp(gates), s_in, precision=_HIGHEST)
    o = o + jnp.dot(aqk, v_new, precision=_HIGHEST)
    return o, v_new, gates, decay


def _state_at_row(row, *, gates, decay, k, v_new, s_in):
    """State after in-chunk row ``row`` (0-based, runtime value).

    ``S_row = diag(exp(G_row)) S_in + sum_{j <= row} (k_j exp(G_row - G_j)) v_new_j^T``,
    the decays ``exp(G_row - G_j)`` being row ``row`` of `_chunk_outputs`' (zero for j > row).
    """
    carried = jnp.exp(gates[row])[:, None] * s_in
    return carried + jnp.dot((k * decay[row]).T, v_new, precision=_HIGHEST)
