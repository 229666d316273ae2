"""Exact top-k selection of each row as one Pallas kernel lowered through Triton.

Grid: (rows,). A program owns one row of scores and finds its k-th largest order key tau
(`top_k.order_keys`'s order; here as int32 with the sign bit flipped, so signed compares
order them) digit by digit from the top, then compacts the selection. Keys past the row's
length (`lengths`: a causal row's end) are -inf by contract and never read.

1. Search. `digit_bits` bits a step: the step counts the row's keys at or above
   prefix | d for each candidate digit d (2^digit_bits - 1 of them, digit 0 always fits) and
   keeps the largest digit that still leaves k keys; 32 / digit_bits steps, each a compare
   and a block reduction per candidate. Rows up to `resident` keys (rounded up to a power
   of two, P) are loaded once and stay in registers over every step, so one bit a step (32
   steps of one compare) is the cheapest; the register tile is the smallest of P / 8,
   P / 4, P / 2, P that covers the row's length (a branch each), so a short causal row
   compares fewer keys. Longer rows are read again from L2 `tile` keys at a time in every
   step, up to their length, so fewer steps of more candidates pay (`streamed_digit_bits`).
2. Compaction, `tile` keys at a time, until all k are placed (a causal row's tiles past
   its last chosen key are never read): the keys above tau, then the first (k - their
   count) keys equal to tau in index order, are the selection. Within a tile one cumsum of
   (above + tied << 16) gives both exclusive ranks; the counts of earlier tiles ride in the
   loop carry. Each chosen key's index is stored to its slot with a masked scatter
   (every slot of [0, k) written exactly once).

The search ends early at a step whose candidate has exactly k keys at or above it (random
scores at 32K, k 2048: ~21 of the 32 steps), and is skipped where a row has fewer than k
finite scores. Every primitive is Pallas Triton's own: the fp32 -> int32 bitcast, int32
compares (signed, after the sign flip, rather than uint32), `jnp.cumsum` (a Triton scan)
and a store through a vector of indices with a mask (the scatter).

Ties, -0.0, -inf and the output order are exactly `top_k.select_top_k`'s.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tiles import iota
from pallas_kernels.tuning import DeviceSpec, device_spec

SIGN = -(1 << 31)  # int32 with only the sign bit: below every score's key
NEG_INF_KEY = -0x7F800001  # -inf's key (0xFF800000 ^ 0x7FFFFFFF)
RESIDENT_BUCKETS = 4  # register tiles of padded / 8 .. padded keys, by the row's length


@dataclasses.dataclass(frozen=True)
class TopKConfig:
    """Static parameters (hashable: a jit static argument)."""

    tile: int = 4096  # keys a compaction step (and a streamed search step) handles
    resident: int = 32768  # longest row (padded to a power of two) kept in registers
    streamed_digit_bits: int = 2  # search bits a step when the row is streamed
    num_warps: int = 8

    def __post_init__(self):
        for name in ("tile", "resident"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if self.tile >= 1 << 16:  # ranks are packed in 16 bits
            raise ValueError(f"tile={self.tile} must be below 65536")
        if self.streamed_digit_bits not in (1, 2, 4, 8):
            raise ValueError(f"streamed_digit_bits={self.streamed_digit_bits} must divide "
                             "32 (1, 2, 4 or 8)")


# Per compute capability major: GB10 has the H200's 64K registers per SM, so the same 32K
# row fits in registers there (`python -m pallas_kernels.aot`, rows select_top_k_*).
TUNING = {12: TopKConfig(), 9: TopKConfig(), 10: TopKConfig(), 8: TopKConfig()}


def select_top_k_config(spec: DeviceSpec | None = None) -> TopKConfig:
    """The tuning table's entry for `spec` (default: this process's first device)."""
    spec = spec or device_spec()
    return TUNING.get(spec.compute_capability[0], TUNING[8])


def signed_order_keys(x):
    """fp32 scores -> int32 keys whose signed order is the scores' (-0.0 as +0.0)."""
    bits = lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _kth_largest(counts_at_least, smallest_at_least, k, digit_bits):
    """The row's k-th largest key, `digit_bits` bits a step: the largest t with at least k
    keys >= t (`counts_at_least`: those counts for a list of thresholds), built as an
    unsigned bit pattern (^ SIGN maps it to the signed key). A step that finds a candidate
    with exactly k keys at or above it ends the search early: the k-th largest key is then
    the smallest of those (one more reduction). The search runs only where at least k keys
    are finite, so a threshold at or below -inf's key always fits and is never taken as
    exact: the counts may leave out -inf keys."""
    steps = 32 // digit_bits

    def searching(carry):
        i, _, exact = carry
        return (i < steps) & (exact == SIGN)

    def step(carry):
        i, prefix, exact = carry
        shift = 32 - digit_bits * (i + 1)
        candidates = [(prefix | lax.shift_left(jnp.int32(d), shift)) ^ SIGN  # each > SIGN
                      for d in range(1, 1 << digit_bits)]  # digit 0 always fits
        digit = jnp.int32(0)
        # counts fall as the digit grows: the fitting digits are 1..digit.
        for candidate, count in zip(candidates, counts_at_least(candidates)):
            digit += (count >= k).astype(jnp.int32)
            exact = jnp.where((count == k) & (candidate > NEG_INF_KEY), candidate, exact)
        return i + 1, prefix | lax.shift_left(digit, shift), exact

    # A row with fewer than k finite scores (a causal row near its sequence start) needs
    # no search: its k-th largest score is -inf.
    (finite,) = counts_at_least([NEG_INF_KEY + 1])
    few = (finite < k).astype(jnp.int32)  # integer, not a bool: a scalar select of
    start = few * steps  # constants lowers as i1
    _, prefix, exact = lax.while_loop(searching, step,
                                      (start, jnp.int32(0), jnp.int32(SIGN)))
    # Without an early end the prefix is the k-th largest key itself: the min is a no-op.
    return jnp.where(few == 1, jnp.int32(NEG_INF_KEY),
                     smallest_at_least(jnp.where(exact == SIGN, prefix ^ SIGN, exact)))


