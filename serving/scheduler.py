"""The step scheduler: which decodes and prefill spans each model step computes.

Per step (DESIGN section 6): decodes first, one token each, then prefill spans while the
token budget lasts, running requests before waiting ones. A request's span is re-planned
every step from its ``num_computed`` with ``plan_prefill``; a span the remaining budget
cuts short ends on the P grid (``cut_span_to_budget``), and a request that cannot get P
tokens waits. Waiting requests are admitted first come, first served, through a prefix
cache lookup. A running request that needs KV blocks the pool cannot give preempts the
most recently admitted running request not yet in the step (possibly itself); a waiting
request never preempts.

One step is in flight at a time. The engine runs it as:

    step = scheduler.schedule()
    copy step.block_copies, then step.resume_state_copies     # before the model
    run the model on batch_builder's PrefillBatch / DecodeBatch of the step
    copy step.retain_state_copies                             # after the model
    scheduler.update_from_step(step, {request_id: sampled token, ...})

``update_from_step`` then registers what the step wrote in the prefix cache: the KV blocks
of every full P-token chunk computed, each checkpoint slot as the retained state at its
position, and each end-of-span copy as the retained state at the span's end.

Retained states are an optimisation, so their destination slots are best effort: when
the slot pool is short, a span keeps the destinations it can get (its end state first,
then its checkpoints from the latest back) rather than preempting anyone.

With ``speculative_tokens`` N, a greedy decode also verifies up to N of the request's
drafts (``Request.draft_token_ids``), as many as its remaining ``max_tokens``, the budget,
the free state slots (one scratch slot per draft, held for the step) and the free KV
blocks allow (drafts never preempt): its block table then covers the drafts, and
``update_from_step`` takes the accepted tokens (1 to 1 + drafts of them) for it.
"""

import collections
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from serving.plan import PrefillSpan, cut_span_to_budget, plan_prefill
from serving.prefix_cache import PrefixCache, PrefixHit
from serving.request import Request, RequestStatus, SamplingParams
from serving.step import (
    BlockCopy,
    ScheduledDecode,
    ScheduledPrefill,
    ScheduledStep,
    SchedulerConfig,
    SlotCopy,
)


@dataclasses.dataclass
class _Draft:
    """A step being scheduled."""

    budget: int
    seqs_left: int
    decodes: list = dataclasses.field(default_factory=list)
    prefills: list = dataclasses.field(default_factory=list)
    block_copies: list = dataclasses.field(default_factory=list)
    resume_copies: list = dataclasses.field(default_factory=list)
    retain_copies: list = dataclasses.field(default_factory=list)
    preempted: list = dataclasses.field(default_factory=list)
    scheduled: set = dataclasses.field(default_factory=set)


