"""The hybrid KDA / MLA model and its jitted, cache-aware prefill and decode steps.

    model = HybridModel(config, nnx.Rngs(0))
    model_state = nnx.split(model)                  # (GraphDef, params): a pytree
    caches = Caches.init(config, num_state_slots, num_kv_blocks)
    out = prefill(model_state, caches, prefill_batch)   # caches donated: use out.caches
    out = decode(model_state, out.caches, decode_batch)

Both steps compile once per bucket (the static shapes of the batch and caches); lengths,
offsets, slots, positions and block tables are runtime values. `prefill` and `decode` run
on one device; `prefill_step` and `decode_step` are the same steps, unjitted, taking a
`glmjax.sharding.ShardingPlan`, which jits them over a (tp, dcp) mesh. A step whose slot metadata
is invalid (see `glmjax.state_pool.PoolStatus`) writes no cache at all, KDA pools and MLA
blocks alike, and its logits are meaningless: check `status` before using them.

Positions: no layer rotates queries or keys (qk_rope is unrotated), so the steps read no
`positions` in prefill; MLA places each span's tokens after `prefix_lens[n]` cached ones.
In decode, `positions[n]` is the new token's cache position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.batch import DecodeBatch, PrefillBatch
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.layer_scan import LayerPlan, block_at, layer_plan, scan_prefill, stack_blocks
from glmjax.layers.block import DecoderBlock
from glmjax.layers.kda import KDAState
from glmjax.layers.mhc import collapse_streams, expand_streams
from glmjax.layers.mtp import MTP
from glmjax.layers.norms import RMSNorm
from glmjax.layers.packing import PackedBatch, sequence_ids
from glmjax.layers.paged_cache import MLACache
from glmjax.layers.projection import projection
from glmjax.state_pool import (
    PoolStatus,
    StatePool,
    commit_prefill,
    decode_slots,
    prefill_status,
    read_states,
)
from glmjax.xla_options import STEP_OPTIONS

if TYPE_CHECKING:
    from glmjax.sharding import ShardingPlan


@jax.tree_util.register_pytree_node_class
class FlatParams:
    """The parameters as one level of leaves, the nested dicts' treedef as static aux data:
    what `pure_state` hands the step programs. A jitted call flattens its arguments on the
    host at every call: with kimi-linear-48b's 563 parameters a call took 704 us of host
    time as an `nnx.State` (flattened variable by variable in Python), 241 as nested
    dicts, 129 as these (`bench.param_dispatch`, a 2-core CPU)."""

    def __init__(self, leaves: Sequence, treedef):
        self.leaves, self.treedef = tuple(leaves), treedef

    def tree_flatten(self):
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves):
        return cls(leaves, treedef)

    def unflatten(self) -> dict:
        """The nested dicts of arrays (``nnx.to_pure_dict``'s form)."""
        return jax.tree.unflatten(self.treedef, self.leaves)


ModelState = tuple[nnx.GraphDef, nnx.State | dict | FlatParams]  # nnx.split(model), or `pure_state`'s


def pure_state(model_state: ModelState) -> ModelState:
    """``nnx.split(model)`` with its parameters as `FlatParams`, as the engine passes them
    to the step programs (`merge` takes every form). Already pure: returned as it is."""
    graphdef, params = model_state
    if isinstance(params, FlatParams):
        return model_state
    leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(params))
    return graphdef, FlatParams(leaves, treedef)


def merge(model_state: ModelState) -> HybridModel:
    """``nnx.merge`` of any `ModelState` form."""
    graphdef, params = model_state
    return nnx.merge(graphdef, params.unflatten() if isinstance(params, FlatParams) else params)


class ForwardResult(NamedTuple):
    hidden: jax.Array  # [T, D] after the final norm
    kda_states: list[KDAState]  # per KDA layer, after each whole sequence
    kda_snapshots: list[KDAState]  # per KDA layer, [N, capacity, ...]
    mla_caches: list[MLACache | None]  # per MLA layer


