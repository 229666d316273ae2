"""`python -m bench.dsa_schedule --quick` on the CPU: a 64-token prompt through the tiny
preset's MLA with DSA (bf16, top-k 8), one coalesced span against the ladder 32, 16, 8, 8.
The CPU's kernels give every row the same bits whatever the span, so the ladder selects
exactly the coalesced keys and writes the same cache; a one-step perturbation of 1% of
the input moves every output row. The model rows: a KDA + MLA tiny model in fp32
(--model-dtype float32) along both schedules, every retained state and cached key
compared: they differ by rounding only."""

import json

import pytest

from bench.dsa_schedule import layer_config, main, model_config, parse_args


@pytest.mark.extended
def test_quick_run_layer_ladder_is_coalesced_bit_for_bit_and_fp32_model_rows_agree(tmp_path):
    path = tmp_path / "dsa_schedule.json"
    main(["--quick", "--model-dtype", "float32", "--out", str(path)])
    (case,) = json.loads(path.read_text())["lengths"]
    assert case["spans"] == {"coalesced": [[0, 64]], "ladder": [[0, 32], [32, 48], [48, 56],
                                                                 [56, 64]]}
    assert 0.005 < case["x_elements_moved"] < 0.02
    for name in ("dsa", "dense"):
        schedule, perturbed = case[name]["schedule"], case[name]["perturbed"]
        assert all(v == 0 for v in schedule.values()), (name, schedule)
        assert perturbed["rows_differing"] > 0.5 and perturbed["row_rel_diff_median"] > 0
    assert case["dsa"]["schedule"]["swaps_max"] == 0
    assert case["perturbed_amplification"] > 0
    model = json.loads(path.read_text())["model"]
    assert model["layer_types"] == ["kda", "mla"]
    (run,) = model["lengths"]
    assert run["logprobs"]["max_abs_diff"] < 1e-4 and len(run["logprobs"]["gaps"]) == 2
    (kda,) = run["kda_recurrent_bits_differing"]
    assert set(kda) == {"48", "56", "64"}  # the ladder's last boundaries and the end
    assert all(0 <= v <= 1 for v in kda.values())
    (rel,) = run["kda_recurrent_rel_diff_max"]
    assert 0 <= rel < 1e-5
    (mla,) = run["mla"]
    assert set(mla) == {"latent", "index_keys"}
    for v in mla.values():
        assert 0 <= v["positions_differing"] <= 1
        assert 0 <= v["row_rel_diff_median"] <= v["row_rel_diff_max"] < 1e-5


def test_no_rows_asked_writes_an_empty_result(tmp_path):
    path = tmp_path / "dsa_schedule.json"
    main(["--quick", "--no-layer-rows", "--model-layers", "0", "--out", str(path)])
    result = json.loads(path.read_text())
    assert result["lengths"] == [] and "model" not in result


def test_model_rows_take_the_attention_asked_for():
    assert model_config(parse_args(["--quick"])).mla_attention is None  # the device's pick
    config = model_config(parse_args(["--quick", "--mla-attention", "pallas"]))
    assert config.mla_attention == "pallas"
    with pytest.raises(SystemExit):
        parse_args(["--quick", "--mla-attention", "flash"])


def test_batch_invariant_reaches_the_model_and_layer_rows():
    assert not model_config(parse_args(["--quick"])).batch_invariant
    args = parse_args(["--quick", "--batch-invariant"])
    assert model_config(args).batch_invariant
    assert layer_config(args.quick, args.block_size, args.batch_invariant).batch_invariant
