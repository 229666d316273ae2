"""`python -m bench.kda_conv --quick` on the CPU (interpret mode): both paths timed, the
kernel agrees with the jax.numpy path, and the floor is x read and q, k, v written once."""

import json

import pytest

from bench.kda_conv import H200_BANDWIDTH, SWEEP, main


@pytest.mark.extended
def test_quick_run_times_both_paths_and_writes_json(tmp_path):
    path = tmp_path / "kda_conv.json"
    main(["--quick", "--cases", "70x2", "--sweep", "--out", str(path)])
    (row,) = json.loads(path.read_text())["rows"]

    assert (row["tokens"], row["heads"]) == (70, 2)
    assert set(row["ms"]) == {"pallas", "xla"} and all(ms > 0 for ms in row["ms"].values())
    assert row["least_bytes"] == 2 * 70 * 3 * 2 * 128 * 2  # bf16 in and out
    assert row["floor_ms"] == pytest.approx(row["least_bytes"] / H200_BANDWIDTH * 1e3)
    assert row["xla_over_pallas"] == pytest.approx(row["ms"]["xla"] / row["ms"]["pallas"])
    assert row["relative_difference"] < 2e-2  # bf16 outputs
    assert set(row["sweep"]) == {f"{t.block_rows}x{t.num_warps}" for t in SWEEP}
    assert all(ms > 0 for ms in row["sweep"].values())
