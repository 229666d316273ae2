"""What the engine reports: a request's output after each step, and the engine's metrics
(plain data, read by ``serving.async_engine``, the HTTP handlers and the benchmarks); and
``TrackedRequest``, what the engine keeps of a live request to build its outputs."""

import dataclasses
import enum
from collections.abc import Callable, Sequence

from serving.request import Request


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token (or end of sequence) or a stop string
    LENGTH = "length"  # max_tokens
    ABORT = "abort"
    ERROR = "error"  # the step it was in failed; the engine went on serving the others


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step: everything generated so far.

    Attributes:
      output_token_ids: generated tokens, all of them (a stop token or the token that
        completed a stop string included).
      logprobs: log p of each generated token under the model's raw distribution.
      top_logprobs: per generated token, the ``MAX_TOP_LOGPROBS`` most likely
        (token id, log p) pairs under the same distribution, most likely first.
      text: the detokenized output, cut before a stop string (None without a detokenizer).
      finish_reason: None while the request runs.
      stop_reason: the stop token id or stop string that finished it, if any.
      num_prompt_tokens: prompt length.
      num_cached_tokens: prompt tokens its first admission took from the prefix cache.
      num_preemptions: times it was preempted (and recomputed through the prefix cache).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    text: str | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class EngineMetrics:
    """Counters and gauges for ``/metrics``: a snapshot, plain data.

    Counters (since start): requests added / finished / aborted / failed, steps that
    failed and engine resets (``serving.engine``), prompt tokens added,
    prompt tokens served by the prefix cache at first admission, tokens generated,
    preemptions, copy-on-write block copies, steps, seconds the engine's thread waited for
    the device (``StepDispatch.device_get``), prefix-cache lookups and hits, evictions,
    and with speculative decoding the decodes that verified drafts, the drafts verified and
    those accepted. Gauges (now): requests running and waiting, KV blocks and state slots
    total / referenced / cached.
    """

    requests_added: int
    requests_finished: int
    requests_aborted: int
    requests_failed: int
    step_failures: int
    engine_resets: int
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    preemptions: int
    kv_block_copies: int
    steps: int
    device_wait_seconds: float
    prefix_cache_lookups: int
    prefix_cache_hits: int
    kv_block_evictions: int
    state_slot_evictions: int
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    state_slots_total: int
    state_slots_used: int
    state_slots_retained: int
    spec_verified_decodes: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Drafts accepted / drafts verified (0 before any)."""
        return self.spec_accepted_tokens / max(self.spec_draft_tokens, 1)

    @property
    def spec_tokens_per_step(self) -> float:
        """Tokens a decode that verified drafts gained per step, on average (1 + accepted;
        0 before any)."""
        decodes = self.spec_verified_decodes
        return (decodes + self.spec_accepted_tokens) / decodes if decodes else 0.0


@dataclasses.dataclass(eq=False)
class TrackedRequest:
    """What the engine keeps about a live request beside the scheduler's ``Request``."""

    request: Request
    seed: int
    stop_token_ids: frozenset[int]
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
    cached_counted: bool = False

    @property
    def tokens(self) -> list[int]:
        """The tokens emitted so far (the request's later ones are still being sampled)."""
        return self.request.output_token_ids[: len(self.logprobs)]

    def sampling_row(self, position: int) -> tuple[float, int, float, int, int, int]:
        """(temperature, top_k, top_p, seed, output token index, alternatives reported) of
        the draw of the request's token at sequence ``position``."""
        s = self.request.sampling
        index = position - len(self.request.prompt_token_ids)
        return s.temperature, s.top_k, s.top_p, self.seed, index, s.top_logprobs

    def first_stop_string(self, detokenize: Callable[[Sequence[int]], str]) -> str | None:
        """The stop string that occurs first in the output text, or None."""
        if not self.request.sampling.stop:
            return None
        text = detokenize(self.tokens)
        found = [(text.find(s), s) for s in self.request.sampling.stop if s in text]
        return min(found)[1] if found else None

    def output(
        self,
        reason: FinishReason | None,
        stop_reason: int | str | None,
        detokenize: Callable[[Sequence[int]], str] | None,
    ) -> RequestOutput:
        """The output so far; ``detokenize`` None leaves the text out (no detokenizer, or
        a failed request, whose output may be what failed to detokenize)."""
        request = self.request
        text = None
        if detokenize is not None:
            text = detokenize(self.tokens)
            if isinstance(stop_reason, str):
                text = text[: text.find(stop_reason)]
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            top_logprobs=tuple(self.top_logprobs),
            text=text,
            finish_reason=reason,
            stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_tokens or 0,
            num_preemptions=request.num_preemptions,
        )
