"""A generation request as the scheduler tracks it, from arrival to its last token."""

import dataclasses
import enum
from collections.abc import Sequence


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
    """What the scheduler needs to know about sampling: when a request stops.

    Attributes:
      max_tokens: most tokens generated (>= 1).
      stop_token_ids: generating any of these finishes the request (the token is kept).
      temperature: passed through to the sampler; the scheduler does not read it.
    """

    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


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
      sampling: stop conditions.
      status: see ``RequestStatus``.
      output_token_ids: generated tokens, in order.
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
    def is_decoding(self) -> bool:
        """Whether its next step is a single-token decode rather than a prefill span."""
        return bool(self.output_token_ids) and self.num_tokens - self.num_computed == 1
