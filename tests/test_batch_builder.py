"""Tests for serving.batch_builder (bucket shapes, relative offsets, inert padding) and
serving.batch_validation (its checks)."""

import itertools

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from serving.batch_builder import BatchBuckets, BatchBuilder, power_of_two_buckets
from serving.plan import PrefillSpan, retention_capacity
from serving.step import ScheduledDecode, ScheduledPrefill, ScheduledStep, SchedulerConfig

P = 512
CONFIG = SchedulerConfig(max_model_len=1 << 16, max_num_seqs=100)


def prefill(request_id, span, slot, checkpoint_slots, table, retain_slot=None):
    tokens = tuple(range(span.start % 7, span.start % 7 + span.num_tokens))
    return ScheduledPrefill(
        request_id, span, tokens, slot, tuple(checkpoint_slots), retain_slot, tuple(table), True
    )


def example_step():
    """A cold span with two checkpoints, a resumed span, a one-token span, two decodes."""
    return ScheduledStep(
        step_id=0,
        prefills=(
            prefill("a", PrefillSpan(0, 3000, (2048, 2560)), 0, (5, 6), range(6)),
            prefill("b", PrefillSpan(1024, 2048, (1536,), True), 1, (7,), (10, 11, 6, 7), 8),
            prefill("c", PrefillSpan(0, 1), 2, (), (9,)),
        ),
        decodes=(
            ScheduledDecode("d", 17, 600, 3, (12, 13)),
            ScheduledDecode("e", 18, 5000, 4, tuple(range(14, 24))),
        ),
    )


def builder():
    return BatchBuilder(CONFIG, num_blocks=64, num_slots=32)


def test_buckets():
    assert power_of_two_buckets(512, 8192) == (512, 1024, 2048, 4096, 8192)
    assert power_of_two_buckets(512, 1536) == (512, 1024, 1536)
    assert power_of_two_buckets(512, 512) == (512,)
    buckets = BatchBuckets.for_config(CONFIG)
    assert buckets.seqs == (1, 2, 4, 8, 16, 32, 64, 128)
    assert buckets.block_table_widths == (1, 2, 4, 8, 16, 32, 64, 128)
    dcp4 = BatchBuckets.for_config(SchedulerConfig(max_model_len=40000, dcp=4, budget=6144))
    assert dcp4.tokens == (512, 1024, 2048, 4096, 6144)
    assert dcp4.block_table_widths == (1, 2, 4, 8, 16, 20)


def test_example_step_shapes_offsets_and_padding():
    batch, decode = builder().build(example_step())
    assert batch.token_ids.shape == (4096,) and batch.cu_seqlens.tolist() == [
        0,
        3000,
        4024,
        4025,
        4025,
    ]
    assert batch.block_tables.shape == (4, 8)
    assert batch.checkpoint_offsets.tolist() == [
        [2048, 2560, -1, -1],
        [512, -1, -1, -1],  # span-relative: 1536 - 1024
        [-1, -1, -1, -1],
        [-1, -1, -1, -1],
    ]
    assert batch.checkpoint_slots.tolist() == [[5, 6, -1, -1], [7, -1, -1, -1], [-1] * 4, [-1] * 4]
    assert batch.state_slots.tolist() == [0, 1, 2, -1]
    assert batch.has_initial.tolist() == [False, True, False, False]
    assert batch.prefix_lens.tolist() == [0, 1024, 0, 0]
    assert batch.positions[3000:3003].tolist() == [1024, 1025, 1026]
    assert not batch.positions[4025:].any() and not batch.token_ids[4025:].any()
    assert batch.block_tables[3].tolist() == [-1] * 8
    assert decode.token_ids.tolist() == [17, 18] and decode.positions.tolist() == [600, 5000]
    assert decode.block_tables.shape == (2, 16) and decode.block_tables[0, 2:].tolist() == [-1] * 14
    for array in (*batch, *decode):
        assert array.dtype == (bool if array is batch.has_initial else np.int32)


def corrupt(name, index, value):
    def apply(batch):
        array = np.array(getattr(batch, name))
        array[index] = value
        return batch._replace(**{name: array})

    return apply


PREFILL_CORRUPTIONS = [
    (corrupt("state_slots", 0, 99), "99 is outside \\[0, 32\\)"),
    (corrupt("state_slots", 1, 0), "0 appears more than once"),
    (corrupt("checkpoint_slots", (0, 0), 1), "running and checkpoint slots: 1 appears more"),
    (corrupt("checkpoint_offsets", (1, 0), 2000), "past the length 1024"),
    (corrupt("checkpoint_offsets", (1, 0), 0), "count tokens from 1"),
    (corrupt("checkpoint_slots", (0, 1), -1), "an active offset needs a slot"),
    (corrupt("checkpoint_slots", (1, 1), 20), "an active offset needs a slot"),
    (corrupt("has_initial", 1, False), "has_initial False with prefix_len 1024"),
    (corrupt("prefix_lens", 1, 1000), "prefix_len 1000 is not a multiple"),
    (corrupt("block_tables", (0, 3), -1), "-1 is outside"),
    (corrupt("block_tables", (0, 6), 40), "entries past block 6 must be -1"),
    (corrupt("block_tables", (1, 0), 0), "prefill row 0 writes block 0 that prefill row 1"),
    (corrupt("block_tables", (2, 0), 6), "writes block 6"),
    (corrupt("state_slots", 3, 9), "padding row 3: state_slots 9 must be -1"),
    (corrupt("positions", 3001, 7), "token row 3001 has position 7, expected 1025"),
    (corrupt("cu_seqlens", 2, 5000), "non-decreasing"),
    (corrupt("cu_seqlens", 3, 4024), "row 2 is padding before a real row"),
    (corrupt("token_ids", 4, -5), "token id -5 is negative"),
    (lambda b: b._replace(token_ids=b.token_ids.astype(np.int64)), "token_ids must be int32"),
]


