"""Tiling choice per device: GB10's 99 KB of shared memory per block is never exceeded."""

import dataclasses
import functools

import pytest

from pallas_kernels.tuning import (
    GB10,
    H200,
    SEGMENT_STEP_COST,
    TRANSITION_REGISTERS,
    DeviceSpec,
    KernelConfig,
    estimate_shared_memory,
    resident_programs,
    segment_model,
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


@pytest.mark.parametrize("spec", [GB10, H200], ids=["gb10", "h200"])
def test_segment_parallel_scan_for_few_heads_and_one_long_prompt(spec):
    """TP4's 16 heads and one 32K prompt split the scan where it is latency-bound (H200);
    on GB10 its bytes already take longer than its steps, so it stays plain there unless
    the bandwidth is unknown. Many heads, several sequences, short prompts or an unknown
    token count keep the plain scan everywhere."""

    def segments(num_seqs, num_heads, num_tokens=None, spec=spec):
        return select_config(spec, num_seqs=num_seqs, num_heads=num_heads, head_k=128,
                             head_v=128, num_tokens=num_tokens).scan_segments

    if spec is H200:
        assert segments(1, 16, 32768) == 4
        assert segments(1, 4, 32768) > 4
    else:
        # plain: max(2 waves x 512 steps x 2.6 us, 1,544 B x 32K x 16 / 273 GB/s = 2.97 ms)
        assert segments(1, 16, 32768) == 1
        unknown = dataclasses.replace(spec, memory_bandwidth=0.0)
        assert segments(1, 16, 32768, spec=unknown) == 3
    assert segments(1, 64, 32768) == 1
    assert segments(4, 16, 4 * 8192) == 1
    assert segments(1, 4, 2048) == 1  # 32 chunks: not MIN_SEGMENT_CHUNKS for 3 segments
    assert segments(1, 16) == 1


def test_segment_model_counts_waves():
    """H200, 16 heads x 4 value blocks = 64 programs, 512 chunks: the plain scan is one
    wave of 512 steps. P segments run 64 (2P - 3) transition programs (3 a SM) and 64 P
    scan programs (2 a SM at 4 warps), each wave ceil(512 / P) steps."""
    model = functools.partial(segment_model, H200.num_sms, 64, 4, 4, chunks=512,
                              plain_warps=8, segment_warps=4)
    assert resident_programs(8) == 1 and resident_programs(4) == 2
    assert resident_programs(4, TRANSITION_REGISTERS) == 3
    assert model(1) == 512
    assert model(3) == pytest.approx(SEGMENT_STEP_COST * 171 * 2)
    assert model(4) == pytest.approx(SEGMENT_STEP_COST * 128 * 2)  # 320 and 256: one wave each
    assert model(5) == pytest.approx(SEGMENT_STEP_COST * 103 * 4)  # 448 and 320: two each
    assert select_config(H200, num_seqs=1, num_heads=16, head_k=128, head_v=128,
                         num_tokens=32768).scan_segments == 4


def test_scan_prefetch_and_pipelined_inverse_only_where_measured():
    """The scan's one-chunk-ahead loads and the inverse kernel's pipelined key slices are
    picked on sm_90 (timed on an H100) and not on GB10, where Triton's compile spills more
    registers with the prefetch and the pipelined inverse is untimed; the prep kernel's
    pipelined loads (slower on the H100) nowhere."""
    shape = dict(num_seqs=1, num_heads=32, head_k=128, head_v=128, num_tokens=8192)
    hopper, gb10 = select_config(H200, **shape), select_config(GB10, **shape)
    assert hopper.scan_prefetch and hopper.inverse_num_stages == 2
    assert not gb10.scan_prefetch and gb10.inverse_num_stages == 1
    assert hopper.prep_num_stages == gb10.prep_num_stages == 1
    assert not KernelConfig().scan_prefetch and KernelConfig().inverse_num_stages == 1