class HybridModel(nnx.Module):
    """Embedding, decoder blocks per `config.layer_types`, final norm, LM head; the MTP
    heads are held (for drafting and weight loading) but not run by the forward passes
    (`glmjax.speculative` drafts with the first). With `config.scan_layers` the repeated
    layer groups are held stacked in `layer_groups` and `layers` holds the others
    (`glmjax.layer_scan.layer_plan`)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=config.dtype,
                                      param_dtype=config.param_dtype, rngs=rngs)
        kinds, plan = config.layer_types, layer_plan(config)

        def block(i):
            return DecoderBlock(config, kinds[i], dense_mlp=i < config.first_dense_layers,
                                rngs=rngs)

        # Every layer, or with `config.scan_layers` the unrolled ones and, per position of
        # the scanned group, its layers stacked (`glmjax.layer_scan`).
        self.layers = nnx.List([block(i) for i in plan.unrolled])
        self.layer_groups = (nnx.List([stack_blocks([block(i) for i in plan.group_layers(j)])
                                       for j in range(plan.group_size)])
                             if plan.num_groups else None)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                            param_dtype=config.param_dtype)
        self.lm_head = (None if config.tie_word_embeddings
                        else projection(config, config.hidden_size, config.vocab_size,
                                        rngs=rngs, out_dtype=jnp.float32))
        self.mtp = nnx.List([MTP(config, rngs=rngs) for _ in range(config.num_mtp_layers)])

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., D] normed hidden -> fp32 [..., vocab] (the head's output is not rounded to
        bf16: at |logit| ~ 16-32 a bf16 step is 0.125-0.25, enough to flip a greedy token)."""
        if self.lm_head is None:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def forward(self, token_ids: jax.Array, batch: PackedBatch,
                kda_states: Sequence[KDAState], mla_caches: Sequence[MLACache | None], *,
                decode: bool = False, plan: ShardingPlan | None = None) -> ForwardResult:
        """All layers over a packed batch.

        Args:
          token_ids: int32 [T]. batch: the packed metadata the layers read.
          kda_states: per KDA layer, the initial state of each sequence; with `decode`, the
            layer's whole pool, advanced in place at `batch.state_slots` (and returned as
            `kda_states`).
          mla_caches: per MLA layer, its paged cache (None: no cache, no prefix).
          decode: one token per sequence; MLA attends in absorbed form.
          plan: the mesh the layers run on (None: one device).
        """
        x = self.embed_tokens(token_ids)
        if self.config.mhc_streams is not None:
            x = expand_streams(x, self.config.mhc_streams)
        kinds, layers = self.config.layer_types, layer_plan(self.config)
        # caches[i]: layer i's cache as its block takes it; outs[i]: (cache, snapshots).
        kda_in, mla_in = iter(kda_states), iter(mla_caches)
        caches = [next(kda_in) if kind == "kda" else next(mla_in) for kind in kinds]
        outs: list = [None] * len(kinds)

        def run(block, i, x, layer=None):
            if plan is not None:
                x = plan.constrain(x, plan.specs.tokens)
            x, cache, snapshots = block(x, batch, caches[i], decode=decode, plan=plan,
                                        layer=layer)
            outs[i] = (cache, snapshots)
            return x

        if decode or not layers.num_groups:
            for i, (block, layer) in enumerate(self.blocks()):
                x = run(block, i, x, layer)
        else:  # the scanned groups between the unrolled layers before and after them
            for i, block in zip(layers.unrolled, self.layers, strict=True):
                if i == layers.stop:
                    x = self._scan(x, batch, layers, caches, outs, plan)
                x = run(block, i, x)
            if layers.stop == len(kinds):
                x = self._scan(x, batch, layers, caches, outs, plan)
        if self.config.mhc_streams is not None:
            x = collapse_streams(x)
        kda_out = [outs[i] for i, kind in enumerate(kinds) if kind == "kda"]
        return ForwardResult(self.norm(x), [cache for cache, _ in kda_out],
                             [snapshots for _, snapshots in kda_out],
                             [outs[i][0] for i, kind in enumerate(kinds) if kind == "mla"])

    def blocks(self) -> list[tuple[DecoderBlock, int | None]]:
        """Every layer's block, in order, with the ``layer`` argument it is called with: a
        scanned group's layer is its entry of the stacked block (`layer_scan.block_at`)."""
        layers = layer_plan(self.config)
        unrolled = dict(zip(layers.unrolled, self.layers, strict=True))
        blocks = []
        for i in range(self.config.num_layers):
            if i in unrolled:
                blocks.append((unrolled[i], None))
            else:
                g, j = divmod(i - layers.start, layers.group_size)
                blocks.append((block_at(self.layer_groups[j], g), g))
        return blocks

    def _scan(self, x, batch, layers: LayerPlan, caches, outs, plan):
        """Prefill through the scanned groups (`layer_scan.scan_prefill`)."""
        columns = [[caches[i] for i in layers.group_layers(j)]
                   for j in range(layers.group_size)]
        x, results = scan_prefill(self.layer_groups, x, batch, columns, plan=plan)
        for j, column in enumerate(results):
            for i, out in zip(layers.group_layers(j), column, strict=True):
                outs[i] = out
        return x

    def reference_forward(self, token_ids: jax.Array) -> jax.Array:
        """Cache-free forward over one whole sequence from a cold start, for tests.

        token_ids int32 [L] -> fp32 logits [L, vocab].
        """
        config = self.config
        num_kda = config.layer_types.count("kda")
        heads, dim = config.kda_num_heads, config.kda_head_dim
        cold = KDAState(jnp.zeros((1, heads, dim, dim), jnp.float32),
                        jnp.zeros((1, config.conv_channels, config.conv_kernel - 1),
                                  config.dtype))
        cu = jnp.array([0, token_ids.shape[0]], jnp.int32)
        batch = PackedBatch(cu, None, None, jnp.full((1, 1), -1, jnp.int32))
        out = self.forward(token_ids, batch, [cold] * num_kda,
                           [None] * (config.num_layers - num_kda))
        return self.logits(out.hidden)


