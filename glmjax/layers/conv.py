"""Depthwise causal conv1d (the KDA short convolution) over a packed variable-length batch.

Layout: the conv history of a sequence, ``[C, W - 1]`` for a kernel of width W, holds the
last W - 1 *pre-convolution* inputs before the sequence's first token, oldest first (zeros
for a cold start). All gathers read one buffer, the N histories followed by the T packed
rows, so the function has static shapes, runtime lengths and offsets, and no vmap.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.kda_conv import buffer_rows, conv_silu, history_buffer


class ConvResult(NamedTuple):
    y: jax.Array  # [T, C], x's dtype; zero on padding rows
    history: jax.Array  # [N, C, W-1], the history after each whole sequence
    snapshots: jax.Array  # [N, capacity, C, W-1], the history at each checkpoint offset


def causal_conv1d(x: jax.Array, weight: jax.Array, cu_seqlens: jax.Array,
                  history: jax.Array, checkpoint_offsets: jax.Array) -> ConvResult:
    """``silu(sum_j weight[:, j] * x[t - (W - 1) + j])`` per sequence, reading the history
    before each sequence's start (`pallas_kernels.kda_conv.conv_silu`), and the histories.

    Args:
      x: [T, C] packed pre-convolution inputs.
      weight: [C, W] depthwise taps (torch's Conv1d weight without its middle axis).
      cu_seqlens: int32 [N + 1].
      history: [N, C, W - 1], the inputs before each sequence (oldest first).
      checkpoint_offsets: int32 [N, capacity]; p >= 0 asks for the history before token p
        of the sequence (so p = len is the final history); -1 gives zeros.
    """
    return ConvResult(conv_silu(x, weight, cu_seqlens, history),
                      *conv_states(x, cu_seqlens, history, checkpoint_offsets))


def conv_states(x: jax.Array, cu_seqlens: jax.Array, history: jax.Array,
                checkpoint_offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`causal_conv1d`'s histories alone: after each whole sequence [N, C, W - 1] and at
    each checkpoint offset [N, capacity, C, W - 1], in history's dtype."""
    num_seqs, hist = history.shape[0], history.shape[2]
    buf = history_buffer(x, history)
    seqs = jnp.arange(num_seqs, dtype=jnp.int32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]

    def history_before(seq, pos):
        """[..., C, W-1]: the W-1 inputs before relative position `pos` of `seq`."""
        taps = jnp.arange(hist, dtype=jnp.int32) - hist
        idx = buffer_rows(cu_seqlens, hist, seq[..., None], pos[..., None] + taps)
        return jnp.swapaxes(jnp.take(buf, idx, axis=0, mode="clip"), -1, -2)

    snapshots = history_before(jnp.broadcast_to(seqs[:, None], checkpoint_offsets.shape),
                               checkpoint_offsets)
    snapshots = jnp.where((checkpoint_offsets >= 0)[..., None, None], snapshots, 0)
    return (history_before(seqs, lengths).astype(history.dtype),
            snapshots.astype(history.dtype))


def conv_decode(x: jax.Array, weight: jax.Array, pool: jax.Array, state_slots: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """One token per row: the conv over each row's history in the pool and its new input,
    and the pool with that input shifted into the row's history.

    Args:
      x: [N, C] pre-convolution inputs, one token per row.
      weight: [C, W].
      pool: [S, C, W - 1], every slot's history (oldest first). Donate it to the
        enclosing jit: the update is a scatter of the rows' slots, in place.
      state_slots: int32 [N], row n's slot; -1 for a padding row (reads a zero history,
        writes nothing). The caller checks the slots (no repeats; see
        `glmjax.state_pool.decode_slots`): a gather and a scatter along the slot axis.
    Returns:
      y [N, C] in x's dtype and the pool.

    A separate XLA gather / scatter rather than part of the decode kernel: a row's history
    is (W - 1) C = 9 H K values against H K V fp32 for its recurrent state (3.5% of the
    bytes at glm5.3-flash's shapes, bf16 history), and XLA already moves it once each way.
    """
    num_slots, _, hist = pool.shape
    index = jnp.where(state_slots >= 0, state_slots, num_slots)  # out of range: fill / drop
    history = pool.at[index].get(mode="fill", fill_value=0).astype(x.dtype)
    window = jnp.concatenate([history, x[:, :, None]], axis=-1)  # [N, C, W], oldest first
    acc = jnp.zeros(x.shape, jnp.float32)
    for j in range(hist + 1):  # the taps in causal_conv1d's order: the same rounding
        acc = acc + window[:, :, j].astype(jnp.float32) * weight[:, j].astype(jnp.float32)
    y = jax.nn.silu(acc).astype(x.dtype)
    return y, pool.at[index].set(window[:, :, 1:].astype(pool.dtype), mode="drop")


class ShortConvolution(nnx.Module):
    """Depthwise causal conv1d with SiLU over C channels, kernel width W (no bias)."""

    def __init__(self, channels: int, width: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        # torch's Conv1d default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = W.
        bound = width ** -0.5
        self.weight = nnx.Param(jax.random.uniform(
            rngs.params(), (channels, width), param_dtype, -bound, bound))

    def __call__(self, x, cu_seqlens, history, checkpoint_offsets) -> ConvResult:
        """See `causal_conv1d`; x [T, C], history [N, C, W-1]."""
        return causal_conv1d(x, self.weight[...], cu_seqlens, history, checkpoint_offsets)

    def states(self, parts, cu_seqlens, history, checkpoint_offsets
               ) -> tuple[jax.Array, jax.Array]:
        """See `conv_states`: the histories after each sequence and at its checkpoints.
        parts: the inputs [T, C_i] whose channels, concatenated in order, are the conv's C
        (KDA's q, k, v projections, never copied into one array): each part's histories
        are gathered from it alone and joined along the channel axis."""
        bounds = [0, *itertools.accumulate(x.shape[-1] for x in parts)]
        pieces = [conv_states(x, cu_seqlens, history[:, lo:hi], checkpoint_offsets)
                  for x, lo, hi in zip(parts, bounds[:-1], bounds[1:])]
        return tuple(jnp.concatenate(p, axis=-2) for p in zip(*pieces))

    def decode(self, x, pool, state_slots) -> tuple[jax.Array, jax.Array]:
        """See `conv_decode`; x [N, C], pool [S, C, W-1], state_slots int32 [N]."""
        return conv_decode(x, self.weight[...], pool, state_slots)
