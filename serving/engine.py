"""The serving loop: scheduler, batch builder, model steps and sampler, one step at a time.

    engine = Engine(model_config, model, EngineConfig(max_model_len=4096,
                                                      num_kv_blocks=256, num_state_slots=64))
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=32, temperature=0.7))
    outputs = engine.run_until_done()          # {request_id: final RequestOutput}

Each ``step()`` follows the scheduler's contract (``serving.scheduler``): schedule; copy
the step's KV blocks (copy-on-write) and resume states into their slots; run the model's
prefill and / or decode on the device batches; copy the retained end states out of the
running slots; sample a token for every request the step samples; hand the tokens back
to the scheduler, which registers what the step retained.

A step that fails fails only its own requests. Whatever raises while the step is built,
run or sampled (a model refusal, ``StepRefusedError``, which leaves the caches unchanged;
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

import dataclasses
import logging
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model import HybridModel, ModelState
from glmjax.sharding import ModelSteps, single_device_steps
from glmjax.state_pool import PoolStatus
from serving.batch_builder import BatchBuckets, BatchBuilder
from serving.block_allocator import BlockAllocator
from serving.outputs import EngineMetrics, FinishReason, RequestOutput
from serving.prefix_cache import PrefixCache
from serving.request import Request, SamplingParams
from serving.sampling import SEED_LIMIT, Draw, Sampled, SamplingTensors, sample
from serving.scheduler import Scheduler
from serving.speculative import COUNTERS as SPECULATIVE_COUNTERS
from serving.speculative import SpeculativeRunner, trim_draws
from serving.state_slots import StateSlotAllocator
from serving.step import ScheduledStep, SchedulerConfig

logger = logging.getLogger(__name__)


class StepRefusedError(RuntimeError):
    """The model refused a step's cache update (a non-OK `PoolStatus`); nothing was written."""


class DeviceLostError(RuntimeError):
    """The device stopped answering after a failed step; the engine cannot go on."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig(SchedulerConfig):
    """Memory and scheduling of one engine (see ``SchedulerConfig`` for the knobs it shares).

    Attributes:
      num_kv_blocks: MLA KV block ids (each P * dcp tokens).
      num_state_slots: KDA state slots (running requests and retained states).
      eos_token_id: finishes a request unless its ``ignore_eos`` (None: no such token).
      single_bucket: pad every batch to the largest bucket, so each entry point compiles
        once; good for small models and tests, wasteful for long budgets.
      speculative_tokens (from ``SchedulerConfig``): N > 0 drafts N tokens per request
        with the model's MTP head and verifies them in the next step
        (``serving.speculative``; greedy requests, one device).
      seed: draws the seed of every request that brings none.
    """

    num_kv_blocks: int
    num_state_slots: int
    eos_token_id: int | None = None
    single_bucket: bool = False
    seed: int = 0

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduling knobs alone."""
        names = (field.name for field in dataclasses.fields(SchedulerConfig))
        return SchedulerConfig(**{name: getattr(self, name) for name in names})


@dataclasses.dataclass(eq=False)
class _Tracked:
    """What the engine keeps about a live request beside the scheduler's ``Request``."""

    request: Request
    seed: int
    stop_token_ids: frozenset[int]
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
    cached_counted: bool = False