class Scheduler:
    """Admits requests, schedules steps, preempts, and updates after each step."""

    def __init__(self, config: SchedulerConfig, prefix_cache: PrefixCache):
        """Schedules over the allocators of ``prefix_cache`` (used even without caching).

        Raises:
          ValueError: if the allocators' block size or dcp differ from the config's, or
            the slot pool is too small for one request (2 slots with prefix caching: the
            running slot and the retained state it resumes from).
        """
        blocks, states = prefix_cache.blocks, prefix_cache.states
        if (blocks.block_size, blocks.dcp) != (config.block_size, config.dcp):
            raise ValueError(
                f"block allocator has block_size {blocks.block_size}, dcp {blocks.dcp}; "
                f"config has {config.block_size}, {config.dcp}"
            )
        min_slots = 2 if config.prefix_caching else 1
        if states.num_slots < min_slots:
            raise ValueError(f"need at least {min_slots} state slots, got {states.num_slots}")
        self.config = config
        self._cache = prefix_cache
        self._blocks = blocks
        self._states = states
        self._requests: dict[str, Request] = {}
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._in_flight: ScheduledStep | None = None
        self._num_steps = 0
        self.schedule_log: list[dict] = []

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The live (waiting, running or preempted) request, or None."""
        return self._requests.get(request_id)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
    ) -> Request:
        """Queues a request (``sampling`` defaults to ``SamplingParams()``).

        Raises:
          ValueError: for a duplicate id, an empty prompt, or a request that can never
            fit: prompt plus ``max_tokens`` over ``max_model_len``, or more KV blocks than
            the whole pool holds.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already live")
        sampling = sampling or SamplingParams()
        request = Request.create(request_id, prompt_token_ids, sampling)
        if request.max_num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt {len(request.prompt_token_ids)} + max_tokens "
                f"{sampling.max_tokens} = {request.max_num_tokens} tokens exceeds max_model_len "
                f"{self.config.max_model_len}"
            )
        # The last sampled token is never computed; a copy-on-write hit holds one more block.
        copy_on_write = int(self.config.prefix_caching and self.config.dcp > 1)
        needed = self._blocks.blocks_needed(request.max_num_tokens - 1) + copy_on_write
        if needed > self._blocks.num_blocks:
            raise ValueError(
                f"request {request_id!r}: {request.max_num_tokens} tokens need {needed} KV "
                f"blocks, the pool has {self._blocks.num_blocks}"
            )
        self._requests[request_id] = request
        self._waiting.append(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Drops a live request and frees everything it holds, at any point.

        Slots that a step in flight writes for it stay held by that step until
        ``update_from_step``, which then registers nothing for it.

        Returns:
          True if the request was live; False if it is unknown or already done.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self._free_resources(request)
        else:
            self._waiting.remove(request)
        request.status = RequestStatus.ABORTED
        return True

    def abort_step(self, step: ScheduledStep) -> list[str]:
        """The step failed (raised while being built, run or sampled): aborts every live
        request it scheduled and frees what the step held, so the pools are as if none of
        them had been admitted. Call it for the step in flight, or after its
        ``update_from_step`` if what followed failed.

        Nothing the step computed is registered in the prefix cache: a failed step's
        writes land only in blocks and slots its own requests held, now free again.

        Returns:
          The ids of the requests aborted (those still live), in step order.
        """
        if step is self._in_flight:
            self._in_flight = None
            for decode in step.decodes:
                self._states.free(decode.draft_slots)
            for prefill in step.prefills:
                self._states.free(prefill.checkpoint_slots)
                if prefill.retain_slot is not None:
                    self._states.free([prefill.retain_slot])
        return [request_id for request_id in step.request_ids if self.abort(request_id)]

    def schedule(self) -> ScheduledStep:
        """Plans the next step. A non-empty step is in flight until ``update_from_step``;
        an empty one (nothing could run) needs no update.

        Raises:
          RuntimeError: if the previous step is still in flight.
        """
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.step_id} is still in flight")
        draft = _Draft(budget=self.config.budget, seqs_left=self.config.max_num_seqs)
        self._schedule_decodes(draft)
        self._schedule_running_prefills(draft)
        if not draft.preempted:
            self._admit_waiting(draft)
        step = ScheduledStep(
            step_id=self._num_steps,
            decodes=tuple(draft.decodes),
            prefills=tuple(draft.prefills),
            block_copies=tuple(draft.block_copies),
            resume_state_copies=tuple(draft.resume_copies),
            retain_state_copies=tuple(draft.retain_copies),
            preempted=tuple(draft.preempted),
        )
        self._num_steps += 1
        if not step.is_empty:
            self._in_flight = step
        if self.config.log_schedule:
            self.schedule_log.append(step.log_entry())
        return step

    def update_from_step(
        self, step: ScheduledStep, sampled_tokens: Mapping[str, int | Sequence[int]]
    ) -> list[Request]:
        """Records that ``step`` ran: advances, registers, appends tokens, finishes.

        Args:
          step: the step in flight.
          sampled_tokens: the token sampled for each of ``step.sampling_request_ids``
            (those aborted since may be left out); for a decode that verified drafts, the
            tokens it accepted, 1 to 1 + drafts of them, in order (the request computed
            all but the last; a stop ends it at that token).

        Returns:
          The requests that finished (their resources are freed).

        Raises:
          ValueError: for a step not in flight, or a token missing or unexpected.
        """
        if step.is_empty and self._in_flight is None:
            return []
        if step is not self._in_flight:
            raise ValueError(f"step {step.step_id} is not the step in flight")
        expected = set(step.sampling_request_ids)
        unexpected = sorted(set(sampled_tokens) - expected)
        if unexpected:
            raise ValueError(f"sampled tokens for requests not sampled in this step: {unexpected}")
        missing = [i for i in expected if self._live(i) and i not in sampled_tokens]
        if missing:
            raise ValueError(f"no sampled token for requests {sorted(missing)}")
        tokens = {i: _token_list(t) for i, t in sampled_tokens.items()}
        for decode in step.decodes:
            count = len(tokens.get(decode.request_id, [0]))
            if not 1 <= count <= decode.num_tokens:
                raise ValueError(f"request {decode.request_id!r}: {count} tokens for a decode "
                                 f"of {decode.num_tokens}")
        for prefill in step.prefills:
            if len(tokens.get(prefill.request_id, [0])) != 1:
                raise ValueError(f"request {prefill.request_id!r}: one token per prefill")
        self._in_flight = None

        finished = []
        for decode in step.decodes:  # the drafts' scratch slots were the step's alone
            self._states.free(decode.draft_slots)
        unreleased = list(step.prefills)  # whose step-held state slots are not yet freed
        try:
            for decode in step.decodes:
                request = self._live(decode.request_id)
                if request is not None:
                    accepted = tokens[request.request_id]
                    request.num_computed += len(accepted)
                    request.draft_token_ids = ()
                    for token in accepted:
                        if self._append_token(request, token, finished):
                            break
            for prefill in step.prefills:
                request = self._live(prefill.request_id)
                if request is not None:
                    request.num_computed = prefill.span.end
                    request.pending_retained = ()
                    self._release_pins(request)
                    if self.config.prefix_caching:
                        self._register(request, prefill)
                    if prefill.samples:
                        request.draft_token_ids = ()
                        self._append_token(request, tokens[request.request_id][0], finished)
                self._free_step_slots(unreleased.pop(0))
        finally:  # a bug above must not leak the slots the step held
            for prefill in unreleased:
                self._free_step_slots(prefill)
        return finished

    def _free_step_slots(self, prefill: ScheduledPrefill) -> None:
        self._states.free(prefill.checkpoint_slots)
        if prefill.retain_slot is not None:
            self._states.free([prefill.retain_slot])

    def _live(self, request_id: str) -> Request | None:
        request = self._requests.get(request_id)
        return request if request is not None and request.status is RequestStatus.RUNNING else None

    def _register(self, request: Request, prefill: ScheduledPrefill) -> None:
        tokens = request.token_ids
        self._cache.register_blocks(tokens, request.block_table, prefill.span.end)
        for position, slot in zip(prefill.span.checkpoints, prefill.checkpoint_slots):
            self._cache.register_state(tokens, position, slot)
        if prefill.retain_slot is not None:
            self._cache.register_state(tokens, prefill.span.end, prefill.retain_slot)

    def set_drafts(self, request_id: str, draft_token_ids: Sequence[int]) -> None:
        """Drafts for the next decode of a running request (ignored for any other)."""
        request = self._live(request_id)
        if request is not None:
            request.draft_token_ids = tuple(int(t) for t in draft_token_ids)

    def _append_token(self, request: Request, token: int, finished: list[Request]) -> bool:
        """Appends ``token``; returns whether it finished the request."""
        request.output_token_ids.append(int(token))
        sampling = request.sampling
        if token in sampling.stop_token_ids or len(request.output_token_ids) >= sampling.max_tokens:
            self._running.remove(request)
            self._free_resources(request)
            del self._requests[request.request_id]
            request.status = RequestStatus.FINISHED
            finished.append(request)
            return True
        return False

    def _num_drafts(self, request: Request, draft: _Draft) -> int:
        """Drafts the request's next decode verifies: its drafts, as far as its remaining
        tokens, the step's budget and the free state slots go, keeping one slot for an
        admission while requests wait (0 when sampling with a temperature, which
        speculation leaves to plain decoding). Drafts never preempt (``_schedule_decodes``
        drops those whose blocks the pool cannot give)."""
        if not self.config.speculative_tokens or request.sampling.temperature > 0:
            return 0
        remaining = request.sampling.max_tokens - len(request.output_token_ids)
        slots = self._states.num_allocatable - int(bool(self._waiting))
        return max(0, min(len(request.draft_token_ids), self.config.speculative_tokens,
                          remaining - 1, draft.budget - 1, slots))

    def _schedule_decodes(self, draft: _Draft) -> None:
        for request in list(self._running):
            if request.status is not RequestStatus.RUNNING or not request.is_decoding:
                continue
            if draft.budget < 1 or draft.seqs_left < 1:
                return
            position = request.num_computed
            num_drafts = self._num_drafts(request, draft)
            new_blocks = (
                self._blocks.blocks_needed(position + 1 + num_drafts) - len(request.block_table)
            )
            while num_drafts and new_blocks > self._blocks.num_allocatable:
                num_drafts -= 1  # a draft never preempts anyone
                new_blocks = (self._blocks.blocks_needed(position + 1 + num_drafts)
                              - len(request.block_table))
            if not self._make_room(new_blocks, request, draft):
                continue
            request.block_table += self._blocks.allocate(new_blocks)
            draft.decodes.append(
                ScheduledDecode(
                    request.request_id,
                    request.output_token_ids[-1],
                    position,
                    request.state_slot,
                    tuple(request.block_table),
                    request.draft_token_ids[:num_drafts],
                    tuple(self._states.allocate(num_drafts)),
                )
            )
            draft.budget -= 1 + num_drafts
            draft.seqs_left -= 1
            draft.scheduled.add(request.request_id)

    def _schedule_running_prefills(self, draft: _Draft) -> None:
        for request in list(self._running):
            if (
                request.status is not RequestStatus.RUNNING
                or request.is_decoding
                or request.request_id in draft.scheduled
            ):
                continue
            if draft.seqs_left < 1:
                return
            span = self._next_span(request, request.num_computed, draft.budget)
            if span is None:
                continue
            new_blocks = self._blocks.blocks_needed(span.end) - len(request.block_table)
            if not self._make_room(new_blocks, request, draft):
                continue
            request.block_table += self._blocks.allocate(new_blocks)
            self._add_prefill(request, span, draft)

    def _admit_waiting(self, draft: _Draft) -> None:
        while self._waiting and draft.seqs_left > 0:
            request = self._waiting[0]
            tokens = request.token_ids
            hit = self._cache.lookup(tokens) if self.config.prefix_caching else PrefixHit()
            span = self._next_span(request, hit.num_tokens, draft.budget)
            if span is None:
                return
            # Pinning the hit takes its unreferenced blocks and slot out of the free pool.
            pinned = sum(self._blocks.refcount(b) == 0 for b in set(hit.block_ids))
            new_blocks = (
                self._blocks.blocks_needed(span.end) - len(hit.block_ids) + int(hit.copy_last_block)
            )
            if new_blocks > self._blocks.num_allocatable - pinned:
                return
            slot_pinned = hit.state_slot is not None and self._states.refcount(hit.state_slot) == 0
            if self._states.num_allocatable - int(slot_pinned) < 1:
                return

            self._waiting.popleft()
            if self.config.prefix_caching:
                acquired = self._cache.acquire(tokens)
                assert acquired == hit, (acquired, hit)
            (running_slot,) = self._states.allocate(1)
            table = list(hit.block_ids)
            if hit.copy_last_block:
                (copy,) = self._blocks.allocate(1)
                draft.block_copies.append(BlockCopy(table[-1], copy))
                request.pinned_blocks = [table[-1]]
                table[-1] = copy
            if hit.state_slot is not None:
                draft.resume_copies.append(SlotCopy(hit.state_slot, running_slot))
                request.pinned_slots = [hit.state_slot]
            table += self._blocks.allocate(self._blocks.blocks_needed(span.end) - len(table))
            request.block_table = table
            request.state_slot = running_slot
            request.num_computed = hit.num_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            self._add_prefill(request, span, draft)

    def _next_span(self, request: Request, start: int, budget: int) -> PrefillSpan | None:
        """The request's next span from ``start``, cut to ``budget``; None if it must wait."""
        config = self.config
        span = plan_prefill(
            request.num_tokens,
            start,
            block_size=config.block_size,
            dcp=config.dcp,
            budget=config.budget,
            coalesce=config.coalesce,
        )[0]
        span = cut_span_to_budget(span, budget, block_size=config.block_size)
        if span is not None and not config.prefix_caching:
            span = dataclasses.replace(span, checkpoints=(), retain_end=False)
        return span

    def _add_prefill(self, request: Request, span: PrefillSpan, draft: _Draft) -> None:
        wanted = ([span.end] if span.retain_end else []) + list(reversed(span.checkpoints))
        slots = self._states.allocate(min(len(wanted), self._states.num_allocatable))
        destinations = dict(zip(wanted, slots))
        retain_slot = destinations.pop(span.end, None)
        checkpoints = tuple(p for p in span.checkpoints if p in destinations)
        span = dataclasses.replace(
            span, checkpoints=checkpoints, retain_end=retain_slot is not None
        )
        tokens = request.token_ids
        draft.prefills.append(
            ScheduledPrefill(
                request_id=request.request_id,
                span=span,
                token_ids=tokens[span.start : span.end],
                state_slot=request.state_slot,
                checkpoint_slots=tuple(destinations[p] for p in checkpoints),
                retain_slot=retain_slot,
                block_table=tuple(request.block_table),
                samples=span.end == len(tokens),
            )
        )
        if retain_slot is not None:
            draft.retain_copies.append(SlotCopy(request.state_slot, retain_slot))
        request.pending_retained = span.retained_positions
        draft.budget -= span.num_tokens
        draft.seqs_left -= 1
        draft.scheduled.add(request.request_id)

    def _make_room(self, num_blocks: int, request: Request, draft: _Draft) -> bool:
        """Preempts until ``num_blocks`` blocks are allocatable; False if ``request`` went."""
        while self._blocks.num_allocatable < num_blocks:
            victim = next(r for r in reversed(self._running) if r.request_id not in draft.scheduled)
            self._preempt(victim, draft)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, draft: _Draft) -> None:
        self._running.remove(request)
        self._free_resources(request)
        request.num_computed = 0
        request.draft_token_ids = ()
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._waiting.appendleft(request)
        draft.preempted.append(request.request_id)

    def _release_pins(self, request: Request) -> None:
        self._blocks.free(request.pinned_blocks)
        self._states.free(request.pinned_slots)
        request.pinned_blocks, request.pinned_slots = [], []

    def _free_resources(self, request: Request) -> None:
        self._release_pins(request)
        self._blocks.free(request.block_table)
        if request.state_slot is not None:
            self._states.free([request.state_slot])
        request.block_table, request.state_slot = [], None
        request.pending_retained = ()


def _token_list(tokens: int | Sequence[int]) -> list[int]:
    return [int(tokens)] if isinstance(tokens, int | np.integer) else [int(t) for t in tokens]
