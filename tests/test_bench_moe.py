"""bench.moe's CPU smoke mode: every implementation runs, is checked, and lands in the JSON."""

import json

from bench import moe


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
