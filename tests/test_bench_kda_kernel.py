"""`python -m bench.kda_kernel --quick` on the CPU (interpret mode): the plain and the
segment-parallel scan are timed and checked against the jax.numpy oracle, and the bytes
per token-head are reported; the byte count itself against a hand count."""

import dataclasses
import json

import pytest

from bench import kda_kernel
from bench.kda_kernel import GATE_LOWER_BOUND, WIDE_ROW, main, sweep_configs
from pallas_kernels.kda_traffic import GB10_BANDWIDTH, traffic_summary
from pallas_kernels.tuning import KernelConfig


@pytest.mark.extended  # ~50 s of CPU (2-3 min on busy cores): five kernel variants and the passes
def test_quick_run_times_segment_counts_and_writes_json(tmp_path):
    path = tmp_path / "kda_kernel.json"
    main(["--quick", "--segments", "3", "--pass-cases", "quick", "--out", str(path)])
    (result,) = json.loads(path.read_text())["results"]
    assert "pallas 3 seg w4, 4 snap" in result["ms"]
    # The passes alone, the scan computing the output (the runtime's config).
    assert set(result["pass_ms"]) == {"prep matrices", "prep w_u", "prep", "scan"}
    assert all(ms > 0 for ms in result["ms"].values())
    assert WIDE_ROW in result["ms"]  # the any-decay path's worst case, checked too
    for row in ("bounded", "any decay", WIDE_ROW, "pallas 3 seg w4, 4 snap",
                "pallas, W/U pass, 4 snap"):  # the runtime's scan forms W/U: the other way
        for name in ("o", "final_states", "snapshots"):
            assert result["relative_error_vs_reference"][f"{row} {name}"] < 1e-2, (row, name)
    traffic = result["traffic"]
    tokens_heads = sum(result["lens"]) * 2
    assert traffic["gb10_ms_at_273GBs"] == pytest.approx(
        traffic["total_bytes_per_token_head"] * tokens_heads / GB10_BANDWIDTH * 1e3)


def test_sweep_covers_the_prep_tilings_on_both_paths():
    """Each gate path from the selected tiling, then the prep's warps and key slices; the
    inverse kernel's tilings on the bounded path; no pair twice."""
    base = KernelConfig()
    pairs = list(sweep_configs(base))
    assert pairs[0] == (base, None) and (base, GATE_LOWER_BOUND) in pairs
    assert len(set(pairs)) == len(pairs)
    for bound in (None, GATE_LOWER_BOUND):
        configs = [c for c, b in pairs if b == bound]
        assert {16, 32, 64} <= {c.prep_block_k for c in configs}
        assert {(1, 16), (2, 16), (4, 16)} <= {
            (c.prep_num_warps, c.prep_block_k) for c in configs}
    assert {(1, 64), (2, 32)} <= {(c.inverse_num_warps, c.inverse_block_k)
                                  for c, b in pairs if b == GATE_LOWER_BOUND}
    assert all(bound in (None, GATE_LOWER_BOUND) for _, bound in pairs)


@pytest.mark.extended  # ~10 s of CPU: one config in interpret mode
def test_quick_sweep_times_and_checks_each_config(tmp_path, monkeypatch):
    """The sweep alone (`--cases ''`): every config of the chosen gate path timed and its
    outputs checked against the reference."""
    def configs(base):
        yield dataclasses.replace(base, prep_block_k=8), None
        yield base, GATE_LOWER_BOUND  # not the chosen path: skipped

    monkeypatch.setattr(kda_kernel, "sweep_configs", configs)
    path = tmp_path / "sweep.json"
    main(["--quick", "--sweep", "any", "--sweep-case", "quick", "--cases", "", "--out",
          str(path)])
    result = json.loads(path.read_text())
    assert result["results"] == []
    assert [row["config"]["prep_block_k"] for row in result["sweep"]] == [8]
    for row in result["sweep"]:
        assert row["gate"] == "any decay" and row["ms"] > 0
        assert set(row["relative_error_vs_reference"]) == {"o", "final_states", "snapshots"}
        assert max(row["relative_error_vs_reference"].values()) < 1e-2, row


def test_bytes_per_token_head_by_hand():
    """K = V = 128, C = 64, either gate path: 7,638 B (issue 20 counted about 7.4 KB before
    T and W's right-hand side were stored in bf16 and G only in snapshot chunks; the
    diagonal blocks' inverse kernel reads the inputs once more)."""
    inputs = 2 * 128 * 2 + 4 * 128 + 2
    plain = traffic_summary(KernelConfig(), 128, 128, tokens=1, heads=1)
    assert plain["bytes_per_token_head"] == {
        "inverse": inputs + 6 * 16,
        "prep": inputs + 6 * 16 + 2 * 2 * 64 + 3 * 2 * 128 + 8,
        "w_u": 2 * 256 + 2 + 2 * 64 + 2 * 256,
        "scan": 2 * 384 + 8 + 2 * 128 * 128 / 64 + 2 * 128,
        "output": 2 * (128 + 64 + 256 + 128) + 4 * 128,
    }
    assert plain["total_bytes_per_token_head"] == 7638
    segmented = traffic_summary(KernelConfig(scan_segments=4), 128, 128, tokens=1, heads=1)
    assert segmented["bytes_per_token_head"]["transition"] == pytest.approx(776 * 3 / 4)
    # The output fused into the scan: Qg and Aqk read there, o written once (the scan
    # zeroes the padding rows: no fill first); no entry states or Vnew stored, no output
    # pass. 5,846 B: over issue 20's 5 KB.
    fused = traffic_summary(KernelConfig(fuse_output=True), 128, 128, tokens=1, heads=1)
    assert fused["bytes_per_token_head"]["scan"] == 2 * 384 + 8 + 2 * (128 + 64) + 2 * 128
    assert "output" not in fused["bytes_per_token_head"]
    assert fused["total_bytes_per_token_head"] == 5846
    # And W, U formed by the scan (GB10's pick): it reads T, beta k exp(G), v and beta
    # where it read W and U, and the W/U pass is gone. 4,822 B: under 5 KB.
    formed = traffic_summary(KernelConfig(fuse_output=True, form_w_u_in_scan=True), 128, 128,
                             tokens=1, heads=1)
    assert "w_u" not in formed["bytes_per_token_head"]
    assert formed["bytes_per_token_head"]["scan"] == (
        fused["bytes_per_token_head"]["scan"] + 2 * (64 + 1) + 2 * (128 + 128) - 2 * 256)
    assert formed["total_bytes_per_token_head"] == 4822
