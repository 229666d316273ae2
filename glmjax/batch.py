"""The step inputs the serving loop builds and the model's jitted entry points consume.

Every array has a static, bucketed shape; lengths, offsets and slots are runtime values, so
a new mix of requests in the same bucket never recompiles. Rows and sequences past the
real ones are padding: zero-length sequences with slot -1 and offsets -1.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

CHECKPOINT_CAPACITY = 4  # snapshot slots per sequence: R = 2 + log2(dcp) <= 4, padded with -1


class PrefillBatch(NamedTuple):
    """N packed prefill spans of one step (T rows in all, T a bucket size)."""

    token_ids: jax.Array           # int32 [T]
    positions: jax.Array           # int32 [T], absolute position of each token in its request
    cu_seqlens: jax.Array          # int32 [N + 1], span n is rows cu_seqlens[n]:cu_seqlens[n+1]
    state_slots: jax.Array         # int32 [N], running KDA state slot of each span (-1: padding)
    has_initial: jax.Array         # bool [N], read the running slot (False: cold start, zeros)
    checkpoint_offsets: jax.Array  # int32 [N, 4], span-relative token counts (1..len, -1 off)
    checkpoint_slots: jax.Array    # int32 [N, 4], state slot receiving each snapshot (-1: none)
    block_tables: jax.Array        # int32 [N, M], MLA cache blocks of each request (-1: none)
    prefix_lens: jax.Array         # int32 [N], tokens of the request already in the MLA cache


class DecodeBatch(NamedTuple):
    """N single-token decode rows of one step (N a bucket size)."""

    token_ids: jax.Array     # int32 [N]
    positions: jax.Array     # int32 [N], position of the new token (= tokens already cached)
    state_slots: jax.Array   # int32 [N], running KDA state slot (-1: padding row)
    block_tables: jax.Array  # int32 [N, M]


class VerifyBatch(NamedTuple):
    """R decodes of one step, each verifying up to J - 1 speculative drafts (J, R, M static;
    `glmjax.speculative`). Padding sequences have position -1, no drafts, slots -1."""

    token_ids: jax.Array  # int32 [J, R]: the last sampled token, then the drafts (0: none)
    positions: jax.Array  # int32 [R], position of token 0 (-1: padding sequence)
    num_drafts: jax.Array  # int32 [R] in [0, J - 1]; rows j > num_drafts[r] are padding
    slot_chain: jax.Array  # int32 [J, R]: the running slot, then a scratch slot per draft
    block_tables: jax.Array  # int32 [R, M], covering positions .. positions + num_drafts
