"""glmjax.mixed: one forward over prefill spans and decode rows equals the two forwards
(prefill, then decode) and the cache-free reference; a refused mixed step writes nothing.

Shapes are ``tests/test_model.py``'s (T = 256 rows, 2 spans, 4 blocks of 64 tokens) plus
two decode rows, so the mixed step compiles once for the module.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import (  # noqa: F401 (setup: a fixture)
    CONFIG,
    NUM_BLOCKS,
    NUM_SLOTS,
    Span,
    assert_logits_close,
    assert_unchanged,
    host_copy,
    prefill_batch,
    setup,
)

from glmjax.batch import DecodeBatch
from glmjax.caches import Caches
from glmjax.mixed import mixed
from glmjax.model import decode, prefill
from glmjax.state_pool import PoolStatus

CONTEXT, SLOT, TABLE = 90, 9, (8, 9, 10, 11)  # the decoding request, prefilled first


def decode_batch(tokens, slots=(SLOT, -1), position=CONTEXT) -> DecodeBatch:
    """Row 0 decodes token `position` of the shared sequence; row 1 is padding."""
    return DecodeBatch(
        jnp.asarray([tokens[position], 0], jnp.int32),
        jnp.asarray([position, 0], jnp.int32),
        jnp.asarray(slots, jnp.int32),
        jnp.asarray([TABLE, (-1,) * len(TABLE)], jnp.int32),
    )


@pytest.fixture(scope="module")
def context(setup):  # noqa: F811
    """Caches holding the decoding request's first CONTEXT tokens."""
    model_state, tokens, _ = setup
    out = prefill(model_state, Caches.init(CONFIG, NUM_SLOTS, NUM_BLOCKS),
                  prefill_batch(tokens, Span(0, CONTEXT, SLOT, TABLE)))
    assert int(out.status) == PoolStatus.OK
    return out.caches


def copy(caches):
    return jax.tree.map(jnp.copy, caches)


# Spans beside the decode row: a cold prompt with a checkpoint; two spans in one batch.
SPANS = {
    "cold with a checkpoint": (Span(0, 150, 4, (0, 1, 2, 3), offsets=(64,), dests=(5,)),),
    "two spans": (Span(0, 64, 4, (0, 1, 2, 3)), Span(0, 100, 6, (4, 5, 6, 7))),
}


def check_against_two_forwards(setup, context, spans, *, rtol, atol, reference=True):  # noqa: F811
    model_state, tokens, ref = setup
    spans_batch, rows = prefill_batch(tokens, *spans), decode_batch(tokens)
    first = prefill(model_state, copy(context), spans_batch)
    two = decode(model_state, first.caches, rows)
    one = mixed(model_state, copy(context), spans_batch, rows)
    assert int(one.status) == int(first.status) == int(two.status) == PoolStatus.OK
    for n, span in enumerate(spans):
        if reference:
            assert_logits_close(one.prefill_logits[n], ref[span.end - 1])
        np.testing.assert_allclose(one.prefill_logits[n], first.logits[n], rtol=rtol, atol=atol)
    if reference:
        assert_logits_close(one.decode_logits[0], ref[CONTEXT])
    np.testing.assert_allclose(one.decode_logits, two.logits, rtol=rtol, atol=atol)
    assert not np.any(one.decode_logits[1])  # the padding row
    for got, want in zip(jax.tree.leaves(one.caches), jax.tree.leaves(two.caches), strict=True):
        np.testing.assert_allclose(got, want, rtol=10 * rtol, atol=2 * atol)


@pytest.mark.parametrize("spans", SPANS.values(), ids=SPANS.keys())
def test_mixed_step_equals_two_forwards_and_the_reference(setup, context, spans):  # noqa: F811
    check_against_two_forwards(setup, context, spans, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("spans", SPANS.values(), ids=SPANS.keys())
def test_mixed_step_equals_two_forwards_on_the_gpu(setup, context, spans):  # noqa: F811
    """The Pallas kernels, the decode kernel updating the pool in place inside the same
    program that read the spans' initial states from it. Two programs of other shapes
    round differently (TF32 matmuls): the bound is loose, a wrong slot is not close."""
    check_against_two_forwards(setup, context, spans, rtol=2e-3, atol=2e-3, reference=False)


REFUSED = {
    "a slot written by a span and a row": (Span(0, 150, SLOT, (0, 1, 2, 3)), (SLOT, -1),
                                           PoolStatus.DUPLICATE_DESTINATION),
    "a decode slot out of range": (Span(0, 150, 4, (0, 1, 2, 3)), (SLOT, NUM_SLOTS),
                                   PoolStatus.SLOT_OUT_OF_RANGE),
    "a checkpoint without a slot": (Span(0, 150, 4, (0, 1, 2, 3), offsets=(64,), dests=(-1,)),
                                    (SLOT, -1), PoolStatus.OFFSET_WITHOUT_DESTINATION),
}


@pytest.mark.parametrize("span, slots, want", REFUSED.values(), ids=REFUSED.keys())
def test_a_refused_mixed_step_writes_nothing(setup, context, span, slots, want):  # noqa: F811
    model_state, tokens, _ = setup
    caches = copy(context)
    before = host_copy(caches)
    out = mixed(model_state, caches, prefill_batch(tokens, span), decode_batch(tokens, slots))
    assert int(out.status) == want
    assert_unchanged(before, out.caches)
