"""Useful FLOPs of a prefill step, and the bf16 peaks MFU is measured against.

A step is a list of `Span`s: sequence n computes `tokens` new positions after `prefix`
positions already in its caches. "Useful" means the work the model's maths needs, whatever
an implementation does beyond it (DESIGN section 7):
- routed experts at top-k only, never all experts;
- attention over causally visible keys only (the prefix plus the query's own position and
  those before it in the span), and with a DSA indexer over its top-k keys only;
- the KDA scan in the chunked form of DESIGN section 2, triangles counted as triangles.

Every count is 2 x multiply-accumulates of the matrix products. Elementwise work (norms,
the short convolution, gates, softmax exponentials, SiLU, the Sinkhorn iterations) is left
out: it is a few percent at the real shapes and no tensor core runs it.

`step_flops` returns one number per term; `CATEGORY` maps each term to a row of the
per-op profile (`bench.profile`), so the two line up.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

from glmjax.config import ModelConfig

KDA_CHUNK = 64  # the chunk of `pallas_kernels.kda_prefill`


class Span(NamedTuple):
    """One sequence of a packed prefill step."""

    tokens: int  # new positions computed in this step
    prefix: int = 0  # positions already cached before them


def causal_pairs(span: Span, top_k: int | None = None) -> int:
    """(query, key) pairs attention needs: query i of the span (0-based) sees the prefix and
    positions 0..i of the span, ``prefix + i + 1`` keys, or at most `top_k` of them under a
    DSA indexer."""
    n, p = span.tokens, span.prefix
    if top_k is None:
        return n * p + n * (n + 1) // 2
    # visible(i) = p + i + 1 <= top_k  <=>  i <= top_k - p - 1
    below = max(0, min(n, top_k - p))  # queries seeing fewer than top_k keys
    return below * p + below * (below + 1) // 2 + (n - below) * top_k


def kda_chunk_macs(c: int, heads: int, k: int, v: int) -> int:
    """Multiply-accumulates of one chunk of c tokens of the chunked KDA form (DESIGN
    section 2), per step of the form, all heads:
    - L = strictly lower (k e^G)(k e^-G)^T:            c(c-1)/2 * K
    - T = (I + L)^-1 by forward substitution:            c^3 / 6
    - W = T diag(beta)(k e^G), U = T diag(beta) v:       c(c+1)/2 * (K + V)  (T lower)
    - Vnew = U - W S; inter-chunk output (q e^G) S:      2 * c * K * V
    - Aqk = lower-inclusive (q e^G)(k e^-G)^T:           c(c+1)/2 * K
    - intra-chunk output tril(Aqk) Vnew:                 c(c+1)/2 * V
    - state update (k e^(G_last - G))^T Vnew:            c * K * V
    """
    tri, stri = c * (c + 1) // 2, c * (c - 1) // 2
    per_head = (stri * k + c ** 3 // 6 + tri * (k + v) + 2 * c * k * v + tri * k + tri * v
                + c * k * v)
    return heads * per_head


def kda_scan_flops(config: ModelConfig, span: Span, chunk: int = KDA_CHUNK) -> int:
    """One KDA layer's scan over a span: full chunks of `chunk` tokens from the span's
    start, then the remainder (the kernel chunks each sequence from its own start)."""
    full, rest = divmod(span.tokens, chunk)
    h, d = config.kda_num_heads, config.kda_head_dim
    return 2 * (full * kda_chunk_macs(chunk, h, d, d) + kda_chunk_macs(rest, h, d, d))


def kda_projection_flops(config: ModelConfig) -> int:
    """Per token, one KDA layer: q, k, v (D -> H K each), the low-rank decay gate
    f_a (D -> K) and f_b (K -> H K), beta (D -> H), the low-rank output gate g_a, g_b,
    and o_proj (H V -> D)."""
    d, h, k = config.hidden_size, config.kda_num_heads, config.kda_head_dim
    return 2 * (3 * d * h * k + 2 * (d * k + k * h * k) + d * h + h * k * d)


def mla_query_flops(config: ModelConfig) -> int:
    """Per token: the query (q_a D -> q_lora, q_b q_lora -> H (nope + rope), or one
    D -> H (nope + rope) without a query LoRA), the latent kv_a (D -> kv_lora + rope) and
    o_proj (H v -> D)."""
    d, h = config.hidden_size, config.mla_num_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    if config.q_lora_rank is None:
        query = d * h * qk
    else:
        query = d * config.q_lora_rank + config.q_lora_rank * h * qk
    latent = d * (config.kv_lora_rank + config.qk_rope_head_dim)
    return 2 * (query + latent + h * config.v_head_dim * d)


def mla_key_expansion_flops(config: ModelConfig) -> int:
    """Per key: kv_b (kv_lora -> H (nope + v)). Prefill attends in the non-absorbed form, so
    a step expands every key it attends, its cached prefix included."""
    h = config.mla_num_heads
    return 2 * config.kv_lora_rank * h * (config.qk_nope_head_dim + config.v_head_dim)


def mla_attention_flops(config: ModelConfig, span: Span) -> int:
    """Scores (nope + rope per head) and the value sum (v per head) over the causally
    visible pairs (`causal_pairs`), the DSA top-k when there is an indexer."""
    per_pair = 2 * config.mla_num_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim
                                           + config.v_head_dim)
    return per_pair * causal_pairs(span, config.dsa_top_k)


def dsa_projection_flops(config: ModelConfig) -> int:
    """Per token, the indexer's projections: wq_b (q_lora -> H_I d_I), wk (D -> d_I) and
    the head weights (D -> H_I)."""
    h, d_i = config.dsa_num_heads, config.dsa_head_dim
    return 2 * (config.q_lora_rank * h * d_i + config.hidden_size * (d_i + h))


def dsa_score_flops(config: ModelConfig, span: Span) -> int:
    """Index scores over every causally visible pair (the indexer itself is dense):
    H_I dots of d_I, then the head-weighted sum (H_I more)."""
    h, d_i = config.dsa_num_heads, config.dsa_head_dim
    return 2 * h * (d_i + 1) * causal_pairs(span)


def mlp_flops(config: ModelConfig, inter: int) -> int:
    """Per token, a SwiGLU MLP of width `inter`: gate and up (D -> inter), down (back)."""
    return 2 * 3 * config.hidden_size * inter


def routed_expert_flops(config: ModelConfig) -> int:
    """Per token: its top-k experts only, each a SwiGLU MLP of moe_intermediate_size."""
    return config.num_experts_per_token * mlp_flops(config, config.moe_intermediate_size)


def router_flops(config: ModelConfig) -> int:
    """Per token: the router's scores, D -> E."""
    return 2 * config.hidden_size * config.num_experts


