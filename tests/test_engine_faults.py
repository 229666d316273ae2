"""Failure isolation in serving.engine: a fault injected at every stage of a step fails
that step's requests only, frees everything they held, and leaves the caches able to
serve the same answers as an engine that never failed.

Faults are injected around the real model steps of test_engine's model (CPU, fp32): the
stage raises the first time it runs after being armed, before (or, for ``donated``, after)
the real call. The engines share ``tests/test_engine.py``'s shapes, so nothing recompiles.
"""

import itertools
import time

import jax
import numpy as np
import pytest
from test_engine import BASE, detokenize, make_engine, model_state  # noqa: F401 (fixture)

import serving.dispatch
from serving.engine import DeviceLostError
from serving.outputs import FinishReason
from serving.request import SamplingParams

FIRST = ("first", BASE[:150])  # finishes before the fault; retains states for SECOND
SECOND = ("second", BASE[:140] + BASE[300:330])  # resumes from FIRST's state at 128
THIRD = ("third", BASE[200:260])
GREEDY = SamplingParams(max_tokens=3)


class InjectedFault(RuntimeError):
    pass


def raise_once(fn, *, after_call=False):
    """``fn`` that raises ``InjectedFault`` on its first call (after running it when
    ``after_call``: the donated caches are then gone)."""
    fired = []

    def call(*args, **kwargs):
        if fired:
            return fn(*args, **kwargs)
        fired.append(True)
        if after_call:
            jax.block_until_ready(fn(*args, **kwargs))
        raise InjectedFault("injected")

    call.fired = fired
    return call


def arm(engine, stage: str, monkeypatch):
    """Arms a one-shot fault at ``stage``; returns the list that records it fired."""
    if stage in ("copy_state_slots", "prefill", "decode", "prefill_donated", "decode_donated"):
        name = stage.removesuffix("_donated")
        name = {"decode": "decode_pinned"}.get(name, name)  # the one-device engine's decode
        fault = raise_once(getattr(engine.steps, name), after_call=stage.endswith("_donated"))
        engine.steps = engine.steps._replace(**{name: fault})
    elif stage == "build":
        fault = engine.builder.build = raise_once(engine.builder.build)
    elif stage in ("sample", "keep_status"):  # the sampler; the decode status's copy
        name = {"sample": "sample_rows"}.get(stage, stage)
        fault = raise_once(getattr(serving.dispatch, name))
        monkeypatch.setattr(serving.dispatch, name, fault)
    elif stage == "update":
        fault = engine.scheduler.update_from_step = raise_once(engine.scheduler.update_from_step)
    elif stage == "detokenize":
        fault = engine._detokenize = raise_once(engine._detokenize)
    else:
        raise ValueError(stage)
    return fault.fired


def run(engine, requests) -> dict:
    for request_id, prompt in requests:
        engine.add_request(request_id, prompt, GREEDY)
    return engine.run_until_done()


@pytest.fixture(scope="module")
def clean(model_state):  # noqa: F811
    """Every request's output from an engine that never fails."""
    engine = make_engine(model_state)
    outputs = run(engine, [FIRST])
    return outputs | run(engine, [SECOND, THIRD])


def assert_idle(engine):
    metrics = engine.metrics()
    assert (metrics.running, metrics.waiting) == (0, 0)
    assert (metrics.kv_blocks_used, metrics.state_slots_used) == (0, 0), metrics


STAGES = ("build", "copy_state_slots", "prefill", "decode", "keep_status", "sample", "update",
          "detokenize", "prefill_donated", "decode_donated")


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_fails_only_its_step_and_the_engine_serves_on(model_state, clean, stage,  # noqa: F811
                                                              monkeypatch):
    engine = make_engine(model_state)
    run(engine, [FIRST])
    fired = arm(engine, stage, monkeypatch)
    outputs = run(engine, [SECOND, THIRD])
    assert fired, f"the {stage} fault never fired"
    failed = {i for i, o in outputs.items() if o.finish_reason is FinishReason.ERROR}
    assert failed, outputs
    for request_id in outputs.keys() - failed:
        assert outputs[request_id].output_token_ids == clean[request_id].output_token_ids
    metrics = engine.metrics()
    assert metrics.requests_failed == len(failed)
    # A request whose output fails after the step is done fails alone; the step stands.
    assert metrics.step_failures == int(stage != "detokenize")
    assert metrics.engine_resets == int(stage.endswith("_donated"))
    assert_idle(engine)
    # The pools and caches serve on: the failed requests again, then a prefix hit on them.
    again = run(engine, [(i, p) for i, p in (SECOND, THIRD) if i in failed])
    again |= run(engine, [("fourth", SECOND[1] + BASE[400:410])])
    for request_id in failed:
        assert again[request_id].output_token_ids == clean[request_id].output_token_ids
    assert again["fourth"].finish_reason is FinishReason.LENGTH
    assert_idle(engine)


def retained(engine, tokens) -> list[np.ndarray]:
    """What the prefix cache holds for ``tokens``: its retained state (every KDA pool's
    row) and its KV blocks (every MLA layer's)."""
    hit = engine.prefix_cache.lookup(tokens)
    assert hit.state_slot is not None and hit.block_ids, hit
    blocks = np.asarray(hit.block_ids)
    return ([np.array(leaf[hit.state_slot]) for leaf in jax.tree.leaves(engine.caches.kda)]
            + [np.array(leaf[blocks]) for leaf in jax.tree.leaves(engine.caches.mla)])


