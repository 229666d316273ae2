"""Sums of kernels' partial results in one order whatever the batch (batch invariance).

A kernel that splits a reduction over programs (the weight stream's K splits, the MLA decode
attention's position splits) leaves [S, ...] partials to add. An XLA reduction over S may
pick its order from the other dimensions, so a row's sum would change with the number of
rows beside it; MTP's verify step runs N + 1 rows per sequence where plain decoding runs
one, and their greedy tokens must agree bit for bit. `ordered_sum` adds the partials by
explicit adds that XLA fuses into one pass: split s joins group s // GROUP, each group is
summed left to right, then the groups left to right. Trailing partials that are exactly
zero (splits past a sequence's end) leave the sum unchanged, so the result does not depend
on S either, only on where each split starts.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

GROUP = 16  # splits per left-to-right group: at most S / GROUP + GROUP adds in the program


def chain(parts) -> jax.Array:
    """((p_0 + p_1) + p_2) + ..."""
    return functools.reduce(operator.add, parts)


def ordered_sum(partials: jax.Array, axis: int = 0) -> jax.Array:
    """Sum over `axis` of fp32 partials in the fixed grouped order above."""
    partials = jnp.moveaxis(partials, axis, 0)
    return sum_in_order([partials[s] for s in range(partials.shape[0])])


def sum_in_order(parts) -> jax.Array:
    """`ordered_sum` of a sequence of same-shape arrays (e.g. the partials a kernel loads one
    by one: a consumer that adds them itself gets the same bits)."""
    parts = list(parts)
    return chain(chain(parts[start:start + GROUP]) for start in range(0, len(parts), GROUP))
