"""One engine step on the device: its copies, model calls and sampler calls dispatched back
to back (``StepDispatch.dispatch``), then the one blocking transfer that fetches every
call's pool status with the sampled tokens (``StepDispatch.fetch``). With ``mixed_steps``
a step with prefill spans and decode rows runs them in one forward (``glmjax.mixed``).

Between the two the device runs on its own, so the engine can schedule and dispatch the
next step meanwhile (asynchronous scheduling, ``serving.scheduler``). That step's decode
rows whose input token the step in flight samples (``PLACEHOLDER`` tokens) take it from
that step's sampled tokens on the device: no transfer between the steps. On one device a
decode step's batch goes into its bucket's pinned buffers, whose staging program feeds
them (``serving.pinned``); a mixed step's and a mesh's decode rows are fed by
``feed_tokens``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import jax
import numpy as np

from glmjax.state_pool import PoolStatus
from glmjax.xla_options import STEP_OPTIONS
from serving.pinned import fed_token_ids, keep_status
from serving.request import PLACEHOLDER
from serving.sampling import Sampled, SamplerVariant, SamplingTensors, sample
from serving.step import ScheduledStep


class StepRefusedError(RuntimeError):
    """The model refused a step's cache update (a non-OK `PoolStatus`); nothing was written."""


