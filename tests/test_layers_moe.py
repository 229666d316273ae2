"""MoE (sigmoid router, biased selection, grouped-GEMM experts) and the SwiGLU MLP against
per-token, per-expert float64 loops, on every grouped-GEMM implementation that runs on the
CPU (ours in Pallas interpret mode, with and without its fusions)."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_layers_oracles import f64, moe_oracle, random_module, swiglu_oracle

from glmjax.config import ModelConfig
from glmjax.layers.moe import MLP, MoE, swiglu
from glmjax.sharding import ShardingPlan, make_mesh
from pallas_kernels import gmm_tokamax, moe_experts

projection_module = sys.modules["glmjax.layers.projection"]  # the package exports the function
moe_module = sys.modules["glmjax.layers.moe"]

VARIANTS = {
    "tiny": {},  # 4 experts top-2, clamp 10
    "kimi-like": {
        "num_experts": 7,
        "num_experts_per_token": 3,
        "swiglu_limit": None,
        "routed_scaling_factor": 2.446,
    },
}


def moe_params(moe: MoE) -> dict:
    return {
        "router": f64(moe.router.kernel),
        "bias": f64(moe.e_score_correction_bias),
        "w_gate": f64(moe.w_gate),
        "w_up": f64(moe.w_up),
        "w_down": f64(moe.w_down),
        "shared_gate": f64(moe.shared_experts.gate_proj.kernel),
        "shared_up": f64(moe.shared_experts.up_proj.kernel),
        "shared_down": f64(moe.shared_experts.down_proj.kernel),
    }


# (moe_backend, fusions of the Pallas path)
BACKENDS = {
    "ragged_dot": ("ragged_dot", ()),
    "pallas-plain": ("pallas", ()),
    "pallas-fused": ("pallas", moe_experts.FUSIONS),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_moe_matches_per_token_loop(rng, monkeypatch, variant, backend):
    moe_backend, fusions = BACKENDS[backend]
    monkeypatch.setattr(moe_experts, "DEFAULT_FUSIONS", fusions)
    # The Pallas backends route as on one GPU (the routing kernel in interpret mode).
    monkeypatch.setattr(moe_module, "on_one_gpu", lambda: moe_backend == "pallas")
    config = dataclasses.replace(
        ModelConfig.preset("tiny"), moe_backend=moe_backend, **VARIANTS[variant]
    )
    moe = random_module(lambda: MoE(config, rngs=nnx.Rngs(0)), rng)
    x = (rng.normal(size=(19, config.hidden_size)) * 4).astype(np.float32)  # reach the clamp
    y = nnx.jit(lambda m, x: m(x))(moe, jnp.asarray(x))
    expected = moe_oracle(
        moe_params(moe),
        f64(x),
        top_k=config.num_experts_per_token,
        scaling=config.routed_scaling_factor,
        limit=config.swiglu_limit,
    )
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)


def test_few_rows_on_the_stream_route(rng, monkeypatch):
    """Rows of a decode step as on one GPU (forced on the CPU, interpret mode): the shared
    expert's gate and up and the router in one stream launch (the logits in fp32, as their
    partial sums), the Pallas routing adding them, the per-row grouped GEMMs; against the
    float64 loop."""
    monkeypatch.setattr(projection_module, "default_implementation",
                        lambda rows, d_in, d_out: "stream")
    launches = []
    real = projection_module.stream_matmul
    monkeypatch.setattr(projection_module, "stream_matmul",
                        lambda x, weights, **kw: launches.append(len(weights))
                        or real(x, weights, **kw))
    monkeypatch.setattr(moe_experts, "sort_by_expert", None)  # the per-row schedule only
    routing = []
    monkeypatch.setattr(moe_module, "on_one_gpu", lambda: routing.append(1) or True)
    config = dataclasses.replace(ModelConfig.preset("tiny"), moe_backend="pallas",
                                 num_experts=16, num_experts_per_token=3)
    moe = random_module(lambda: MoE(config, rngs=nnx.Rngs(0)), rng)
    x = (rng.normal(size=(2, config.hidden_size)) * 4).astype(np.float32)
    y = nnx.jit(lambda m, x: m(x))(moe, jnp.asarray(x))
    assert launches[0] == 3  # gate, up and router together; then the shared down
    assert routing  # the Pallas routing, of the router's partial sums
    expected = moe_oracle(moe_params(moe), f64(x), top_k=3,
                          scaling=config.routed_scaling_factor, limit=config.swiglu_limit)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)


def test_router_weights_renormalised_and_bias_only_selects(rng):
    config = ModelConfig.preset("tiny")
    moe = random_module(lambda: MoE(config, rngs=nnx.Rngs(0)), rng)
    x = jnp.asarray(rng.normal(size=(5, config.hidden_size)), jnp.float32)
    moe.e_score_correction_bias[...] = jnp.array([100.0, 100.0, 0, 0])  # forces experts 0, 1
    weights, experts = moe.route(moe.router(x))
    np.testing.assert_array_equal(np.sort(experts, axis=-1), [[0, 1]] * 5)
    np.testing.assert_allclose(weights.sum(-1), config.routed_scaling_factor, rtol=1e-6)
    scores = 1 / (1 + np.exp(-f64(x) @ f64(moe.router.kernel)))
    chosen = np.take_along_axis(scores, np.asarray(experts), -1)
    np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True) * 2.5, rtol=1e-5)


@pytest.mark.parametrize("limit", [None, 10.0])
def test_dense_mlp(rng, limit):
    config = ModelConfig.preset("tiny")
    mlp = random_module(
        lambda: MLP(config, config.intermediate_size, limit=limit, rngs=nnx.Rngs(0)), rng
    )
    x = (rng.normal(size=(6, config.hidden_size)) * 4).astype(np.float32)
    expected = swiglu_oracle(
        f64(x), f64(mlp.gate_proj.kernel), f64(mlp.up_proj.kernel), f64(mlp.down_proj.kernel), limit
    )
    np.testing.assert_allclose(mlp(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-4)


def test_swiglu_clamp():
    gate = jnp.array([20.0, -20.0, 3.0])
    up = jnp.array([-30.0, 5.0, 30.0])
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    np.testing.assert_allclose(
        swiglu(gate, up, 10.0), [silu(10.0) * -10, silu(-20.0) * 5, silu(3.0) * 10], rtol=1e-6
    )


@pytest.mark.parametrize("fusions", [(), moe_experts.FUSIONS], ids=["plain", "fused"])
def test_pallas_experts_run_per_device_on_a_mesh(rng, monkeypatch, fusions):
    """On a mesh the Pallas grouped GEMMs run per device on their intermediate slice
    (shard_map + psum of the down projection) and still match the float64 loop."""
    monkeypatch.setattr(moe_experts, "DEFAULT_FUSIONS", fusions)
    config = dataclasses.replace(ModelConfig.preset("tiny"), moe_backend="pallas")
    moe = random_module(lambda: MoE(config, rngs=nnx.Rngs(0)), rng)
    plan = ShardingPlan(config, make_mesh(2, 2))
    graphdef, params = nnx.split(moe)
    params = jax.device_put(params, plan.param_shardings(params))
    x = (rng.normal(size=(19, config.hidden_size)) * 4).astype(np.float32)
    y = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x, plan=plan))(params, jnp.asarray(x))
    expected = moe_oracle(moe_params(moe), f64(x), top_k=config.num_experts_per_token,
                          scaling=config.routed_scaling_factor, limit=config.swiglu_limit)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "tokamax"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_moe_on_the_gpu_matches_per_token_loop(rng, variant, backend):
    """The GPU grouped GEMMs in the layer, bf16 as served, against the float64 loop on
    the same bf16-rounded parameters (tokamax only where it is installed, sm_90 / sm_100)."""
    if backend == "tokamax" and not gmm_tokamax.supported():
        pytest.skip("tokamax is not installed or this GPU has no Mosaic GPU kernel")
    config = dataclasses.replace(ModelConfig.preset("tiny"), moe_backend=backend,
                                 dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                 **VARIANTS[variant])
    moe = random_module(lambda: MoE(config, rngs=nnx.Rngs(0)), rng)
    x = jnp.asarray(rng.normal(size=(200, config.hidden_size)) * 4, jnp.bfloat16)
    y = nnx.jit(lambda m, x: m(x))(moe, x)
    expected = moe_oracle(moe_params(moe), f64(x), top_k=config.num_experts_per_token,
                          scaling=config.routed_scaling_factor, limit=config.swiglu_limit)
    error = np.linalg.norm(f64(y) - expected) / np.linalg.norm(expected)
    assert error < 2e-2, error