def mhc_flops(config: ModelConfig) -> int:
    """Per token, one hyper-connection (two per layer) over n streams of D: the fused map
    projection (n D -> 2n + n^2), the read H_pre X (n D), the residual mix H_res X
    (n^2 D) and the write H_post^T y (n D)."""
    n, d = config.mhc_streams, config.hidden_size
    return 2 * (n * d * (2 * n + n * n) + n * d + n * n * d + n * d)


def lm_head_flops(config: ModelConfig) -> int:
    """Per span: the LM head on its last token only (D -> vocab), as the step computes."""
    return 2 * config.hidden_size * config.vocab_size


CATEGORY = {
    "kda_projections": "projections", "mla_projections": "projections",
    "mla_key_expansion": "projections", "dsa_projections": "projections",
    "dense_mlp": "projections", "router": "projections", "lm_head": "projections",
    "kda_scan": "kda_kernel", "mla_attention": "mla_attention", "dsa_scores": "dsa_indexer",
    "routed_experts": "moe", "shared_experts": "shared_experts", "mhc": "mhc",
}  # fmt: skip
"""The profile row of every term of `step_flops`."""


def step_flops(config: ModelConfig, spans: Sequence[Span], *,
               kda_chunk: int = KDA_CHUNK) -> dict[str, int]:
    """Useful FLOPs of one prefill step, by term (the keys of `CATEGORY`).

    Raises:
      ValueError: a span with negative tokens or prefix.
    """
    for span in spans:
        if span.tokens < 0 or span.prefix < 0:
            raise ValueError(f"span {span} has a negative length")
    spans = [s for s in spans if s.tokens]
    tokens = sum(s.tokens for s in spans)
    keys = sum(s.tokens + s.prefix for s in spans)
    out = collections.Counter({term: 0 for term in CATEGORY})
    for i, kind in enumerate(config.layer_types):
        if kind == "kda":
            out["kda_projections"] += tokens * kda_projection_flops(config)
            out["kda_scan"] += sum(kda_scan_flops(config, s, kda_chunk) for s in spans)
        else:
            out["mla_projections"] += tokens * mla_query_flops(config)
            out["mla_key_expansion"] += keys * mla_key_expansion_flops(config)
            out["mla_attention"] += sum(mla_attention_flops(config, s) for s in spans)
            if config.dsa_top_k is not None:
                out["dsa_projections"] += tokens * dsa_projection_flops(config)
                out["dsa_scores"] += sum(dsa_score_flops(config, s) for s in spans)
        if i < config.first_dense_layers:
            out["dense_mlp"] += tokens * mlp_flops(config, config.intermediate_size)
        else:
            out["router"] += tokens * router_flops(config)
            out["routed_experts"] += tokens * routed_expert_flops(config)
            shared = config.moe_intermediate_size * config.num_shared_experts
            out["shared_experts"] += tokens * mlp_flops(config, shared)
        if config.mhc_streams is not None:
            out["mhc"] += 2 * tokens * mhc_flops(config)
    out["lm_head"] += len(spans) * lm_head_flops(config)
    return dict(out)


def by_category(terms: dict[str, int]) -> dict[str, int]:
    """`step_flops` summed into the profile's rows."""
    rows = collections.Counter()
    for term, flops in terms.items():
        rows[CATEGORY[term]] += flops
    return dict(rows)


# Dense bf16 tensor-core peaks (FLOP/s), no sparsity; keys are substrings of
# `jax.Device.device_kind`, most specific first.
PEAK_BF16 = {
    "H200": 989e12,  # datasheet (SXM); the same SM array and clocks as the H100 SXM
    "H100 PCIe": 756e12,  # datasheet
    "H100": 989e12,  # datasheet (SXM)
    "A100": 312e12,  # datasheet
    # Derived, no datasheet figure: "1 PFLOP FP4 with sparsity" / 2 (dense) / 4 (FP4 ->
    # BF16). Half that if sm_121 accumulates bf16 into fp32 at half rate, as GeForce
    # Blackwell parts do: measure before trusting an MFU on it.
    "GB10": 125e12,
}
# Measured: the best bf16 matmul XLA ran on the device (issue 17: ~790 TFLOP/s on one
# H200, jax 0.11.2), the ceiling a whole step can hope to approach.
MEASURED_MATMUL_BF16 = {"H200": 790e12}


def device_peak(device_kind: str, table: dict[str, float] = PEAK_BF16) -> float | None:
    """The entry of `table` whose key is in `device_kind` (None: unknown device, e.g. CPU)."""
    return next((peak for key, peak in table.items() if key in device_kind), None)