class Draw(NamedTuple):
    """One request's sampled token, its logprob and the top alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]

    @classmethod
    def from_row(cls, sampled: Sampled, k: int, num_top: int) -> Draw:
        """Row k of a fetched ``Sampled`` (host arrays), with its ``num_top`` alternatives
        (the alternatives' arrays may be None where no row reports any)."""
        top = () if not num_top else tuple(zip(sampled.top_ids[k, :num_top].tolist(),
                                               sampled.top_logprobs[k, :num_top].tolist(),
                                               strict=True))
        return cls(int(sampled.tokens[k]), float(sampled.logprobs[k]), top)


@dataclasses.dataclass(eq=False)
class InFlight:
    """A dispatched step whose results are not fetched yet.

    Attributes:
      step: the step.
      statuses: (what, PoolStatus as an int32 [] device scalar) of each call that can refuse.
      tokens: the sampled tokens of its prefill rows and of its decode rows (device int32
        [R] each, None where it samples no such row).
      sources: per request sampled, its row of ``concat(tokens)`` (decode rows after R).
      calls: the ``Sampled`` of each sampler call (device arrays), in the order of ``rows``.
      rows: per sampler call, the request ids of its rows.
      owners: what the engine tracks for each request the step samples, as it was at
        dispatch (an id may name another request by the time the results come back).
    """

    step: ScheduledStep
    statuses: list[tuple[str, jax.Array]]
    tokens: tuple[jax.Array | None, jax.Array | None]
    sources: dict[str, int]
    calls: list[Sampled]
    rows: list[list[str]]
    owners: dict[str, object]


@jax.jit
def gather_rows(logits: jax.Array, rows: jax.Array) -> jax.Array:
    """Rows ``rows`` (int32 [R]) of one batch's logits (fp32 [N, V]): fp32 [R, V]."""
    return logits[rows]


sample_gathered = jax.jit(sample, static_argnames="variant", compiler_options=STEP_OPTIONS)


def sample_rows(logits: jax.Array, rows: jax.Array, params: SamplingTensors) -> Sampled:
    """Samples rows ``rows`` (int32 [R]) of one batch's logits (fp32 [N, V]): a gather
    compiled per N (a copy of R rows), then the sampler for [R, V], compiled once per
    ``SamplerVariant``, the one host ``params`` need. The sort over the vocabulary, the
    costly compile, is in the sampler alone."""
    return sample_gathered(gather_rows(logits, rows), params, variant=SamplerVariant.of(params))


# A mixed step's or a mesh's decode batch with its placeholders fed (one device's decode
# steps feed theirs in `serving.pinned`'s staging program).
feed_tokens = jax.jit(fed_token_ids)


class StepDispatch:
    """The device side of ``serving.engine.Engine`` (a mixin: it reads the engine's
    ``config``, ``steps``, ``builder``, ``caches``, ``_model_state``, ``_rows``,
    ``_pinned`` (a ``serving.pinned.PinnedDecode``), ``_speculative`` and ``_counts``, and
    keeps ``caches`` on the live buffers after every call, as each donates them)."""

    @property
    def sampler_rows(self) -> int:
        """Rows of every sampler call and cache copy (the largest sequence bucket)."""
        return self._rows

    @property
    def pinned_decode(self) -> bool:
        """Whether decode steps go through pinned buffers (``serving.pinned``): on one
        device (``steps.decode_pinned``), without speculation (its own steps)."""
        return self.steps.decode_pinned is not None and self._speculative is None

    @property
    def sampler(self):
        """The jitted sampler, one compiled shape: (logits fp32 [R, V], SamplingTensors of
        R rows, static ``variant``), R = ``sampler_rows``."""
        return sample_gathered

    @property
    def row_gather(self):
        """The jitted gather of the sampled rows: (logits fp32 [N, V], rows int32 [R]) ->
        fp32 [R, V]; one small program per sequence bucket N."""
        return gather_rows

    def dispatch(self, step: ScheduledStep, owners: dict, sampling: dict,
                 previous: InFlight | None) -> InFlight:
        """Copies, the model's prefill and decode, retain copies and sampling of one step,
        dispatched back to back; nothing is fetched.

        Args:
          owners: what the engine tracks for each request the step samples.
          sampling: per request the step samples, (temperature, top_k, top_p, seed,
            output token index, alternatives reported) of its draw.
          previous: the step in flight before this one, whose sampled tokens feed this
            step's placeholder decode tokens.
        """
        mixed = self.config.mixed_steps and bool(step.prefills) and bool(step.decodes)
        prefill_batch, decode_batch = self.builder.build(step, mixed=mixed)
        statuses = []
        if step.block_copies:
            self.caches = self.steps.copy_kv_blocks(self.caches, *self._pairs(step.block_copies))
            self._counts["kv_block_copies"] += len(step.block_copies)
        if step.resume_state_copies:
            statuses.append(("resume copies", self._copy_slots(step.resume_state_copies)))
        # The batches go to the steps as host arrays: jit's own dispatch copies them to the
        # device (~8 us for a decode batch on a CPU host) where jax.device_put took ~100.
        # A decode step on one device goes through its bucket's pinned buffers instead.
        pinned = self._pinned if self.pinned_decode and not mixed else None
        if decode_batch is not None:
            sources, tokens = self._sources(step, decode_batch.token_ids.shape, previous)
            if pinned is not None:
                decode_batch = pinned.stage(decode_batch, sources, tokens)
            elif tokens is not None:
                decode_batch = decode_batch._replace(
                    token_ids=feed_tokens(decode_batch.token_ids, sources, *tokens))
        prefill_logits = decode_logits = None
        if mixed:
            out = self.steps.mixed(self._model_state, self.caches, prefill_batch, decode_batch)
            self.caches, prefill_logits, decode_logits = (
                out.caches, out.prefill_logits, out.decode_logits)
            statuses.append(("mixed step", out.status))
        else:
            if prefill_batch is not None:
                out = self.steps.prefill(self._model_state, self.caches, prefill_batch)
                self.caches, prefill_logits = out.caches, out.logits
                statuses.append(("prefill", out.status))
            if decode_batch is not None:
                args = self._model_state, self.caches, decode_batch
                out = (self.steps.decode(*args) if pinned is None
                       else pinned.decode(self.steps.decode_pinned, *args))
                self.caches, decode_logits = out.caches, out.logits
                statuses.append(("decode", out.status if pinned is None
                                 else keep_status(out.status)))
        if step.retain_state_copies:
            statuses.append(("retain copies", self._copy_slots(step.retain_state_copies)))
        parts = [
            (prefill_logits, [(i, p.request_id) for i, p in enumerate(step.prefills) if p.samples]),
            (decode_logits, [(i, d.request_id) for i, d in enumerate(step.decodes)]),
        ]
        tokens, sources, calls, rows = [None, None], {}, [], []
        for kind, (logits, picked) in enumerate(parts):
            if not picked:
                continue
            index = np.zeros(self._rows, np.int32)
            index[: len(picked)] = [row for row, _ in picked]
            params = SamplingTensors.host([sampling[i] for _, i in picked], self._rows)
            calls.append(sample_rows(logits, index, params))
            tokens[kind] = calls[-1].tokens
            rows.append([request_id for _, request_id in picked])
            sources |= {request_id: kind * self._rows + k for k, request_id in enumerate(rows[-1])}
        return InFlight(step, statuses, tuple(tokens), sources, calls, rows, owners)

    def fetch(self, flight: InFlight) -> dict[str, Draw]:
        """The step's one blocking device-to-host transfer: every call's pool status and
        the draws. Checking the statuses only then is safe: each call is transactional,
        and whatever ran after a refused call wrote only into blocks and slots of the
        step's own requests, which a refused step fails, registering nothing. That holds
        for a step dispatched after it too: its rows of those requests are dropped, and
        its other requests read nothing the refused step would have written (what a step
        retains is registered only after its fetch).

        Raises:
          StepRefusedError: a call refused its cache update.
        """
        # The alternatives' arrays only for a call with a row that reports them.
        calls = [call if any(self._num_top(flight, i) for i in request_ids)
                 else call._replace(top_ids=None, top_logprobs=None)
                 for call, request_ids in zip(flight.calls, flight.rows, strict=True)]
        codes, drawn = self.device_get(([status for _, status in flight.statuses], calls))
        for (what, _), code in zip(flight.statuses, codes):
            if PoolStatus(int(code)) is not PoolStatus.OK:
                raise StepRefusedError(
                    f"step {flight.step.step_id}: the model refused the {what} "
                    f"({PoolStatus(int(code)).name}); the caches are unchanged")
        draws = {}
        for sampled, request_ids in zip(drawn, flight.rows):
            for k, request_id in enumerate(request_ids):
                draws[request_id] = Draw.from_row(sampled, k, self._num_top(flight, request_id))
        return draws

    @staticmethod
    def _num_top(flight: InFlight, request_id: str) -> int:
        """The alternatives a request sampled by ``flight`` reports."""
        return flight.owners[request_id].request.sampling.top_logprobs

    def device_get(self, tree):
        """``jax.device_get(tree)``, the seconds the engine's thread waited for it added to
        ``device_wait_seconds``: of a step's wall time, the rest is the host's (scheduling,
        dispatch, the CUDA graph's update and launch), so a wait near zero marks a
        host-bound step."""
        start = time.perf_counter()
        values = jax.device_get(tree)
        self._counts["device_wait_seconds"] += time.perf_counter() - start
        return values

    @staticmethod
    def _sources(step: ScheduledStep, shape: tuple[int], previous: InFlight | None):
        """(sources int32 ``shape``, tokens) of the decode batch's placeholder tokens: per row -1
        or the row of ``concat(tokens)`` holding its token, and ``previous``'s sampled
        (prefill, decode) tokens, either standing for the other where absent; tokens None
        when no row is a placeholder."""
        sources = np.full(shape, -1, np.int32)
        fed = [i for i, d in enumerate(step.decodes) if d.token_id == PLACEHOLDER]
        if not fed:
            return sources, None
        if previous is None:
            raise ValueError(f"step {step.step_id} decodes a placeholder with no step in flight")
        for i in fed:
            sources[i] = previous.sources[step.decodes[i].request_id]
        first, second = previous.tokens
        return sources, (first if first is not None else second,
                         second if second is not None else first)

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
