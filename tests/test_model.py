"""HybridModel's jitted prefill / decode against its cache-free reference forward, on the
tiny preset in fp32: one pass, resume from a retained snapshot, snapshots against cold runs,
decode after prefill, refused updates, and no recompiles within a bucket.

Every step runs in one bucket (T = 256 rows, N = 2 spans, M = 4 blocks of 64 tokens), so
each entry point compiles once for the whole module. The blocks are 64 tokens (not 512) so
that requests span several blocks. All requests are prefixes of one random sequence, so one
reference forward over it serves every comparison (the model is causal).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_layers_oracles import random_module

from glmjax.batch import CHECKPOINT_CAPACITY, DecodeBatch, PrefillBatch
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.model import FlatParams, HybridModel, decode, merge, prefill, pure_state
from glmjax.state_pool import PoolStatus, copy_slots

CONFIG = dataclasses.replace(ModelConfig.preset("tiny"), kv_block_size=64)
LENGTH, NUM_ROWS, NUM_SPANS, MAX_BLOCKS = 200, 256, 2, 4
NUM_SLOTS, NUM_BLOCKS = 16, 16
LOGIT_RTOL = 2e-5  # max |diff| / max |reference logit|
STATE_TOL = dict(rtol=1e-4, atol=2e-5)


class Span(NamedTuple):
    """Tokens [start, end) of the shared sequence, as one prefill span."""

    start: int
    end: int
    slot: int
    blocks: tuple = (0, 1, 2, 3)
    has_initial: bool = False
    offsets: tuple = ()
    dests: tuple = ()


def padded(values, size):
    return list(values) + [-1] * (size - len(values))


def prefill_batch(tokens, *spans: Span) -> PrefillBatch:
    spans = [*spans, *[Span(0, 0, -1, ())] * (NUM_SPANS - len(spans))]
    ids = np.concatenate([tokens[s.start : s.end] for s in spans])
    positions = np.concatenate([np.arange(s.start, s.end) for s in spans])
    lengths = [s.end - s.start for s in spans]
    return PrefillBatch(
        token_ids=jnp.asarray(np.pad(ids, (0, NUM_ROWS - len(ids))), jnp.int32),
        positions=jnp.asarray(np.pad(positions, (0, NUM_ROWS - len(ids))), jnp.int32),
        cu_seqlens=jnp.asarray(np.cumsum([0, *lengths]), jnp.int32),
        state_slots=jnp.array([s.slot for s in spans], jnp.int32),
        has_initial=jnp.array([s.has_initial for s in spans]),
        checkpoint_offsets=jnp.array(
            [padded(s.offsets, CHECKPOINT_CAPACITY) for s in spans], jnp.int32
        ),
        checkpoint_slots=jnp.array(
            [padded(s.dests, CHECKPOINT_CAPACITY) for s in spans], jnp.int32
        ),
        block_tables=jnp.array([padded(s.blocks, MAX_BLOCKS) for s in spans], jnp.int32),
        prefix_lens=jnp.array([s.start for s in spans], jnp.int32),
    )


def slot_states(caches: Caches, slot: int):
    """Every KDA layer's (recurrent, conv) in `slot`, as NumPy."""
    return [(np.asarray(p.recurrent[slot]), np.asarray(p.conv[slot])) for p in caches.kda]


def host_copy(caches: Caches):
    return [np.array(x) for x in jax.tree.leaves(caches)]


def assert_unchanged(before, caches: Caches):
    """Every cache array still equals its `host_copy` taken `before`, bit for bit."""
    for old, new in zip(before, jax.tree.leaves(caches), strict=True):
        np.testing.assert_array_equal(np.asarray(new), old)


def assert_logits_close(actual, reference):
    err = np.max(np.abs(np.asarray(actual) - reference)) / np.max(np.abs(reference))
    assert err <= LOGIT_RTOL, f"max relative logit error {err:.2e}"


