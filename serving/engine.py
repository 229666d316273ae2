"""The serving loop: scheduler, batch builder, model steps and sampler, one step at a time.

    engine = Engine(model_config, model, EngineConfig(max_model_len=4096,
                                                      num_kv_blocks=256, num_state_slots=64))
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=32, temperature=0.7))
    outputs = engine.run_until_done()          # {request_id: final RequestOutput}

Each step follows the scheduler's contract (``serving.scheduler``): schedule; copy the
step's KV blocks (copy-on-write) and resume states into their slots; run the model's
prefill and / or decode on the device batches; copy the retained end states out of the
running slots; sample a token for every request the step samples (all dispatched back to
back, ``serving.dispatch``); fetch the results in one blocking transfer; hand the tokens
back to the scheduler, which registers what the step retained.

With ``async_scheduling`` (the default) each ``step()`` call schedules and dispatches the
next step before it blocks on the results of the one in flight, so the host's scheduling,
batch building and output processing overlap the device's work; the call returns the
outputs of the step it fetched. Tokens sampled past a stop are never emitted.

A step that fails fails only its own requests (with a step dispatched after it, that
step's rows of those requests are computed and dropped). Whatever raises while the step is
built, run or sampled (a model refusal, ``StepRefusedError``, which leaves the caches unchanged;
an input the device dtypes cannot hold; a bug), ``step()`` aborts the step's requests
(``Scheduler.abort_step``: their blocks, slots and pins go back, nothing is registered)
and reports each finished with ``FinishReason.ERROR``; every other request goes on. A
failure inside a device call that had already consumed its donated caches leaves no
caches to go on with: the engine then fails every live request and starts again from
empty pools and a fresh prefix cache (counted in ``engine_resets``). Only a device that no
longer answers is fatal: ``step()`` raises ``DeviceLostError``.

At dcp > 1 a block id names P * dcp tokens, so the model's ``kv_block_size`` must be
``block_size * dcp``. By default the model runs on one device, where such a block is one
physical block (dcp emulated); with ``steps`` from ``glmjax.sharding.ShardingPlan`` it runs
on a (tp, dcp) mesh, where each dcp rank holds P tokens of every block id.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model import HybridModel, ModelState
from glmjax.sharding import ModelSteps, single_device_steps
from serving.batch_builder import BatchBuckets, BatchBuilder
from serving.block_allocator import BlockAllocator
from serving.dispatch import InFlight, StepDispatch, StepRefusedError
from serving.engine_config import EngineConfig
from serving.outputs import EngineMetrics, FinishReason, RequestOutput, TrackedRequest
from serving.pinned import PinnedDecode
from serving.prefix_cache import PrefixCache
from serving.request import SamplingParams
from serving.sampling import SEED_LIMIT
from serving.scheduler import Scheduler
from serving.speculative import COUNTERS as SPECULATIVE_COUNTERS
from serving.speculative import SpeculativeInFlight, SpeculativeRunner, trim_draws
from serving.state_slots import StateSlotAllocator
from serving.step import ScheduledStep
from serving.step_failures import DeviceLostError, StepFailures

__all__ = ["DeviceLostError", "Engine", "EngineConfig", "StepRefusedError"]

logger = logging.getLogger(__name__)


class Engine(StepDispatch, StepFailures):
    """Runs requests to completion on one model and one set of caches."""

    def __init__(
        self,
        config: ModelConfig,
        model: HybridModel | ModelState | nnx.State,
        engine_config: EngineConfig,
        *,
        detokenize: Callable[[Sequence[int]], str] | None = None,
        steps: ModelSteps | None = None,
    ):
        """Args:
          config: the model's config.
          model: the model, ``nnx.split(model)``, or its parameters alone (an
            ``nnx.State`` of the module ``HybridModel(config)``).
          engine_config: memory and scheduling.
          detokenize: token ids -> text; needed for stop strings and ``text``.
          steps: where and how the model runs (default: one device).

        Raises:
          ValueError: for a model whose config or KV block size does not match, steps on
            a mesh whose dcp differs from the engine's, or ``mixed_steps`` with steps that
            have no mixed forward.
        """
        if isinstance(model, HybridModel):
            if model.config != config:
                raise ValueError(
                    f"model config {model.config.name!r} differs from config {config.name!r}"
                )
            model = nnx.split(model)
        elif isinstance(model, nnx.State):
            graphdef, _ = nnx.split(nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0))))
            model = (graphdef, model)
        tokens_per_block = engine_config.block_size * engine_config.dcp
        if config.kv_block_size != tokens_per_block:
            raise ValueError(
                f"model kv_block_size {config.kv_block_size} must equal block_size * dcp = "
                f"{tokens_per_block} (one device holds a block id's tokens in one block)"
            )
        steps = steps or single_device_steps(config)
        if steps.dcp not in (None, engine_config.dcp):
            raise ValueError(f"the mesh has dcp={steps.dcp}, the engine dcp={engine_config.dcp}")
        if engine_config.mixed_steps and steps.mixed is None:
            raise ValueError("mixed_steps: these steps have no mixed forward (a mesh has none yet)")
        if engine_config.mixed_steps and config.batch_invariant:
            # A decoding row's MLP / MoE products would run among a prefill's rows in a mixed
            # step and through the decode weight stream otherwise: two roundings.
            raise ValueError("--batch-invariant cannot run with --mixed-steps: a decoding "
                             "row would round differently in a mixed step and a decode step")
        sched_config = engine_config.scheduler_config()
        self.config = engine_config
        self.model_config = config
        self.steps = steps
        self._model_state: ModelState = steps.place(model)
        self._detokenize = detokenize
        self._speculative = None
        if engine_config.speculative_tokens:
            self._speculative = SpeculativeRunner(config, engine_config.speculative_tokens,
                                                  on_mesh=steps.mesh is not None)
        buckets = BatchBuckets.for_config(sched_config)
        if engine_config.single_bucket:
            buckets = buckets.largest_only()
        self.builder = BatchBuilder(
            sched_config,
            num_blocks=engine_config.num_kv_blocks,
            num_slots=engine_config.num_state_slots,
            buckets=buckets,
        )
        self._rows = buckets.seqs[-1]  # copies and sampled rows per step are at most this
        self._make_pools()
        self._seeds = np.random.default_rng(engine_config.seed)
        self._tracked: dict[str, TrackedRequest] = {}
        self._aborted: list[RequestOutput] = []
        self._idle = False  # the last step scheduled nothing, preempted no one, none in flight
        self._counts = dict(
            requests_added=0,
            requests_finished=0,
            requests_aborted=0,
            requests_failed=0,
            step_failures=0,
            engine_resets=0,
            prompt_tokens=0,
            cached_prompt_tokens=0,
            generated_tokens=0,
            preemptions=0,
            kv_block_copies=0,
            steps=0,
            device_wait_seconds=0.0,
        ) | dict.fromkeys(SPECULATIVE_COUNTERS, 0)

    def _make_pools(self) -> None:
        """Empty caches, allocators, prefix cache and scheduler, fresh pinned decode buffers
        (at start and on a reset)."""
        config = self.config
        self.prefix_cache = PrefixCache(
            BlockAllocator(config.num_kv_blocks, block_size=config.block_size, dcp=config.dcp),
            StateSlotAllocator(config.num_state_slots),
        )
        self.scheduler = Scheduler(config.scheduler_config(), self.prefix_cache)
        init_caches = self.steps.init_caches if self._speculative is None else (
            self._speculative.init_caches)
        self.caches = init_caches(config.num_state_slots, config.num_kv_blocks)
        self._pinned = PinnedDecode(self._rows, self.model_config.vocab_size)
        self._in_flight: collections.deque = collections.deque()  # InFlight, oldest first

    @property
    def model_state(self) -> ModelState:
        """The parameters as placed for the steps."""
        return self._model_state

    @property
    def schedule_log(self) -> list[dict]:
        """One plain-data entry per step when ``log_schedule`` is set (else empty)."""
        return self.scheduler.schedule_log

    def has_unfinished(self) -> bool:
        """Whether a request is live, an abort unreported, or a step still in flight."""
        return self.scheduler.has_unfinished() or bool(self._aborted) or bool(self._in_flight)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
    ) -> None:
        """Queues a request.

        Raises:
          ValueError: as ``Scheduler.add_request`` does, for a token id (prompt or stop)
            outside the vocabulary, ``top_k`` over the vocabulary size, or stop strings
            without a detokenizer.
        """
        sampling = sampling or SamplingParams()
        vocab = self.model_config.vocab_size
        bad = [t for t in (*prompt_token_ids, *sampling.stop_token_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token id {bad[0]} outside [0, {vocab})")
        if sampling.top_k > vocab:
            raise ValueError(
                f"request {request_id!r}: top_k {sampling.top_k} exceeds the vocabulary ({vocab})"
            )
        if sampling.stop and self._detokenize is None:
            raise ValueError(
                f"request {request_id!r} has stop strings but the engine has no detokenize callback"
            )
        stops = set(sampling.stop_token_ids)
        if self.config.eos_token_id is not None and not sampling.ignore_eos:
            stops.add(self.config.eos_token_id)
        scheduled = dataclasses.replace(sampling, stop_token_ids=tuple(sorted(stops)))
        request = self.scheduler.add_request(request_id, prompt_token_ids, scheduled)
        seed = sampling.seed if sampling.seed is not None else int(self._seeds.integers(SEED_LIMIT))
        self._tracked[request_id] = TrackedRequest(request, seed, frozenset(stops))
        self._counts["requests_added"] += 1
        self._counts["prompt_tokens"] += len(request.prompt_token_ids)

    def abort(self, request_id: str) -> bool:
        """Drops a live request and frees what it holds; the next ``step`` reports it
        finished with reason ABORT. Returns False for an unknown or finished request."""
        if not self.scheduler.abort(request_id):
            return False
        tracked = self._tracked.pop(request_id)
        # No text: nobody reads an aborted request's, and detokenizing could raise here.
        self._aborted.append(tracked.output(FinishReason.ABORT, None, None))
        self._counts["requests_aborted"] += 1
        return True

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns an output for every request that got a token,
        finished, failed or was aborted since the last step. With ``async_scheduling``
        it first dispatches the next step (two when none is in flight), then fetches the
        oldest, leaving one in flight.

        Raises:
          DeviceLostError: the step failed and the device no longer answers.
        """
        outputs, self._aborted = self._aborted, []
        if not self._in_flight:
            outputs += self._launch()
        if self._in_flight and self.config.async_scheduling:
            outputs += self._launch()
        if self._in_flight:
            outputs += self._finish(self._in_flight.popleft())
        return outputs

    def _launch(self) -> list[RequestOutput]:
        """Schedules a step and dispatches it (outputs only if it failed)."""
        step = self.scheduler.schedule()
        self._counts["preemptions"] += len(step.preempted)
        self._idle = step.is_empty and not step.preempted and not self._in_flight
        if step.is_empty:
            return []
        self._counts["steps"] += 1
        previous = self._in_flight[-1] if self._in_flight else None
        try:
            owners = {i: self._tracked[i] for i in step.sampling_request_ids}
            sampling = {i: owners[i].sampling_row(position)
                        for i, position in _sampled_positions(step).items()}
            if self._speculative is None:
                flight = self.dispatch(step, owners, sampling, previous)
            else:
                flight = self._speculative.dispatch(self, step, owners, sampling)
            self._in_flight.append(flight)
        except DeviceLostError:  # raised by multi-process steps (serving.multiprocess)
            raise
        except Exception as error:
            return self._fail_step(step, error)
        return []

    def _finish(self, flight: InFlight | SpeculativeInFlight) -> list[RequestOutput]:
        """Fetches a dispatched step's results and hands them to the scheduler."""
        step = flight.step
        try:
            if self._speculative is None:
                sampled = {i: [draw] for i, draw in self.fetch(flight).items()}
            else:  # synchronous: the step's requests are all still tracked
                sampled = {i: trim_draws(self._tracked[i].request, draws,
                                         self._tracked[i].stop_token_ids, self._detokenize)
                           for i, draws in self._speculative.fetch(self, flight).items()}
            self._count_cached_tokens(step)
            finished = {
                r.request_id
                for r in self.scheduler.update_from_step(
                    step, {i: [draw.token for draw in draws] for i, draws in sampled.items()}
                )
            }
            if self._speculative is not None:
                self._speculative.set_drafts(self)
        except DeviceLostError:
            raise
        except Exception as error:
            return self._fail_step(step, error)
        outputs = []
        for request_id, draws in sampled.items():
            tracked = flight.owners[request_id]
            if self._tracked.get(request_id) is not tracked:
                continue  # finished by an earlier step's stop, aborted or failed since
            try:
                for draw in draws:
                    tracked.logprobs.append(draw.logprob)
                    tracked.top_logprobs.append(draw.top)
                    self._counts["generated_tokens"] += 1
                outputs.append(self._after_token(tracked, request_id in finished))
            except Exception:
                logger.exception("request %s failed after step %d", request_id, step.step_id)
                outputs += self._fail_requests([request_id])
        return outputs

    def run_until_done(self) -> dict[str, RequestOutput]:
        """Steps until no request is left; returns each request's final output.

        Raises:
          RuntimeError: if a step schedules nothing while requests remain (a bug).
        """
        final = {}
        while self.has_unfinished():
            outputs = self.step()
            if self._idle and self.scheduler.has_unfinished():
                raise RuntimeError(
                    f"no progress: {self.scheduler.num_waiting} requests wait and nothing runs"
                )
            final |= {o.request_id: o for o in outputs if o.finished}
        return final

    def metrics(self) -> EngineMetrics:
        blocks = self.prefix_cache.blocks.usage()
        slots = self.prefix_cache.states.usage()
        stats = self.prefix_cache.stats()
        return EngineMetrics(
            **self._counts,
            prefix_cache_lookups=stats.requests,
            prefix_cache_hits=stats.hits,
            kv_block_evictions=self.prefix_cache.blocks.num_evictions,
            state_slot_evictions=self.prefix_cache.states.num_evictions,
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_blocks_total=blocks.total,
            kv_blocks_used=blocks.used,
            kv_blocks_cached=blocks.cached,
            state_slots_total=slots.total,
            state_slots_used=slots.used,
            state_slots_retained=slots.cached,
        )

    def _count_cached_tokens(self, step: ScheduledStep) -> None:
        for scheduled in step.prefills:
            tracked = self._tracked.get(scheduled.request_id)
            if tracked is not None and not tracked.cached_counted:
                tracked.cached_counted = True
                self._counts["cached_prompt_tokens"] += tracked.request.num_cached_tokens or 0

    def _after_token(self, tracked: TrackedRequest, finished: bool) -> RequestOutput:
        """The output after a new token; finishes the request on a stop string."""
        request = tracked.request
        last = tracked.tokens[-1]
        reason, stop_reason = None, None
        stop_string = tracked.first_stop_string(self._detokenize)
        if finished and last in tracked.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, last
        elif stop_string is not None:
            reason, stop_reason = FinishReason.STOP, stop_string
            if not finished:
                self.scheduler.abort(request.request_id)
        elif finished:
            reason = FinishReason.LENGTH
        output = tracked.output(reason, stop_reason, self._detokenize)  # may raise: still tracked then
        if reason is not None:
            del self._tracked[request.request_id]
            self._counts["requests_finished"] += 1
        return output


def _sampled_positions(step: ScheduledStep) -> dict[str, int]:
    """The sequence position of the token the step samples for each request."""
    return {d.request_id: d.position + 1 for d in step.decodes} | {
        p.request_id: p.span.end for p in step.prefills if p.samples}
