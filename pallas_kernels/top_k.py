"""`select_top_k`: the k largest scores of each row without sorting the row.

`lax.top_k` with a large k (DSA keeps 2048 of up to 32K keys per query) falls back to a full
sort on the GPU. The selection here needs only a few passes over the scores.

Implementations behind the one signature (`IMPLEMENTATIONS`), the same set and order:
- "reference": jax.numpy, below; the CPU default.
- "pallas": `pallas_kernels.top_k_pallas`, one program per row, the row's keys (up to its
  length) in registers over a bit-by-bit search (rows above 32K keys streamed from L2);
  every GPU's default.

The jax.numpy selection:

1. Threshold: scores map to uint32 keys in the same order (`order_keys`); the k-th largest
   key of each row, tau, is found digit by digit from the top (`RADIX_BITS` bits a pass):
   for every candidate digit a pass counts the row's keys at or above prefix | digit and
   keeps the largest digit that still leaves k of them. 32 / RADIX_BITS passes, each a
   compare-and-count over the row, no histogram memory.
2. Compaction: the keys above tau, then the first (k - their count) keys equal to tau in
   index order, are the selection. The row prefix counts of both (`row_cumsums`: one pass,
   blocked, the within-block sums as a matmul with a triangular 0/1 matrix, exact) give
   every key its output slot; one scatter without collisions places them.

Ties are broken as `lax.top_k` breaks them: among equal scores the lower index wins, so the
selected set is exactly lax.top_k's. -0.0 ranks as +0.0; scores must not be NaN. The output
order is not lax.top_k's (descending score) but: the keys above tau in ascending index, then
the chosen keys equal to tau in ascending index. So a row's selected finite scores come
before its selected -inf ones (either tau is finite and every selected score is, or tau is
-inf and the finite ones are all above it): a caller that masks keys with -inf gets its
visible selections as a prefix of each row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.top_k_pallas import select_top_k_config, select_top_k_pallas

IMPLEMENTATIONS = ("reference", "pallas")
RADIX_BITS = 4
CUMSUM_BLOCK = 128


def default_implementation(device: jax.Device | None = None) -> str:
    """The implementation `select_top_k` uses on `device` (default: the first one)."""
    device = device or jax.devices()[0]
    return "pallas" if device.platform == "gpu" else "reference"


def order_keys(scores: jax.Array) -> jax.Array:
    """fp32 [..., S] -> uint32 [..., S], ordered as the scores (-0.0 as +0.0)."""
    scores = scores.astype(jnp.float32)
    # Not `scores + 0.0`: XLA folds that away, and -0.0 would rank below +0.0.
    bits = lax.bitcast_convert_type(jnp.where(scores == 0, 0.0, scores), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def kth_largest_key(keys: jax.Array, k: int) -> jax.Array:
    """uint32 [R, S] -> uint32 [R, 1]: each row's k-th largest key (1 <= k <= S)."""
    digits = jnp.arange(1, 1 << RADIX_BITS, dtype=jnp.uint32)  # [D - 1]; digit 0 always fits
    prefix = jnp.zeros((keys.shape[0], 1), jnp.uint32)
    for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
        candidates = prefix | (digits[None] << shift)  # [R, D - 1]
        # Reduced over the minor axis: the reduction XLA's GPU emitter does best.
        counts = jnp.sum(keys[:, None, :] >= candidates[:, :, None], axis=2, dtype=jnp.int32)
        # counts fall as the digit grows: the fitting digits are a prefix 1..d.
        digit = jnp.sum(counts >= k, axis=1, keepdims=True, dtype=jnp.int32).astype(jnp.uint32)
        prefix = prefix | (digit << shift)
    return prefix


