"""Tiling choice per device: GB10's 99 KB of shared memory per block is never exceeded."""

import dataclasses

import pytest

from pallas_kernels.tuning import (
    GB10,
    H200,
    DeviceSpec,
    KernelConfig,
    estimate_shared_memory,
    select_config,
)


@pytest.mark.parametrize("spec", [GB10, H200], ids=["gb10", "h200"])
@pytest.mark.parametrize("heads", [4, 32, 64])
@pytest.mark.parametrize("operand_bytes", [2, 4], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_selected_config_fits_the_device(spec, heads, operand_bytes, head_dim):
    config = select_config(
        spec,
        num_seqs=1,
        num_heads=heads,
        head_k=head_dim,
        head_v=head_dim,
        operand_bytes=operand_bytes,
    )
    estimate = estimate_shared_memory(
        config,
        head_dim,
        head_dim,
        compute_capability=spec.compute_capability,
        operand_bytes=operand_bytes,
    )
    assert max(estimate.values()) <= spec.smem_per_block
    assert head_dim % config.block_v == 0


def test_gb10_drops_pipeline_stages_that_do_not_fit():
    # fp32 operands at K = V = 128: two stages need ~150 KB on an mma.sync target.
    config = select_config(GB10, num_seqs=1, num_heads=32, head_k=128, head_v=128, operand_bytes=4)
    assert config.scan_num_stages == 1
    two_stages = dataclasses.replace(config, scan_num_stages=2)
    assert (
        estimate_shared_memory(two_stages, 128, 128, compute_capability=(12, 1), operand_bytes=4)[
            "scan"
        ]
        > GB10.smem_per_block
    )


def test_estimate_grows_with_stages_and_tiles():
    small = KernelConfig(block_v=32, scan_num_stages=1)
    for capability in [(9, 0), (12, 1)]:
        base = estimate_shared_memory(small, 128, 128, compute_capability=capability)["scan"]
        staged = estimate_shared_memory(
            dataclasses.replace(small, scan_num_stages=2), 128, 128, compute_capability=capability
        )["scan"]
        wider = estimate_shared_memory(
            dataclasses.replace(small, block_v=64), 128, 128, compute_capability=capability
        )["scan"]
        assert base <= wider and base < staged


def test_no_config_fits_a_tiny_device():
    tiny = DeviceSpec("tiny", (12, 1), 8, 16 * 1024)
    with pytest.raises(ValueError, match="shared memory"):
        select_config(tiny, num_seqs=1, num_heads=1, head_k=128, head_v=128)