def _top_k_kernel(lengths_ref, scores_ref, out_ref, *, k, num_keys, padded, tile,
                  resident_sizes, digit_bits):
    """One row: its k-th largest key tau (searched over its first `lengths` keys only:
    the rest are -inf), then the compaction."""
    row = pl.program_id(0)
    end = lengths_ref[row]  # in [0, num_keys]: keys from `end` on are -inf, never read

    def load_keys(start, size):  # [size] keys of columns start.., SIGN past the row
        cols = start + iota((size,), 0)
        x = plgpu.load(scores_ref.at[row, pl.ds(start, size)], mask=cols < end,
                       other=-jnp.inf)
        return jnp.where(cols < num_keys, signed_order_keys(x), SIGN), cols

    def counts(keys, thresholds):
        return tuple(jnp.sum((keys >= t).astype(jnp.int32)) for t in thresholds)

    def smallest(keys, threshold):
        return jnp.min(jnp.where(keys >= threshold, keys, jnp.iinfo(jnp.int32).max))

    def search(over_row):
        """(tau, keys above tau) with `over_row(per_tile, combine, init)` reducing over
        the keys from 0 to at least `end` (the -inf keys past `end` may be left out, see
        `_kth_largest`; tau + 1 is above -inf's key)."""
        def counts_at_least(thresholds):
            return over_row(lambda keys: counts(keys, thresholds), jnp.add,
                            tuple(jnp.int32(0) for _ in thresholds))

        def smallest_at_least(threshold):
            return over_row(lambda keys: smallest(keys, threshold), jnp.minimum,
                            jnp.int32(jnp.iinfo(jnp.int32).max))

        tau = _kth_largest(counts_at_least, smallest_at_least, k, digit_bits)
        (num_above,) = counts_at_least([tau + 1])  # tau <= +inf's key: no overflow
        return tau, num_above

    if resident_sizes:  # the row's first `size` keys held in registers over the search
        def resident(size):
            keys, _ = load_keys(0, size)
            return search(lambda per_tile, combine, init: per_tile(keys))

        # The smallest size that covers `end` (integer sum, not a bool select).
        bucket = sum((end > size).astype(jnp.int32) for size in resident_sizes[:-1])
        tau, num_above = lax.switch(bucket, [functools.partial(resident, size)
                                             for size in resident_sizes])
    else:
        def streamed(per_tile, combine, init):  # one pass over the row's tiles, from L2
            def add_tile(t, acc):
                return jax.tree.map(combine, acc, per_tile(load_keys(t * tile, tile)[0]))
            return lax.fori_loop(0, (end + tile - 1) // tile, add_tile, init)

        tau, num_above = search(streamed)
    need = k - num_above  # >= 1: tau itself is among the k
    num_tiles = padded // tile

    def unplaced(carry):
        t, above_before, tied_before = carry
        return (t < num_tiles) & (above_before + jnp.minimum(tied_before, need) < k)

    def compact(carry):  # tiles past the last chosen key are never read
        t, above_before, tied_before = carry
        keys, cols = load_keys(t * tile, tile)
        above, tied = keys > tau, keys == tau
        packed = above.astype(jnp.int32) + lax.shift_left(tied.astype(jnp.int32), 16)
        inclusive = jnp.cumsum(packed)  # a tile holds < 2^16 keys: the halves stay apart
        exclusive = inclusive - packed
        rank_above = above_before + (exclusive & 0xFFFF)
        rank_tied = tied_before + lax.shift_right_logical(exclusive, 16)
        taken = above | (tied & (rank_tied < need))
        slot = jnp.where(above, rank_above, num_above + rank_tied)
        plgpu.store(out_ref.at[row, slot], cols, mask=taken)
        total = jnp.sum(packed)
        return (t + 1, above_before + (total & 0xFFFF),
                tied_before + lax.shift_right_logical(total, 16))

    lax.while_loop(unplaced, compact, (jnp.int32(0), jnp.int32(0), jnp.int32(0)))


def _padded_length(num_keys: int, tile: int) -> int:
    """The row length the kernel walks: a power of two up to `tile`, else whole tiles."""
    if num_keys <= tile:
        return max(16, 1 << (num_keys - 1).bit_length())
    return -(-num_keys // tile) * tile


@functools.partial(jax.jit, static_argnames=("k", "config", "interpret"))
def select_top_k_pallas(scores, lengths, *, k: int, config: TopKConfig, interpret: bool):
    """fp32 [R, S] scores, int32 [R] lengths in [0, S] -> int32 [R, k] (see
    `pallas_kernels.top_k`; 1 <= k <= S checked there)."""
    num_rows, num_keys = scores.shape
    padded = _padded_length(num_keys, config.tile)
    tile = min(config.tile, padded)
    resident_len = 1 << (padded - 1).bit_length()
    resident_sizes = ()
    if resident_len <= config.resident:
        padded = resident_len
        tile = min(tile, padded)
        # Short causal rows search a smaller register tile: up to RESIDENT_BUCKETS sizes.
        resident_sizes = tuple(padded >> i for i in reversed(range(RESIDENT_BUCKETS))
                               if padded >> i >= 16)
    scores = scores.astype(jnp.float32)
    if interpret:  # the interpreter clamps out-of-range windows; Triton masks them
        scores = jnp.pad(scores, ((0, 0), (0, padded - num_keys)), constant_values=-jnp.inf)
    kernel = functools.partial(
        _top_k_kernel, k=k, num_keys=num_keys, padded=padded, tile=tile,
        resident_sizes=resident_sizes,
        digit_bits=1 if resident_sizes else config.streamed_digit_bits)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, k), jnp.int32),
        grid=(num_rows,),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="select_top_k",
    )(jnp.clip(lengths.astype(jnp.int32), 0, num_keys), scores)