@pytest.mark.parametrize(("mutate", "match"), PREFILL_CORRUPTIONS)
def test_bad_prefill_batches_raise_naming_the_value(mutate, match):
    builder_ = builder()
    batch, _ = builder_.build(example_step())
    with pytest.raises(ValueError, match=match):
        builder_.validator.validate_prefill(mutate(batch))


def test_too_many_checkpoints_for_dcp():
    batch, _ = builder().build(example_step())
    offsets, slots = batch.checkpoint_offsets.copy(), batch.checkpoint_slots.copy()
    offsets[0, 2], slots[0, 2] = 100, 30
    with pytest.raises(ValueError, match="more than R = 2 checkpoints"):
        builder().validator.validate_prefill(
            batch._replace(checkpoint_offsets=offsets, checkpoint_slots=slots)
        )


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (corrupt("state_slots", 1, 3), "3 appears more than once"),
        (corrupt("block_tables", (0, 1), 23), "decode row 0 writes block 23 that decode row 1"),
        (corrupt("block_tables", (0, 1), -1), "-1 is outside"),
        (corrupt("positions", 0, -1), "decode position -1 is negative"),
        (corrupt("state_slots", 0, -1), "row 0 is padding before a real row"),
    ],
)
def test_bad_decode_batches_raise(mutate, match):
    builder_ = builder()
    _, batch = builder_.build(example_step())
    with pytest.raises(ValueError, match=match):
        builder_.validator.validate_decode(mutate(batch))


def test_checks_across_prefill_and_decode():
    builder_ = builder()
    step = example_step()
    slot_clash = ScheduledStep(0, (ScheduledDecode("d", 1, 600, 5, (12, 13)),), step.prefills)
    with pytest.raises(ValueError, match="state slot 5 is written by more than one row"):
        builder_.build(slot_clash)
    block_clash = ScheduledStep(0, (ScheduledDecode("d", 1, 600, 20, (12, 2)),), step.prefills)
    with pytest.raises(
        ValueError, match="prefill row 0 writes block 2 that decode row 0 also uses"
    ):
        builder_.build(block_clash)
    too_long = ScheduledStep(0, prefills=(prefill("a", PrefillSpan(0, 9000), 0, (), range(18)),))
    with pytest.raises(ValueError, match="9000 prefill tokens exceed the largest bucket 8192"):
        builder_.build(too_long)


@st.composite
def prefill_steps(draw):
    dcp = draw(st.sampled_from([1, 2, 4]))
    config = SchedulerConfig(max_model_len=1 << 15, dcp=dcp, budget=8192)
    slots, blocks = itertools.count(), itertools.count()
    prefills, remaining = [], config.budget
    for i in range(draw(st.integers(1, 6))):
        start = P * draw(st.integers(0, 6))
        length = draw(st.integers(1, min(remaining, 2000)))
        inside = list(range(start + P, start + length, P))
        cps = sorted(
            draw(st.sets(st.sampled_from(inside), max_size=retention_capacity(dcp)))
            if inside
            else []
        )
        table = [next(blocks) for _ in range(-(-(start + length) // (P * dcp)))]
        span = PrefillSpan(start, start + length, tuple(cps))
        prefills.append(prefill(f"r{i}", span, next(slots), [next(slots) for _ in cps], table))
        remaining -= length
        if remaining == 0:
            break
    return config, ScheduledStep(0, prefills=tuple(prefills))


@settings(max_examples=50, deadline=None)
@given(prefill_steps())
def test_generated_prefill_batches_are_valid_relative_and_padded(case):
    config, step = case
    batch, decode = BatchBuilder(config, num_blocks=512, num_slots=64).build(step)
    assert decode is None
    buckets = BatchBuckets.for_config(config)
    n = len(step.prefills)
    assert batch.token_ids.shape[0] in buckets.tokens and batch.state_slots.shape[0] in buckets.seqs
    assert batch.block_tables.shape[1] in buckets.block_table_widths
    for i, scheduled in enumerate(step.prefills):
        span = scheduled.span
        rows = slice(batch.cu_seqlens[i], batch.cu_seqlens[i + 1])
        assert batch.token_ids[rows].tolist() == list(scheduled.token_ids)
        assert batch.positions[rows].tolist() == list(range(span.start, span.end))
        active = batch.checkpoint_offsets[i][batch.checkpoint_offsets[i] != -1]
        assert (active + span.start).tolist() == list(span.checkpoints)
        assert np.all((active >= 1) & (active <= span.num_tokens))
    assert np.all(batch.cu_seqlens[n:] == batch.cu_seqlens[n])
    assert np.all(batch.state_slots[n:] == -1) and np.all(batch.checkpoint_slots[n:] == -1)
    assert np.all(batch.block_tables[n:] == -1) and not batch.has_initial[n:].any()
    assert not batch.token_ids[batch.cu_seqlens[n] :].any()
