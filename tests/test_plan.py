"""Tests for serving.plan: DESIGN section 6's worked examples and generated invariants."""

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

from serving.plan import (
    PrefillSpan,
    alignment,
    cut_span_to_budget,
    plan_prefill,
    retention_capacity,
)

P = 512


def reference_ladder(prompt_len, num_computed, block_size, budget):
    """DESIGN's ladder written out step by step: [(start, end), ...]."""
    tail = block_size * ((prompt_len - 1) // block_size)
    steps, position = [], num_computed
    while position < tail:
        limit = min(budget, tail - position)
        size = block_size
        while size * 2 <= limit:
            size *= 2
        steps.append((position, position + size))
        position += size
    steps.append((position, prompt_len))
    return steps


@st.composite
def requests(draw, block_sizes=(P,)):
    """(prompt_len, num_computed, block_size, dcp, budget) covering DESIGN's ranges."""
    block_size = draw(st.sampled_from(block_sizes))
    dcp = draw(st.sampled_from([1, 2, 4]))
    align = block_size * dcp
    budget = align * draw(st.integers(1, 32768 // align))
    prompt_len = draw(
        st.one_of(
            st.integers(1, 70000),
            st.sampled_from([1, 2, block_size - 1, block_size, block_size + 1, budget, budget + 1]),
        )
    )
    num_computed = block_size * draw(st.integers(0, (prompt_len - 1) // block_size))
    return prompt_len, num_computed, block_size, dcp, budget


def plan(request, coalesce):
    prompt_len, num_computed, block_size, dcp, budget = request
    return plan_prefill(
        prompt_len, num_computed, block_size=block_size, dcp=dcp, budget=budget, coalesce=coalesce
    )


@pytest.mark.parametrize(
    ("block_size", "dcp", "expected"), [(512, 1, 512), (512, 2, 1024), (512, 4, 2048), (16, 4, 64)]
)
def test_alignment(block_size, dcp, expected):
    assert alignment(block_size, dcp) == expected


@pytest.mark.parametrize(("dcp", "expected"), [(1, 2), (2, 3), (4, 4)])
def test_retention_capacity(dcp, expected):
    assert retention_capacity(dcp) == expected


@pytest.mark.parametrize(
    ("prompt_len", "sizes"),
    [(8192, [4096, 2048, 1024, 512, 512]), (16228, [8192, 4096, 2048, 1024, 512, 356])],
)
@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_ladder_worked_examples(prompt_len, sizes, dcp):
    spans = plan_prefill(prompt_len, 0, dcp=dcp, coalesce=False)
    assert [span.num_tokens for span in spans] == sizes
    assert all(span.checkpoints == () for span in spans)
    assert [span.retain_end for span in spans] == [span.end % P == 0 for span in spans]


def test_coalesced_8k_at_dcp4_is_one_span_with_four_checkpoints():
    assert plan_prefill(8192, 0, dcp=4) == [
        PrefillSpan(0, 8192, checkpoints=(4096, 6144, 7168, 7680), retain_end=True)
    ]


def test_coalesced_16228_at_dcp4():
    assert plan_prefill(16228, 0, dcp=4) == [
        PrefillSpan(0, 8192, checkpoints=(), retain_end=True),
        PrefillSpan(8192, 16228, checkpoints=(12288, 14336, 15360, 15872), retain_end=False),
    ]


def test_coalesced_keeps_the_checkpoints_closest_to_the_end():
    assert plan_prefill(8192, 0, dcp=1) == [PrefillSpan(0, 8192, (7168, 7680), True)]
    assert plan_prefill(8192, 0, dcp=2, budget=8192) == [
        PrefillSpan(0, 8192, (6144, 7168, 7680), True)
    ]


def test_continuation_uses_the_ladder_from_its_own_start():
    assert plan_prefill(16228, 4096, dcp=4) == [
        PrefillSpan(4096, 12288, (), True),
        PrefillSpan(12288, 16228, (14336, 15360, 15872), False),
    ]
    ladder = plan_prefill(16228, 4096, coalesce=False)
    assert [span.num_tokens for span in ladder] == [8192, 2048, 1024, 512, 356]


def test_single_block_remaining_is_one_span():
    for coalesce in (False, True):
        assert plan_prefill(1000, 512, coalesce=coalesce) == [PrefillSpan(512, 1000, (), False)]
        assert plan_prefill(1, 0, coalesce=coalesce) == [PrefillSpan(0, 1, (), False)]
        assert plan_prefill(1024, 512, coalesce=coalesce) == [PrefillSpan(512, 1024, (), True)]


@settings(max_examples=400, deadline=None)
@given(requests(block_sizes=(P, 128)))
@example((8192, 0, P, 4, 8192))
@example((16228, 0, P, 4, 8192))
@example((70000, 0, P, 1, 512))
def test_ladder_mode_is_the_reference_ladder(request):
    spans = plan(request, coalesce=False)
    block_size = request[2]
    assert [(span.start, span.end) for span in spans] == reference_ladder(
        request[0], request[1], block_size, request[4]
    )
    for span in spans:
        assert span.checkpoints == ()
        assert span.retain_end == (span.end % block_size == 0)


@settings(max_examples=400, deadline=None)
@given(requests(block_sizes=(P, 128)), st.booleans())
def test_spans_tile_the_uncomputed_prompt(request, coalesce):
    prompt_len, num_computed, block_size, dcp, budget = request
    spans = plan(request, coalesce)
    assert spans[0].start == num_computed
    assert spans[-1].end == prompt_len
    for before, after in itertools.pairwise(spans):
        assert before.end == after.start
        assert before.end % block_size == 0
        assert before.retain_end
    for span in spans:
        assert 0 < span.num_tokens <= budget
        assert len(span.checkpoints) <= retention_capacity(dcp)
        assert all(position % block_size == 0 for position in span.checkpoints)
        assert all(position % block_size == 0 for position in span.retained_positions)


@settings(max_examples=400, deadline=None)
@given(requests(block_sizes=(P, 128)), st.booleans())
def test_final_block_is_computed_and_its_start_retained(request, coalesce):
    prompt_len, num_computed, block_size, _, _ = request
    tail = block_size * ((prompt_len - 1) // block_size)
    spans = plan(request, coalesce)
    assert spans[-1].start <= tail < spans[-1].end == prompt_len
    if tail > num_computed:
        assert tail in {p for span in spans for p in span.retained_positions}


@settings(max_examples=400, deadline=None)
@given(requests(block_sizes=(P, 128)))
@example((8192, 0, P, 4, 8192))
@example((16228, 0, P, 4, 8192))
def test_coalesced_checkpoints_are_the_ladder_boundaries_nearest_each_span_end(request):
    prompt_len, num_computed, block_size, dcp, budget = request
    spans = plan(request, coalesce=True)
    boundaries = [end for _, end in reference_ladder(prompt_len, num_computed, block_size, budget)]
    starts = list(range(num_computed, prompt_len, budget))
    assert [span.start for span in spans] == starts
    for span in spans:
        assert span.end == min(span.start + budget, prompt_len)
        inside = [p for p in boundaries if span.start < p < span.end]
        assert span.checkpoints == tuple(inside[-retention_capacity(dcp) :])
        assert set(span.checkpoints) <= set(boundaries)
        assert span.retain_end == (span.end % block_size == 0)


@settings(max_examples=400, deadline=None)
@given(requests(), st.booleans(), st.integers(0, 40000))
def test_cut_span_to_budget(request, coalesce, token_budget):
    block_size = request[2]
    for span in plan(request, coalesce):
        cut = cut_span_to_budget(span, token_budget, block_size=block_size)
        if span.num_tokens <= token_budget:
            assert cut is span
        elif token_budget < block_size:
            assert cut is None
        else:
            assert cut.start == span.start
            assert cut.end % block_size == 0
            assert token_budget - block_size < cut.num_tokens <= token_budget  # whole blocks
            assert cut.end < span.end
            assert cut.retain_end
            assert cut.checkpoints == tuple(p for p in span.checkpoints if p < cut.end)


def test_cut_span_examples():
    span = PrefillSpan(0, 8192, (4096, 6144, 7168, 7680), True)
    assert cut_span_to_budget(span, 8192) is span
    assert cut_span_to_budget(span, 7000) == PrefillSpan(0, 6656, (4096, 6144), True)
    assert cut_span_to_budget(span, 6144) == PrefillSpan(0, 6144, (4096,), True)
    assert cut_span_to_budget(span, 511) is None
    assert cut_span_to_budget(PrefillSpan(15872, 16228), 356) == PrefillSpan(15872, 16228)
    assert cut_span_to_budget(PrefillSpan(15872, 16228), 355) is None


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"prompt_len": 0}, "prompt_len"),
        ({"prompt_len": -5}, "prompt_len"),
        ({"num_computed": 256}, "num_computed"),
        ({"num_computed": 8192}, "num_computed"),
        ({"num_computed": -512}, "num_computed"),
        ({"dcp": 3}, "dcp"),
        ({"dcp": 8}, "dcp"),
        ({"budget": 0}, "budget"),
        ({"budget": 1024, "dcp": 4}, "budget"),
        ({"budget": 3000}, "budget"),
        ({"block_size": 0}, "block_size"),
        ({"prompt_len": 8192.0}, "prompt_len"),
    ],
)
def test_plan_prefill_rejects_bad_arguments(kwargs, bad):
    arguments = {"prompt_len": 8192, "num_computed": 0, **kwargs}
    with pytest.raises(ValueError, match=bad):
        plan_prefill(arguments.pop("prompt_len"), arguments.pop("num_computed"), **arguments)


def test_other_functions_reject_bad_arguments():
    with pytest.raises(ValueError, match="dcp"):
        retention_capacity(3)
    with pytest.raises(ValueError, match="dcp"):
        alignment(512, True)
    with pytest.raises(ValueError, match="token_budget"):
        cut_span_to_budget(PrefillSpan(0, 512), -1)
    with pytest.raises(ValueError, match="100"):
        cut_span_to_budget(PrefillSpan(100, 2000), 512)
    with pytest.raises(ValueError, match="empty"):
        PrefillSpan(512, 512)
    with pytest.raises(ValueError, match="checkpoint 512"):
        PrefillSpan(0, 1024, (512, 512))
    with pytest.raises(ValueError, match="checkpoint 1024"):
        PrefillSpan(0, 1024, (1024,))
