"""`python -m bench.prefill --quick` on the CPU, scaled down further: every case runs through
both engines, timed samples never compile, and the coalesced and ladder engines produce
the same greedy tokens for every request (the tiny preset is fp32).

Blocks of 32 tokens and a budget of 64, so a 128-token prompt takes 2 coalesced steps (the
second with a kernel checkpoint at 96) and 3 ladder steps (64, 32, then the final block);
one bucket (``single_bucket``), so the module compiles the prefill and decode steps once
each.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.buckets import Output
from bench.prefill import case_list, engine_config, main, model_config, parse_args
from bench.prefill_cases import compare_greedy

ARGS = [
    "--quick", "--budget", "64", "--lengths", "128", "--unaligned", "100",
    "--beside-lengths", "100", "--decoders", "1", "--concurrency", "1", "--decode-context", "64",
    "--samples", "1", "--decode-steps", "2", "--no-compile-cache",
]  # fmt: skip


def test_cold_cases_alone_size_the_engine_for_the_longest_prompt():
    """Empty `--concurrency` and `--beside-lengths` leave the cold cases only (a crash
    before: the engine's size took the max of no concurrency)."""
    args = parse_args(["--quick", "--lengths", "128,256", "--unaligned", "0",
                       "--concurrency", "", "--beside-lengths", ""])
    config = engine_config(args, coalesce=True)

    assert case_list(args) == [("cold", 128), ("cold", 256)]
    assert config.max_model_len == 257 and config.max_num_seqs == args.decoders + 1


@pytest.mark.parametrize("preset,layers,experts", [
    ("glm5.3-flash", 6, 288), ("kimi-linear-48b", 27, 256), ("glm5.3-flash", 4, 16)])
def test_real_presets_at_their_full_expert_count_are_selectable(preset, layers, experts):
    args = parse_args(["--preset", preset, "--num-layers", str(layers),
                       "--num-experts", str(experts)])
    config = model_config(args)
    assert (config.num_layers, config.num_experts, config.num_experts_per_token) == (
        layers, experts, 8)
    assert config.kv_block_size == 512


def test_float32_runs_the_model_in_fp32():
    """`--dtype float32` (to tell rounding from logic when the schedules part): weights,
    activations and caches in fp32; the preset's dtype otherwise."""
    assert model_config(parse_args(["--quick"])).dtype == jnp.float32  # the tiny preset's
    for dtype, want in (("preset", jnp.bfloat16), ("float32", jnp.float32)):
        config = model_config(parse_args(["--preset", "kimi-linear-48b", "--dtype", dtype]))
        assert config.dtype == want and config.param_dtype == want


@pytest.mark.extended  # ~30-60 s on two busy cores, most of it compiling
def test_quick_run_writes_every_field_and_both_schedules_agree(tmp_path):
    path = tmp_path / "prefill.json"
    main([*ARGS, "--profile", "--profile-length", "128", "--trace-dir", str(tmp_path / "tr"),
          "--json", str(path)])
    result = json.loads(path.read_text())

    assert result["complete"]
    assert result["model"]["param_bytes"] > 0 and result["model"]["layer_types"].count("mla") == 1
    assert result["engine"]["block_size"] == 32 and result["engine"]["single_bucket"]
    assert {b["kind"] for b in result["buckets"]} == {"prefill", "decode"}
    assert all(b["compile_s"] > 0 and not b["predicted_oom"] for b in result["buckets"])
    # One program per step (none if this process compiled the same bucket before), reused
    # by the engine after the ahead-of-time compile.
    assert result["programs"]["prefill"] <= 1 and result["programs"]["decode"] <= 1
    assert result["recompiles"] == {"prefill": 0, "decode": 0}
    assert result["compiles_during_timing"] == 0
    assert "peak_bytes_in_use" in result

    (cold_100, cold_128) = result["cold"]
    for entry in (cold_100, cold_128):
        for mode in ("coalesced", "ladder"):
            assert entry[mode]["median_ttft_s"] > 0 and entry[mode]["tokens_per_s"] > 0
            assert entry[mode]["cached_tokens"] == [0]  # cold: no prefix-cache hit
            # The engine's wait for the device is a part of each TTFT.
            assert all(0 < w <= t for w, t in zip(entry[mode]["device_wait_s"],
                                                  entry[mode]["ttft_s"], strict=True))
        assert entry["ratio"] > 0
        assert entry["coalesced"]["steps"] == [2] and entry["ladder"]["steps"] == [3]
    (beside,) = result["beside"]
    assert beside["decoders"] == 1 and beside["ttft_ratio"] > 0
    assert all(beside[m]["median_decode_tokens_per_s"] > 0 for m in ("coalesced", "ladder"))
    (decode,) = result["decode"]
    assert decode["concurrency"] == 1 and decode["ratio"] > 0

    # Greedy tokens: the same for every request in both engines (decoders generate a
    # different number of tokens in each, so their common prefix is compared).
    tokens = result["greedy"]["tokens"]
    # cold (2 lengths x 2), beside cold + decoder, decoder, profile prompt and its warm-up
    assert len(tokens) == 4 + 2 + 1 + 1 + 2
    for request_id, pair in tokens.items():
        common = min(len(pair["coalesced"]), len(pair["ladder"]))
        assert common >= 1, request_id
        assert pair["coalesced"][:common] == pair["ladder"][:common], request_id
    assert result["greedy"]["identical"] and result["greedy"]["logprobs_within_design_bound"]

    # One traced step per engine (the first 64-token span of a 128-token prompt in both at a
    # budget of 64); a CPU trace names no scopes here (bench.profile), so only the totals.
    profile = result["profile"]
    assert profile["tokens"] == 128
    for mode in ("coalesced", "ladder"):
        step = profile[mode]
        assert step["step_tokens"] == 64 and step["kernels"] > 0 and step["busy_ms"] > 0
        assert (tmp_path / "tr" / mode).is_dir() and step["trace"].endswith(".json.gz")
        assert step["useful_tflop"] == pytest.approx(
            sum(step["flops_by_term"].values()) / 1e12)


@pytest.mark.extended  # ~35 s on two cores
@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (the CPU run has 8)")
def test_quick_run_on_a_mesh_of_four_cpu_devices(tmp_path):
    """`--tp 4 --dcp 2`: both engines run the mesh's steps, compiled ahead (abstract
    parameters with their shardings) and never again, with the same greedy tokens."""
    path = tmp_path / "prefill.json"
    # A decoder's prompt is its context less one KV block, and a block is 32 x dcp tokens.
    main([*ARGS, "--decode-context", "128", "--tp", "4", "--dcp", "2", "--json", str(path)])
    result = json.loads(path.read_text())

    assert result["complete"] and result["args"]["tp"] == 4 and result["engine"]["dcp"] == 2
    assert set(result["compiles"]) >= {"jit(prefill_on_mesh)", "jit(decode_on_mesh)"}
    assert result["programs"]["prefill"] <= 1 and result["programs"]["decode"] <= 1
    assert result["recompiles"] == {"prefill": 0, "decode": 0}
    assert result["compiles_during_timing"] == 0
    assert len(result["peak_bytes_per_device"]) == 4
    assert [e["tokens"] for e in result["cold"]] == [100, 128]
    assert result["greedy"]["identical"] and result["greedy"]["logprobs_within_design_bound"]


def test_compare_greedy_tells_a_near_tie_from_a_real_difference():
    def out(tokens, top):
        return Output("r", tuple(tokens), (-1.0,) * len(tokens), 0, tuple(top))

    agree = ((5, -1.0), (9, -1.5))
    tie_on = ((7, -2.00), (3, -2.02), (8, -2.05))
    tie_off = ((8, -2.01), (7, -2.04))
    far_off = ((8, -1.0), (7, -3.0))  # the coalesced choice is 2 nats behind here
    result = compare_greedy({"r": out([5, 7], [agree, tie_on])},
                            {"r": out([5, 8], [agree, tie_off])})
    assert not result["identical"] and result["all_differences_near_ties"]
    assert result["near_ties"]["r"]["position"] == 1
    np.testing.assert_allclose(result["near_ties"]["r"]["gaps"], [0.05, 0.03])
    result = compare_greedy({"r": out([5, 7], [agree, tie_on])},
                            {"r": out([5, 8], [agree, far_off])})
    assert not result["near_ties"]["r"]["near_tie"]
    assert not result["all_differences_near_ties"]
    absent = compare_greedy({"r": out([5, 7], [agree, ((7, -2.0), (3, -2.01))])},
                            {"r": out([5, 8], [agree, tie_off])})
    assert absent["near_ties"]["r"]["gaps"][0] == np.inf
    # A NaN row: argmax took the NaN's index, which its own top list does not hold.
    lost = compare_greedy({"r": out([5, 4], [agree, ((0, np.nan), (1, np.nan))])},
                          {"r": out([5, 8], [agree, tie_off])})
    assert not lost["near_ties"]["r"]["near_tie"] and "not among" in lost["near_ties"]["r"]["reason"]
    nan_row = compare_greedy({"r": Output("r", (5, 4), (-1.0, np.nan), 0, (agree, agree))},
                             {"r": out([5, 8], [agree, tie_off])})
    assert nan_row["nonfinite_logprobs"] == {"coalesced": 1, "ladder": 0}
    same = compare_greedy({"r": out([5], [agree])}, {"r": out([5], [agree])})
    assert same["identical"] and same["all_differences_near_ties"]
    assert same["nonfinite_logprobs"] == {"coalesced": 0, "ladder": 0}
