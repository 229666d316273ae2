"""`bench.decode_floor` against sizes counted by hand from the presets' widths and a
simulated router; `python -m bench.decode --quick` on the CPU: every case decodes its
whole batch each timed step, nothing compiles while timing, and the JSON holds the floor."""

import json
import math

import numpy as np
import pytest

from bench.decode import main, model_steps, parse_args
from bench.decode_floor import decode_sizes, decode_step_bytes, expected_experts, floor_seconds
from glmjax.config import ModelConfig
from glmjax.model import decode


def test_expected_experts_matches_a_simulated_router(rng):
    experts, top_k, rows, trials = 64, 6, 9, 4000
    touched = [len({e for _ in range(rows) for e in rng.choice(experts, top_k, replace=False)})
               for _ in range(trials)]
    assert np.mean(touched) == pytest.approx(expected_experts(experts, top_k, rows), rel=0.01)
    assert expected_experts(experts, top_k, 1) == pytest.approx(top_k)
    assert expected_experts(256, 8, 10_000) == pytest.approx(256)


KIMI = ModelConfig.preset("kimi-linear-48b")


@pytest.fixture(scope="module")
def kimi_sizes():
    return decode_sizes(KIMI)


@pytest.mark.parametrize("preset", ["kimi-linear-48b", "glm5.3-flash"])
def test_sizes_match_the_presets_widths(preset, kimi_sizes):
    c = ModelConfig.preset(preset)
    # glm5.3-flash cut to 5 layers (3 dense, a DSA MLA layer, a MoE layer): its shapes
    # take seconds to trace whole.
    c, sizes = (KIMI, kimi_sizes) if c == KIMI else (c.replace_depth(5), None)
    sizes = sizes or decode_sizes(c)
    bf16, fp32 = 2, 4
    kda = c.layer_types.count("kda")
    assert (sizes.kda_layers, sizes.mla_layers) == (kda, c.num_layers - kda)
    assert sizes.moe_layers == c.num_layers - c.first_dense_layers
    assert sizes.expert_bytes == 3 * c.hidden_size * c.moe_intermediate_size * bf16
    conv = 3 * c.kda_num_heads * c.kda_head_dim * (c.conv_kernel - 1) * bf16  # q, k, v
    assert sizes.slot_bytes == c.kda_num_heads * c.kda_head_dim ** 2 * fp32 + conv
    index_keys = 0 if c.dsa_top_k is None else c.dsa_head_dim * bf16
    assert sizes.token_bytes == (c.kv_lora_rank + c.qk_rope_head_dim) * bf16 + index_keys
    assert sizes.embed_row_bytes == c.hidden_size * bf16
    # The LM head and the dense layers' MLPs are among the weights read every step.
    assert sizes.dense_bytes > (c.vocab_size + 3 * c.first_dense_layers * c.intermediate_size
                                ) * c.hidden_size * bf16


def test_step_bytes_add_up_the_terms(kimi_sizes):
    c, sizes = KIMI, kimi_sizes
    contexts = [8192, 8200, 9000]
    got = decode_step_bytes(c, sizes, contexts)
    assert got["weights"] == sizes.dense_bytes + 3 * sizes.embed_row_bytes
    assert got["experts"] == pytest.approx(
        sizes.moe_layers * 256 * (1 - (248 / 256) ** 3) * sizes.expert_bytes)
    assert got["states"] == 2 * 3 * sizes.kda_layers * sizes.slot_bytes
    assert got["kv"] == sizes.mla_layers * sizes.token_bytes * (8193 + 8201 + 9001)
    assert got["total"] == pytest.approx(sum(got[k] for k in ("weights", "experts", "states",
                                                               "kv")))
    # One row at 8K: ~6.4 GB, 1.3 ms at 4.8 TB/s (3.3 GB of dense weights, 8 experts a layer).
    one = decode_step_bytes(c, sizes, [8192])["total"]
    assert 6e9 < one < 7e9 and floor_seconds(one) == pytest.approx(one / 4.8e12)
    with pytest.raises(ValueError, match="contexts"):
        decode_step_bytes(c, sizes, [])


@pytest.mark.extended  # ~40-80 s on two busy cores, nearly all of it compiling three programs
def test_quick_run_times_each_batch_against_its_floor(tmp_path):
    path = tmp_path / "decode.json"
    main(["--quick", "--batches", "2", "--context", "40", "--steps", "2", "--device-time",
          "--no-compile-cache", "--trace-dir", str(tmp_path), "--json", str(path)])
    result = json.loads(path.read_text())

    assert result["complete"] and result["compiles_during_timing"] == 0
    (case,) = result["cases"]
    assert case["batch"] == 2 and len(case["step_s"]) == 2
    assert case["mean_step_s"] >= min(case["step_s"])
    assert case["tokens_per_s"] == pytest.approx(2 / case["mean_step_s"])
    # Of a step, the engine's wait for the device and the host's share add up to the mean.
    assert case["device_wait_ms_per_step"] >= 0 and case["host_ms_per_step"] > 0
    assert case["device_wait_ms_per_step"] + case["host_ms_per_step"] == pytest.approx(
        case["mean_step_s"] * 1e3)
    floor = case["floor_bytes"]
    assert floor["total"] == pytest.approx(sum(floor[k] for k in ("weights", "experts",
                                                                 "states", "kv")))
    assert case["floor_s"] == pytest.approx(floor["total"] / 4.8e12)
    assert case["step_over_floor"] == pytest.approx(case["median_step_s"] / case["floor_s"])
    sizes = result["floor_sizes"]
    # Each row attends over its 40 prompt tokens and the tokens it generated before.
    per_row = floor["kv"] / (sizes["mla_layers"] * sizes["token_bytes"]) / 2
    assert 41 < per_row < 40 + result["args"]["decode_room"]
    assert not math.isnan(case["median_step_s"])
    # The device's (here the CPU's) busy time over 4 more traced steps: the sum of its ops'
    # times, which on the CPU can exceed the span (ops overlap on the host's threads; a
    # GPU's one stream runs them one after another).
    assert case["device_ms_per_step"] > 0 and case["traced_span_ms_per_step"] > 0
    assert {b["kind"] for b in result["buckets"]} == {"prefill", "decode"}
    # The engine's calls find the executables compiled ahead (at most once per bucket: none
    # where this process compiled the same bucket before); they compiled twice when the
    # ahead-of-time compile was given parameters of another tree than the engine's.
    for kind, function in (("prefill", "prefill_step"), ("decode", "decode_into")):
        buckets = sum(b["kind"] == kind for b in result["buckets"])
        assert result["compiles"].get(f"jit({function})", {"count": 0})["count"] <= buckets


def test_unpinned_takes_the_pinned_decode_away():
    """--unpinned gives the engine steps without `decode_pinned`; without it the engine's
    own (None)."""
    config = ModelConfig.preset("tiny")
    assert not parse_args(["--quick"]).unpinned
    assert model_steps(config, False) is None
    steps = model_steps(config, True)
    assert steps.decode_pinned is None and steps.decode is decode
