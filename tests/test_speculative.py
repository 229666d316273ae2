"""MTP speculative decoding (glmjax.speculative, serving.speculative) on the tiny preset in
fp32 on the CPU: the verify step against plain one-token decodes, the accepted state
against the state plain decoding reaches, and the engine's greedy output with and without
speculation (with the MTP's own drafts, which random weights almost never get right, and
with oracle drafts that are often right), under preemption, prefix hits and every stop.
The engines share ``tests/test_engine.py``'s shapes and weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_engine import BASE, logprob_diff, make_engine
from test_engine import model_state as engine_model_state  # noqa: F401 (fixture)
from test_layers_oracles import random_module

from glmjax.batch import CHECKPOINT_CAPACITY, DecodeBatch, PrefillBatch
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.model import HybridModel, decode
from glmjax.speculative import (
    VerifyBatch,
    accept_and_draft,
    accepted_counts,
    spec_prefill,
    verify,
)
from glmjax.state_pool import PoolStatus
from serving.request import SamplingParams

P = 64
CONFIG = dataclasses.replace(ModelConfig.preset("tiny"), kv_block_size=P)
SLOTS, BLOCKS, WIDTH = 12, 8, 4


@pytest.fixture(scope="module")
def model_state():
    model = random_module(lambda: HybridModel(CONFIG, nnx.Rngs(0)), np.random.default_rng(7))
    return nnx.split(model)


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def prefill_two(model_state, prompts):
    """Both prompts prefilled from cold (running slots 0 and 1, blocks 0-3 and 4-7)."""
    lengths = [len(p) for p in prompts]
    tokens = np.zeros(2 * P * 2, np.int32)
    tokens[: lengths[0]] = prompts[0]
    tokens[lengths[0] : sum(lengths)] = prompts[1]
    none = np.full((2, CHECKPOINT_CAPACITY), -1, np.int32)
    batch = PrefillBatch(
        tokens, np.zeros_like(tokens), np.array([0, lengths[0], sum(lengths)], np.int32),
        np.array([0, 1], np.int32), np.zeros(2, bool), none, none,
        np.arange(8, dtype=np.int32).reshape(2, WIDTH), np.zeros(2, np.int32))  # fmt: skip
    caches = Caches.init(CONFIG, SLOTS, BLOCKS, mtp=True)
    out = spec_prefill(model_state, caches, batch, np.zeros(2, np.int32))
    assert int(out.status) == PoolStatus.OK
    return out


def plain_decodes(model_state, caches, tokens, positions):
    """One-token decodes of tokens[j] (both sequences) at positions + j: logits and the
    KDA pools after each step."""
    logits, pools = [], []
    for j, step in enumerate(tokens):
        batch = DecodeBatch(np.asarray(step, np.int32), np.asarray(positions, np.int32) + j,
                            np.array([0, 1], np.int32),
                            np.arange(8, dtype=np.int32).reshape(2, WIDTH))
        out = decode(model_state, caches, batch)
        caches = out.caches
        logits.append(np.asarray(out.logits))
        pools.append(jax.tree.map(np.asarray, caches.kda))
    return logits, pools, caches


def test_accepted_counts_stop_at_the_first_mismatch():
    # Columns are sequences: drafts in rows 1..3 against the tokens sampled after rows 0..2.
    tokens = np.array([[9, 9, 9, 9], [1, 1, 1, 1], [2, 5, 2, 2], [3, 0, 3, 3]], np.int32)
    sampled = np.array([[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]], np.int32)
    got = accepted_counts(tokens, sampled, np.array([3, 3, 2, 0], np.int32))
    np.testing.assert_array_equal(got, [3, 1, 2, 0])


def test_verify_matches_plain_decodes_and_keeps_the_accepted_state(model_state, rng):
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (70, 33)]
    positions = [70, 33]
    pre = prefill_two(model_state, prompts)
    first = np.argmax(np.asarray(pre.logits), axis=-1).astype(np.int32)
    # The greedy continuation of both, from plain decodes.
    caches = copy(pre.caches)
    greedy = [first]
    for j in range(3):
        logits, _, caches = plain_decodes(model_state, caches, [greedy[-1]], np.add(positions, j))
        greedy.append(np.argmax(logits[0], axis=-1).astype(np.int32))
    # Drafts: sequence 0 gets the right three, sequence 1 a wrong second draft.
    drafts = np.stack(greedy[1:])  # [3, 2]
    drafts[1, 1] = (drafts[1, 1] + 1) % CONFIG.vocab_size
    tokens = np.concatenate([first[None], drafts]).astype(np.int32)  # [4, 2]
    want_logits, want_pools, _ = plain_decodes(model_state, copy(pre.caches), tokens, positions)

    batch = VerifyBatch(tokens, np.array(positions, np.int32), np.array([3, 3], np.int32),
                        np.array([[0, 1], [2, 3], [4, 5], [6, 7]], np.int32),
                        np.arange(8, dtype=np.int32).reshape(2, WIDTH))
    out = verify(model_state, copy(pre.caches), batch)
    assert int(out.status) == PoolStatus.OK
    logits = np.asarray(out.logits).reshape(4, 2, -1)
    for j in range(4):
        np.testing.assert_allclose(logits[j], want_logits[j], rtol=1e-5, atol=1e-5)
    sampled = np.argmax(logits, axis=-1).astype(np.int32)
    drafted = accept_and_draft(model_state, out.caches, batch, sampled.reshape(-1), out.hidden,
                               np.arange(8, dtype=np.int32), out.status, num_speculative=3)
    np.testing.assert_array_equal(drafted.accepted, [3, 1])
    assert int(drafted.status) == PoolStatus.OK and drafted.drafts.shape == (2, 3)
    for r, accepted in enumerate([3, 1]):
        for layer, pool in enumerate(drafted.caches.kda):
            want = want_pools[accepted][layer]
            np.testing.assert_allclose(pool.recurrent[r], want.recurrent[r], rtol=1e-5,
                                       atol=1e-6, err_msg=f"row {r} layer {layer}")
            np.testing.assert_allclose(pool.conv[r], want.conv[r], rtol=1e-5, atol=1e-5)


# --- the engine -----------------------------------------------------------------------------

N = 3


def requests(plain_free):
    """Two waves of (id, prompt, sampling): long prompts (preemption in a pool of 10
    blocks), then one sharing a prefix with them (a hit), every kind of stop, and a seeded
    sampled request (never speculated)."""
    greedy = dict(ignore_eos=True)
    free = plain_free.output_token_ids
    first = [(f"g{i}", BASE[100 * i : 100 * i + 190], SamplingParams(max_tokens=6 + 2 * i,
                                                                      **greedy))
             for i in range(3)]
    return first, [
        ("shares_g2", BASE[200:328] + BASE[:9], SamplingParams(max_tokens=9, **greedy)),
        ("stop_id", BASE[:40], SamplingParams(max_tokens=12, stop_token_ids=(free[5],), **greedy)),
        ("stop_str", BASE[:40], SamplingParams(max_tokens=12, stop=(f"<{free[3]}><",), **greedy)),
        ("seeded", BASE[:40], SamplingParams(max_tokens=6, temperature=0.8, seed=3, **greedy)),
    ]


def run_engine(engine, *waves):
    outputs = {}
    for wave in waves:
        for request_id, prompt, sampling in wave:
            engine.add_request(request_id, prompt, sampling)
        outputs |= engine.run_until_done()
    return outputs


@pytest.fixture(scope="module")
def plain(engine_model_state):  # noqa: F811
    engine = make_engine(engine_model_state)
    free = run_engine(engine, [("free", BASE[:40], SamplingParams(max_tokens=12,
                                                                  ignore_eos=True))])["free"]
    waves = requests(free)
    return waves, run_engine(make_engine(engine_model_state), *waves)


def oracle_drafts(engine, plain_outputs, rng):
    """Replaces the MTP's drafts by the plain run's next tokens, a third of the time with
    one wrong."""
    runner = engine._speculative
    set_drafts = runner.set_drafts

    def set_oracle(engine):
        for request_id in runner.drafts:
            request = engine.scheduler.get_request(request_id)
            if request is None:
                continue
            done = len(request.output_token_ids)
            drafts = list(plain_outputs[request_id].output_token_ids[done : done + N])
            if drafts and rng.random() < 1 / 3:
                drafts[rng.integers(len(drafts))] ^= 1
            runner.drafts[request_id] = tuple(drafts)
        set_drafts(engine)

    runner.set_drafts = set_oracle


@pytest.mark.parametrize("drafts", ["mtp", "oracle"])
def test_greedy_output_is_the_plain_output(engine_model_state, plain, drafts, rng):  # noqa: F811
    waves, want = plain
    engine = make_engine(engine_model_state, speculative_tokens=N)
    if drafts == "oracle":
        oracle_drafts(engine, want, rng)
    got = run_engine(engine, *waves)
    diffs = []
    for request_id, _, _ in waves[0] + waves[1]:
        a, b = got[request_id], want[request_id]
        assert a.output_token_ids == b.output_token_ids, request_id
        assert (a.finish_reason, a.stop_reason, a.text) == (b.finish_reason, b.stop_reason,
                                                           b.text), request_id
        diffs.append(logprob_diff(a.logprobs, b.logprobs))
    metrics = engine.metrics()
    assert (metrics.kv_blocks_used, metrics.state_slots_used) == (0, 0)
    assert metrics.prefix_cache_hits > 0 and metrics.spec_verified_decodes > 0
    if drafts == "oracle":  # decodes finish sooner: the pool no longer runs short
        assert metrics.spec_tokens_per_step > 1.5, metrics
    else:
        assert metrics.preemptions > 0
    print(f"{drafts}: acceptance {metrics.spec_acceptance_rate:.2f}, "
          f"{metrics.spec_tokens_per_step:.2f} tokens per verified decode, "
          f"max |logprob - plain| = {max(diffs):.3g}")
