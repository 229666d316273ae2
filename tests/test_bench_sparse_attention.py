"""`python -m bench.sparse_attention --quick` runs on the CPU and records every row."""

import json

import numpy as np
import pytest

from bench import sparse_attention


@pytest.mark.extended
def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "sparse_attention.json"
    assert sparse_attention.main(["--quick", "--out", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"].values()
    rows = case["rows"]
    for row in ("layer-dense-reference", "layer-dsa", "layer-dsa-reference", "select",
                "top_k-sort", "top_k-radix", "top_k-pallas", "sparse-op",
                "sparse-op-reference", "dense-op-reference"):
        assert rows[row]["ms"] > 0, row
    for row in ("top_k-sort", "top_k-radix", "top_k-pallas"):
        assert rows[row]["rows_unlike_sort"] == 0, row
    assert rows["sparse-op"]["error_vs_reference"] < 1e-5
    assert rows["layer-dsa"]["error_vs_reference"] < 1e-5
    assert rows["ratio-dsa/dense-reference"] > 0


def test_random_selection_is_causal_and_distinct(rng):
    picks = sparse_attention.random_selection(rng, 50, 8)
    t = np.arange(50)[:, None]
    assert ((picks == -1) == (np.arange(8)[None] > t)).all()
    assert (picks <= t).all()
    for row in picks:
        kept = row[row >= 0]
        assert (np.diff(kept) > 0).all()
