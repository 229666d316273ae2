"""MTP speculative decoding (glmjax.speculative, serving.speculative) on test_engine's model
(the tiny preset cut to a KDA and an MLA layer) in fp32 on the CPU: the verify step against
plain one-token decodes, the accepted state against the state plain decoding reaches, and
the engine's greedy output with and without speculation (with the MTP's own drafts, which
random weights almost never get right, and with oracle drafts that are often right), under
preemption, prefix hits and every stop. The engines share ``tests/test_engine.py``'s shapes
and weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import BASE, CONFIG, ENGINE, P, logprob_diff, make_engine
from test_engine import model_state as engine_model_state  # noqa: F401 (fixture)
from test_engine_faults import raise_once

import serving.speculative
from glmjax.batch import CHECKPOINT_CAPACITY, DecodeBatch, PrefillBatch
from glmjax.caches import Caches
from glmjax.model import decode, pure_state
from glmjax.speculative import (
    VerifyBatch,
    accept_and_draft,
    accepted_counts,
    spec_prefill,
    verify,
)
from glmjax.state_pool import PoolStatus
from serving.batch_builder import BatchBuckets
from serving.compiles import CompileLog
from serving.engine import EngineConfig
from serving.outputs import FinishReason
from serving.precompile import precompile, reachable_programs
from serving.request import SamplingParams
from serving.step import SchedulerConfig

# test_engine.py's engine shapes (slots, blocks, prefill tokens, sequences, table width):
# the steps compile once for the whole suite.
SLOTS, BLOCKS, TOKENS, SEQS, WIDTH = 8, 10, 3 * P, 4, 4
TABLES = np.full((SEQS, WIDTH), -1, np.int32)
TABLES[:2] = np.arange(8).reshape(2, WIDTH)
RUNNING = np.array([0, 1, -1, -1], np.int32)
N = 3  # speculative tokens of the engines


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def prefill_two(model_state, prompts):
    """Both prompts prefilled from cold (running slots 0 and 1, blocks 0-3 and 4-7)."""
    lengths = [len(p) for p in prompts]
    tokens = np.zeros(TOKENS, np.int32)
    tokens[: sum(lengths)] = prompts[0] + prompts[1]
    none = np.full((SEQS, CHECKPOINT_CAPACITY), -1, np.int32)
    cu = np.array([0, lengths[0]] + [sum(lengths)] * 3, np.int32)
    batch = PrefillBatch(tokens, np.zeros_like(tokens), cu, RUNNING, np.zeros(SEQS, bool), none,
                         none, TABLES, np.zeros(SEQS, np.int32))
    caches = Caches.init(CONFIG, SLOTS, BLOCKS, mtp=True)
    out = spec_prefill(model_state, caches, jax.device_put(batch), np.zeros(SEQS, np.int32))
    assert int(out.status) == PoolStatus.OK
    return out


def plain_decodes(model_state, caches, tokens, positions):
    """One-token decodes of tokens[j] (both sequences) at positions + j: logits and the
    KDA pools after each step."""
    logits, pools = [], []
    for j, step in enumerate(tokens):
        batch = DecodeBatch(np.pad(np.asarray(step, np.int32), (0, 2)),
                            np.array([positions[0] + j, positions[1] + j, 0, 0], np.int32),
                            RUNNING, TABLES)
        out = decode(model_state, caches, jax.device_put(batch))
        caches = out.caches
        logits.append(np.asarray(out.logits)[:2])
        pools.append(jax.tree.map(np.asarray, caches.kda))
    return logits, pools, caches


# The file's first test: the speculative programs (the prefill with drafts, verify,
# accept-and-draft, its donated twin) are compiled here by the precompile alone, and the
# tests after it reuse them (the steps' own tests below call them as the engine does).
@pytest.mark.slow  # compiles the speculative programs (~1 min)
def test_precompile_covers_every_speculative_program(engine_model_state):  # noqa: F811
    engine = make_engine(engine_model_state, speculative_tokens=N)
    report = precompile(engine, progress=False)
    assert report.programs == 14  # copies, 6 sampler variants, gathers of N and 4 N rows, the 4 above
    with CompileLog() as compiles:
        run_engine(engine, [("a", BASE[:150], SamplingParams(max_tokens=5, ignore_eos=True)),
                            ("b", BASE[:20], SamplingParams(max_tokens=4, ignore_eos=True))])
    assert engine.metrics().spec_verified_decodes > 0
    assert compiles.count == 0, compiles.by_function()


def test_accepted_counts_stop_at_the_first_mismatch():
    # Columns are sequences: drafts in rows 1..3 against the tokens sampled after rows 0..2.
    tokens = np.array([[9, 9, 9, 9], [1, 1, 1, 1], [2, 5, 2, 2], [3, 0, 3, 3]], np.int32)
    sampled = np.array([[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]], np.int32)
    got = accepted_counts(tokens, sampled, np.array([3, 3, 2, 0], np.int32))
    np.testing.assert_array_equal(got, [3, 1, 2, 0])


def test_verify_matches_plain_decodes_and_keeps_the_accepted_state(engine_model_state, rng):  # noqa: F811
    model_state = pure_state(engine_model_state)  # as the engine passes it: one program each
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (70, 33)]
    positions = [70, 33]
    pre = prefill_two(model_state, prompts)
    first = np.argmax(np.asarray(pre.logits)[:2], axis=-1).astype(np.int32)
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

    chain = np.full((4, SEQS), -1, np.int32)
    chain[:, :2] = [[0, 1], [2, 3], [4, 5], [6, 7]]
    batch = VerifyBatch(np.pad(tokens, ((0, 0), (0, 2))),
                        np.array(positions + [-1, -1], np.int32),
                        np.array([3, 3, 0, 0], np.int32), chain, TABLES)
    out = verify(model_state, copy(pre.caches), jax.device_put(batch))
    assert int(out.status) == PoolStatus.OK
    logits = np.asarray(out.logits).reshape(4, SEQS, -1)
    for j in range(4):
        np.testing.assert_allclose(logits[j, :2], want_logits[j], rtol=1e-5, atol=1e-5)
    assert not np.any(logits[:, 2:])  # padding sequences
    sampled = np.argmax(logits, axis=-1).astype(np.int32)
    drafted = accept_and_draft(model_state, out.caches, batch, tuple(sampled), out.hidden,
                               np.arange(4 * SEQS, dtype=np.int32), out.status,
                               num_speculative=3)
    np.testing.assert_array_equal(drafted.accepted, [3, 1, 0, 0])
    assert int(drafted.status) == PoolStatus.OK and drafted.drafts.shape == (SEQS, 3)
    for r, accepted in enumerate([3, 1]):
        for layer, pool in enumerate(drafted.caches.kda):
            want = want_pools[accepted][layer]
            # The two paths' fp32 sums round differently (more rows per matmul): an
            # element's error scales with the state, not with the element (on an AVX-512
            # host one of 16,384 was 2.5e-5 off relative to itself; the largest error is
            # 1.2e-6 of the state's largest element).
            scale = np.abs(want.recurrent[r]).max()
            np.testing.assert_allclose(pool.recurrent[r], want.recurrent[r], rtol=1e-5,
                                       atol=1e-5 * scale, err_msg=f"row {r} layer {layer}")
            np.testing.assert_allclose(pool.conv[r], want.conv[r], rtol=1e-5, atol=1e-5)


def test_a_refused_verify_and_its_drafting_write_nothing(engine_model_state, rng):  # noqa: F811
    model_state = pure_state(engine_model_state)
    pre = prefill_two(model_state, [rng.integers(0, CONFIG.vocab_size, n).tolist()
                                    for n in (20, 9)])
    before = jax.tree.map(np.asarray, pre.caches)
    chain = np.full((4, SEQS), -1, np.int32)
    chain[:, :2] = [[0, 1], [2, 3], [4, 1], [6, 7]]  # slot 1 twice: refused
    tokens = np.zeros((4, SEQS), np.int32)
    tokens[:, :2] = rng.integers(0, CONFIG.vocab_size, (4, 2))
    batch = VerifyBatch(tokens, np.array([20, 9, -1, -1], np.int32),
                        np.array([3, 3, 0, 0], np.int32), chain, TABLES)
    out = verify(model_state, pre.caches, jax.device_put(batch))
    assert int(out.status) == PoolStatus.DUPLICATE_DESTINATION
    sampled = (tokens[1],) * 4  # would accept the first draft
    drafted = accept_and_draft(model_state, out.caches, batch, sampled, out.hidden,
                               np.arange(4 * SEQS, dtype=np.int32), out.status,
                               num_speculative=3)
    np.testing.assert_array_equal(drafted.accepted, 0)
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(drafted.caches), strict=True):
        np.testing.assert_array_equal(old, new)


# --- the engine -----------------------------------------------------------------------------


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


def test_one_blocking_transfer_per_speculative_step(engine_model_state, monkeypatch):  # noqa: F811
    """Copies, prefill, verify, sampling, acceptance and drafts come back in one
    ``jax.device_get`` per step; any other device-to-host transfer would raise."""
    engine = make_engine(engine_model_state, speculative_tokens=N)
    first = [("a", BASE[:150], SamplingParams(max_tokens=4, ignore_eos=True))]
    run_engine(engine, first)  # compiles; "b" then resumes from its retained state
    fetches = []
    device_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda tree: fetches.append(1) or device_get(tree))
    for request_id, prompt in (("b", BASE[:140] + BASE[300:330]), ("c", BASE[200:260])):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    with jax.transfer_guard_device_to_host("disallow"):
        while engine.has_unfinished():
            before = len(fetches)
            engine.step()
            assert len(fetches) - before == 1
    assert engine.metrics().spec_verified_decodes > 0


def test_a_refused_verify_fails_its_requests_and_touches_nothing_retained(engine_model_state):  # noqa: F811
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    first = [("first", BASE[:150], sampling)]
    second = [("second", BASE[:140] + BASE[300:330], sampling)]
    clean = run_engine(make_engine(engine_model_state), first, second)
    engine = make_engine(engine_model_state, speculative_tokens=N)
    run_engine(engine, first)
    engine.add_request(*second[0])
    engine.step()  # second resumes from first's state at 128, samples its first token
    tokens = second[0][1]
    hit = engine.prefix_cache.lookup(tokens)
    assert hit.state_slot is not None
    before = [np.array(leaf[hit.state_slot]) for leaf in jax.tree.leaves(engine.caches.kda)]
    build = engine.builder.build

    def corrupt(step):  # the first draft's slot is the running slot: refused
        prefill, verify_batch = build(step)
        chain = verify_batch.slot_chain.copy()
        assert verify_batch.num_drafts[0] >= 1
        chain[1, 0] = chain[0, 0]
        return prefill, verify_batch._replace(slot_chain=chain)

    engine.builder.build = corrupt
    (output,) = engine.step()
    assert output.finish_reason is FinishReason.ERROR
    after = [np.array(leaf[hit.state_slot]) for leaf in jax.tree.leaves(engine.caches.kda)]
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, new)
    metrics = engine.metrics()
    assert (metrics.kv_blocks_used, metrics.state_slots_used, metrics.engine_resets) == (0, 0, 0)
    engine.builder.build = build
    again = run_engine(engine, second)["second"]
    assert again.output_token_ids == clean["second"].output_token_ids


@pytest.mark.parametrize("stage", ["spec_prefill", "verify", "accept_and_draft",
                                   "accept_and_draft_donated"])
def test_a_fault_in_a_speculative_call_fails_only_its_step(engine_model_state, stage,  # noqa: F811
                                                            monkeypatch):
    """As ``test_engine_faults``: the step's requests fail, everything they held is freed
    (after a call that consumed the caches, every request fails and the pools restart),
    and the engine serves the same answers again."""
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    first = [("first", BASE[:150], sampling)]
    later = [("second", BASE[:140] + BASE[300:330], sampling), ("third", BASE[200:260], sampling)]
    clean = run_engine(make_engine(engine_model_state), first, later)
    engine = make_engine(engine_model_state, speculative_tokens=N)
    run_engine(engine, first)
    name = stage.removesuffix("_donated")
    fault = raise_once(getattr(serving.speculative, name), after_call=stage.endswith("_donated"))
    monkeypatch.setattr(serving.speculative, name, fault)
    outputs = run_engine(engine, later)
    assert fault.fired
    failed = {i for i, o in outputs.items() if o.finish_reason is FinishReason.ERROR}
    assert failed
    for request_id in outputs.keys() - failed:
        assert outputs[request_id].output_token_ids == clean[request_id].output_token_ids
    metrics = engine.metrics()
    assert metrics.engine_resets == int(stage.endswith("_donated"))
    assert (metrics.kv_blocks_used, metrics.state_slots_used, metrics.running) == (0, 0, 0)
    again = run_engine(engine, [r for r in later if r[0] in failed])
    for request_id in failed:
        assert again[request_id].output_token_ids == clean[request_id].output_token_ids


def test_speculation_schedules_synchronously_and_refuses_mixed_steps(caplog):
    """A verified decode's length is known only at its step's fetch: the engine turns
    asynchronous scheduling off (saying so); mixed steps and fed programs are refused."""
    with caplog.at_level("INFO", logger="serving.engine"):
        config = EngineConfig(**ENGINE | dict(speculative_tokens=N, async_scheduling=True))
    assert not config.async_scheduling and not config.scheduler_config().async_scheduling
    assert "asynchronous scheduling off" in caplog.text
    assert EngineConfig(**ENGINE).async_scheduling  # main's default stands without it
    with pytest.raises(ValueError, match=f"--speculative-tokens {N} cannot run with "
                                         "--mixed-steps"):
        EngineConfig(**ENGINE | dict(speculative_tokens=N, mixed_steps=True))
    with pytest.raises(ValueError, match="needs async_scheduling=False"):
        SchedulerConfig(max_model_len=256, block_size=P, budget=P, speculative_tokens=N,
                        async_scheduling=True)
    buckets = BatchBuckets.for_config(config)
    for flags in (dict(feed=True), dict(mixed=True)):
        with pytest.raises(ValueError, match="synchronous, unmixed"):
            reachable_programs(buckets, speculative_tokens=N, **flags)


def test_the_server_checks_the_flag_before_reading_any_weight():
    pytest.importorskip("uvicorn")
    from serving.server import build_engine, parse_args

    with pytest.raises(ValueError, match="--speculative-tokens 2 cannot run with --mixed-steps"):
        build_engine(parse_args(["--preset", "glm5.3-flash", "--speculative-tokens", "2",
                                 "--mixed-steps"]))

    with pytest.raises(ValueError, match="--speculative-tokens 2: .*num_mtp_layers=0"):
        build_engine(parse_args(["--preset", "kimi-linear-48b", "--speculative-tokens", "2"]))
    with pytest.raises(SystemExit):
        parse_args(["--speculative-tokens", "4"])
