"""Scanned layer groups (`glmjax.layer_scan`): which layers each preset scans, and the scanned
model against the unrolled one with the same weights (tiny preset cut to 5 layers with MLA
every second one, fp32, DSA top 64: a dense KDA layer, two scanned MLA + KDA groups; the
presets' 3 KDA + 1 MLA groups scan by the same code, and a 9-layer model of them compiled
~90 s of CI's busy cores): a cold prefill with snapshots, a resume from a retained snapshot
over the cached MLA prefix and a decode step (on the GPU a mixed step too, `glmjax.mixed`:
on the CPU its two compiles cost ~20 s of the CI's 2 cores); logits and every cache array
equal within fp32 rounding. Weights convert both ways exactly, and load from and write back
to per-layer safetensors checkpoints. On a (4, 2) mesh the scanned model (test_sharding's
depth-2 model made four layers of two scanned KDA + MLA groups, with MoE) equals its
one-device run (`make test-extended`).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_layers_oracles import random_module
from test_model import CONFIG, NUM_BLOCKS, NUM_SLOTS, Span, prefill_batch
from test_sharding import CONFIG as MESH_CONFIG
from test_sharding import model_workload
from test_weights import write_checkpoint

from glmjax.batch import DecodeBatch
from glmjax.caches import Caches, copy_state_slots
from glmjax.config import ModelConfig
from glmjax.layer_scan import GROUPS, LayerPlan, layer_plan, stack_params, unstack_params
from glmjax.mixed import mixed
from glmjax.model import HybridModel, decode, prefill
from glmjax.shard import run_workload
from glmjax.sharding import ShardingPlan, make_mesh, single_device_steps
from glmjax.sharding_specs import param_spec
from glmjax.state_pool import PoolStatus
from glmjax.weights import load_safetensors, upstream_tensors

# With a DSA indexer: the resumed span's queries see more than top_k keys (selected
# attention), the cold ones fewer (dense).
UNROLLED = dataclasses.replace(CONFIG.replace_depth(5), full_attn_interval=2, dsa_top_k=64)
SCANNED = dataclasses.replace(UNROLLED, scan_layers=True)
# max |diff| / max |unrolled value|, per array: fp32 rounding. The loop body fuses and
# orders sums differently, and its routed experts are one layer's groups of the stacked
# weights (a larger ragged_dot); measured: logits 1.3e-6, KDA states 5e-6.
TOL = 1e-5


@pytest.mark.parametrize("preset, depth, plan", [
    # Kimi: MLA at 3, 7, ..., 23 and the last layer; layer 0 dense.
    ("kimi-linear-48b", 27, LayerPlan(27, 1, 4, 6)),
    ("kimi-linear-48b", 10, LayerPlan(10, 1, 4, 2)),
    ("kimi-linear-48b", 9, LayerPlan(9, 0, 4, 0)),  # the last MLA breaks the second group
    # GLM: MLA at 3, 7, ..., 43; layers 0-2 dense.
    ("glm5.3-flash", 45, LayerPlan(45, 3, 4, 10)),
    ("tiny", 4, LayerPlan(4, 0, 4, 0)),
    ("tiny", 9, LayerPlan(9, 1, 4, 2)),
])
def test_layer_plan(preset, depth, plan):
    config = dataclasses.replace(ModelConfig.preset(preset).replace_depth(depth),
                                 scan_layers=True)
    assert layer_plan(config) == plan
    kinds = config.layer_types
    for j in range(plan.group_size):  # each position holds one kind, all with MoE
        assert len({kinds[i] for i in plan.group_layers(j)}) <= 1
        assert all(i >= config.first_dense_layers for i in plan.group_layers(j))
    off = dataclasses.replace(config, scan_layers=False)
    assert layer_plan(off).num_groups == 0
    assert layer_plan(off).unrolled == tuple(range(depth))


def test_scanned_parameters_are_stacked_and_split_like_their_layers():
    _, params = nnx.split(nnx.eval_shape(lambda: HybridModel(SCANNED, nnx.Rngs(0))))
    flat = dict(nnx.to_flat_state(params))
    kernel = flat[(GROUPS, 1, "mixer", "q_proj", "kernel")].get_value()  # the KDA of each group
    assert kernel.shape == (2, 256, 256)
    assert len(params["layers"]) == 1  # the dense layer 0
    single = param_spec((jax.tree_util.DictKey("q_proj"), jax.tree_util.DictKey("kernel")))
    stacked = param_spec((jax.tree_util.DictKey(GROUPS), jax.tree_util.DictKey("q_proj"),
                          jax.tree_util.DictKey("kernel")))
    assert tuple(stacked) == (None, *single)


def test_scanned_model_reads_and_writes_per_layer_checkpoints(tmp_path):
    """A checkpoint (one tensor per layer) loads into the scanned model stacked, and the
    scanned model writes the same tensors back."""
    source = random_module(lambda: HybridModel(UNROLLED, nnx.Rngs(0)), np.random.default_rng(3))
    tensors = upstream_tensors(source, "glm")
    loaded = load_safetensors(write_checkpoint(tmp_path, tensors), SCANNED, family="glm")
    want = stack_params(nnx.to_pure_dict(nnx.state(source, nnx.Param)), SCANNED)
    jax.tree.map(np.testing.assert_array_equal,
                 nnx.to_pure_dict(nnx.state(loaded, nnx.Param)), want)
    written = upstream_tensors(loaded, "glm")
    assert written.keys() == tensors.keys()
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)


def build_models(unrolled_config):
    """(unrolled graphdef and state, scanned graphdef and state, 200 prompt tokens)."""
    scanned_config = dataclasses.replace(unrolled_config, scan_layers=True)
    rng = np.random.default_rng(7)
    unrolled = random_module(lambda: HybridModel(unrolled_config, nnx.Rngs(0)), rng)
    pure = nnx.to_pure_dict(nnx.state(unrolled))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: HybridModel(scanned_config,
                                                                    nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, stack_params(pure, scanned_config))
    back = unstack_params(nnx.to_pure_dict(state), scanned_config)
    jax.tree.map(np.testing.assert_array_equal, back, pure)
    tokens = rng.integers(0, unrolled_config.vocab_size, 200).astype(np.int32)
    return nnx.split(unrolled), (graphdef, state), tokens


@pytest.fixture(scope="module")
def models():
    return build_models(UNROLLED)


@pytest.fixture(scope="module")
def dense_models():
    """No discrete choice anywhere: DSA's top_k above every sequence's length (the indexer
    is skipped) and every token routed to every expert."""
    return build_models(dataclasses.replace(UNROLLED, dsa_top_k=256,
                                            num_experts_per_token=UNROLLED.num_experts))


def assert_close(actual, expected, what, tol=TOL):
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = max(np.max(np.abs(expected)), 1e-30)
    err = np.max(np.abs(actual - expected)) / scale if expected.size else 0.0
    assert err <= tol, f"{what}: max relative difference {err:.2e}"


def assert_outputs_close(scanned, unrolled, tol):
    assert int(scanned.status) == int(unrolled.status) == PoolStatus.OK
    for field in ("logits", "prefill_logits", "decode_logits"):
        if hasattr(unrolled, field):
            assert_close(getattr(scanned, field), getattr(unrolled, field), field, tol)
    for k, (s, u) in enumerate(zip(jax.tree.leaves(scanned.caches),
                                   jax.tree.leaves(unrolled.caches), strict=True)):
        assert_close(s, u, f"cache array {k}", tol)


@pytest.mark.slow
def test_scanned_steps_equal_unrolled(models):
    """Cold prefill with snapshots, resume from a retained one over the MLA prefix the
    first step wrote, then decode: the same outputs and caches from both models."""
    check_steps(models, TOL)


@pytest.mark.gpu
def test_scanned_steps_equal_unrolled_on_the_gpu(dense_models):
    """The same on the GPU's kernels (Pallas KDA and grouped GEMM, flash attention), with no
    top-k choice. XLA's fp32 matmuls run as TF32 on a GPU (unit roundoff 2^-11) and the two
    models fuse and sum in different orders, so the bar is 5e-3 (a wrong layer order or a
    lost snapshot is off by O(1)). TF32 noise flips near-tied top-k choices, which no
    rounding bound covers: on the H200, with DSA selection on, 9.6e-3 on a KDA state after
    the first DSA layer; with DSA off but 2 of 4 experts routed, 3.6e-2 on a cache array of
    the resumed prefill. At full fp32 precision the Pallas kernels did not compile within
    170 s there."""
    check_steps(dense_models, 5e-3, mixed_step=True)


def check_steps(models, tol, mixed_step=False):
    unrolled_state, scanned_state, tokens = models
    caches = {"unrolled": Caches.init(UNROLLED, NUM_SLOTS, NUM_BLOCKS),
              "scanned": Caches.init(SCANNED, NUM_SLOTS, NUM_BLOCKS)}
    states = {"unrolled": unrolled_state, "scanned": scanned_state}

    def step(fn, batch, *extra):
        outs = {name: fn(states[name], caches[name], batch, *extra) for name in states}
        assert_outputs_close(outs["scanned"], outs["unrolled"], tol)
        caches.update({name: out.caches for name, out in outs.items()})

    step(prefill, prefill_batch(tokens, Span(0, 130, 0, offsets=(1, 64, 130), dests=(1, 2, 3)),
                                Span(0, 37, 4, blocks=(4, 5, 6, 7))))
    for name in caches:  # resume after 64 tokens: copy the snapshot to a running slot
        caches[name], status = copy_state_slots(caches[name], jnp.array([2], jnp.int32),
                                                jnp.array([5], jnp.int32))
        assert int(status) == PoolStatus.OK
    step(prefill, prefill_batch(tokens, Span(64, 200, 5, has_initial=True, offsets=(136,),
                                             dests=(6,)),
                                Span(37, 90, 4, blocks=(4, 5, 6, 7), has_initial=True)))
    step(decode, DecodeBatch(token_ids=jnp.asarray(tokens[[10, 20]], jnp.int32),
                             positions=jnp.array([200, 90], jnp.int32),
                             state_slots=jnp.array([5, 4], jnp.int32),
                             block_tables=jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)))
    if not mixed_step:
        return
    # glmjax.mixed: a cold span and the first request's next token in one forward.
    step(mixed, prefill_batch(tokens, Span(0, 50, 7, blocks=(8, 9, 10, 11))),
         DecodeBatch(token_ids=jnp.asarray(tokens[[30, 0]], jnp.int32),
                     positions=jnp.array([201, -1], jnp.int32),
                     state_slots=jnp.array([5, -1], jnp.int32),
                     block_tables=jnp.array([[0, 1, 2, 3], [-1] * 4], jnp.int32)))


@pytest.mark.extended  # ~30-45 s on two busy cores: the model compiled for 8 devices and 1
def test_scanned_model_on_a_mesh_equals_one_device():
    """test_sharding's workload (two prefills over a cached prefix, two decodes)."""
    config = dataclasses.replace(MESH_CONFIG, num_layers=4, first_dense_layers=0,
                                 scan_layers=True)
    assert layer_plan(config) == LayerPlan(4, 0, 2, 2)
    rng = np.random.default_rng(11)
    model_state = nnx.split(random_module(lambda: HybridModel(config, nnx.Rngs(0)), rng))
    workload = model_workload(rng.integers(0, config.vocab_size, 256).astype(np.int32))
    want = run_workload(single_device_steps(config), model_state, workload)
    plan = ShardingPlan(config, make_mesh(4, 2), interleave=2)
    got = run_workload(plan.steps(), model_state, workload)
    for kind in ("prefill_logits", "decode_logits"):
        for g, w in zip(getattr(got, kind), getattr(want, kind), strict=True):
            assert_close(g, w, kind)
    for g, w in zip(jax.tree.leaves(got.caches), jax.tree.leaves(want.caches), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
