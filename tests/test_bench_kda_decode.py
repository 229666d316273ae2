"""`python -m bench.kda_decode --quick` on the CPU (interpret mode, one row): every path is
timed, the kernel agrees with the jax.numpy path, and the floor is the state traffic."""

import json

import pytest

from bench.kda_decode import main


@pytest.mark.extended  # ~10-25 s on two busy cores, most of it compiling the chunked path
def test_quick_run_times_every_path_and_writes_json(tmp_path):
    path = tmp_path / "kda_decode.json"
    main(["--quick", "--rows", "1", "--out", str(path)])
    payload = json.loads(path.read_text())

    (result,) = payload["results"]
    assert set(result["ms"]) == {
        "decode kernel",
        "decode jax.numpy",
        "chunked path (before)",
        "chunked kernel alone",
        "conv history (XLA)",
    }
    assert all(ms > 0 for ms in result["ms"].values())
    assert result["relative_error_vs_jax_numpy"]["states"] < 1e-5
    assert result["relative_error_vs_jax_numpy"]["o"] < 1e-2  # bf16 outputs
    shape = payload["shape"]
    assert result["state_bytes"] == 2 * shape["heads"] * shape["head_dim"] ** 2 * 4
    floor = result["floor_ms"]["h200_4.8TBps"]
    assert floor == pytest.approx(result["state_bytes"] / 4.8e12 * 1e3)
    assert result["kernel_over_floor"] == pytest.approx(result["ms"]["decode kernel"] / floor)
