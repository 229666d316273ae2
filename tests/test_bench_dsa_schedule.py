"""`python -m bench.dsa_schedule --quick` on the CPU: a 64-token prompt through the tiny
preset's MLA with DSA (bf16, top-k 8), one coalesced span against the ladder 32, 16, 8, 8.
The CPU's kernels give every row the same bits whatever the span, so the ladder selects
exactly the coalesced keys and writes the same cache; a one-step perturbation of 1% of
the input moves every output row."""

import json

from bench.dsa_schedule import main


def test_quick_run_ladder_equals_coalesced_bit_for_bit(tmp_path):
    path = tmp_path / "dsa_schedule.json"
    main(["--quick", "--out", str(path)])
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
