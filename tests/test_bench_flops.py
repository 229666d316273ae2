"""Useful FLOPs of a prefill step (`bench.flops`): a hand count on the tiny preset, the
causal pair count against enumeration, and XLA's own cost analysis on a dense config."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from bench.flops import (
    PEAK_BF16,
    Span,
    by_category,
    causal_pairs,
    device_peak,
    mlp_flops,
    step_flops,
)
from bench.model_prefill import cold_prompt_batch
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.layers.moe import MLP
from glmjax.model import HybridModel, prefill


def test_tiny_preset_hand_count():
    """tiny: D 256, [KDA x3, MLA], KDA 4 x 64, MLA 4 heads (q_lora 128, kv_lora 64, nope 64,
    v 64), dense first layer (512), then 4 experts top-2 (128) + 1 shared, mHC n 4,
    vocab 1024. One cold span of 64 tokens (one KDA chunk)."""
    flops = step_flops(ModelConfig.tiny(), [Span(64)])

    # Per token and layer, multiply-accumulates: q, k, v 3*256*256; f_a, f_b, g_a, g_b
    # 4*256*64; beta 256*4; o 256*256.
    assert flops["kda_projections"] == 2 * 64 * 3 * (196608 + 65536 + 1024 + 65536)
    # q_a 256*128, q_b 128*256, kv_a 256*64, o 256*256; kv_b 64*4*128 per key.
    assert flops["mla_projections"] == 2 * 64 * (32768 + 32768 + 16384 + 65536)
    assert flops["mla_key_expansion"] == 2 * 64 * 32768
    # 64 * 65 / 2 causal pairs, 4 heads x (64 score + 64 value) each.
    assert flops["mla_attention"] == 2 * 2080 * 4 * 128
    # One chunk of 64, per head: L 2016*64, inverse 64^3/6, W and U 2080*128, Vnew and the
    # inter-chunk output 2*64*64*64, Aqk 2080*64, intra output 2080*64, state 64*64*64.
    per_head = 129024 + 43690 + 266240 + 524288 + 133120 + 133120 + 262144
    assert flops["kda_scan"] == 2 * 3 * 4 * per_head
    assert flops["dense_mlp"] == 2 * 64 * 3 * 256 * 512
    assert flops["router"] == 2 * 64 * 3 * 256 * 4
    assert flops["routed_experts"] == 2 * 64 * 3 * 2 * 3 * 256 * 128  # top-2 of 4 only
    assert flops["shared_experts"] == 2 * 64 * 3 * 3 * 256 * 128
    # 8 hyper-connections: phi 1024*24, read 1024, mix 16*256, write 1024.
    assert flops["mhc"] == 2 * 64 * 8 * (24576 + 1024 + 4096 + 1024)
    assert flops["lm_head"] == 2 * 256 * 1024  # the span's last token
    assert flops["dsa_projections"] == flops["dsa_scores"] == 0
    assert sum(by_category(flops).values()) == sum(flops.values())


@pytest.mark.parametrize("tokens,prefix,top_k", [
    (1, 0, None), (7, 0, None), (5, 9, None), (12, 3, 8), (12, 0, 4), (3, 20, 8), (6, 2, 100),
])  # fmt: skip
def test_causal_pairs_count_what_each_query_sees(tokens, prefix, top_k):
    visible = [prefix + i + 1 for i in range(tokens)]
    if top_k is not None:
        visible = [min(v, top_k) for v in visible]
    assert causal_pairs(Span(tokens, prefix), top_k) == sum(visible)


def test_packed_spans_add_and_the_kda_scan_chunks_each_span():
    config = ModelConfig.tiny()
    one, other = step_flops(config, [Span(100, 64)]), step_flops(config, [Span(30)])
    both = step_flops(config, [Span(100, 64), Span(30), Span(0, 5)])  # an empty span: nothing
    assert both == {k: one[k] + other[k] for k in both}
    # 100 tokens: a chunk of 64 and one of 36, not 100 / 64 chunks of 64.
    assert step_flops(config, [Span(100)])["kda_scan"] == (
        step_flops(config, [Span(64)])["kda_scan"] + step_flops(config, [Span(36)])["kda_scan"])
    with pytest.raises(ValueError, match="negative"):
        step_flops(config, [Span(-1)])


def test_dsa_counts_top_k_attention_and_dense_index_scores():
    config = dataclasses.replace(ModelConfig.tiny(), dsa_top_k=16)
    flops = step_flops(config, [Span(64)])
    pairs_top = sum(min(i + 1, 16) for i in range(64))
    assert flops["mla_attention"] == 2 * pairs_top * 4 * 128
    assert flops["dsa_scores"] == 2 * 2080 * 4 * (32 + 1)  # 4 index heads of 32


def test_device_peaks():
    assert device_peak("NVIDIA H200") == 989e12 == PEAK_BF16["H200"]
    assert device_peak("NVIDIA H100 PCIe") == 756e12
    assert device_peak("NVIDIA GB10") == PEAK_BF16["GB10"]
    assert device_peak("cpu") is None


def test_mlp_count_matches_xla_cost_analysis():
    """A matmul-only layer: XLA's count is ours plus the SiLU and product (0.3%)."""
    config = ModelConfig.tiny()
    mlp = MLP(config, 512, rngs=nnx.Rngs(0))
    x = jax.ShapeDtypeStruct((128, 256), np.float32)
    xla = jax.jit(lambda m, x: m(x)).lower(mlp, x).compile().cost_analysis()["flops"]
    assert xla == pytest.approx(128 * mlp_flops(config, 512), rel=0.01)


def test_dense_model_step_roughly_matches_xla_cost_analysis():
    """No MoE (XLA would count a ragged_dot over every expert): XLA counts the attention's
    full score matrix, the reference KDA scan's elementwise decay products and every
    elementwise op, so it lands somewhat above the useful count (1.11x when written)."""
    config = dataclasses.replace(ModelConfig.tiny(), first_dense_layers=4)
    tokens = 256
    abstract = nnx.split(nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0))))
    batch = cold_prompt_batch(np.zeros(tokens, np.int64))
    caches = jax.eval_shape(lambda: Caches.init(config, num_state_slots=5, num_kv_blocks=1))
    xla = prefill.lower(abstract, caches, batch).compile().cost_analysis()["flops"]
    ours = sum(step_flops(config, [Span(tokens)]).values())
    assert 1.0 <= xla / ours <= 1.25
