"""The step scheduler: which decodes and prefill spans each model step computes.

Per step (DESIGN section 6): decodes first, one token each, then prefill spans while the
token budget lasts, running requests before waiting ones. A request's span is re-planned
every step from its ``num_computed`` with ``plan_prefill``; a span the remaining budget
cuts short ends on the P grid (``cut_span_to_budget``), and a request that cannot get P
tokens waits. Waiting requests are admitted first come, first served, through a prefix
cache lookup. A running request that needs KV blocks the pool cannot give preempts the
most recently admitted running request not yet in the step (possibly itself); a waiting
request never preempts.

The engine runs a step as:

    step = scheduler.schedule()
    copy step.block_copies, then step.resume_state_copies     # before the model
    run the model on batch_builder's PrefillBatch / DecodeBatch of the step
    copy step.retain_state_copies                             # after the model
    scheduler.update_from_step(step, {request_id: sampled token, ...})

``schedule`` already counts the step's tokens as computed and appends a ``PLACEHOLDER``
output token for each token it samples; ``update_from_step`` then puts the sampled tokens
in their place, finishes requests on a stop token or ``max_tokens``, and registers what
the step wrote in the prefix cache: the KV blocks of every full P-token chunk computed,
each checkpoint slot as the retained state at its position, and each end-of-span copy as
the retained state at the span's end.

Asynchronous scheduling (``async_scheduling``): the next step may be scheduled while one
is in flight, so the host plans step n + 1 while the device runs step n. Step n + 1
decodes the requests step n samples for with placeholder tokens (the engine feeds them
from step n's sampled tokens on the device). Whether step n's token stops a request is
known only at its update: such a request's row in step n + 1 is computed and dropped (its
placeholder is never emitted), into blocks and a slot it held, which the device writes
before any later step can reuse them. Requests that reach ``max_tokens`` are not
scheduled again. What step n retains becomes findable only at its update, so step n + 1
never resumes from a state a failed step n would not have written. A request preempted
while its last step is in flight keeps its placeholder until that update; it cannot be
readmitted before, since a step that preempts admits no one and at most one step is in
flight when the next is scheduled.

Retained states are an optimisation, so their destination slots are best effort: when
the slot pool is short, a span keeps the destinations it can get (its end state first,
then its checkpoints from the latest back) rather than preempting anyone.

With ``speculative_tokens`` N, a greedy decode also verifies up to N of the request's
drafts (``Request.draft_token_ids``), as many as its remaining ``max_tokens``, the budget,
the free state slots (one scratch slot per draft, held for the step) and the free KV
blocks allow (drafts never preempt): its block table then covers the drafts, and
``update_from_step`` takes the accepted tokens (1 to 1 + drafts of them) for it: the
first fills the decode's placeholder, the others are appended. Only with synchronous
scheduling (``SchedulerConfig`` refuses both), since how many tokens a verified decode
adds is known only at its update.
"""

import collections
from collections.abc import Mapping, Sequence

import numpy as np

from serving.prefix_cache import PrefixCache
from serving.request import PLACEHOLDER, Request, RequestStatus, SamplingParams
from serving.step import ScheduledPrefill, ScheduledStep, SchedulerConfig
from serving.step_planner import StepDraft, StepPlanner


