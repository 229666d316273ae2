"""MLA (multi-head latent attention) without positional rotation, over a paged latent cache.

Per token the cache keeps the latent ``rmsnorm(c_kv) | k_pe`` ([kv_lora + qk_rope]; k_pe is
one unrotated key part shared by all heads). With W_uk, W_uv the two halves of kv_b_proj:

    score[t, s] = scale * (q_nope[t] . (c_kv[s] W_uk) + q_pe[t] . k_pe[s])
    out[t]      = sum_s softmax(score)[t, s] * (c_kv[s] W_uv)

Prefill packs each sequence's keys contiguously (its cached prefix up to prefix_lens,
then its new tokens), expands their latents through kv_b_proj (non-absorbed) and attends
with the flash op `pallas_kernels.prefill_attention`: no score tensor in memory, and a
packed batch costs what its sequences cost. With a DSA indexer, a batch in which some
query sees more than top_k keys goes through the indexer's selection instead (index scores
[query_block, S] per block of queries by `pallas_kernels.index_scores`, top-k by
`pallas_kernels.top_k.select_top_k`) and
`pallas_kernels.sparse_attention`: absorbed, each query's heads against only its top_k
latents; otherwise the indexer would select every visible key and is skipped. Decode folds
W_uk into the query and W_uv after the weighted sum (absorbed), so it reads only latents.
All are the same function of the cache, up to rounding.

Under a `glmjax.sharding.ShardingPlan` the latent cache is split by token over the dcp
ranks (`DCPLayout`). Prefill all-gathers the cached prefix over dcp and attends as on one
device, heads split over all tp devices; each rank writes only the tokens it owns. Decode
gathers the queries over dcp (each rank then holds the heads of its tpo group), attends to
its own shard returning output and log-sum-exp, and merges the ranks' partial results with
LSE weights, scattered back to each rank's own heads
(`glmjax.layers.latent_attention.merge_partial_attention`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from glmjax.config import ModelConfig
from glmjax.layers.dsa_indexer import DSAIndexer
from glmjax.layers.latent_attention import (
    in_query_blocks,
    latent_attention,
    merge_partial_attention,
    owned_top_k_mask,
)
from glmjax.layers.mla_cache import NewLatents, read_prefix, write_latents, write_prefill
from glmjax.layers.norms import RMSNorm
from glmjax.layers.packing import sequence_ids
from glmjax.layers.paged_cache import (
    MLACache,
    read_paged,
    write_paged,
    write_paged_local,
)
from glmjax.layers.prefill_keys import CachedPrefix, PackedKeys, sequence_keys
from glmjax.layers.projection import on_one_gpu, projection
from pallas_kernels.attention import (
    INVARIANT_KEY_ALIGN,
    default_implementation,
    prefill_attention,
)
from pallas_kernels.head_matmul import head_matmul
from pallas_kernels.mla_decode import mla_decode, visible_positions
from pallas_kernels.sparse_attention import sparse_attention

if TYPE_CHECKING:
    from glmjax.sharding import ShardingPlan

PREFILL_QUERY_BLOCK = 1024  # queries per block of the DSA indexer's [block, S] scores



class MLA(nnx.Module):
    """MLA with optional query LoRA and optional DSA indexer (upstream DeepSeek names)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        hidden, heads = config.hidden_size, config.mla_num_heads
        self.num_heads, self.kv_lora = heads, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = (config.qk_nope_head_dim, config.qk_rope_head_dim,
                                            config.v_head_dim)
        self.scale = (self.nope + self.rope) ** -0.5
        q_dim = heads * (self.nope + self.rope)
        linear = functools.partial(projection, config, rngs=rngs)
        norm = functools.partial(RMSNorm, eps=config.rms_norm_eps, param_dtype=config.param_dtype)
        if config.q_lora_rank is None:
            self.q_proj = linear(hidden, q_dim)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = linear(hidden, config.q_lora_rank)
            self.q_a_layernorm = norm(config.q_lora_rank)
            self.q_b_proj = linear(config.q_lora_rank, q_dim)
        self.kv_a_proj_with_mqa = linear(hidden, self.kv_lora + self.rope)
        self.kv_a_layernorm = norm(self.kv_lora)
        self.kv_b_proj = linear(self.kv_lora, heads * (self.nope + self.v_dim))
        self.o_proj = linear(heads * self.v_dim, hidden)
        self.indexer = None if config.dsa_top_k is None else DSAIndexer(config, rngs=rngs)
        self.query_block = PREFILL_QUERY_BLOCK
        self.attention = config.mla_attention
        # Batch-invariant mode: our flash kernel on a GPU, each sequence's keys at a
        # multiple of its key blocks (`sequence_keys`).
        self.batch_invariant = config.batch_invariant
        # The DSA ops (`index_scores`, `sparse_attention`): None picks by device.
        self.dsa_implementation = "reference" if self.attention == "reference" else None

    def __call__(self, x: jax.Array, cu_seqlens: jax.Array, cache: MLACache | None = None,
                 block_table: jax.Array | None = None, prefix_lens: jax.Array | None = None,
                 *, plan: ShardingPlan | None = None) -> tuple[jax.Array, MLACache | None]:
        """Prefill a packed batch, causal within each sequence.

        Args:
          x: [T, D]; cu_seqlens: int32 [N + 1].
          cache, block_table (int32 [N, M]), prefix_lens (int32 [N]): with a cache, sequence
            n continues after prefix_lens[n] cached tokens, attends to them, and its new
            tokens are written at positions prefix_lens[n] + i. Without one, there is no
            prefix and nothing is written.
        Returns:
          y [T, D] (zero on padding rows) and the updated cache.
        """
        prefix = None
        if cache is not None:
            self._check_cache(cache.index_keys)
            prefix = read_prefix(cache, block_table, plan)
            # The write below then follows the read: otherwise XLA may schedule it first and
            # copies the whole pool (twice, in every MLA layer, every prefill step:
            # `tests/test_layers_mla.py` counts them) to keep the old values for the read.
            prefix, cache = lax.optimization_barrier((prefix, cache))
        y, new = self.attend(x, cu_seqlens, prefix, prefix_lens, plan=plan)
        if cache is not None:
            cache = write_prefill(cache, block_table, cu_seqlens, prefix_lens, new, plan)
        return y, cache

    def attend(self, x: jax.Array, cu_seqlens: jax.Array, prefix: CachedPrefix | None,
               prefix_lens: jax.Array | None = None, *, plan: ShardingPlan | None = None
               ) -> tuple[jax.Array, NewLatents]:
        """`__call__` given the cached prefix (`read_prefix`, read before any write) instead
        of the cache: returns y [T, D] and the new tokens' latents, for `write_prefill`. The
        layer scan (`glmjax.layer_scan`) reads every layer's prefix before it and writes
        every layer's latents after it."""
        with jax.named_scope("mla_prefill"):
            tokens, num_seqs = x.shape[0], cu_seqlens.shape[0] - 1
            if prefix_lens is None:
                prefix_lens = jnp.zeros((num_seqs,), jnp.int32)
            if prefix is not None:
                self._check_cache(prefix.index)
            seq, valid = sequence_ids(cu_seqlens, tokens)
            q_nope, q_pe, q_latent = self._queries(x)
            latent, index_keys = self._latent(x), self._index_keys(x)
            align = INVARIANT_KEY_ALIGN if self.batch_invariant else 1
            keys, cu_keys, seqused, prefix_used = sequence_keys(
                prefix, latent, index_keys, cu_seqlens, prefix_lens, align=align)
            dense = functools.partial(self._attend_dense, q_nope, q_pe, keys, cu_seqlens,
                                      cu_keys, seqused, plan)
            if self.indexer is None:
                out = dense()
            else:
                query_pos = (prefix_used[seq] + jnp.arange(tokens, dtype=jnp.int32)
                             - cu_seqlens[seq])
                selected = functools.partial(
                    self._attend_selected, q_nope, q_pe, self.indexer.queries(x, q_latent),
                    keys, cu_keys, seq, query_pos, valid, plan)
                max_keys = tokens + (0 if prefix is None else prefix.latent.shape[1])
                out = self._dense_or_selected(dense, selected, cu_seqlens, prefix_used,
                                              max_keys=max_keys)
            return self.o_proj(out.reshape(tokens, -1)), NewLatents(latent, index_keys)

    def decode(self, x: jax.Array, cache: MLACache, block_table: jax.Array,
               context_lens: jax.Array, *, plan: ShardingPlan | None = None
               ) -> tuple[jax.Array, MLACache]:
        """One new token per sequence, at position context_lens[n] (-1: inactive row).

        Args: x [N, D]; cache; block_table int32 [N, M]; context_lens int32 [N]; plan: the
          mesh (None: one device).
        Returns: y [N, D] (zero on inactive rows) and the cache with the new latents.
        """
        with jax.named_scope("mla_decode"):
            self._check_cache(cache.index_keys)
            num_seqs = x.shape[0]
            q_nope, q_pe, q_latent = self._queries(x)
            latent = self._latent(x)
            if plan is not None:
                return self._decode_dcp(x, q_nope, q_pe, q_latent, latent, cache, block_table,
                                        context_lens, plan)
            new = NewLatents(latent, self._index_keys(x))
            cache = write_latents(cache, block_table, jnp.arange(num_seqs, dtype=jnp.int32),
                           context_lens, context_lens >= 0, new, None)
            mask = None
            if self.indexer is not None:
                width = block_table.shape[1] * cache.latent.shape[1]
                mask = self.indexer.select(*self.indexer.queries(x, q_latent),
                                           read_paged(cache.index_keys, block_table),
                                           visible_positions(context_lens, None, width))
            # On one GPU the kernels: the per-head products in tiles of the shapes alone,
            # and the attention reading the latents in their blocks (flash decoding; its
            # steps take 16 or 32 positions of one block).
            heads_kernel = on_one_gpu() and all(
                d % 16 == 0 for d in (self.nope, self.v_dim, self.kv_lora))
            kernel = on_one_gpu() and cache.latent.shape[1] % 16 == 0
            q_abs = self._absorbed_queries(q_nope, heads_kernel)
            out_latent, _ = mla_decode(q_abs, q_pe if self.rope else None, cache.latent,
                                       block_table, context_lens, mask, scale=self.scale,
                                       implementation="pallas" if kernel else "xla")
            out = self._from_latent(out_latent, q_nope.dtype, heads_kernel)
            return self.o_proj(out.reshape(num_seqs, -1)), cache

    def _decode_dcp(self, x, q_nope, q_pe, q_latent, latent, cache, block_table, context_lens,
                    plan: ShardingPlan):
        """`decode` on a mesh: partial attention per dcp rank, merged by LSE."""
        num_seqs, specs, dcp_axis = x.shape[0], plan.specs, plan.dcp_axis
        index_keys, top = cache.index_keys, ()
        if self.indexer is not None:  # replicated: every rank selects the same positions
            seqs = jnp.arange(num_seqs, dtype=jnp.int32)
            index_keys = write_paged(index_keys, block_table, seqs, context_lens,
                                     self._index_keys(x), context_lens >= 0)
            keys = read_paged(index_keys, block_table)  # [N, S, d_I], global order
            top = self.indexer.top_keys(*self.indexer.queries(x, q_latent), keys,
                                        visible_positions(context_lens, None, keys.shape[1]))
        q_abs = self._absorbed_queries(q_nope)

        # Zero-width arrays (no rope part) crash XLA's CPU compiler inside a shard_map.
        q_pe = (q_pe,) if self.rope else ()

        def on_rank(pages, block_table, context_lens, latent, q_abs, q_pe, top):
            rank = lax.axis_index(dcp_axis)
            seqs = jnp.arange(num_seqs, dtype=jnp.int32)
            pages = write_paged_local(pages, block_table, seqs, context_lens, latent,
                                      context_lens >= 0, layout=plan.layout, rank=rank)
            local = read_paged(pages, block_table)  # [N, M * P, L], local order
            local_len = local.shape[1]
            if top:
                mask = owned_top_k_mask(*top, layout=plan.layout, rank=rank,
                                        local_len=local_len)
            else:
                positions = plan.layout.global_position(jnp.arange(local_len), rank)
                mask = positions[None] <= context_lens[:, None]
            # Gather the queries of my tpo group's heads over dcp.
            q_abs, q_pe = lax.all_gather((q_abs, q_pe), dcp_axis, axis=1, tiled=True)
            out, lse = latent_attention(q_abs, q_pe[0] if q_pe else None, local, mask,
                                        kv_lora=self.kv_lora, scale=self.scale)
            return pages, merge_partial_attention(out, lse, dcp_axis)

        pages, out_latent = jax.shard_map(
            on_rank, mesh=plan.mesh,
            in_specs=(specs.mla_latent, *[specs.replicated] * 3, specs.heads, specs.heads,
                      specs.replicated),
            out_specs=(specs.mla_latent, specs.heads),
        )(cache.latent, block_table, context_lens, latent, q_abs, q_pe, top)
        out = self._from_latent(out_latent, q_nope.dtype)
        return self.o_proj(out.reshape(num_seqs, -1)), MLACache(pages, index_keys)

    def _queries(self, x):
        """x [T, D] -> q_nope [T, H, nope], q_pe [T, H, rope], q latent [T, q_lora] or None."""
        if self.q_proj is None:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        else:
            q_latent, q = None, self.q_proj(x)
        q = q.reshape(x.shape[0], self.num_heads, self.nope + self.rope)
        return q[..., :self.nope], q[..., self.nope:], q_latent

    def _latent(self, x):
        """x [T, D] -> cached latent [T, kv_lora + rope] = rmsnorm(c_kv) | k_pe."""
        kv = self.kv_a_proj_with_mqa(x)
        return jnp.concatenate([self.kv_a_layernorm(kv[:, :self.kv_lora]),
                                kv[:, self.kv_lora:]], axis=-1)

    def _index_keys(self, x):
        return None if self.indexer is None else self.indexer.keys(x)

    def _check_cache(self, index_keys: jax.Array | None):
        """`index_keys`: the cache's (or its prefix's) DSA index keys, or None."""
        if (index_keys is None) != (self.indexer is None):
            raise ValueError("an MLA layer with a DSA indexer needs cache.index_keys, and one "
                             "without must not have them")

    def _expand(self, keys: PackedKeys, dtype):
        """Latents [S, L] -> k_nope [S, H, nope], k_pe [S, rope], v [S, H, v] (kv_b_proj)."""
        kv = self.kv_b_proj(keys.latent[:, :self.kv_lora].astype(dtype))
        kv = kv.reshape(keys.latent.shape[0], self.num_heads, self.nope + self.v_dim)
        return kv[..., :self.nope], keys.latent[:, self.kv_lora:].astype(dtype), kv[..., self.nope:]

    def _attend_dense(self, q_nope, q_pe, keys: PackedKeys, cu_seqlens, cu_keys, seqused,
                      plan):
        """Causal over each sequence's prefix and itself, by `prefill_attention`:
        q [T, H, *] -> [T, H, v]. On a mesh each device attends with its own heads."""
        k_nope, k_pe, v = self._expand(keys, q_nope.dtype)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        k = jnp.concatenate(
            [k_nope, jnp.broadcast_to(k_pe[:, None], (*k_pe.shape[:1], self.num_heads,
                                                     self.rope))], axis=-1)
        implementation = self.attention or default_implementation(
            num_sequences=cu_seqlens.shape[0] - 1, dtype=q.dtype,
            batch_invariant=self.batch_invariant)
        attend = functools.partial(prefill_attention, scale=self.scale,
                                   implementation=implementation)
        if plan is not None:
            s = plan.specs
            # check_vma off: a pallas_call does not declare how its outputs vary.
            attend = jax.shard_map(
                attend, mesh=plan.mesh,
                in_specs=(s.heads, s.heads, s.heads, *[s.replicated] * 3),
                out_specs=(s.heads, s.head_scalars), check_vma=False)
        with jax.named_scope("attention"):
            out, _ = attend(q, k, v, cu_seqlens, cu_keys, seqused)
        return out

    def _dense_or_selected(self, dense, selected, cu_seqlens, prefix_used, *, max_keys: int):
        """DSA: where no query sees more than top_k keys, the indexer would select every
        visible key, so dense attention gives exactly the same result without it. Static
        when no sequence can hold more than top_k keys (max_keys: a sequence's key
        capacity); otherwise decided on the device from the batch (both branches compiled
        once, never retraced on lengths)."""
        if max_keys <= self.indexer.top_k:
            return dense()
        lens = jnp.diff(cu_seqlens)
        widest = jnp.max(jnp.where(lens > 0, prefix_used + lens, 0))
        return lax.cond(widest <= self.indexer.top_k, dense, selected)

    def select_keys(self, index_queries, keys: PackedKeys, cu_keys, seq, pos, valid, plan=None
                    ) -> jax.Array:
        """Each query's top_k causally visible keys by index score, `query_block` queries at
        a time (their [block, S] scores by `index_scores`): int32 [T, min(top_k, S)] rows
        of `keys`, -1 past the visible ones.

        Args: index_queries: `DSAIndexer.queries`; cu_keys int32 [N + 1]: sequence n's keys
          are rows cu_keys[n]:cu_keys[n + 1]; seq, pos, valid int32 / bool [T]: each query's
          sequence, position among its sequence's keys, and realness; plan: the mesh (the
          selection is replicated on it).
        """
        first = jnp.where(valid, cu_keys[seq], 0)
        last = jnp.where(valid, first + pos + 1, 0)  # row t sees keys [first, last)
        top_keys = functools.partial(self.indexer.top_keys_in_ranges,
                                     implementation=self.dsa_implementation)
        if plan is not None:
            # check_vma off: a pallas_call does not declare how its outputs vary.
            top_keys = jax.shard_map(top_keys, mesh=plan.mesh, in_specs=plan.specs.replicated,
                                     out_specs=plan.specs.replicated, check_vma=False)

        def select(index_q, index_w, first, last):
            top, keep = top_keys(index_q, index_w, keys.index, first, last)
            return jnp.where(keep, top, -1)

        return in_query_blocks(select, self.query_block, *index_queries, first, last)

    def _attend_selected(self, q_nope, q_pe, index_queries, keys: PackedKeys, cu_keys, seq,
                         pos, valid, plan):
        """Absorbed over the latents the DSA indexer selects for each query
        (`sparse_attention`: per query, all heads against its top_k latents; no [H, T, S]
        scores): q [T, H, *] -> [T, H, v]. On a mesh each device attends with its own
        heads; the keys and the selection are replicated."""
        top = self.select_keys(index_queries, keys, cu_keys, seq, pos, valid, plan)
        q = self._absorbed_queries(q_nope)
        if self.rope:
            q = jnp.concatenate([q, q_pe], axis=-1)  # [T, H, kv_lora + rope]
        attend = functools.partial(sparse_attention, kv_lora=self.kv_lora, scale=self.scale,
                                   implementation=self.dsa_implementation)
        if plan is not None:
            s = plan.specs
            # check_vma off: a pallas_call does not declare how its outputs vary.
            attend = jax.shard_map(
                attend, mesh=plan.mesh, in_specs=(s.heads, s.replicated, s.replicated),
                out_specs=(s.heads, s.head_scalars), check_vma=False)
        with jax.named_scope("attention"):
            out_latent, _ = attend(q, keys.latent.astype(q.dtype), top)  # [T, H, kv_lora]
        return self._from_latent(out_latent, q_nope.dtype)

    def _kv_b(self, dtype) -> jax.Array:
        """kv_b_proj's kernel as [C, H, nope + v]: W_uk | W_uv of each head."""
        return self.kv_b_proj.kernel[...].astype(dtype).reshape(
            self.kv_lora, self.num_heads, self.nope + self.v_dim)

    def _absorption(self, dtype) -> tuple[jax.Array, jax.Array]:
        """W_uk [C, H, nope] and W_uv [C, H, v], the two halves of kv_b_proj."""
        w = self._kv_b(dtype)
        return w[..., :self.nope], w[..., self.nope:]

    def _absorbed_queries(self, q_nope, kernel: bool = False) -> jax.Array:
        """q_nope [N, H, nope] -> q_abs [N, H, kv_lora] (q_nope W_uk, in its dtype).
        `kernel`: per head in `head_matmul`'s Pallas kernel, whose sums do not depend on N
        (decode on one GPU: MTP's verify runs N + 1 rows per sequence where plain decoding
        runs one); XLA's batched product otherwise."""
        if kernel:
            q_abs = head_matmul(q_nope, self._kv_b(q_nope.dtype), transposed=True,
                                implementation="pallas")
        else:
            w_uk, _ = self._absorption(q_nope.dtype)
            q_abs = jnp.einsum("nhd,chd->nhc", q_nope, w_uk, preferred_element_type=jnp.float32)
        return q_abs.astype(q_nope.dtype)

    def _from_latent(self, out_latent, dtype, kernel: bool = False) -> jax.Array:
        """The attention's output latent [N, H, kv_lora] -> [N, H, v] (W_uv) in dtype;
        `kernel` as in `_absorbed_queries`."""
        latent = out_latent.astype(dtype)
        if kernel:
            out = head_matmul(latent, self._kv_b(dtype), transposed=False, offset=self.nope,
                              width=self.v_dim, implementation="pallas")
        else:
            _, w_uv = self._absorption(dtype)
            out = jnp.einsum("nhc,chv->nhv", latent, w_uv, preferred_element_type=jnp.float32)
        return out.astype(dtype)
