"""How ``serving.scheduler.Scheduler`` fills a step: decodes first (with their drafts),
then the spans of running prefills, then waiting requests admitted through a prefix cache
lookup, preempting the most recently admitted running request not yet in the step when a
running one needs KV blocks the pool cannot give (see ``serving.scheduler`` for the
rules). ``StepPlanner`` is the scheduler's base class: its methods read and change the
scheduler's queues and pools and append to a ``StepDraft``."""

import collections
import dataclasses

from serving.block_allocator import BlockAllocator
from serving.plan import PrefillSpan, cut_span_to_budget, plan_prefill
from serving.prefix_cache import PrefixCache, PrefixHit
from serving.request import Request, RequestStatus
from serving.state_slots import StateSlotAllocator
from serving.step import BlockCopy, ScheduledDecode, ScheduledPrefill, SchedulerConfig, SlotCopy


@dataclasses.dataclass
class StepDraft:
    """A step being scheduled: what is left of its budget, and what it holds so far."""

    budget: int
    seqs_left: int
    decodes: list = dataclasses.field(default_factory=list)
    prefills: list = dataclasses.field(default_factory=list)
    block_copies: list = dataclasses.field(default_factory=list)
    resume_copies: list = dataclasses.field(default_factory=list)
    retain_copies: list = dataclasses.field(default_factory=list)
    preempted: list = dataclasses.field(default_factory=list)
    scheduled: set = dataclasses.field(default_factory=set)


class StepPlanner:
    """The step-filling half of the scheduler, over the state ``Scheduler.__init__`` sets:
    ``config``, the prefix cache ``_cache`` and its allocators ``_blocks`` and
    ``_states``, the ``_waiting`` queue and the ``_running`` list (admission order)."""

    config: SchedulerConfig
    _cache: PrefixCache
    _blocks: BlockAllocator
    _states: StateSlotAllocator
    _waiting: collections.deque[Request]
    _running: list[Request]

    def _num_drafts(self, request: Request, draft: StepDraft) -> int:
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

    def _schedule_decodes(self, draft: StepDraft) -> None:
        for request in list(self._running):
            if (
                request.status is not RequestStatus.RUNNING
                or not request.is_decoding
                or request.reached_max_tokens  # its last token is being sampled
            ):
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

    def _schedule_running_prefills(self, draft: StepDraft) -> None:
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

    def _admit_waiting(self, draft: StepDraft) -> None:
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

    def _add_prefill(self, request: Request, span: PrefillSpan, draft: StepDraft) -> None:
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

    def _make_room(self, num_blocks: int, request: Request, draft: StepDraft) -> bool:
        """Preempts until ``num_blocks`` blocks are allocatable; False if ``request`` went."""
        while self._blocks.num_allocatable < num_blocks:
            victim = next(r for r in reversed(self._running) if r.request_id not in draft.scheduled)
            self._preempt(victim, draft)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, draft: StepDraft) -> None:
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