class Scheduler(StepPlanner):
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
        # Steps in flight, oldest first, each with the requests it scheduled (an id may
        # name a new request by the time the step is updated).
        self._in_flight: collections.deque[tuple[ScheduledStep, dict[str, Request]]] = (
            collections.deque()
        )
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
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._remove(request, RequestStatus.ABORTED)
        return True

    def _remove(self, request: Request, status: RequestStatus) -> None:
        """Drops a live request (running, waiting or preempted) and frees what it holds."""
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self._free_resources(request)
        else:
            self._waiting.remove(request)
        del self._requests[request.request_id]
        request.status = status

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
        entry = next((e for e in self._in_flight if e[0] is step), None)
        if entry is None:
            return [request_id for request_id in step.request_ids if self.abort(request_id)]
        self._in_flight.remove(entry)
        self._free_step_slots(step)
        requests = entry[1]
        return [
            request_id
            for request_id in step.request_ids
            if self._requests.get(request_id) is requests[request_id] and self.abort(request_id)
        ]

    def schedule(self) -> ScheduledStep:
        """Plans the next step. A non-empty step is in flight until ``update_from_step``;
        an empty one (nothing could run) needs no update.

        Raises:
          RuntimeError: if a step is still in flight (two with ``async_scheduling``).
        """
        if len(self._in_flight) >= (2 if self.config.async_scheduling else 1):
            raise RuntimeError(f"step {self._in_flight[-1][0].step_id} is still in flight")
        draft = StepDraft(budget=self.config.budget, seqs_left=self.config.max_num_seqs)
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
            self._in_flight.append((step, self._advance(step)))
        if self.config.log_schedule:
            self.schedule_log.append(step.log_entry())
        return step

    def update_from_step(
        self, step: ScheduledStep, sampled_tokens: Mapping[str, int | Sequence[int]]
    ) -> list[Request]:
        """Records that ``step`` ran: sets its sampled tokens, registers, finishes.

        Args:
          step: the oldest step in flight.
          sampled_tokens: the token sampled for each of ``step.sampling_request_ids``
            (those aborted or finished since may be left out; their tokens are dropped);
            for a decode that verified drafts (synchronous scheduling only), the tokens it
            accepted, 1 to 1 + drafts of them, in order (the request computed all but the
            last; a stop ends it at that token).

        Returns:
          The requests that finished (their resources are freed).

        Raises:
          ValueError: for a step not in flight (or not the oldest), or a token missing or
            unexpected.
        """
        if step.is_empty and not self._in_flight:
            return []
        if not self._in_flight or step is not self._in_flight[0][0]:
            raise ValueError(f"step {step.step_id} is not the step in flight (the oldest)")
        requests = self._in_flight[0][1]

        def live(request_id: str) -> Request | None:
            request = requests[request_id]
            return request if self._requests.get(request_id) is request else None

        expected = set(step.sampling_request_ids)
        unexpected = sorted(set(sampled_tokens) - expected)
        if unexpected:
            raise ValueError(f"sampled tokens for requests not sampled in this step: {unexpected}")
        missing = [i for i in expected if live(i) and i not in sampled_tokens]
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
        self._in_flight.popleft()

        finished = []
        try:
            for decode in step.decodes:
                request = live(decode.request_id)
                if request is not None:
                    request.draft_token_ids = ()
                    self._set_accepted(request, decode.position + 1, tokens[decode.request_id],
                                       finished)
            for prefill in step.prefills:
                request = live(prefill.request_id)
                # Not running: preempted after the step was scheduled; its blocks are gone.
                if request is not None and request.status is RequestStatus.RUNNING:
                    request.pending_retained = ()
                    self._release_pins(request)
                    if self.config.prefix_caching:
                        self._register(request, prefill)
                if request is not None and prefill.samples:
                    request.draft_token_ids = ()
                    self._set_token(request, prefill.span.end, tokens[prefill.request_id][0],
                                    finished)
        finally:  # the step no longer holds them, even if a bug raised above
            self._free_step_slots(step)
        return finished

    def _advance(self, step: ScheduledStep) -> dict[str, Request]:
        """Counts the step's tokens as computed and appends a placeholder for each token
        it samples; returns its requests by id."""
        requests = {}
        for decode in step.decodes:
            request = requests[decode.request_id] = self._requests[decode.request_id]
            request.num_computed += 1
            request.output_token_ids.append(PLACEHOLDER)
        for prefill in step.prefills:
            request = requests[prefill.request_id] = self._requests[prefill.request_id]
            request.num_computed = prefill.span.end
            if prefill.samples:
                request.output_token_ids.append(PLACEHOLDER)
        return requests

    def _set_token(self, request: Request, position: int, token: int, finished: list) -> bool:
        """Puts the token sampled at sequence ``position`` in its placeholder; finishes the
        request on a stop token or at ``max_tokens``. Returns whether it finished."""
        index = position - len(request.prompt_token_ids)
        request.output_token_ids[index] = token
        sampling = request.sampling
        if token in sampling.stop_token_ids or index + 1 >= sampling.max_tokens:
            # A later step in flight may have sampled past a stop: never emitted.
            del request.output_token_ids[index + 1 :]
            self._remove(request, RequestStatus.FINISHED)
            finished.append(request)
            return True
        return False

    def _set_accepted(
        self, request: Request, position: int, accepted: list[int], finished: list
    ) -> None:
        """A decode's tokens from sequence ``position`` on: the first fills the placeholder
        ``schedule`` appended; each further one (after an accepted draft, which the step
        computed) is appended, up to the first that finishes the request. Several tokens
        come only from a verified decode, hence with no other step in flight."""
        for j, token in enumerate(accepted):
            if j:
                request.num_computed += 1
                request.output_token_ids.append(PLACEHOLDER)
            if self._set_token(request, position + j, token, finished):
                return

    def _free_step_slots(self, step: ScheduledStep) -> None:
        """Frees the checkpoint and retain slots the step held (registered ones stay)."""
        for decode in step.decodes:  # the drafts' scratch slots were the step's alone
            self._states.free(decode.draft_slots)
        for prefill in step.prefills:
            self._states.free(prefill.checkpoint_slots)
            if prefill.retain_slot is not None:
                self._states.free([prefill.retain_slot])

    def _register(self, request: Request, prefill: ScheduledPrefill) -> None:
        tokens = request.token_ids
        self._cache.register_blocks(tokens, request.block_table, prefill.span.end)
        for position, slot in zip(prefill.span.checkpoints, prefill.checkpoint_slots):
            self._cache.register_state(tokens, position, slot)
        if prefill.retain_slot is not None:
            self._cache.register_state(tokens, prefill.span.end, prefill.retain_slot)

    def set_drafts(self, request_id: str, draft_token_ids: Sequence[int]) -> None:
        """Drafts for the next decode of a running request (ignored for any other)."""
        request = self._requests.get(request_id)
        if request is not None and request.status is RequestStatus.RUNNING:
            request.draft_token_ids = tuple(int(t) for t in draft_token_ids)

def _token_list(tokens: int | Sequence[int]) -> list[int]:
    return [int(tokens)] if isinstance(tokens, int | np.integer) else [int(t) for t in tokens]