def row_cumsums(first: jax.Array, second: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inclusive prefix counts along the last axis of two disjoint bool [R, S] flags: int32
    [R, S] each, in one pass. Both ride in one bf16 operand (1 and 256, exact in bf16) of a
    blocked matmul with a triangular 0/1 matrix; fp32 sums of at most CUMSUM_BLOCK such
    values are exact and split back by base 256."""
    rows, num = first.shape
    block = min(CUMSUM_BLOCK, num)
    pad = -num % block
    x = jnp.where(first, 1.0, jnp.where(second, 256.0, 0.0)).astype(jnp.bfloat16)
    x = jnp.pad(x, ((0, 0), (0, pad))).reshape(rows, -1, block)
    upper = jnp.triu(jnp.ones((block, block), jnp.bfloat16))  # [j, i] = 1 where j <= i
    within = jnp.einsum("rbj,ji->rbi", x, upper,
                        preferred_element_type=jnp.float32).astype(jnp.int32)

    def counts(within):  # [R, blocks, block] -> [R, S], the earlier blocks' totals added
        carry = jnp.cumsum(within[:, :, -1], axis=1) - within[:, :, -1]
        return (within + carry[:, :, None]).reshape(rows, -1)[:, :num]

    return counts(within % 256), counts(within // 256)


def select_top_k(scores: jax.Array, k: int, *, lengths: jax.Array | None = None,
                 implementation: str | None = None, interpret: bool | None = None,
                 config=None) -> jax.Array:
    """The indices of each row's k largest scores, exactly lax.top_k's set.

    Args:
      scores: fp32 [R, S] (no NaN; -inf allowed).
      k: 1 <= k <= S.
      lengths: int32 [R] or None (= S): row r's keys from lengths[r] on (clipped to
        [0, S]) rank as -inf whatever their scores; the kernel does not read them, and a
        causal row searches only its prefix.
      implementation: one of `IMPLEMENTATIONS`; None: `default_implementation()`.
      interpret: Pallas interpret mode (default: on the CPU); "pallas" only.
      config: a `top_k_pallas.TopKConfig` override; "pallas" only.
    Returns:
      int32 [R, k], ordered as the module docstring says.
    """
    if scores.ndim != 2:
        raise ValueError(f"scores must be [R, S], got shape {scores.shape}")
    rows, num = scores.shape
    if not 1 <= k <= num:
        raise ValueError(f"k={k} must be in [1, {num}] (the row length)")
    implementation = implementation or default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if lengths is not None and (lengths.shape != (rows,) or lengths.dtype != jnp.int32):
        raise ValueError(f"lengths must be int32 [R={rows}], got "
                         f"{lengths.dtype}{list(lengths.shape)}")
    if implementation == "pallas":
        if interpret is None:
            interpret = jax.default_backend() == "cpu"
        if lengths is None:
            lengths = jnp.full((rows,), num, jnp.int32)
        return select_top_k_pallas(scores, lengths, k=k,
                                   config=config or select_top_k_config(),
                                   interpret=bool(interpret))
    if lengths is not None:
        cols = jnp.arange(num, dtype=jnp.int32)[None]
        scores = jnp.where(cols < lengths[:, None], scores, -jnp.inf)
    return select_top_k_reference(scores, k)


def select_top_k_reference(scores: jax.Array, k: int) -> jax.Array:
    """jax.numpy `select_top_k` (arguments checked there)."""
    rows, num = scores.shape
    with jax.named_scope("select_top_k"):
        keys = order_keys(scores)
        tau = kth_largest_key(keys, k)
        above, tied = keys > tau, keys == tau
        rank_above, rank_tied = row_cumsums(above, tied)
        num_above = rank_above[:, -1:]
        need = k - num_above  # >= 1: tau itself is among the k
        taken = tied & (rank_tied <= need)
        chosen_so_far = rank_above + jnp.minimum(rank_tied, need)
        # A permutation of each row: the keys above tau, the taken ties, the rest.
        slot = jnp.where(above, rank_above - 1,
                         jnp.where(taken, num_above + rank_tied - 1,
                                   k + jnp.arange(num, dtype=jnp.int32) - chosen_so_far))
        rows_ix = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], (rows, num))
        cols = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32)[None], (rows, num))
        placed = jnp.zeros((rows, num), jnp.int32).at[rows_ix, slot].set(
            cols, unique_indices=True)
        return placed[:, :k]