def test_a_refused_step_fails_its_requests_and_touches_nothing_retained(model_state, clean):  # noqa: F811
    engine = make_engine(model_state)
    run(engine, [FIRST])
    engine.add_request(*SECOND, GREEDY)  # resumes from what FIRST retained
    before = retained(engine, SECOND[1])
    build = engine.builder.build

    def corrupt(step, **kwargs):  # a snapshot destination equal to the running slot: refused
        prefill, decode = build(step, **kwargs)
        slots = prefill.checkpoint_slots.copy()
        slots[0, 0] = prefill.state_slots[0]
        offsets = prefill.checkpoint_offsets.copy()
        offsets[0, 0] = 1
        return prefill._replace(checkpoint_slots=slots, checkpoint_offsets=offsets), decode

    engine.builder.build = corrupt
    (output,) = engine.step()
    assert output.finish_reason is FinishReason.ERROR and output.request_id == SECOND[0]
    for old, new in zip(before, retained(engine, SECOND[1]), strict=True):
        np.testing.assert_array_equal(old, new)
    assert_idle(engine)
    engine.builder.build = build
    assert run(engine, [SECOND])[SECOND[0]].output_token_ids == clean[SECOND[0]].output_token_ids


def test_a_lost_device_is_fatal(model_state, monkeypatch):  # noqa: F811
    engine = make_engine(model_state)
    prefill = engine.steps.prefill

    def lost(*args, **kwargs):
        raise RuntimeError("device gone")

    def prefill_then_lose_the_device(*args, **kwargs):
        jax.block_until_ready(prefill(*args, **kwargs))  # the caches are donated
        monkeypatch.setattr(jax, "device_put", lost)
        raise InjectedFault("injected")

    engine.steps = engine.steps._replace(prefill=prefill_then_lose_the_device)
    engine.add_request(*THIRD, GREEDY)
    with pytest.raises(DeviceLostError, match="injected"):
        engine.step()


@pytest.mark.parametrize(
    "sampling, match",
    [
        (dict(top_k=3_000_000_000), "top_k"),
        (dict(top_k=2000), "exceeds the vocabulary"),
        (dict(stop_token_ids=(5, 10**12)), "token id"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(seed=1.5), "seed"),
        (dict(max_tokens=2**40), "max_tokens"),
    ],
)
def test_out_of_range_sampling_is_refused_at_admission(model_state, sampling, match):  # noqa: F811
    engine = make_engine(model_state)
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", BASE[:10], SamplingParams(**sampling))
    assert not engine.has_unfinished()
    assert_idle(engine)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "async"])
def test_one_blocking_transfer_per_step(model_state, monkeypatch, pipelined):  # noqa: F811
    """Copies, prefill, decode, sampling and the pool statuses come back in one
    ``jax.device_get`` per step; any other device-to-host transfer (``int(status)``,
    ``np.asarray``) would raise under the transfer guard. With asynchronous scheduling,
    step n + 1 is dispatched before step n is fetched, whenever it has work."""
    engine = make_engine(model_state, async_scheduling=pipelined)
    run(engine, [FIRST])  # compiles; SECOND then resumes from its retained state
    fetches, in_flight = [], {}
    device_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda tree: fetches.append(1) or device_get(tree))
    fetch = engine.fetch

    def recording_fetch(flight):
        in_flight[flight.step.step_id] = [f.step.step_id for f in engine._in_flight]
        return fetch(flight)

    monkeypatch.setattr(engine, "fetch", recording_fetch)
    steps, schedule = {}, engine.scheduler.schedule

    def recording_schedule():
        step = schedule()
        steps[step.step_id] = step
        return step

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    engine.add_request(*SECOND, GREEDY)
    with jax.transfer_guard_device_to_host("disallow"):
        for call in itertools.count():
            if not engine.has_unfinished():
                break
            if call == 1:  # THIRD prefills beside SECOND's decodes
                engine.add_request(*THIRD, GREEDY)
            before, waited = len(fetches), engine.metrics().device_wait_seconds
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            assert len(fetches) - before <= 1
            # The transfer's wait is counted, and is part of the step's time.
            waited = engine.metrics().device_wait_seconds - waited
            assert (waited > 0) == (len(fetches) > before) and waited <= seconds
    busy = sorted(i for i, step in steps.items() if not step.is_empty)
    assert len(fetches) == len(busy) and sorted(in_flight) == busy
    for i in busy:
        overlapped = pipelined and i + 1 in busy
        assert in_flight[i] == ([i + 1] if overlapped else []), (i, in_flight)
    kinds = {(bool(s.prefills), bool(s.decodes), bool(s.resume_state_copies))
             for s in steps.values()}
    assert (True, True, False) in kinds and (True, False, True) in kinds, kinds


def test_a_finishing_output_that_fails_still_reaches_its_waiter(model_state):  # noqa: F811
    """The output that finishes a request is built before the request is dropped: if
    building it raises, the request is reported failed, never left without a final output."""
    engine = make_engine(model_state)

    def fails_on_the_last_token(token_ids):
        if len(token_ids) == GREEDY.max_tokens:
            raise InjectedFault("injected")
        return detokenize(token_ids)

    engine._detokenize = fails_on_the_last_token
    outputs = run(engine, [THIRD])
    assert outputs[THIRD[0]].finish_reason is FinishReason.ERROR
    metrics = engine.metrics()
    assert (metrics.requests_failed, metrics.requests_finished) == (1, 0)
    assert_idle(engine)
    assert not engine.has_unfinished()
