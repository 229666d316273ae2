"""What one scheduler step is: its configuration, and the prefill spans, decodes and cache
copies it schedules (produced by ``serving.scheduler``, consumed by
``serving.batch_builder`` and ``serving.engine``).
"""

import dataclasses
from typing import NamedTuple

from serving.plan import PrefillSpan, alignment

MAX_SPECULATIVE_TOKENS = 3  # N + 1 rows of a verified sequence: at most 4 chained states


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Scheduling knobs.

    Attributes:
      max_model_len: most tokens (prompt plus generated) one request may have.
      block_size: P, the KV block and prefix-lookup unit in tokens.
      dcp: decode-context-parallel ranks (1, 2, 4); a KV block id holds P * dcp tokens.
      budget: B, the most tokens one step computes; a multiple of P * dcp.
      coalesce: coalesced spans with kernel checkpoints (True) or the reference ladder.
      prefix_caching: look requests up in the prefix cache and retain states for it.
      max_num_seqs: the most requests (decodes plus prefills) in one step.
      log_schedule: keep ``Scheduler.schedule_log``, one plain-data entry per step.
      speculative_tokens: N, drafts (from the model's MTP head) a greedy decode verifies
        per step, 0..3 (0: plain decoding; see ``serving.speculative``).
      async_scheduling: allow scheduling a step while the previous one is in flight
        (its sampled tokens are placeholders until ``update_from_step``).
    """

    max_model_len: int
    block_size: int = 512
    dcp: int = 1
    budget: int = 8192
    coalesce: bool = True
    prefix_caching: bool = True
    max_num_seqs: int = 256
    log_schedule: bool = False
    speculative_tokens: int = 0
    async_scheduling: bool = False

    def __post_init__(self):
        align = alignment(self.block_size, self.dcp)
        if self.budget < align or self.budget % align:
            raise ValueError(
                f"budget must be a positive multiple of block_size * dcp = {align}, "
                f"got {self.budget}"
            )
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.speculative_tokens}")
        if self.speculative_tokens and self.async_scheduling:
            raise ValueError(f"speculative_tokens={self.speculative_tokens} needs "
                             "async_scheduling=False (a verified decode's length is known "
                             "only after its step's fetch)")


class BlockCopy(NamedTuple):
    """Copy KV block ``src`` into block ``dst`` on every dcp rank."""

    src: int
    dst: int


class SlotCopy(NamedTuple):
    """Copy state slot ``src`` into slot ``dst`` in every KDA layer (recurrent and conv)."""

    src: int
    dst: int


@dataclasses.dataclass(frozen=True)
class ScheduledPrefill:
    """One request's prefill span in a step.

    Attributes:
      request_id: the request.
      span: tokens [start, end) and the states retained: ``span.checkpoints`` are kernel
        snapshots, ``span.retain_end`` an end-state copy. Each has a destination below.
      token_ids: the span's tokens, ``end - start`` of them.
      state_slot: the running slot; read at the start (when ``has_initial``) and
        holding the state after ``end`` tokens when the step is done.
      checkpoint_slots: the destination slot of each checkpoint, in order.
      retain_slot: where the state after ``end`` is copied after the step, or None.
      block_table: the request's KV blocks covering [0, end).
      samples: the span ends the sequence, so the model samples the next token.
    """

    request_id: str
    span: PrefillSpan
    token_ids: tuple[int, ...]
    state_slot: int
    checkpoint_slots: tuple[int, ...]
    retain_slot: int | None
    block_table: tuple[int, ...]
    samples: bool

    @property
    def has_initial(self) -> bool:
        """Whether the span resumes a state (False: a cold start from zeros)."""
        return self.span.start > 0


@dataclasses.dataclass(frozen=True)
class ScheduledDecode:
    """One request's decode in a step: token ``token_id`` at ``position``.

    With speculation it also verifies ``draft_token_ids`` at the positions after it; the
    KDA state after each of them goes to its ``draft_slots`` entry (held for the step),
    and ``block_table`` covers them all.
    """

    request_id: str
    token_id: int
    position: int
    state_slot: int
    block_table: tuple[int, ...]
    draft_token_ids: tuple[int, ...] = ()
    draft_slots: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return 1 + len(self.draft_token_ids)


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
    """What one model step computes, and the copies around it.

    Attributes:
      step_id: counts steps from 0.
      decodes: decode rows, in priority order.
      prefills: prefill spans, in priority order.
      block_copies: before the model, copy-on-write of a prefix hit's partly shared block.
      resume_state_copies: before the model, a prefix hit's retained state into the
        request's running slot.
      retain_state_copies: after the model, a running slot holding a span's end state
        into a retained slot (before the next step moves the running state on).
      preempted: requests preempted while scheduling this step.
    """

    step_id: int
    decodes: tuple[ScheduledDecode, ...] = ()
    prefills: tuple[ScheduledPrefill, ...] = ()
    block_copies: tuple[BlockCopy, ...] = ()
    resume_state_copies: tuple[SlotCopy, ...] = ()
    retain_state_copies: tuple[SlotCopy, ...] = ()
    preempted: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens computed: one per decode (and its drafts) plus every span's length."""
        return sum(d.num_tokens for d in self.decodes) + sum(
            p.span.num_tokens for p in self.prefills
        )

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def request_ids(self) -> tuple[str, ...]:
        """Every request the step computes for: decodes, then prefills."""
        return tuple(d.request_id for d in self.decodes) + tuple(
            p.request_id for p in self.prefills
        )

    @property
    def sampling_request_ids(self) -> tuple[str, ...]:
        """Requests the model samples a token for: every decode and every final span."""
        return tuple(d.request_id for d in self.decodes) + tuple(
            p.request_id for p in self.prefills if p.samples
        )

    def log_entry(self) -> dict:
        """The step as plain data: which spans, which checkpoints, who was preempted."""
        return {
            "step": self.step_id,
            "num_tokens": self.num_tokens,
            "decodes": [d.request_id for d in self.decodes],
            "drafts": {d.request_id: len(d.draft_token_ids) for d in self.decodes
                       if d.draft_token_ids},
            "prefills": [
                {
                    "request_id": p.request_id,
                    "start": p.span.start,
                    "end": p.span.end,
                    "checkpoints": list(p.span.checkpoints),
                    "retain_end": p.span.retain_end,
                }
                for p in self.prefills
            ],
            "preempted": list(self.preempted),
        }
