"""The cases of `bench.prefill`: two serving sessions (coalescing on and off) fed the same
requests, and what each case measures. See `bench/prefill.py` for the run around them.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.buckets import DryRun, Output
from bench.flops import Span, step_flops
from bench.profile import profile_call, traceable
from glmjax.config import ModelConfig
from glmjax.model import prefill_step
from serving.compiles import CompileLog
from serving.engine import Engine
from serving.plan import plan_prefill
from serving.request import SamplingParams

MODES = {"coalesced": True, "ladder": False}
TARGET_RATIOS = {8192: 1.51, 16384: 1.24, 32768: 1.12}  # upstream cold-prefill speedups
MAX_STEPS = 100_000  # per request: a scheduler that stops making progress is a bug


class Session:
    """One engine (or `DryRun`); the latest output of each of its requests in `outputs`.
    Its greedy requests ask for `top_logprobs` alternatives per token (bench.prefill
    reads them to tell near ties; a decode benchmark times the plain request)."""

    def __init__(self, engine: Engine | DryRun, outputs: dict[str, Output], *,
                 top_logprobs: int = 0):
        self.engine = engine
        self.outputs = outputs
        self.sampling = SamplingParams(top_logprobs=top_logprobs)

    def step(self) -> None:
        for out in self.engine.step():
            self.outputs[out.request_id] = Output(
                out.request_id, tuple(out.output_token_ids), tuple(out.logprobs),
                out.num_cached_tokens, tuple(out.top_logprobs))

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
        """Adds a greedy request, steps until its first token: (seconds, steps) since added."""
        start = time.perf_counter()
        self.engine.add_request(request_id, prompt,
                                dataclasses.replace(self.sampling, max_tokens=max_tokens))
        for steps in range(1, MAX_STEPS):
            self.step()
            if request_id in self.outputs:
                return time.perf_counter() - start, steps
        raise RuntimeError(f"request {request_id!r} got no token in {MAX_STEPS} steps")

    def device_wait_seconds(self) -> float:
        """The engine's wait for the device since it started (`Engine.metrics`; a dry run
        has no device: 0)."""
        return 0.0 if isinstance(self.engine, DryRun) else self.engine.metrics().device_wait_seconds

    def generated(self, request_ids: Sequence[str]) -> int:
        return sum(len(self.outputs[r].output_token_ids) for r in request_ids)


@dataclasses.dataclass
class Run:
    """Both sessions of a run, its prompts, and the compiles seen while timing."""

    sessions: dict[str, Session]  # keyed like MODES
    args: argparse.Namespace
    vocab_size: int
    compile_log: CompileLog
    rng: np.random.Generator
    compiles_during_timing: int = 0

    def prompt(self, length: int) -> list[int]:
        """A fresh random prompt: none of its blocks is in a prefix cache."""
        return self.rng.integers(0, self.vocab_size, length).tolist()

    def samples(self, measure: Callable, length: int = 0) -> dict[str, dict[str, list]]:
        """`measure(tag, session, prompt)` for each sample (one fresh prompt of `length` each)
        and each session, alternating which goes first; lists of what timed samples return."""
        modes = {mode: collections.defaultdict(list) for mode in MODES}
        for i in range(self.args.warmup + self.args.samples):
            warm = i < self.args.warmup
            tag, prompt = f"{'w' if warm else 's'}{i}", self.prompt(length)
            for mode, session in list(self.sessions.items())[:: 1 if i % 2 == 0 else -1]:
                compiles = len(self.compile_log.events)
                values = measure(tag, session, prompt)
                if not warm:
                    self.compiles_during_timing += len(self.compile_log.events) - compiles
                    for key, value in values.items():
                        modes[mode][key].append(value)
        return {mode: dict(values) for mode, values in modes.items()}

    def add_decoders(self, name: str, count: int) -> list[str]:
        """`count` requests decoding at `--decode-context` tokens in both sessions, added one
        at a time (no prefill step packs two of them)."""
        block = self.args.block_size * self.args.dcp
        ids = [f"{name}-d{k}" for k in range(count)]
        for request_id in ids:
            prompt = self.prompt(self.args.decode_context - block)
            for session in self.sessions.values():
                session.add(request_id, prompt, block)
        return ids

    def abort(self, request_ids: Sequence[str]) -> None:
        for session in self.sessions.values():
            for request_id in request_ids:
                session.engine.abort(request_id)
            session.step()  # reports the aborts


def _with_medians(modes: dict, *keys: str) -> dict:
    for values in modes.values():
        for key in keys:
            values[f"median_{key}"] = statistics.median(values[key]) if values.get(key) else None
    return modes


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def cold_case(run: Run, length: int) -> dict:
    """Cold prompts of `length` tokens, one greedy token each; of each TTFT, the seconds the
    engine waited for the device (the rest is the host's: scheduling, batch building,
    dispatch, the CUDA graphs' update and launch)."""

    def measure(tag, session, prompt):
        request_id = f"cold-{length}-{tag}"
        waited = session.device_wait_seconds()
        seconds, steps = session.add(request_id, prompt, 1)
        waited = session.device_wait_seconds() - waited
        return dict(ttft_s=seconds, steps=steps, device_wait_s=waited,
                    cached_tokens=session.outputs[request_id].num_cached_tokens)

    modes = _with_medians(run.samples(measure, length), "ttft_s", "device_wait_s")
    for values in modes.values():
        values["tokens_per_s"] = _ratio(length, values["median_ttft_s"])
    ladder, coalesced = (modes[m]["median_ttft_s"] for m in ("ladder", "coalesced"))
    return dict(tokens=length, **modes, ratio=_ratio(ladder, coalesced),
                target_ratio=TARGET_RATIOS.get(length))


def beside_case(run: Run, length: int) -> dict:
    """Cold prompts of `length` tokens while `--decoders` requests decode."""
    decoders = run.add_decoders(f"beside-{length}", run.args.decoders)

    def measure(tag, session, prompt):
        before = session.generated(decoders)
        seconds, _ = session.add(f"beside-{length}-{tag}", prompt, 1)
        return dict(ttft_s=seconds,
                    decode_tokens_per_s=(session.generated(decoders) - before) / seconds)

    modes = _with_medians(run.samples(measure, length), "ttft_s", "decode_tokens_per_s")
    run.abort(decoders)
    ladder, coalesced = (modes[m]["median_ttft_s"] for m in ("ladder", "coalesced"))
    return dict(tokens=length, decoders=run.args.decoders,
                decode_context=run.args.decode_context, **modes,
                ttft_ratio=_ratio(ladder, coalesced))


def decode_case(run: Run, concurrency: int) -> dict:
    """`concurrency` requests decoding: tokens/s over `--decode-steps` steps a sample."""
    decoders = run.add_decoders(f"decode-c{concurrency}", concurrency)

    def measure(tag, session, prompt):
        before, start = session.generated(decoders), time.perf_counter()
        for _ in range(run.args.decode_steps):
            session.step()
        return dict(tokens_per_s=(session.generated(decoders) - before)
                    / (time.perf_counter() - start))

    modes = _with_medians(run.samples(measure), "tokens_per_s")
    run.abort(decoders)
    coalesced, ladder = (modes[m]["median_tokens_per_s"] for m in ("coalesced", "ladder"))
    return dict(concurrency=concurrency, context=run.args.decode_context, **modes,
                ratio=_ratio(coalesced, ladder))


CASES = {"decode": decode_case, "beside": beside_case, "cold": cold_case}


def profile_case(run: Run, length: int, config: ModelConfig, device_kind: str,
                 trace_dir: Path) -> dict:
    """The first step of a cold `length`-token prompt in each session, traced once
    (`bench.profile`): the coalesced span and the ladder's first step. An untraced prompt of
    the same length runs first, so the step is compiled and warm. Both sessions get the
    same prompt, so its greedy token joins the comparison of the two."""
    args, out = run.args, {}
    warm_up, prompt = run.prompt(length), run.prompt(length)
    request_id = f"profile-{length}"
    for mode, session in run.sessions.items():
        timed_steps = session.engine.steps
        if timed_steps.mesh is None:  # a twin step whose kernels keep their op names
            session.engine.steps = timed_steps._replace(prefill=traceable(
                prefill_step, donate_argnums=1, static_argnames="return_logprobs"))
        session.add(f"{request_id}-warm-up", warm_up, 1)
        first = plan_prefill(length, 0, block_size=args.block_size, dcp=args.dcp,
                             budget=args.budget, coalesce=MODES[mode])[0]
        session.engine.add_request(request_id, prompt, SamplingParams(max_tokens=1))
        out[mode] = profile_call(
            lambda session=session: (session.step(), session.engine.caches)[1],
            trace_dir / mode, flops=step_flops(config, [Span(first.end - first.start, first.start)]),
            device_kind=device_kind) | {"step_tokens": first.end - first.start}
        for _ in range(MAX_STEPS):
            if request_id in session.outputs:
                break
            session.step()
        session.engine.steps = timed_steps
    return dict(tokens=length, **out)


def compare_greedy(on: dict[str, Output], off: dict[str, Output]) -> dict:
    """Paired requests' tokens up to the first difference, logprobs where the tokens agree
    (DESIGN section 6: |on - off| <= 0.1 + 0.02 |off|), at each first difference whether
    it is a near tie (`_first_difference`), and each schedule's count of non-finite
    logprobs (a NaN or inf logit row)."""
    tokens, compared, differing, max_diff, within = {}, 0, [], 0.0, True
    near_ties = {}
    for request_id in sorted(on.keys() & off.keys()):
        a, b = on[request_id], off[request_id]
        length = min(len(a.output_token_ids), len(b.output_token_ids))
        same = next((k for k in range(length)
                     if a.output_token_ids[k] != b.output_token_ids[k]), length)
        compared += min(same + 1, length)
        if same < length:
            differing.append(request_id)
            near_ties[request_id] = _first_difference(a, b, same)
        if same:
            diff = np.abs(np.subtract(a.logprobs[:same], b.logprobs[:same]))
            max_diff = max(max_diff, float(diff.max()))
            within &= bool(np.all(diff <= 0.1 + 0.02 * np.abs(b.logprobs[:same])))
        tokens[request_id] = {"coalesced": list(a.output_token_ids),
                              "ladder": list(b.output_token_ids)}
    nonfinite = {name: int(sum(np.count_nonzero(~np.isfinite(o.logprobs)) for o in outs.values()))
                 for name, outs in (("coalesced", on), ("ladder", off))}
    return dict(requests=len(tokens), compared_tokens=compared, identical=not differing,
                differing_requests=differing, nonfinite_logprobs=nonfinite,
                max_abs_logprob_diff=max_diff,
                logprobs_within_design_bound=within,
                all_differences_near_ties=all(t["near_tie"] for t in near_ties.values()),
                near_ties=near_ties, tokens=tokens)


def _first_difference(a: Output, b: Output, position: int) -> dict:
    """Where two runs' greedy tokens first differ: each run's gap from its own top token to
    the other run's choice (inf when that is not among its top logprobs). A near tie is
    both gaps within DESIGN section 6's logprob bound, so rounding explains the flip."""
    if not (len(a.top_logprobs) > position and len(b.top_logprobs) > position):
        return dict(position=position, near_tie=False, reason="no top logprobs recorded")
    top_a, top_b = dict(a.top_logprobs[position]), dict(b.top_logprobs[position])
    chosen_a, chosen_b = a.output_token_ids[position], b.output_token_ids[position]
    if chosen_a not in top_a or chosen_b not in top_b:
        # A greedy token is its own run's top-1 unless the logits were not finite (argmax
        # takes a NaN; the log-softmax is NaN everywhere then).
        return dict(position=position, near_tie=False, tokens=[chosen_a, chosen_b],
                    logprobs=[a.logprobs[position], b.logprobs[position]],
                    reason="a run's greedy token is not among its own top logprobs")
    gaps = [top_a[chosen_a] - top_a.get(chosen_b, -np.inf),
            top_b[chosen_b] - top_b.get(chosen_a, -np.inf)]
    bound = 0.1 + 0.02 * abs(top_b[chosen_b])
    return dict(position=position, tokens=[chosen_a, chosen_b], gaps=gaps, bound=bound,
                near_tie=bool(max(gaps) <= bound))
