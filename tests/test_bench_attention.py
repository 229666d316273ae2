"""`python -m bench.attention --quick` runs on the CPU and records every row it times."""

import json

import pytest

from bench import attention


@pytest.mark.extended  # ~15 s on two busy cores, most of it compiling
def test_quick_run_writes_rows_that_agree(tmp_path):
    out = tmp_path / "attention.json"
    assert attention.main(["--quick", "--impls", "pallas,reference", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["cases"]) == set(attention.QUICK)
    for case in record["cases"].values():
        assert case["useful_tflop"] > 0
        for impl in ("pallas", "reference"):
            row = case["rows"][impl]
            assert row["ms"] > 0 and row["error_vs_reference"] < 2e-2, (impl, row)


def test_causal_flops_count_visible_pairs():
    # 2 queries after 3 cached keys: 4 + 5 pairs; 1 query alone: 1 pair.
    assert attention.causal_flops(1, 3, 1, [2, 1], [3, 0]) == 2 * 4 * 10
