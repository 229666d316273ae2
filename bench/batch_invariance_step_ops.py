"""The ops of a decode / verify step past the layers' own (`bench.batch_invariance_ops` holds
the `Op` contract and the KDA and MoE ops): the LM head, the norms, mHC, the MLA decode
attention and layer, the sampler and a whole decode step; and `OPS`, every op by name.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from bench.batch_invariance_ops import (
    Op,
    Shapes,
    dense_mlp,
    kda_decode_layer,
    kda_fused_step,
    kda_in,
    kda_o_proj,
    kda_pools,
    keys,
    mla_layer,
    module_op,
    moe_in,
    moe_whole,
    normal,
    routed_experts,
    router,
    rows_of,
    shared_down,
)
from glmjax.batch import DecodeBatch
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.layers.mhc import HyperConnection
from glmjax.layers.norms import GatedRMSNorm, RMSNorm
from glmjax.layers.paged_cache import MLACache
from glmjax.layers.projection import on_one_gpu, projection
from glmjax.model import HybridModel, decode_step
from glmjax.random_weights import random_model
from glmjax.state_pool import StatePool
from glmjax.xla_options import STEP_OPTIONS
from pallas_kernels.mla_decode import mla_decode
from pallas_kernels.mla_decode_pallas import select_tiling
from serving.sampling import SamplerVariant, SamplingTensors, sample


class LogitsOnly(nnx.Module):
    """What `HybridModel.logits` reads of the model: the LM head (or the tied embedding)."""

    logits = HybridModel.logits

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        tied = config.tie_word_embeddings
        self.lm_head = None if tied else projection(
            config, config.hidden_size, config.vocab_size, rngs=rngs, out_dtype=jnp.float32)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=config.dtype,
                                      param_dtype=config.param_dtype, rngs=rngs) if tied else None


def lm_head(s: Shapes) -> Op:
    """`HybridModel.logits`: the normed hidden state to fp32 logits."""
    c = s.config
    head = LogitsOnly(c, nnx.Rngs(s.seed + 4))
    (k,) = keys(s.seed, "lm_head", 1)
    hidden = normal(k, (s.max_rows, c.hidden_size), c.dtype)
    notes = (lambda rows: {"stream": head.lm_head.streams(rows)}) if head.lm_head else (
        lambda rows: {})
    return module_op(head, lambda m, h: {"logits": m.logits(h)}, rows_of(hidden), notes)


def final_norm(s: Shapes) -> Op:
    """`RMSNorm` over the hidden size (the final norm, every block's input norms)."""
    c = s.config
    k1, k2 = keys(s.seed, "final_norm", 2)
    norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=c.param_dtype)
    norm.weight[...] = normal(k1, (c.hidden_size,), c.param_dtype, 0.5) + 1
    x = normal(k2, (s.max_rows, c.hidden_size), c.dtype, 3.0)
    return module_op(norm, lambda m, x: {"y": m(x)}, rows_of(x))


def gated_norm(s: Shapes) -> Op:
    """`GatedRMSNorm`, KDA's output norm on its per-op decode path: [R, H, K]."""
    c = s.config
    k1, k2 = keys(s.seed, "gated_norm", 2)
    norm = GatedRMSNorm(c.kda_head_dim, eps=c.rms_norm_eps, param_dtype=c.param_dtype)
    shape = (s.max_rows, c.kda_num_heads, c.kda_head_dim)
    o, gate = normal(k1, shape, c.dtype), normal(k2, shape, c.dtype)
    return module_op(norm, lambda m, o, g: {"y": m(o, g)}, rows_of(o, gate))


