"""A generation request as the scheduler tracks it, from arrival to its last token."""

import dataclasses
import enum
import math
from collections.abc import Sequence

INT32_LIMIT = 2**31  # token counts and top_k reach the device as int32
MAX_TOP_LOGPROBS = 20  # alternatives returned per token (OpenAI allows up to 20)
# An output token a step in flight samples, not fetched yet (``serving.scheduler``).
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    """Where a request is in its life.

    WAITING: queued, holds nothing. RUNNING: admitted, holds a running state slot and a
    block table. PREEMPTED: its blocks and slot were taken back; it is queued again and
    resumes through the prefix cache. FINISHED and ABORTED: done, holds nothing.
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request samples and when it stops.

    The scheduler reads only the stop conditions ``max_tokens`` and ``stop_token_ids``;
    the engine (``serving.engine``) adds the end-of-sequence token to the latter unless
    ``ignore_eos``, samples with the rest (``serving.sampling``), and checks ``stop``.

    Attributes:
      max_tokens: most tokens generated (>= 1).
      stop_token_ids: generating any of these finishes the request (the token is kept).
      temperature: 0 samples greedily (argmax); otherwise logits are divided by it.
      top_p: keep the most likely tokens up to this probability mass, in (0, 1].
      top_k: keep the k most likely tokens (0: all); the engine also refuses more than the
        vocabulary.
      seed: the request's own random stream (None: the engine draws one); the k-th output
        token is sampled with a key made from (seed, k), so a seeded request reproduces.
      stop: strings that finish the request when the detokenized output contains one;
        the output text is cut before it (the tokens are kept).
      ignore_eos: keep generating past the model's end-of-sequence token.
      top_logprobs: most likely alternatives reported with each generated token, at most
        ``MAX_TOP_LOGPROBS`` (0: none; the sampler finds them only for a step with a row
        that asks).
    """

    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        for name in ("max_tokens", "top_k", "top_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.top_k < INT32_LIMIT:
            raise ValueError(f"top_k must be in [0, 2**31) (0: all tokens), got {self.top_k}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not self.max_tokens < INT32_LIMIT:
            raise ValueError(f"max_tokens must be < 2**31, got {self.max_tokens}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**32
        ):
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")


@dataclasses.dataclass(eq=False)
class Request:
    """One request's tokens and the cache resources it holds.

    The sequence is ``prompt_token_ids + output_token_ids``; the model has computed (the
    MLA KV and the KDA running state hold) its first ``num_computed`` tokens. A request
    with output and exactly one uncomputed token decodes it; any other request prefills
    its uncomputed tokens, which after a preemption includes the output generated so far.

    Attributes:
      request_id: unique among live requests.
      prompt_token_ids: the prompt (at least one token).
      sampling: how it samples and when it stops.
      status: see ``RequestStatus``.
      output_token_ids: generated tokens, in order; the last ones are ``PLACEHOLDER``
        while the steps sampling them are in flight.
      num_computed: tokens of the sequence whose KV and state are in the cache.
      num_cached_tokens: tokens the first admission took from the prefix cache (None
        before it is admitted).
      block_table: MLA KV blocks, one per logical block of P * dcp tokens; the request
        holds one reference on each.
      state_slot: the KDA state slot the request's recurrence runs in (None unless running).
      pending_retained: positions whose states the step in flight retains for it.
      num_preemptions: times it was preempted.
      pinned_blocks, pinned_slots: what a prefix hit shares and the step in flight copies
        from (the copy-on-write source block, the retained state); the request holds a
        reference on them until that step is done.
      draft_token_ids: speculative drafts of the tokens after the last output token, for
        the next decode to verify (set by the engine after each step; any drafts are safe:
        a wrong draft only shortens what is accepted).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int | None = None
    block_table: list[int] = dataclasses.field(default_factory=list)
    state_slot: int | None = None
    pending_retained: tuple[int, ...] = ()
    num_preemptions: int = 0
    pinned_blocks: list[int] = dataclasses.field(default_factory=list)
    pinned_slots: list[int] = dataclasses.field(default_factory=list)
    draft_token_ids: tuple[int, ...] = ()

    @classmethod
    def create(
        cls, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> "Request":
        """A waiting request; raises ValueError for an empty prompt or a negative token id."""
        prompt = tuple(int(token) for token in prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if min(prompt) < 0:
            raise ValueError(f"request {request_id!r} has a negative token id {min(prompt)}")
        return cls(request_id, prompt, sampling)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The whole sequence: prompt then output."""
        return self.prompt_token_ids + tuple(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Longest the sequence can grow: prompt plus ``max_tokens``."""
        return len(self.prompt_token_ids) + self.sampling.max_tokens

    @property
    def reached_max_tokens(self) -> bool:
        """Whether every token it may generate is sampled (or being sampled)."""
        return len(self.output_token_ids) >= self.sampling.max_tokens

    @property
    def is_decoding(self) -> bool:
        """Whether its next step is a single-token decode rather than a prefill span."""
        return bool(self.output_token_ids) and self.num_tokens - self.num_computed == 1
