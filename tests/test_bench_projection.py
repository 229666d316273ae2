"""`python -m bench.projection`: the decoder's projection shapes, the sweep grid's filter,
and a quick CPU run (interpret mode) that times both paths and writes its JSON."""

import json

import pytest

from bench.projection import decode_projections, main, sweep_configs
from glmjax.config import ModelConfig
from pallas_kernels.stream_matmul import estimate_shared_memory
from pallas_kernels.tuning import device_spec


def test_kimi_decoder_projections_are_counted_per_shape():
    config = ModelConfig.preset("kimi-linear-48b")
    counts = decode_projections(config)
    kda_layers = sum(kind == "kda" for kind in config.layer_types)
    width = config.kda_num_heads * config.kda_head_dim
    # q, k and v of every KDA layer read the hidden state into the heads' width.
    assert counts[(config.hidden_size, width)] >= 3 * kda_layers
    # o of every KDA layer writes the heads' width back into the hidden state.
    assert counts[(width, config.hidden_size)] >= kda_layers


@pytest.mark.parametrize("d_in, d_out", [(2304, 4096), (4096, 2304), (48, 80)])
def test_the_sweep_keeps_only_tilings_that_divide_the_shape_and_fit(d_in, d_out):
    configs = sweep_configs(1, d_in, d_out)
    for config in configs.values():
        (t,) = config.tilings
        assert d_in % (t.block_k * t.splits) == 0 and d_out % t.block_n == 0
        assert estimate_shared_memory(t, 16, config.num_stages) <= device_spec().smem_per_block
    if d_in % 64 or d_out % 32:
        assert configs == {}
    else:
        assert {c.tilings[0].block_n for c in configs.values()} == {32, 64, 128}


@pytest.mark.extended
def test_quick_run_times_both_paths_and_writes_json(tmp_path):
    path = tmp_path / "projection.json"
    main(["--quick", "--rows", "2", "--out", str(path)])
    payload = json.loads(path.read_text())
    assert payload["results"], "no shape was timed"
    for r in payload["results"]:
        assert r["rows"] == 2 and set(r["ms"]) == {"stream", "xla"}
        assert r["relative_error"]["stream"] < 1e-2 and r["relative_error"]["xla"] < 1e-2
        assert r["floor_ms"]["h200_4.8TBps"] == pytest.approx(
            r["d_in"] * r["d_out"] * 2 / 4.8e12 * 1e3)
    shapes = {f"{r['d_in']}x{r['d_out']}" for r in payload["results"]}
    assert shapes | set(payload["not_streamed"]) == set(payload["shapes_per_step"])
    assert set(payload["step_estimate_ms"]["2"]) == {"stream", "xla", "floor"}
    assert {r["launch"] for r in payload["launches"]} == {"kda_in", "shared_gate_up"}
    for r in payload["launches"]:
        assert set(r["ms"]) == {"one_launch", "launch_per_weight", "xla"}
        assert all(v > 0 for v in r["ms"].values())