def mhc(s: Shapes) -> Op:
    """`HyperConnection.read` then `write` (glm5.3-flash's mHC around a sublayer): the
    fused fp32 projection of the normed streams, the maps, the mixes."""
    c = s.config
    if c.mhc_streams is None:
        raise ValueError(f"{c.name} has no mHC")
    module = HyperConnection(c.hidden_size, c.mhc_streams, sinkhorn_iters=c.mhc_sinkhorn_iters,
                             eps=c.rms_norm_eps, rngs=nnx.Rngs(s.seed + 5))
    k1, k2 = keys(s.seed, "mhc", 2)
    streams = normal(k1, (s.max_rows, c.mhc_streams, c.hidden_size), c.dtype)
    y = normal(k2, (s.max_rows, c.hidden_size), c.dtype)

    def call(m, streams, y):
        x, mixing = m.read(streams)
        return {"x": x, "streams": m.write(streams, y, mixing)}

    return module_op(module, call, rows_of(streams, y))


def mla_cache(s: Shapes, key) -> tuple[MLACache, jax.Array, jax.Array]:
    """A random paged cache holding max_rows sequences, row i in blocks i M .. i M + M - 1
    (M blocks of the context), and each row's context length (its new token's position)."""
    c = s.config
    block, blocks = c.kv_block_size, -(-s.context // c.kv_block_size)
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (s.max_rows * blocks, block)
    latent = normal(k1, (*shape, c.kv_lora_rank + c.qk_rope_head_dim), c.dtype)
    index = None if c.dsa_top_k is None else normal(k2, (*shape, c.dsa_head_dim), c.dtype)
    table = jnp.arange(s.max_rows * blocks, dtype=jnp.int32).reshape(s.max_rows, blocks)
    lens = jax.random.randint(k3, (s.max_rows,), s.context // 2, s.context).astype(jnp.int32)
    return MLACache(latent, index), table, lens


def mla_attention(s: Shapes) -> Op:
    """`mla_decode` as `MLA.decode` calls it (the Pallas kernel on one GPU): absorbed
    queries against each row's own paged context."""
    c = s.config
    k1, k2, k3 = keys(s.seed, "mla_attention", 3)
    cache, table, lens = mla_cache(s, k1)
    heads, rope = c.mla_num_heads, c.qk_rope_head_dim
    q_abs = normal(k2, (s.max_rows, heads, c.kv_lora_rank), c.dtype)
    q_pe = normal(k3, (s.max_rows, heads, rope), c.dtype) if rope else None
    kernel = on_one_gpu() and c.kv_block_size % 16 == 0
    scale = (c.qk_nope_head_dim + rope) ** -0.5

    @functools.partial(jax.jit, compiler_options=STEP_OPTIONS)
    def program(pages, q_abs, q_pe, table, lens):
        out, lse = mla_decode(q_abs, q_pe, pages, table, lens, scale=scale,
                              implementation="pallas" if kernel else "xla")
        return {"out": out, "lse": lse}

    def notes(rows):
        if not kernel:
            return {"pallas": False}
        return {"pallas": True, "split": select_tiling(c.kv_block_size).split}

    def inputs(indices):
        i = jnp.asarray(indices, jnp.int32)
        return q_abs[i], None if q_pe is None else q_pe[i], table[i], lens[i]

    return Op(program, cache.latent, inputs, notes)


def mla_in(s: Shapes) -> Op:
    """`MLA`'s input projections on a prefill's rows: the queries (q_proj, or q_a, its norm
    and q_b) and the cached latent (kv_a_proj_with_mqa, the latent's norm)."""
    c, layer = s.config, mla_layer(s.config, s.seed)
    (k,) = keys(s.seed, "mla_in", 1)
    x = normal(k, (s.max_rows, c.hidden_size), c.dtype)

    def project(m, x):
        q_nope, q_pe, _ = m._queries(x)
        return dict(q_nope=q_nope, q_pe=q_pe, latent=m._latent(x))

    return module_op(layer, project, rows_of(x))


def mla_decode_layer(s: Shapes) -> Op:
    """`MLA.decode`: the whole layer, one token per row, its latent written to the cache."""
    c, layer = s.config, mla_layer(s.config, s.seed)
    k1, k2 = keys(s.seed, "mla_layer", 2)
    cache, table, lens = mla_cache(s, k1)
    x = normal(k2, (s.max_rows, c.hidden_size), c.dtype)

    def call(m, x, table, lens, cache):
        y, cache = m.decode(x, cache, table, lens)
        rows = jnp.arange(x.shape[0])
        written = cache.latent[table[rows, lens // c.kv_block_size], lens % c.kv_block_size]
        return {"y": y, "latent": written}

    batched = rows_of(x, table, lens)
    return module_op(layer, call, lambda i: (*batched(i), cache),
                     lambda rows: {"pallas": on_one_gpu() and c.kv_block_size % 16 == 0})


def sampler(s: Shapes) -> Op:
    """`serving.sampling.sample` of greedy rows (the variant an all-greedy batch runs)."""
    c = s.config
    (k,) = keys(s.seed, "sampler", 1)
    logits = normal(k, (s.max_rows, c.vocab_size), jnp.float32, 3.0)
    variant = SamplerVariant(filter=False, top=False, draw=False)

    @functools.partial(jax.jit, compiler_options=STEP_OPTIONS)
    def program(_, logits):
        greedy = SamplingTensors.host([(0.0, 0, 1.0, 0, 0, 0)] * logits.shape[0],
                                      logits.shape[0])
        out = sample(logits, SamplingTensors(*map(jnp.asarray, greedy)), variant)
        return {"token": out.tokens, "logprob": out.logprobs}

    return Op(program, None, rows_of(logits), lambda rows: {})


def model_config(s: Shapes) -> ModelConfig:
    """The decode_step op's model: the preset cut to `num_layers` (and `num_experts`)."""
    return s.config.replace_depth(s.num_layers, s.num_experts)


def decode_whole(s: Shapes) -> Op:
    """`glmjax.model.decode_step` of a model cut to a few layers: every row at its own
    state slot and context; the logits and the greedy token."""
    c = model_config(s)
    model = random_model(c, s.seed)
    ks = keys(s.seed, "decode_step", 4)
    mla, table, lens = mla_cache(dataclasses.replace(s, config=c), ks[0])
    kinds = c.layer_types
    caches = Caches(
        tuple(StatePool(*kda_pools(c, s.max_rows, jax.random.fold_in(ks[1], i)))
              for i, kind in enumerate(kinds) if kind == "kda"),
        tuple(MLACache(normal(jax.random.fold_in(ks[2], i), mla.latent.shape, c.dtype),
                       mla.index_keys) for i, kind in enumerate(kinds) if kind == "mla"))
    tokens = jax.random.randint(ks[3], (s.max_rows,), 0, c.vocab_size).astype(jnp.int32)

    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, compiler_options=STEP_OPTIONS)
    def program(state, tokens, lens, slots, table, caches):
        out = decode_step((graphdef, state), caches, DecodeBatch(tokens, lens, slots, table))
        return {"logits": out.logits, "token": jnp.argmax(out.logits, axis=-1)}

    def inputs(indices):
        i = jnp.asarray(indices, jnp.int32)
        return tokens[i], lens[i], i, table[i], caches

    return Op(program, state, inputs, lambda rows: {"model": c.name})


OPS: dict[str, Callable[[Shapes], Op]] = {
    "kda_in": kda_in, "kda_o_proj": kda_o_proj, "kda_fused_step": kda_fused_step,
    "kda_layer": kda_decode_layer, "moe_in": moe_in, "router": router,
    "routed_experts": routed_experts, "shared_down": shared_down, "moe_layer": moe_whole,
    "dense_mlp": dense_mlp, "final_norm": final_norm, "gated_norm": gated_norm,
    "lm_head": lm_head, "mla_in": mla_in, "mla_attention": mla_attention,
    "mla_layer": mla_decode_layer,
    "mhc": mhc, "sampler": sampler, "decode_step": decode_whole,
}  # fmt: skip