class PrefillOutput(NamedTuple):
    logits: jax.Array  # fp32 [N, vocab]: after each span's last token (zeros: empty span)
    caches: Caches
    status: jax.Array  # int32 [], a PoolStatus; caches untouched unless OK
    # fp32 [T] with return_logprobs: row t holds log p(token_ids[t + 1] | the request up to
    # and including token t), where row t + 1 is in the same span; 0 on each span's last row
    # and on padding. (The logprob of a span's first token is the previous step's
    # last-token logits at that token.) None otherwise.
    token_logprobs: jax.Array | None


class DecodeOutput(NamedTuple):
    logits: jax.Array  # fp32 [N, vocab] (zeros on padding rows)
    caches: Caches
    status: jax.Array  # int32 [], a PoolStatus; caches untouched unless OK


class DecodeBuffers(NamedTuple):
    """Where `decode_pinned` writes a step's logits and status (donated each call)."""

    logits: jax.Array  # fp32 [N, vocab]
    status: jax.Array  # int32 []

    @classmethod
    def zeros(cls, num_rows: int, vocab_size: int) -> DecodeBuffers:
        """Host zeros of the buffers' shapes (``jax.device_put`` them: no compile)."""
        return cls(np.zeros((num_rows, vocab_size), np.float32), np.zeros((), np.int32))


def _next_token_logprobs(model: HybridModel, hidden, token_ids, cu_seqlens):
    """log p(token_ids[t + 1]) at every row t whose next row is in the same span: fp32 [T].

    Materialises [T, vocab] fp32 logits: a cost only callers asking for logprobs pay.
    """
    num_tokens = token_ids.shape[0]
    seq, valid = sequence_ids(cu_seqlens, num_tokens)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    has_next = valid & (rows + 1 < cu_seqlens[seq + 1])
    next_ids = jnp.roll(token_ids, -1)
    logprobs = jax.nn.log_softmax(model.logits(hidden), axis=-1)
    picked = jnp.take_along_axis(logprobs, next_ids[:, None], axis=-1)[:, 0]
    return jnp.where(has_next, picked, 0.0)


