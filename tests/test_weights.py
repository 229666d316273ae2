"""Safetensors loading with the upstream names of both families, and the orbax round trip.

Checkpoints are synthetic: a model with random parameters is written under upstream names by
`upstream_tensors` (the loader's inverse), and a hand-written list of names, shapes and
transforms then overwrites some tensors with fresh values, so a mapping that is wrong the
same way in both directions still fails. Two configs: the tiny preset with the DSA indexer
switched on (GLM naming: KDA, MLA + indexer, mHC, MTP) and a shrunken Kimi-Linear (softplus
gate, no q LoRA, rope 8, plain residual, last layer MLA).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file
from test_layers_oracles import random_module

from glmjax.config import ModelConfig
from glmjax.model import HybridModel
from glmjax.weights import (
    INDEX_FILE,
    load_safetensors,
    restore_params,
    save_params,
    upstream_tensors,
)

GLM = dataclasses.replace(ModelConfig.tiny(), name="tiny-dsa", dsa_top_k=8)
KIMI = dataclasses.replace(
    ModelConfig.kimi_linear_48b(), name="kimi-small", vocab_size=512, hidden_size=128,
    num_layers=4, kda_num_heads=2, kda_head_dim=32, mla_num_heads=2, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=256,
    num_experts=4, num_experts_per_token=2, moe_intermediate_size=64,
    dtype=jnp.float32, param_dtype=jnp.float32)
CASES = {"glm": GLM, "kimi": KIMI}


def T(w):
    return w.T


# Hand-written: upstream name, its shape, the model parameter it lands in (a function of
# the model) and the transform from tensor to parameter.
GLM_NAMES = [
    ("model.embed_tokens.weight", (1024, 256), lambda m: m.embed_tokens.embedding, None),
    ("lm_head.weight", (1024, 256), lambda m: m.lm_head.kernel, T),
    ("model.layers.0.self_attn.q_proj.weight", (256, 256),
     lambda m: m.layers[0].mixer.q_proj.kernel, T),
    ("model.layers.1.self_attn.k_conv1d.weight", (256, 1, 4),
     lambda m: m.layers[1].mixer.conv.weight[256:512], lambda w: w[:, 0]),
    ("model.layers.2.self_attn.A_log", (4,), lambda m: m.layers[2].mixer.A_log, None),
    ("model.layers.0.mlp.gate_proj.weight", (512, 256), lambda m: m.layers[0].mlp.gate_proj.kernel,
     T),
    ("model.layers.3.self_attn.kv_b_proj.weight", (512, 64),
     lambda m: m.layers[3].mixer.kv_b_proj.kernel, T),
    ("model.layers.3.self_attn.indexer.k_norm.weight", (32,),
     lambda m: m.layers[3].mixer.indexer.k_norm.scale, None),
    ("model.layers.1.mlp.gate.weight", (4, 256), lambda m: m.layers[1].mlp.router.kernel, T),
    ("model.layers.1.mlp.experts.2.up_proj.weight", (128, 256),
     lambda m: m.layers[1].mlp.w_up[2], T),
    ("model.layers.2.mlp.experts.3.down_proj.weight", (256, 128),
     lambda m: m.layers[2].mlp.w_down[3], T),
    ("model.layers.0.hc_attn_fn", (24, 1024), lambda m: m.layers[0].mixer_residual.phi, T),
    ("model.layers.3.hc_ffn_base", (24,),
     lambda m: jnp.concatenate([m.layers[3].mlp_residual.b_pre[...],
                                m.layers[3].mlp_residual.b_post[...],
                                m.layers[3].mlp_residual.b_res[...].reshape(-1)]), None),
    ("model.layers.4.eh_proj.weight", (256, 512), lambda m: m.mtp[0].eh_proj.kernel, T),
    ("model.layers.4.self_attn.q_a_proj.weight", (128, 256),
     lambda m: m.mtp[0].block.mixer.q_a_proj.kernel, T),
    ("model.layers.4.shared_head.norm.weight", (256,),
     lambda m: m.mtp[0].shared_head_norm.weight, None),
]
KIMI_NAMES = [
    ("model.layers.0.self_attn.A_log", (1, 1, 2, 1), lambda m: m.layers[0].mixer.A_log,
     lambda w: w.reshape(2)),
    ("model.layers.1.self_attn.v_conv1d.weight", (64, 1, 4),
     lambda m: m.layers[1].mixer.conv.weight[128:], lambda w: w[:, 0]),
    ("model.layers.2.self_attn.f_b_proj.weight", (64, 32),
     lambda m: m.layers[2].mixer.f_b_proj.kernel, T),
    ("model.layers.2.self_attn.dt_bias", (64,), lambda m: m.layers[2].mixer.dt_bias, None),
    ("model.layers.0.mlp.down_proj.weight", (128, 256),
     lambda m: m.layers[0].mlp.down_proj.kernel, T),
    ("model.layers.1.block_sparse_moe.experts.3.w1.weight", (64, 128),
     lambda m: m.layers[1].mlp.w_gate[3], T),
    ("model.layers.2.block_sparse_moe.experts.0.w3.weight", (64, 128),
     lambda m: m.layers[2].mlp.w_up[0], T),
    ("model.layers.2.block_sparse_moe.experts.1.w2.weight", (128, 64),
     lambda m: m.layers[2].mlp.w_down[1], T),
    ("model.layers.3.block_sparse_moe.gate.e_score_correction_bias", (4,),
     lambda m: m.layers[3].mlp.e_score_correction_bias, None),
    ("model.layers.3.block_sparse_moe.shared_experts.down_proj.weight", (128, 64),
     lambda m: m.layers[3].mlp.shared_experts.down_proj.kernel, T),
    ("model.layers.3.self_attn.q_proj.weight", (48, 128), lambda m: m.layers[3].mixer.q_proj.kernel,
     T),
    ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", (40, 128),
     lambda m: m.layers[3].mixer.kv_a_proj_with_mqa.kernel, T),
    ("model.norm.weight", (128,), lambda m: m.norm.weight, None),
]
HAND_WRITTEN = {"glm": GLM_NAMES, "kimi": KIMI_NAMES}

# Every tensor of a Kimi-Linear KDA + MoE layer, as its safetensors index lists them.
KIMI_LAYER_1 = {f"model.layers.1.{name}" for name in [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    *[f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "f_a", "f_b", "b", "g_a", "g_b",
                                              "o")],
    "self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight",
    "self_attn.A_log", "self_attn.dt_bias", "self_attn.o_norm.weight",
    "block_sparse_moe.gate.weight", "block_sparse_moe.gate.e_score_correction_bias",
    *[f"block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w2", "w3")],
    *[f"block_sparse_moe.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")],
]}


def random_model(config, rng) -> HybridModel:
    return random_module(lambda: HybridModel(config, nnx.Rngs(0)), rng)


def write_checkpoint(folder, tensors, num_shards=3, index=True):
    """`tensors` split over `num_shards` files, with an index unless told otherwise."""
    names = sorted(tensors)
    weight_map = {}
    for k, chunk in enumerate(np.array_split(names, num_shards)):
        file = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({str(n): tensors[n] for n in chunk}, str(folder / file))
        weight_map.update({str(n): file for n in chunk})
    if index:
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def params_of(model) -> dict:
    return {".".join(map(str, path)): np.asarray(v.get_value())
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(a, b):
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        np.testing.assert_array_equal(pa[name], pb[name], err_msg=name)


@nnx.jit
def reference_logits(model, tokens):
    return model.reference_forward(tokens)


@pytest.mark.parametrize("family", ["glm", "kimi"])
def test_load_matches_source_tensors_and_logits(family, rng, tmp_path):
    config = CASES[family]
    source = random_model(config, rng)
    tensors = upstream_tensors(source, family)
    fresh = {}
    for name, shape, _, _ in HAND_WRITTEN[family]:
        assert tensors[name].shape == shape, name
        fresh[name] = rng.standard_normal(shape).astype(np.float32)
    loaded = load_safetensors(write_checkpoint(tmp_path, {**tensors, **fresh}), config,
                              family=family)
    for name, _, param, transform in HAND_WRITTEN[family]:
        want = fresh[name] if transform is None else transform(fresh[name])
        np.testing.assert_array_equal(np.asarray(param(loaded)[...]), want, err_msg=name)

    # With the source's own tensors the loaded model is the source, bit for bit.
    loaded = load_safetensors(write_checkpoint(tmp_path, tensors), config, family=family)
    assert_same_params(loaded, source)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, 24), jnp.int32)
    # The loader commits its arrays to the device; the source's committed too, so the
    # two calls share one compile (jit keys on it: ~10 s of CI's cores a family).
    nnx.update(source, jax.device_put(nnx.state(source), jax.devices()[0]))
    np.testing.assert_array_equal(reference_logits(loaded, tokens),
                                  reference_logits(source, tokens))


def test_kimi_layer_names_are_upstreams(rng):
    names = upstream_tensors(random_model(KIMI, rng), "kimi")
    assert {n for n in names if n.startswith("model.layers.1.")} == KIMI_LAYER_1
    assert {n for n in names if not n.startswith("model.layers.")} == {
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


@pytest.mark.parametrize("family", ["glm", "kimi"])
def test_bad_checkpoint_names_every_tensor(family, rng, tmp_path):
    config = CASES[family]
    tensors = upstream_tensors(random_model(config, rng), family)
    names = sorted(tensors)
    missing = [names[3], names[-5]]
    extra = ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.99.mlp.gate.weight"]
    misshaped = [n for n in names if ".experts.1." in n][:1] + [names[7]]
    for name in missing:
        del tensors[name]
    for name in extra:
        tensors[name] = np.zeros((2,), np.float32)
    for name in misshaped:
        tensors[name] = np.zeros(tensors[name].shape[:-1] + (tensors[name].shape[-1] + 1,),
                                 np.float32)
    with pytest.raises(ValueError) as error:
        load_safetensors(write_checkpoint(tmp_path, tensors, index=False), config, family=family)
    message = str(error.value)
    for name in missing + extra + misshaped:
        assert name in message
    assert "missing (2)" in message and "unexpected (2)" in message
    assert "wrong shape (2)" in message


def test_size_one_axes_are_optional_and_mtp_copies_are_ignored(rng, tmp_path):
    source = random_model(GLM, rng)
    tensors = upstream_tensors(source, "glm")
    tensors["model.layers.0.self_attn.A_log"] = tensors["model.layers.0.self_attn.A_log"][
        None, None, :, None]
    tensors["model.layers.0.self_attn.q_conv1d.weight"] = tensors[
        "model.layers.0.self_attn.q_conv1d.weight"][:, 0]
    # DeepSeek-style MTP layers carry their own copies of the embedding and head.
    tensors["model.layers.4.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.4.shared_head.head.weight"] = tensors["lm_head.weight"]
    assert_same_params(load_safetensors(write_checkpoint(tmp_path, tensors, num_shards=1),
                                        GLM, family="glm"), source)


def test_tied_embeddings_ignore_lm_head(rng, tmp_path):
    config = dataclasses.replace(KIMI, tie_word_embeddings=True)
    source = random_model(config, rng)
    tensors = upstream_tensors(source, "kimi")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    assert_same_params(load_safetensors(write_checkpoint(tmp_path, tensors), config,
                                        family="kimi"), source)


def test_naming_without_names_for_the_config():
    with pytest.raises(ValueError, match=r"'kimi' naming .*layers\.0\.mixer_residual\.phi"):
        upstream_tensors(random_model(GLM, np.random.default_rng(0)), "kimi")
    with pytest.raises(ValueError, match="unknown weight family 'llama'"):
        load_safetensors("/nonexistent", GLM, family="llama")


def test_bad_files(rng, tmp_path):
    tensors = upstream_tensors(random_model(KIMI, rng), "kimi")
    folder = write_checkpoint(tmp_path, tensors)
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = "model-gone.safetensors"
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-gone.safetensors"):
        load_safetensors(folder, KIMI, family="kimi")
    (folder / INDEX_FILE).unlink()
    save_file({"model.norm.weight": tensors["model.norm.weight"]},
              str(folder / "model-extra.safetensors"))
    with pytest.raises(ValueError, match=r"two files.*model\.norm\.weight"):
        load_safetensors(folder, KIMI, family="kimi")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_safetensors(tmp_path / "empty", KIMI, family="kimi")


def test_cast_to_param_dtype(rng, tmp_path):
    config = dataclasses.replace(KIMI, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    tensors = upstream_tensors(random_model(KIMI, rng), "kimi")  # fp32 tensors
    loaded = load_safetensors(write_checkpoint(tmp_path, tensors), config, family="kimi")
    kernel = loaded.layers[0].mixer.q_proj.kernel[...]
    assert kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(kernel),
        tensors["model.layers.0.self_attn.q_proj.weight"].T.astype(ml_dtypes.bfloat16))
    a_log = loaded.layers[0].mixer.A_log[...]  # the layer keeps it fp32
    assert a_log.dtype == jnp.float32
    np.testing.assert_array_equal(a_log, tensors["model.layers.0.self_attn.A_log"].reshape(-1))


@pytest.mark.parametrize("config", [GLM, dataclasses.replace(
    KIMI, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)], ids=["glm-fp32", "kimi-bf16"])
def test_orbax_round_trip_is_bit_exact(config, rng, tmp_path):
    model = random_model(config, rng)
    save_params(tmp_path / "params", model)
    assert_same_params(restore_params(tmp_path / "params", config), model)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    restored = restore_params(tmp_path / "params", config,
                              sharding=lambda name, shape: replicated)
    assert_same_params(restored, model)
    assert restored.layers[0].mixer.q_proj.kernel[...].sharding == replicated
