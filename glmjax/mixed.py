"""One model forward over a step's prefill spans and decode rows together.

    out = mixed(model_state, caches, prefill_batch, decode_batch)   # caches donated
    out.prefill_logits, out.decode_logits, out.caches, out.status

A step with both prefill spans and decode rows otherwise runs the model twice
(`glmjax.model.prefill`, then `glmjax.model.decode`), reading every weight, every routed
expert included, twice. Here the T prefill rows and the N decode rows go through one
forward of T + N rows: the embedding, the norms, the MLP / MoE and the LM head read their
weights once. Only the mixers split the rows, each part on its own path: KDA runs the
chunked scan over the spans (initial states read from their running slots, final states
and snapshots committed after the forward) and the recurrent decode kernel over the rows
(their slots updated in place); MLA runs its packed prefill attention over the spans and
its absorbed decode form over the rows. So the mixers' projections are applied once per
part: their weights are read twice, as by two forwards. Per glm5.3-flash layer that is
275 MB (KDA) or 249 MB (MLA), against 50 MB for each routed expert: 64 decode rows at
top-8 touch ~240 of the 288 experts (~12 GB), which the prefill's 2048 tokens touch
anyway. Sharing the mixer projections too would mean splitting each mixer between its
projections and its core (the scan or the attention).

Transactional as the two steps are: the prefill metadata, the decode slots and the two
together (no slot written by both) are checked first; if any is invalid, nothing is
written in any cache, and `status` is the first non-OK `PoolStatus` of the three checks.
Prefill and decode rows must also write disjoint MLA blocks (the serving loop's batch
builder checks it on the host, as for two forwards).

One device; the mesh version (a `ShardingPlan` step) is not written yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from glmjax.batch import DecodeBatch, PrefillBatch
from glmjax.caches import Caches
from glmjax.layers.mhc import collapse_streams, expand_streams
from glmjax.model import ModelState, merge
from glmjax.state_pool import (
    PoolStatus,
    StatePool,
    commit_prefill,
    decode_status,
    prefill_status,
    read_states,
)
from glmjax.xla_options import STEP_OPTIONS

if TYPE_CHECKING:
    from glmjax.sharding import ShardingPlan


class MixedOutput(NamedTuple):
    prefill_logits: jax.Array  # fp32 [Np, vocab], after each span's last token (0: empty)
    decode_logits: jax.Array  # fp32 [Nd, vocab] (zeros on padding rows)
    caches: Caches
    status: jax.Array  # int32 [], a PoolStatus; caches untouched unless OK


def mixed_status(prefill: PrefillBatch, decode: DecodeBatch, num_slots: int) -> jax.Array:
    """int32 [] `PoolStatus`: the first non-OK of the prefill's checks, the decode's, and
    the slots both write together (out of range, or one slot written twice)."""
    together = jnp.concatenate([prefill.state_slots, prefill.checkpoint_slots.reshape(-1),
                                decode.state_slots])
    statuses = jnp.stack([prefill_status(prefill, num_slots),
                          decode_status(decode.state_slots, num_slots),
                          decode_status(together, num_slots)])
    return statuses[jnp.argmax(statuses != PoolStatus.OK)]


def _inert(batch: PrefillBatch) -> PrefillBatch:
    """The batch with every span empty and nothing to read or write (status OK)."""
    return batch._replace(
        cu_seqlens=jnp.zeros_like(batch.cu_seqlens),
        state_slots=jnp.full_like(batch.state_slots, -1),
        has_initial=jnp.zeros_like(batch.has_initial),
        checkpoint_offsets=jnp.full_like(batch.checkpoint_offsets, -1),
        checkpoint_slots=jnp.full_like(batch.checkpoint_slots, -1),
        block_tables=jnp.full_like(batch.block_tables, -1),
        prefix_lens=jnp.zeros_like(batch.prefix_lens))


def mixed_step(model_state: ModelState, caches: Caches, prefill_batch: PrefillBatch,
               decode_batch: DecodeBatch, *, plan: ShardingPlan | None = None) -> MixedOutput:
    """`glmjax.model.prefill_step` on `prefill_batch` and `decode_step` on `decode_batch`
    in one forward (same arguments and meanings; `caches` donated by `mixed`)."""
    model = merge(model_state)
    config = model.config
    status = mixed_status(prefill_batch, decode_batch, caches.num_state_slots)
    ok = status == PoolStatus.OK
    spans = jax.tree.map(lambda a, b: jnp.where(ok, a, b), prefill_batch, _inert(prefill_batch))
    slots = jnp.where(ok, decode_batch.state_slots, -1)
    active = slots >= 0
    context = jnp.where(active, decode_batch.positions, -1)
    num_tokens = prefill_batch.token_ids.shape[0]

    def split(h):
        return h[:num_tokens], h[num_tokens:]

    x = model.embed_tokens(jnp.concatenate([prefill_batch.token_ids, decode_batch.token_ids]))
    if config.mhc_streams is not None:
        x = expand_streams(x, config.mhc_streams)
    initial = iter(read_states(caches.kda, spans.state_slots, spans.has_initial))
    kda_in, mla_in = iter(caches.kda), iter(caches.mla)
    pools, finals, snapshots, mla_out = [], [], [], []
    for (block, layer), kind in zip(model.blocks(), config.layer_types, strict=True):
        if plan is not None:
            x = plan.constrain(x, plan.specs.tokens)
        mixer = block.mixer
        if kind == "kda":
            state, pool = next(initial), next(kda_in)

            def mix(h, mixer=mixer, state=state, pool=pool):
                h_spans, h_rows = split(h)
                out = mixer(h_spans, spans.cu_seqlens, state, spans.checkpoint_offsets,
                            plan=plan)
                y, pool = mixer.decode(h_rows, pool, slots, plan=plan)
                return jnp.concatenate([out.y, y]), out.state, out.snapshots, StatePool(*pool)

            x, final, snapshot, pool = block.with_mixer(x, mix, plan=plan, layer=layer)
            finals.append(final)
            snapshots.append(snapshot)
            pools.append(pool)
        else:
            cache = next(mla_in)

            def mix(h, mixer=mixer, cache=cache):
                h_spans, h_rows = split(h)
                y_spans, cache = mixer(h_spans, spans.cu_seqlens, cache, spans.block_tables,
                                       spans.prefix_lens, plan=plan)
                y_rows, cache = mixer.decode(h_rows, cache, decode_batch.block_tables, context,
                                             plan=plan)
                return jnp.concatenate([y_spans, y_rows]), cache

            x, cache = block.with_mixer(x, mix, plan=plan, layer=layer)
            mla_out.append(cache)
    if config.mhc_streams is not None:
        x = collapse_streams(x)
    hidden_spans, hidden_rows = split(model.norm(x))
    kda, _ = commit_prefill(pools, spans, finals, snapshots)  # inert (writes nothing) unless ok
    cu = spans.cu_seqlens
    last = jnp.clip(cu[1:] - 1, 0, num_tokens - 1)
    logits = model.logits(jnp.concatenate([hidden_spans[last], hidden_rows]))  # one LM head read
    prefill_logits, decode_logits = logits[: last.shape[0]], logits[last.shape[0]:]
    return MixedOutput(
        jnp.where((cu[1:] > cu[:-1])[:, None], prefill_logits, 0.0),
        jnp.where(active[:, None], decode_logits, 0.0),
        Caches(kda, tuple(mla_out)), status)


mixed = jax.jit(mixed_step, donate_argnums=1, compiler_options=STEP_OPTIONS)