def prefill_step(model_state: ModelState, caches: Caches, batch: PrefillBatch, *,
                 return_logprobs: bool = False, plan: ShardingPlan | None = None
                 ) -> PrefillOutput:
    """One packed prefill step: run every span, update the caches, return last-token logits.

    Span n (rows cu_seqlens[n]:cu_seqlens[n + 1]) continues a request after
    `prefix_lens[n]` tokens already in its MLA blocks (`block_tables[n]`) and starts from
    KDA running slot `state_slots[n]` if `has_initial[n]` (zeros otherwise). Its final KDA
    states go to `state_slots[n]`, the snapshot after `checkpoint_offsets[n, c]` tokens of
    the span to `checkpoint_slots[n, c]`, its latents to its MLA blocks.
    `caches` is donated by `prefill` and the sharded steps: use the returned one.
    """
    model = merge(model_state)
    num_tokens = batch.token_ids.shape[0]
    out, packed, caches, status = prefill_forward(model, caches, batch, plan=plan)
    cu = packed.cu_seqlens
    lengths = cu[1:] - cu[:-1]
    last = jnp.clip(cu[1:] - 1, 0, num_tokens - 1)
    logits = jnp.where((lengths > 0)[:, None], model.logits(out.hidden[last]), 0.0)
    logprobs = (_next_token_logprobs(model, out.hidden, batch.token_ids, cu)
                if return_logprobs else None)
    return PrefillOutput(logits, caches, status, logprobs)


def prefill_forward(model: HybridModel, caches: Caches, batch: PrefillBatch, *,
                    plan: ShardingPlan | None = None
                    ) -> tuple[ForwardResult, PackedBatch, Caches, jax.Array]:
    """The forward and cache update of `prefill_step`: (the forward's result, the packed
    batch it ran on (empty spans when refused), the updated caches, the PoolStatus)."""
    # A refused step must not write anything; running it on empty spans with no checkpoints
    # and no blocks also keeps bad offsets and lengths away from the kernel.
    ok = prefill_status(batch, caches.num_state_slots) == PoolStatus.OK
    cu = jnp.where(ok, batch.cu_seqlens, 0)
    packed = PackedBatch(cu, batch.prefix_lens, jnp.where(ok, batch.block_tables, -1),
                         jnp.where(ok, batch.checkpoint_offsets, -1))
    initial = read_states(caches.kda, batch.state_slots, batch.has_initial)
    out = model.forward(batch.token_ids, packed, initial, caches.mla, plan=plan)
    kda, status = commit_prefill(caches.kda, batch, out.kda_states, out.kda_snapshots)
    return out, packed, caches._replace(kda=kda, mla=tuple(out.mla_caches)), status


def decode_step(model_state: ModelState, caches: Caches, batch: DecodeBatch, *,
                plan: ShardingPlan | None = None) -> DecodeOutput:
    """One token per row: row n appends `token_ids[n]` at cache position `positions[n]` of
    the request in KDA slot `state_slots[n]` (-1: padding row, nothing read or written) and
    MLA blocks `block_tables[n]`. `caches` is donated by `decode` and the sharded steps:
    use the returned one; each KDA layer updates its pool in place (`KDA.decode`)."""
    model = merge(model_state)
    # A refused step runs with every slot -1: the KDA layers then read and write no slot.
    slots, status = decode_slots(batch.state_slots, caches.num_state_slots)
    num_rows = slots.shape[0]
    active = slots >= 0
    packed = PackedBatch(jnp.arange(num_rows + 1, dtype=jnp.int32),
                         jnp.where(active, batch.positions, -1), batch.block_tables,
                         jnp.full((num_rows, 1), -1, jnp.int32), slots)
    out = model.forward(batch.token_ids, packed, caches.kda, caches.mla, decode=True, plan=plan)
    kda = tuple(StatePool(*pool) for pool in out.kda_states)
    logits = jnp.where(active[:, None], model.logits(out.hidden), 0.0)
    return DecodeOutput(logits, caches._replace(kda=kda, mla=tuple(out.mla_caches)), status)


def decode_into(model_state: ModelState, caches: Caches, batch: DecodeBatch,
                buffers: DecodeBuffers) -> DecodeOutput:
    """`decode_step` with its logits and status written into `buffers` (donated, as the
    caches are): every output of the program keeps its device address from call to call,
    so XLA launches its CUDA graphs as recorded (`serving.pinned`)."""
    del buffers  # donated and unread: XLA aliases each to the output of its shape
    return decode_step(model_state, caches, batch)


# One device; the mesh versions are `glmjax.sharding.ShardingPlan.steps()`.
prefill = jax.jit(prefill_step, donate_argnums=1, static_argnames="return_logprobs",
                  compiler_options=STEP_OPTIONS)
decode = jax.jit(decode_step, donate_argnums=1, compiler_options=STEP_OPTIONS)
decode_pinned = jax.jit(decode_into, donate_argnums=(1, 3), keep_unused=True,
                        compiler_options=STEP_OPTIONS)
