"""ModelConfig presets against DESIGN.md section 4, depth shrinking and validation."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from glmjax.config import PRESETS, ModelConfig


def mla_layers(config):
    """1-based indices of the MLA layers."""
    return [i + 1 for i, kind in enumerate(config.layer_types) if kind == "mla"]


def test_tiny_matches_design():
    c = ModelConfig.preset("tiny")
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (1024, 256, 4)
    assert c.layer_types == ("kda", "kda", "kda", "mla")
    assert (c.kda_num_heads, c.kda_head_dim, c.conv_kernel) == (4, 64, 4)
    assert (
        c.mla_num_heads,
        c.kv_lora_rank,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
        c.q_lora_rank,
    ) == (4, 64, 64, 0, 64, 128)
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts, c.first_dense_layers) == (
        4,
        2,
        1,
        1,
    )
    assert (c.mhc_streams, c.mhc_sinkhorn_iters, c.num_mtp_layers) == (4, 20, 1)
    assert c.dsa_top_k is None
    assert c.dtype == jnp.float32


def test_kimi_matches_design():
    c = ModelConfig.preset("kimi-linear-48b")
    assert (c.hidden_size, c.num_layers) == (2304, 27)
    assert mla_layers(c) == [4, 8, 12, 16, 20, 24, 27]
    assert (c.kda_num_heads, c.kda_head_dim, c.conv_kernel, c.kda_gate) == (32, 128, 4, "softplus")
    assert (
        c.mla_num_heads,
        c.kv_lora_rank,
        c.q_lora_rank,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
    ) == (32, 512, None, 128, 64, 128)
    assert (
        c.num_experts,
        c.num_experts_per_token,
        c.num_shared_experts,
        c.moe_intermediate_size,
        c.first_dense_layers,
    ) == (256, 8, 1, 1024, 1)
    assert (c.swiglu_limit, c.dsa_top_k, c.mhc_streams, c.num_mtp_layers) == (None, None, None, 0)


def test_glm_matches_design():
    c = ModelConfig.preset("glm5.3-flash")
    assert (c.hidden_size, c.num_layers) == (4096, 45)
    assert c.layer_types == ("kda", "kda", "kda", "mla") * 11 + ("kda",)
    assert (c.kda_num_heads, c.kda_head_dim, c.kda_gate, c.kda_gate_bound) == (
        64,
        128,
        "sigmoid_bound",
        -5.0,
    )
    assert (
        c.mla_num_heads,
        c.kv_lora_rank,
        c.q_lora_rank,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
        c.dsa_top_k,
    ) == (64, 512, 1536, 256, 0, 256, 2048)
    assert (
        c.num_experts,
        c.num_experts_per_token,
        c.num_shared_experts,
        c.moe_intermediate_size,
        c.first_dense_layers,
        c.swiglu_limit,
    ) == (288, 8, 1, 2048, 3, 10.0)
    assert (c.mhc_streams, c.mhc_sinkhorn_iters, c.num_mtp_layers) == (4, 20, 1)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_replace_depth_keeps_widths_and_mix(name):
    full = ModelConfig.preset(name)
    experts = min(8, full.num_experts)
    small = full.replace_depth(num_layers=4, num_experts=experts)
    assert small.layer_types == ("kda", "kda", "kda", "mla")
    assert small.num_experts == experts
    assert small.num_experts_per_token <= small.num_experts
    assert 0 < small.num_layers - small.first_dense_layers  # at least one MoE layer
    unchanged = (
        "hidden_size",
        "vocab_size",
        "kda_num_heads",
        "kda_head_dim",
        "mla_num_heads",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "moe_intermediate_size",
        "intermediate_size",
        "dsa_top_k",
        "mhc_streams",
    )
    for field in unchanged:
        assert getattr(small, field) == getattr(full, field), field


def test_replace_depth_other_depths():
    kimi = ModelConfig.preset("kimi-linear-48b")
    assert kimi.replace_depth(8).layer_types.count("mla") == 2
    assert kimi.replace_depth(6).layer_types == ("kda",) * 3 + ("mla", "kda", "mla")
    glm = ModelConfig.preset("glm5.3-flash")
    assert glm.replace_depth(2).layer_types == ("kda", "kda")
    assert glm.replace_depth(2).first_dense_layers == 1
    assert glm.replace_depth(8, num_experts=4).num_experts_per_token == 4


def test_preset_errors_and_frozen():
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        ModelConfig.preset("nope")
    c = ModelConfig.preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 1
    assert hash(c) == hash(ModelConfig.preset("tiny"))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kda_gate": "relu"}, "kda_gate"),
        ({"kda_backend": "cuda"}, "kda_backend"),
        ({"num_experts_per_token": 5}, "num_experts_per_token=5"),
        ({"first_dense_layers": 5}, "first_dense_layers=5"),
        ({"dsa_top_k": 64, "q_lora_rank": None}, "q_lora_rank"),
        ({"mhc_streams": 1}, "mhc_streams"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"batch_invariant": True, "mla_attention": "cudnn"}, "batch_invariant"),
    ],
)
def test_invalid_fields_raise(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(ModelConfig.preset("tiny"), **change)


def test_kda_backend_resolution():
    tiny = ModelConfig.preset("tiny")
    expected = "pallas" if jax.default_backend() == "gpu" else "reference"
    assert tiny.resolved_kda_backend() == expected
    forced = dataclasses.replace(tiny, kda_backend="pallas")
    assert forced.resolved_kda_backend() == "pallas"
