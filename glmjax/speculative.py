"""MTP speculative decoding on the device: verify drafted tokens, keep the accepted prefix
of the KDA recurrence, and draft the next tokens with the model's MTP head.

A sequence r that has sampled token t_p (not yet computed, at position p) and holds k_r
drafts d_1..d_k (k_r <= J - 1) verifies them in one step:

    verify_step:   the model's decode over J = N + 1 rows per sequence, row j = token j
                   (t_p, d_1, ...) at position p + j; rows j > k_r are padding. The KDA
                   layers run the rows as a chain of one-token decodes (`KDA.decode`):
                   slot_chain[j, r] ends holding the state after token j, the running
                   slot slot_chain[0, r] the state after t_p; MLA writes every row's latent
                   at its position and attends causally (rows beyond the accepted prefix
                   are overwritten by later steps before anything reads them).
    (the engine samples every row: s_j, the target's token after row j)
    accept_and_draft_step:
                   accepted a_r = the longest prefix with d_{j+1} = s_j; copies the state
                   after a_r + 1 tokens, slot_chain[a_r, r], into the running slot; writes
                   the MTP cache at the accepted positions p..p + a_r from (hidden_j, s_j);
                   drafts d'_1 from the MTP head at row a_r and d'_2..d'_N by running the
                   MTP layer again on its own output (the first MTP layer at every depth).

The request gains s_0..s_{a_r}: the tokens plain greedy decoding computes, since every
s_j is the target's token after a prefix of verified tokens, and each row runs the same
per-token ops as a plain decode. A prefill (`spec_prefill_step`) fills the MTP cache over
its span (the token after a span's last row is given by the caller, 0 when it is not yet
sampled) and returns each span's last hidden state, from which `accept_and_draft_step`
(J = 1, no drafts) drafts after the prompt's first sampled token.

Both steps are transactional: invalid slots refuse the verify (no cache written, as
`glmjax.model.decode_step`), and `accept_and_draft_step` given a refused status writes
nothing either. Greedy drafts only: rows sampled with a temperature run with k_r = 0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glmjax.batch import PrefillBatch, VerifyBatch
from glmjax.caches import Caches
from glmjax.layers.packing import PackedBatch
from glmjax.model import ModelState, merge, prefill_forward
from glmjax.state_pool import PoolStatus, StatePool, copy_slots, decode_slots
from glmjax.xla_options import STEP_OPTIONS


class VerifyOutput(NamedTuple):
    logits: jax.Array  # fp32 [J R, vocab], row j R + r (zeros on padding rows)
    hidden: jax.Array  # [J R, D], the final normed hidden of each row
    caches: Caches
    status: jax.Array  # int32 [], a PoolStatus; caches untouched unless OK


class DraftOutput(NamedTuple):
    drafts: jax.Array  # int32 [R, N], the next step's drafts (greedy MTP)
    accepted: jax.Array  # int32 [R], drafts accepted (0 on padding)
    caches: Caches
    status: jax.Array  # int32 [], the slot copy's PoolStatus (OK when nothing to copy)


class SpecPrefillOutput(NamedTuple):
    logits: jax.Array  # fp32 [N, vocab] after each span's last token
    last_hidden: jax.Array  # [N, D], the final normed hidden of each span's last token
    caches: Caches
    status: jax.Array


def _rows(batch: VerifyBatch, active: jax.Array) -> PackedBatch:
    """The decode-form PackedBatch of the J R rows (j-major); `active` bool [J, R]."""
    num_chain, num_seqs = batch.token_ids.shape
    rows = num_chain * num_seqs
    positions = batch.positions[None, :] + jnp.arange(num_chain, dtype=jnp.int32)[:, None]
    positions = jnp.where(active, positions, -1).reshape(rows)
    return PackedBatch(jnp.arange(rows + 1, dtype=jnp.int32), positions,
                       jnp.tile(batch.block_tables, (num_chain, 1)),
                       jnp.full((rows, 1), -1, jnp.int32))


def verify_step(model_state: ModelState, caches: Caches, batch: VerifyBatch) -> VerifyOutput:
    """The target model over every sequence's token and drafts (see the module docstring).
    `caches` is donated by `verify`: use the returned one."""
    model = merge(model_state)
    num_chain, num_seqs = batch.token_ids.shape
    chain = jnp.where(batch.positions[None, :] >= 0, batch.slot_chain, -1)
    flat, status = decode_slots(chain.reshape(-1), caches.num_state_slots)
    chain = flat.reshape(num_chain, num_seqs)
    active = chain >= 0
    packed = _rows(batch, active)._replace(state_slots=chain)
    out = model.forward(batch.token_ids.reshape(-1), packed, caches.kda, caches.mla,
                        decode=True)
    kda = tuple(StatePool(*pool) for pool in out.kda_states)
    logits = jnp.where(active.reshape(-1, 1), model.logits(out.hidden), 0.0)
    return VerifyOutput(logits, out.hidden,
                        caches._replace(kda=kda, mla=tuple(out.mla_caches)), status)


def accepted_counts(token_ids: jax.Array, sampled: jax.Array, num_drafts: jax.Array
                    ) -> jax.Array:
    """Drafts accepted per sequence: the longest prefix j < num_drafts with
    token_ids[j + 1] == sampled[j]. token_ids, sampled int32 [J, R] -> int32 [R]."""
    steps = jnp.arange(token_ids.shape[0] - 1, dtype=jnp.int32)[:, None]
    match = (token_ids[1:] == sampled[:-1]) & (steps < num_drafts[None, :])
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=0), axis=0).astype(jnp.int32)


def accept_and_draft_step(model_state: ModelState, caches: Caches, batch: VerifyBatch,
                          sampled: jax.Array, hidden: jax.Array, hidden_rows: jax.Array,
                          verify_status: jax.Array, *, num_speculative: int) -> DraftOutput:
    """Keep what the verification accepted and draft `num_speculative` tokens.

    Args:
      batch: the verified batch (or, after a prefill, J = 1: positions = the span's last
        position, no drafts, slot_chain -1).
      sampled: J arrays int32 [>= R]: sampled[j][r], the token sampled after row j R + r.
      hidden: [*, D], final hidden states (`VerifyOutput.hidden`, or a prefill's
        `last_hidden`); row j R + r is hidden[hidden_rows[j R + r]] (int32 [J R]).
      verify_status: the verify (or prefill) step's status; not OK: nothing is written.
    `caches` is donated by `accept_and_draft`: use the returned one.
    """
    model = merge(model_state)
    mtp = model.mtp[0]
    num_chain, num_seqs = batch.token_ids.shape
    sampled = jnp.stack([tokens[:num_seqs] for tokens in sampled])  # [J, R]
    hidden = hidden[hidden_rows]
    ok = verify_status == PoolStatus.OK
    live = ok & (batch.positions >= 0)
    accepted = jnp.where(live, accepted_counts(batch.token_ids, sampled, batch.num_drafts), 0)
    seqs = jnp.arange(num_seqs, dtype=jnp.int32)
    keep = batch.slot_chain[accepted, seqs]
    moved = live & (accepted > 0)
    kda, copy_status = copy_slots(caches.kda, jnp.where(moved, keep, -1),
                                  jnp.where(moved, batch.slot_chain[0], -1))

    # The MTP cache at the accepted positions, and the first draft from the last of them.
    rows = jnp.arange(num_chain, dtype=jnp.int32)[:, None]
    packed = _rows(batch, live[None, :] & (rows <= accepted[None, :]))
    h, mtp_cache = mtp.block_hidden(hidden, sampled.reshape(-1), model.embed_tokens, packed,
                                    caches.mtp[0], decode=True)
    h = h[accepted * num_seqs + seqs]  # [R, D]
    drafts = [jnp.argmax(mtp.head(h, model.logits), axis=-1).astype(jnp.int32)]
    position = batch.positions + accepted
    for _ in range(num_speculative - 1):
        position = position + 1
        step = PackedBatch(jnp.arange(num_seqs + 1, dtype=jnp.int32),
                           jnp.where(live, position, -1), batch.block_tables,
                           jnp.full((num_seqs, 1), -1, jnp.int32))
        h, mtp_cache = mtp.block_hidden(h, drafts[-1], model.embed_tokens, step, mtp_cache,
                                        decode=True)
        drafts.append(jnp.argmax(mtp.head(h, model.logits), axis=-1).astype(jnp.int32))
    caches = caches._replace(kda=kda, mtp=(mtp_cache,))
    return DraftOutput(jnp.stack(drafts, axis=1), accepted, caches, copy_status)


def spec_prefill_step(model_state: ModelState, caches: Caches, batch: PrefillBatch,
                      next_tokens: jax.Array) -> SpecPrefillOutput:
    """`glmjax.model.prefill_step` that also writes the MTP cache over every span.

    next_tokens: int32 [N], the token after span n's last one (0 when not yet sampled:
    `accept_and_draft_step` then rewrites that position). `caches` is donated by
    `spec_prefill`: use the returned one."""
    model = merge(model_state)
    num_tokens = batch.token_ids.shape[0]
    out, packed, caches, status = prefill_forward(model, caches, batch)
    cu = packed.cu_seqlens
    lengths = cu[1:] - cu[:-1]
    last = jnp.clip(cu[1:] - 1, 0, num_tokens - 1)
    following = jnp.roll(batch.token_ids, -1).at[jnp.where(lengths > 0, last, num_tokens)].set(
        next_tokens, mode="drop")
    _, mtp_cache = model.mtp[0].block_hidden(out.hidden, following, model.embed_tokens,
                                             packed, caches.mtp[0])
    last_hidden = out.hidden[last]
    logits = jnp.where((lengths > 0)[:, None], model.logits(last_hidden), 0.0)
    return SpecPrefillOutput(logits, last_hidden, caches._replace(mtp=(mtp_cache,)), status)


verify = jax.jit(verify_step, donate_argnums=1, compiler_options=STEP_OPTIONS)
accept_and_draft = jax.jit(accept_and_draft_step, donate_argnums=1,
                           static_argnames="num_speculative", compiler_options=STEP_OPTIONS)
spec_prefill = jax.jit(spec_prefill_step, donate_argnums=1, compiler_options=STEP_OPTIONS)
