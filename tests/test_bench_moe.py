"""bench.moe's CPU smoke mode: every implementation runs, is checked, and lands in the JSON."""

import json

import pytest

from bench import moe


@pytest.mark.extended
def test_quick_run_writes_every_implementation(tmp_path):
    out = tmp_path / "moe.json"
    assert moe.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    impls = {(row["part"], row["impl"]) for row in rows}
    assert impls == {("gemm", "ragged_dot"), ("gemm", "pallas"), ("gemm", "dense"),
                     ("moe", "ragged_dot"), ("moe", "dense"),
                     *(("moe", name) for name in moe.PALLAS_FUSIONS)}
    for row in rows:
        assert "error" not in row, row
        assert row["ms"] > 0 and row["floor_ms_gb10"] > row["floor_ms_h200"] > 0
        if row["impl"] != "dense":
            assert row["rel_error"] < 1e-2, row


@pytest.mark.extended
def test_fused_launches_with_and_without_half_tiles(tmp_path):
    """--sweep-fused 0: the model's two launches at the pick and at it with whole tiles, each
    with the MMA rows it runs per useful row (more with whole tiles)."""
    out = tmp_path / "moe.json"
    assert moe.main(["--quick", "--parts", "moe", "--sweep-fused", "0", "--out", str(out)]) == 0
    rows = [row for row in json.loads(out.read_text())["rows"]
            if row["impl"].startswith(("gate_up", "down"))]
    assert len(rows) == 4
    for launch in ("gate_up", "down"):
        half, whole = (row for row in rows if row["impl"].startswith(launch))
        assert half["picked"] and half["config"].endswith("half") and not whole["picked"]
        assert 1 <= half["mma_rows_per_row"] < whole["mma_rows_per_row"]
        assert half["rel_error"] == 0 and whole["rel_error"] < 1e-6