class Engine:
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
          ValueError: for a model whose config or KV block size does not match, or steps
            on a mesh whose dcp differs from the engine's.
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
        self._make_pools()
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
        self._seeds = np.random.default_rng(engine_config.seed)
        self._tracked: dict[str, _Tracked] = {}
        self._aborted: list[RequestOutput] = []
        self._idle = False  # the last step scheduled nothing and preempted no one
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
        ) | dict.fromkeys(SPECULATIVE_COUNTERS, 0)

    def _make_pools(self) -> None:
        """Empty caches, allocators, prefix cache and scheduler (at start and on a reset)."""
        config = self.config
        self.prefix_cache = PrefixCache(
            BlockAllocator(config.num_kv_blocks, block_size=config.block_size, dcp=config.dcp),
            StateSlotAllocator(config.num_state_slots),
        )
        self.scheduler = Scheduler(config.scheduler_config(), self.prefix_cache)
        init_caches = self.steps.init_caches if self._speculative is None else (
            self._speculative.init_caches)
        self.caches = init_caches(config.num_state_slots, config.num_kv_blocks)

    @property
    def model_state(self) -> ModelState:
        """The parameters as placed for the steps."""
        return self._model_state

    @property
    def sampler_rows(self) -> int:
        """Rows of every sampler call and cache copy (the largest sequence bucket)."""
        return self._rows

    @property
    def sampler(self) -> Callable:
        """The jitted sampler, one compiled shape: (logits fp32 [R, V], SamplingTensors of
        R rows), R = ``sampler_rows``."""
        return _sample

    @property
    def row_gather(self) -> Callable:
        """The jitted gather of the sampled rows: (logits fp32 [N, V], rows int32 [R]) ->
        fp32 [R, V]; one small program per sequence bucket N."""
        return _gather_rows

    @property
    def schedule_log(self) -> list[dict]:
        """One plain-data entry per step when ``log_schedule`` is set (else empty)."""
        return self.scheduler.schedule_log

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

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
        self._tracked[request_id] = _Tracked(request, seed, frozenset(stops))
        self._counts["requests_added"] += 1
        self._counts["prompt_tokens"] += len(request.prompt_token_ids)

    def abort(self, request_id: str) -> bool:
        """Drops a live request and frees what it holds; the next ``step`` reports it
        finished with reason ABORT. Returns False for an unknown or finished request."""
        if not self.scheduler.abort(request_id):
            return False
        tracked = self._tracked.pop(request_id)
        # No text: nobody reads an aborted request's, and detokenizing could raise here.
        self._aborted.append(self._output(tracked, FinishReason.ABORT, None, with_text=False))
        self._counts["requests_aborted"] += 1
        return True

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns an output for every request that got a token,
        finished, failed or was aborted since the last step.

        Raises:
          DeviceLostError: the step failed and the device no longer answers.
        """
        outputs, self._aborted = self._aborted, []
        step = self.scheduler.schedule()
        self._counts["preemptions"] += len(step.preempted)
        self._idle = step.is_empty and not step.preempted
        if step.is_empty:
            return outputs
        self._counts["steps"] += 1
        try:
            if self._speculative is None:
                sampled = self._run(step)
            else:
                sampled = {i: trim_draws(self._tracked[i].request, draws,
                                         self._tracked[i].stop_token_ids, self._detokenize)
                           for i, draws in self._speculative.run(self, step).items()}
            finished = {
                r.request_id
                for r in self.scheduler.update_from_step(
                    step, {i: [draw.token for draw in draws] for i, draws in sampled.items()}
                )
            }
            if self._speculative is not None:
                self._speculative.set_drafts(self)
        except DeviceLostError:  # raised by multi-process steps (serving.multiprocess)
            raise
        except Exception as error:
            return outputs + self._fail_step(step, error)
        for request_id, draws in sampled.items():
            tracked = self._tracked[request_id]
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

    def _run(self, step: ScheduledStep) -> dict[str, list[Draw]]:
        """Copies, the model's prefill and decode, retain copies and sampling of one step,
        dispatched back to back; then the step's one blocking device-to-host transfer
        fetches every call's pool status with the draws.

        Checking the statuses only then is safe: each call is transactional, and whatever
        ran after a refused call wrote only into blocks and slots of the step's own
        requests, which a refused step fails (``_fail_step``), registering nothing."""
        prefill_batch, decode_batch = self.builder.build(step)
        statuses = []  # (what, PoolStatus as a device scalar)
        # Every call donates the caches: keep self.caches on the live buffers throughout.
        if step.block_copies:
            self.caches = self.steps.copy_kv_blocks(self.caches, *self._pairs(step.block_copies))
            self._counts["kv_block_copies"] += len(step.block_copies)
        if step.resume_state_copies:
            statuses.append(("resume copies", self._copy_slots(step.resume_state_copies)))
        prefill_logits = decode_logits = None
        if prefill_batch is not None:
            out = self.steps.prefill(self._model_state, self.caches, jax.device_put(prefill_batch))
            self.caches, prefill_logits = out.caches, out.logits
            statuses.append(("prefill", out.status))
        if decode_batch is not None:
            out = self.steps.decode(self._model_state, self.caches, jax.device_put(decode_batch))
            self.caches, decode_logits = out.caches, out.logits
            statuses.append(("decode", out.status))
        if step.retain_state_copies:
            statuses.append(("retain copies", self._copy_slots(step.retain_state_copies)))
        calls, order = self._dispatch_sampling(step, prefill_logits, decode_logits)
        codes, drawn = jax.device_get(([status for _, status in statuses], calls))
        for (what, _), code in zip(statuses, codes):
            if PoolStatus(int(code)) is not PoolStatus.OK:
                raise StepRefusedError(f"step {step.step_id}: the model refused the {what} "
                                       f"({PoolStatus(int(code)).name}); the caches are unchanged")
        self._count_cached_tokens(step)
        return {request_id: [Draw.from_row(sampled, k)]
                for sampled, request_ids in zip(drawn, order)
                for k, request_id in enumerate(request_ids)}

    def _fail_step(self, step: ScheduledStep, error: Exception) -> list[RequestOutput]:
        """Fails the step's requests (or, with the caches gone, every live request)."""
        self._counts["step_failures"] += 1
        if not self._caches_lost():
            self.scheduler.abort_step(step)
            failed = [i for i in step.request_ids if i in self._tracked]
            logger.error("step %d failed; failing its requests %s", step.step_id, failed,
                         exc_info=error)
            return self._fail_requests(failed)
        self._check_device(error)
        failed = list(self._tracked)
        logger.error("step %d failed after its caches were donated; failing every live request "
                     "%s and starting from empty pools", step.step_id, failed, exc_info=error)
        self._make_pools()
        self._counts["engine_resets"] += 1
        return self._fail_requests(failed)

    def _caches_lost(self) -> bool:
        """Whether the caches can no longer be used: a failed call consumed them (donated
        buffers deleted) or they hold an error the device reported after the call."""
        try:
            jax.block_until_ready(self.caches)
        except Exception:
            return True
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.caches))

    def _fail_requests(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """Drops the requests (aborting those still live) and reports each finished with
        ``FinishReason.ERROR``."""
        outputs = []
        for request_id in request_ids:
            self.scheduler.abort(request_id)
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                self._counts["requests_failed"] += 1
                outputs.append(self._output(tracked, FinishReason.ERROR, None, with_text=False))
        return outputs

    def _check_device(self, error: Exception) -> None:
        """Raises ``DeviceLostError`` unless every device of the steps runs a tiny program."""
        devices = jax.devices() if self.steps.mesh is None else self.steps.mesh.devices.flat
        try:
            for device in devices:
                jax.block_until_ready(jax.device_put(np.zeros((), np.int32), device) + 1)
        except Exception as probe_error:
            raise DeviceLostError(f"the device failed after a step failed: {error!r}") from (
                probe_error
            )

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

    def _pairs(self, copies) -> tuple[np.ndarray, np.ndarray]:
        """(sources, destinations) padded with -1 to the fixed row count: one compile."""
        if len(copies) > self._rows:
            raise ValueError(f"{len(copies)} copies exceed {self._rows} rows")
        pairs = np.full((2, self._rows), -1, np.int32)
        pairs[:, : len(copies)] = np.asarray(copies, np.int32).T
        return pairs[0], pairs[1]

    def _copy_slots(self, copies) -> jax.Array:
        """Copies state slots (every KDA layer); the copy's PoolStatus, on the device."""
        self.caches, status = self.steps.copy_state_slots(self.caches, *self._pairs(copies))
        return status

    def _dispatch_sampling(self, step: ScheduledStep, prefill_logits, decode_logits):
        """The sampler calls of every request the step samples, not yet fetched: a list
        of ``Sampled`` (device arrays) and, for each, the request ids of its rows.

        Prefill and decode rows are sampled by separate calls of one sampler whose row
        count is fixed: its rows are gathered from each logits bucket first, so the
        sampler compiles once, and only the gather once per sequence bucket."""
        parts = [
            (prefill_logits, [(i, p.request_id) for i, p in enumerate(step.prefills) if p.samples]),
            (decode_logits, [(i, d.request_id) for i, d in enumerate(step.decodes)]),
        ]
        calls, order = [], []
        for logits, rows in parts:
            if not rows:
                continue
            index = np.zeros(self._rows, np.int32)
            index[: len(rows)] = [row for row, _ in rows]
            params = [self._sampling_row(request_id) for _, request_id in rows]
            calls.append(_sample_rows(logits, index, SamplingTensors.host(params, self._rows)))
            order.append([request_id for _, request_id in rows])
        return calls, order

    def _sampling_row(self, request_id: str) -> tuple[float, int, float, int, int]:
        """(temperature, top_k, top_p, seed, output token index) of a request's next draw."""
        tracked = self._tracked[request_id]
        s = tracked.request.sampling
        return s.temperature, s.top_k, s.top_p, tracked.seed, len(tracked.request.output_token_ids)

    def _count_cached_tokens(self, step: ScheduledStep) -> None:
        for scheduled in step.prefills:
            tracked = self._tracked[scheduled.request_id]
            if not tracked.cached_counted:
                tracked.cached_counted = True
                self._counts["cached_prompt_tokens"] += tracked.request.num_cached_tokens or 0

    def _after_token(self, tracked: _Tracked, finished: bool) -> RequestOutput:
        """The output after a new token; finishes the request on a stop string."""
        request = tracked.request
        last = request.output_token_ids[-1]
        reason, stop_reason = None, None
        stop_string = self._stop_string(tracked)
        if finished and last in tracked.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, last
        elif stop_string is not None:
            reason, stop_reason = FinishReason.STOP, stop_string
            if not finished:
                self.scheduler.abort(request.request_id)
        elif finished:
            reason = FinishReason.LENGTH
        output = self._output(tracked, reason, stop_reason)  # may raise: still tracked then
        if reason is not None:
            del self._tracked[request.request_id]
            self._counts["requests_finished"] += 1
        return output

    def _stop_string(self, tracked: _Tracked) -> str | None:
        """The stop string that occurs first in the output text, or None."""
        if not tracked.request.sampling.stop:
            return None
        text = self._detokenize(tracked.request.output_token_ids)
        found = [(text.find(s), s) for s in tracked.request.sampling.stop if s in text]
        return min(found)[1] if found else None

    def _output(
        self,
        tracked: _Tracked,
        reason: FinishReason | None,
        stop_reason: int | str | None,
        *,
        with_text: bool = True,
    ) -> RequestOutput:
        """``with_text=False`` leaves the text out (a failed request's output may be what
        failed to detokenize)."""
        request = tracked.request
        text = None
        if with_text and self._detokenize is not None:
            text = self._detokenize(request.output_token_ids)
            if isinstance(stop_reason, str):
                text = text[: text.find(stop_reason)]
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=tuple(request.output_token_ids),
            logprobs=tuple(tracked.logprobs),
            top_logprobs=tuple(tracked.top_logprobs),
            text=text,
            finish_reason=reason,
            stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_tokens or 0,
            num_preemptions=request.num_preemptions,
        )


@jax.jit
def _gather_rows(logits: jax.Array, rows: jax.Array) -> jax.Array:
    """Rows ``rows`` (int32 [R]) of one batch's logits (fp32 [N, V]): fp32 [R, V]."""
    return logits[rows]


_sample = jax.jit(sample)


def _sample_rows(logits: jax.Array, rows: jax.Array, params: SamplingTensors) -> Sampled:
    """Samples rows ``rows`` (int32 [R]) of one batch's logits (fp32 [N, V]): a gather
    compiled per N (a copy of R rows), then the sampler, compiled once for [R, V]. The
    sort over the vocabulary, the costly compile, is in the sampler alone."""
    return _sample(_gather_rows(logits, rows), params)