def assert_states_close(actual, expected):
    for layer, ((rec, conv), (rec_want, conv_want)) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(rec, rec_want, **STATE_TOL, err_msg=f"recurrent {layer}")
        np.testing.assert_allclose(conv, conv_want, **STATE_TOL, err_msg=f"conv {layer}")


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(1234)
    model = random_module(lambda: HybridModel(CONFIG, nnx.Rngs(0)), rng)
    tokens = rng.integers(0, CONFIG.vocab_size, LENGTH).astype(np.int32)
    model_state = nnx.split(model)
    reference = jax.jit(lambda state, ids: nnx.merge(*state).reference_forward(ids))
    return model_state, tokens, np.asarray(reference(model_state, jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def cold_states(setup):
    """{p: states after exactly p tokens}, each from a cold prefill of [0, p)."""
    model_state, tokens, _ = setup
    lengths = [1, LENGTH, 3, 199, 64, 128, 65, 100]  # in pairs that fit one bucket
    states = {}
    for pair in zip(lengths[::2], lengths[1::2]):
        caches = Caches.init(CONFIG, NUM_SLOTS, NUM_BLOCKS)
        out = prefill(
            model_state,
            caches,
            prefill_batch(
                tokens, Span(0, pair[0], 0, (0, 1, 2, 3)), Span(0, pair[1], 1, (4, 5, 6, 7))
            ),
        )
        assert int(out.status) == PoolStatus.OK
        states |= {p: slot_states(out.caches, n) for n, p in enumerate(pair)}
    return states


def test_pure_state_is_flat_and_merges_back(setup):
    """`pure_state`'s parameters are the split's leaves one level deep (`FlatParams`);
    `merge` of it is the same model (graph and every parameter: so the same function, whose
    forward would cost a compile of its own here); pure_state of it returns it unchanged."""
    model_state, _, _ = setup
    pure = pure_state(model_state)
    assert isinstance(pure[1], FlatParams)
    assert len(jax.tree.leaves(pure)) == len(jax.tree.leaves(model_state))
    assert pure_state(pure) is pure
    merged = merge(pure)
    assert nnx.graphdef(merged) == model_state[0]
    for a, b in zip(jax.tree.leaves(nnx.state(merged)), jax.tree.leaves(model_state[1]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_pass_prefill_matches_reference(setup):
    model_state, tokens, ref = setup
    caches = Caches.init(CONFIG, NUM_SLOTS, NUM_BLOCKS)
    out = prefill(
        model_state,
        caches,
        prefill_batch(tokens, Span(0, LENGTH, 3, (0, 1, 2, 3)), Span(0, 37, 5, (6, 7))),
        return_logprobs=True,
    )
    assert int(out.status) == PoolStatus.OK
    assert_logits_close(out.logits[0], ref[LENGTH - 1])
    assert_logits_close(out.logits[1], ref[36])
    ref_logprobs = np.asarray(jax.nn.log_softmax(ref, axis=-1))
    next_logprobs = ref_logprobs[np.arange(LENGTH - 1), tokens[1:]]
    logprobs = np.asarray(out.token_logprobs)
    np.testing.assert_allclose(logprobs[: LENGTH - 1], next_logprobs, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(
        logprobs[LENGTH : LENGTH + 36], next_logprobs[:36], atol=1e-4, rtol=1e-5
    )
    assert logprobs[LENGTH - 1] == 0 and not np.any(logprobs[LENGTH + 36 :])


def test_snapshots_equal_the_state_after_exactly_p_tokens(setup, cold_states):
    """Snapshots at four offsets per span (offset 1 and 3 read into the zero conv history,
    64 / 128 on the chunk grid, 65 / 100 / 199 off it, 200 = the span's end)."""
    model_state, tokens, _ = setup
    for offsets in ((100, 1, LENGTH, 64), (3, 199, 128, 65)):
        caches = Caches.init(CONFIG, NUM_SLOTS, NUM_BLOCKS)
        out = prefill(
            model_state,
            caches,
            prefill_batch(
                tokens,
                Span(0, LENGTH, 0, offsets=offsets, dests=(5, 2, 9, 4)),
                Span(0, 40, 1, (4,), offsets=(3,), dests=(6,)),
            ),
        )
        assert int(out.status) == PoolStatus.OK
        for p, slot in zip((*offsets, 3), (5, 2, 9, 4, 6)):
            assert_states_close(slot_states(out.caches, slot), cold_states[p])


@pytest.mark.parametrize("split", [1, 64, 100, 128])
def test_resume_from_retained_snapshot_equals_cold_run(setup, cold_states, split):
    """[0, p) retains its state at p; [p, L) resumes from a copy of it, attends to the MLA
    blocks the first step wrote, and takes snapshots of its own (offset 1 and 2 read the
    resumed conv history)."""
    model_state, tokens, ref = setup
    caches = Caches.init(CONFIG, NUM_SLOTS, NUM_BLOCKS)
    out = prefill(
        model_state, caches, prefill_batch(tokens, Span(0, split, 0, offsets=(split,), dests=(1,)))
    )
    assert int(out.status) == PoolStatus.OK
    assert_logits_close(out.logits[0], ref[split - 1])
    caches, status = jax.jit(copy_slots, donate_argnums=0)(
        out.caches.kda, jnp.array([1], jnp.int32), jnp.array([2], jnp.int32)
    )
    assert int(status) == PoolStatus.OK
    caches = out.caches._replace(kda=caches)
    rest = LENGTH - split
    offsets = tuple(p for p in (1, 2, 128 - split, rest) if 0 < p <= rest)
    out = prefill(
        model_state,
        caches,
        prefill_batch(
            tokens,
            Span(
                split,
                LENGTH,
                2,
                has_initial=True,
                offsets=offsets,
                dests=tuple(range(3, 3 + len(offsets))),
            ),
        ),
    )
    assert int(out.status) == PoolStatus.OK
    assert_logits_close(out.logits[0], ref[LENGTH - 1])
    assert_states_close(slot_states(out.caches, 2), cold_states[LENGTH])
    for p, slot in zip(offsets, range(3, 7)):
        if split + p in cold_states:
            assert_states_close(slot_states(out.caches, slot), cold_states[split + p])


def test_decode_after_prefill_matches_reference(setup):
    model_state, tokens, ref = setup
    prompts, slots = (150, 90), (4, 9)
    caches = Caches.init(CONFIG, NUM_SLOTS, NUM_BLOCKS)
    out = prefill(
        model_state,
        caches,
        prefill_batch(
            tokens,
            Span(0, prompts[0], slots[0], (0, 1, 2, 3)),
            Span(0, prompts[1], slots[1], (8, 9, 10, 11)),
        ),
    )
    caches = out.caches
    tables = jnp.array([[0, 1, 2, 3], [8, 9, 10, 11]], jnp.int32)
    for step in range(3):
        positions = np.array(prompts) + step
        out = decode(
            model_state,
            caches,
            DecodeBatch(
                jnp.asarray(tokens[positions]),
                jnp.asarray(positions, jnp.int32),
                jnp.array(slots, jnp.int32),
                tables,
            ),
        )
        assert int(out.status) == PoolStatus.OK
        caches = out.caches
        for n in range(2):
            assert_logits_close(out.logits[n], ref[positions[n]])
    # A padding row reads and writes nothing; the other row carries on.
    before = slot_states(caches, slots[1])
    positions = np.array([prompts[0] + 3, 0])
    out = decode(
        model_state,
        caches,
        DecodeBatch(
            jnp.asarray(tokens[positions]),
            jnp.asarray(positions, jnp.int32),
            jnp.array([slots[0], -1], jnp.int32),
            tables,
        ),
    )
    assert_logits_close(out.logits[0], ref[positions[0]])
    assert not np.any(out.logits[1])
    for (rec, conv), (rec0, conv0) in zip(slot_states(out.caches, slots[1]), before):
        np.testing.assert_array_equal(rec, rec0)
        np.testing.assert_array_equal(conv, conv0)


BAD_SPANS = {
    "checkpoint slot out of range": (
        [Span(0, 50, 0, offsets=(10,), dests=(NUM_SLOTS,))],
        PoolStatus.SLOT_OUT_OF_RANGE,
    ),
    "checkpoint slot is another row's running slot": (
        [Span(0, 50, 0, offsets=(10,), dests=(7,)), Span(0, 20, 7, (4,))],
        PoolStatus.DUPLICATE_DESTINATION,
    ),
    "checkpoint slot repeated": (
        [Span(0, 50, 0, offsets=(10, 20), dests=(3, 3))],
        PoolStatus.DUPLICATE_DESTINATION,
    ),
    "offset past the span": (
        [Span(0, 50, 0, offsets=(10, 51), dests=(3, 4))],
        PoolStatus.OFFSET_OUT_OF_RANGE,
    ),
    "active slot without offset": (
        [Span(0, 50, 0, offsets=(10, -1), dests=(3, 4))],
        PoolStatus.DESTINATION_WITHOUT_OFFSET,
    ),
}


@pytest.mark.parametrize("case", BAD_SPANS)
def test_invalid_checkpoint_metadata_leaves_every_cache_untouched(setup, case):
    model_state, tokens, _ = setup
    caches = Caches.init(CONFIG, NUM_SLOTS, NUM_BLOCKS)
    caches = prefill(
        model_state,
        caches,
        prefill_batch(
            tokens, Span(0, 120, 0, offsets=(60, 120), dests=(3, 4)), Span(0, 80, 7, (4, 5, 6, 7))
        ),
    ).caches  # something to protect in every cache
    before = host_copy(caches)
    spans, code = BAD_SPANS[case]
    out = prefill(model_state, caches, prefill_batch(tokens, *spans))
    assert int(out.status) == code
    assert_unchanged(before, out.caches)


def test_invalid_decode_slots_leave_every_cache_untouched(setup):
    model_state, tokens, _ = setup
    caches = Caches.init(CONFIG, NUM_SLOTS, NUM_BLOCKS)
    caches = prefill(model_state, caches, prefill_batch(tokens, Span(0, 60, 2))).caches
    before = host_copy(caches)
    out = decode(
        model_state,
        caches,
        DecodeBatch(
            jnp.asarray(tokens[60:62]),
            jnp.array([60, 60], jnp.int32),
            jnp.array([2, 2], jnp.int32),
            jnp.array([[0, 1, 2, 3]] * 2, jnp.int32),
        ),
    )
    assert int(out.status) == PoolStatus.DUPLICATE_DESTINATION
    assert_unchanged(before, out.caches)


def test_new_lengths_offsets_and_slots_do_not_recompile(setup):
    model_state, tokens, _ = setup
    caches = Caches.init(CONFIG, NUM_SLOTS, NUM_BLOCKS)
    caches = prefill(model_state, caches, prefill_batch(tokens, Span(0, 10, 0))).caches
    decode_batch = DecodeBatch(
        jnp.asarray(tokens[:2]),
        jnp.array([10, 0], jnp.int32),
        jnp.array([0, -1], jnp.int32),
        jnp.array([[0, 1, 2, 3], [8, 9, 10, 11]], jnp.int32),
    )
    caches = decode(model_state, caches, decode_batch).caches
    sizes = prefill._cache_size(), decode._cache_size()
    assert min(sizes) >= 1
    for start, end, slot in ((11, 77, 0), (77, 200, 0), (0, 130, 5)):
        caches = prefill(
            model_state,
            caches,
            prefill_batch(
                tokens,
                Span(
                    start,
                    end,
                    slot,
                    has_initial=start > 0,
                    offsets=(end - start, 3),
                    dests=(slot + 1, slot + 2),
                ),
                Span(0, 33, 9, (8,), offsets=(1,), dests=(12,)),
            ),
        ).caches
        caches = decode(
            model_state,
            caches,
            decode_batch._replace(
                positions=jnp.array([end, 33], jnp.int32),
                state_slots=jnp.array([slot, 9], jnp.int32),
            ),
        ).caches
    assert (prefill._cache_size(), decode._cache_size()) == sizes


def test_decode_step_copies_no_kda_pool(setup):
    """The decode step updates every KDA pool in place (the layer's backend: the kernel on
    a GPU, XLA's gather / scatter on the CPU): no copy of a [slots, H, K, V] pool in its
    program; with the kernel, no [rows, H, K, V] states outside it either."""
    model_state, tokens, _ = setup
    caches = jax.eval_shape(lambda: Caches.init(CONFIG, NUM_SLOTS, NUM_BLOCKS))
    batch = DecodeBatch(*(jax.ShapeDtypeStruct(s, jnp.int32)
                          for s in ((2,), (2,), (2,), (2, MAX_BLOCKS))))
    hlo = decode.lower(model_state, caches, batch).compile().as_text()
    heads, dim = CONFIG.kda_num_heads, CONFIG.kda_head_dim
    pool = f"f32[{NUM_SLOTS},{heads},{dim},{dim}]"
    copies = [line for line in hlo.splitlines() if pool in line and " copy(" in line]
    assert not copies, copies[:3]
    if CONFIG.resolved_kda_backend() == "pallas":
        assert f"f32[2,{heads},{dim},{dim}]" not in hlo
