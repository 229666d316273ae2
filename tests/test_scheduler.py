"""Tests for serving.scheduler: generated workloads run against fake device memory.

``FakeDevice`` executes the batches ``BatchBuilder`` packs from each step the way the
model would, over memory that records what it holds: ``kv[block, row]`` is the token whose
KV a block row holds, ``state[slot]`` is (tokens consumed, CRC-32 of them). The "model"
samples the next token from both halves (the running state and the KV its block table
reads), so a request resumed from a wrong state or wrong blocks generates different
tokens from the reference, which is the same function applied to the true sequence.
With speculation the fake device verifies the drafts as the model does (a chain of states,
the accepted one kept in the running slot) and the harness drafts from the reference,
often with a wrong token, so every acceptance length occurs.

With ``async_scheduling`` the harness pipelines as the engine does: it schedules and runs
step n + 1 before updating the scheduler with step n's tokens, feeding step n + 1's
placeholder decode tokens from step n's samples "on the device".
"""

import collections
import random
import zlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import event, given, settings

from glmjax.batch import DecodeBatch, VerifyBatch
from serving.batch_builder import BatchBuilder
from serving.block_allocator import BlockAllocator
from serving.block_hash import chained_block_hashes
from serving.plan import cut_span_to_budget, plan_prefill, retention_capacity
from serving.prefix_cache import PrefixCache
from serving.request import PLACEHOLDER, RequestStatus, SamplingParams
from serving.scheduler import Scheduler
from serving.state_slots import StateKey, StateSlotAllocator
from serving.step import SchedulerConfig

P = 512
VOCAB = 97
STOP = 3


def crc(tokens, previous=0):
    return zlib.crc32(np.asarray(tokens, np.int64).tobytes(), previous)


def next_token(state_crc, kv_crc):
    return (3 * state_crc + kv_crc) % 1_000_003 % VOCAB


def reference_output(prompt, sampling):
    """What any correct schedule generates: the model applied to the true sequence."""
    digest, output = crc(prompt), []
    while True:
        token = next_token(digest, digest)
        output.append(token)
        digest = crc([token], digest)
        if token in sampling.stop_token_ids or len(output) >= sampling.max_tokens:
            return output


class FakeDevice:
    """Device memory that records contents, running a step's copies and batches."""

    def __init__(self, num_blocks, tokens_per_block, num_slots):
        self.rows = tokens_per_block
        self.kv = np.full((num_blocks, tokens_per_block), -1, np.int64)
        self.state = [None] * num_slots

    def kv_crc(self, table, end):
        positions = np.arange(end)
        values = self.kv[np.asarray(table)[positions // self.rows], positions % self.rows]
        assert np.all(values >= 0), "read KV that was never written"
        return crc(values)

    def run(self, step, prefill, decode):
        for copy in step.block_copies:
            self.kv[copy.dst] = self.kv[copy.src]
        for copy in step.resume_state_copies:
            self.state[copy.dst] = self.state[copy.src]
        sampled = {}
        for i, scheduled in enumerate(step.prefills):
            start, end = prefill.cu_seqlens[i], prefill.cu_seqlens[i + 1]
            tokens = prefill.token_ids[start:end]
            slot, prefix = prefill.state_slots[i], prefill.prefix_lens[i]
            initial = self.state[slot] if prefill.has_initial[i] else (0, 0)
            assert initial[0] == prefix, "resumed from a state at the wrong position"
            table = prefill.block_tables[i]
            positions = prefill.positions[start:end]
            self.kv[table[positions // self.rows], positions % self.rows] = tokens
            for offset, dst in zip(prefill.checkpoint_offsets[i], prefill.checkpoint_slots[i]):
                if offset != -1:
                    self.state[dst] = (prefix + offset, crc(tokens[:offset], initial[1]))
            self.state[slot] = (prefix + len(tokens), crc(tokens, initial[1]))
            if scheduled.samples:
                kv = self.kv_crc(table, prefix + len(tokens))
                sampled[scheduled.request_id] = next_token(self.state[slot][1], kv)
        if isinstance(decode, VerifyBatch):
            sampled |= self.verify(step, decode)
        for i, scheduled in enumerate(step.decodes if isinstance(decode, DecodeBatch) else ()):
            slot, position = decode.state_slots[i], decode.positions[i]
            table = decode.block_tables[i]
            assert self.state[slot][0] == position, "decode from a state at the wrong position"
            self.kv[table[position // self.rows], position % self.rows] = decode.token_ids[i]
            self.state[slot] = (position + 1, crc([decode.token_ids[i]], self.state[slot][1]))
            sampled[scheduled.request_id] = next_token(
                self.state[slot][1], self.kv_crc(table, position + 1)
            )
        for copy in step.retain_state_copies:
            self.state[copy.dst] = self.state[copy.src]
        return sampled

    def verify(self, step, batch):
        """Each decode's token and drafts through a chain of states; keeps the accepted."""
        sampled = {}
        for i, scheduled in enumerate(step.decodes):
            position, count = batch.positions[i], batch.num_drafts[i]
            chain, table = batch.slot_chain[: count + 1, i], batch.block_tables[i]
            state = self.state[chain[0]]
            assert state[0] == position, "verify from a state at the wrong position"
            out = []
            for j in range(count + 1):
                token, at = batch.token_ids[j, i], position + j
                self.kv[table[at // self.rows], at % self.rows] = token
                state = (at + 1, crc([token], state[1]))
                self.state[chain[j]] = state
                out.append(next_token(state[1], self.kv_crc(table, at + 1)))
            accepted = 0
            while accepted < count and batch.token_ids[accepted + 1, i] == out[accepted]:
                accepted += 1
            self.state[chain[0]] = self.state[chain[accepted]]
            sampled[scheduled.request_id] = out[: accepted + 1]
        return sampled


class Harness:
    """A scheduler, a batch builder and a fake device, checking invariants every step."""

    def __init__(self, *, num_blocks, num_slots, **config):
        config.setdefault("max_model_len", 1 << 16)
        self.config = SchedulerConfig(**config)
        dcp = self.config.dcp
        self.cache = PrefixCache(
            BlockAllocator(num_blocks, block_size=self.config.block_size, dcp=dcp),
            StateSlotAllocator(num_slots),
        )
        self.scheduler = Scheduler(self.config, self.cache)
        self.builder = BatchBuilder(self.config, num_blocks=num_blocks, num_slots=num_slots)
        self.device = FakeDevice(num_blocks, self.config.block_size * dcp, num_slots)
        self.sequences = {}  # request id -> prompt and sampling, for the reference
        self.outputs = {}
        self.steps = []
        self.num_preemptions = 0
        self.rng = random.Random(5)
        self.accepted = collections.Counter()  # drafts accepted per verified decode
        self.in_flight = []  # async: (step, its sampled tokens), oldest first

    def add(self, request_id, prompt, max_tokens=4, stop=(STOP,)):
        sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop)
        self.scheduler.add_request(request_id, prompt, sampling)
        self.sequences[request_id] = (list(prompt), sampling)

    def live(self):
        return [self.scheduler.get_request(i) for i in self.sequences if i not in self.outputs]

    def step(self):
        """Schedules, checks, runs and updates one step; returns it (None if empty)."""
        launched = self.launch()
        if launched is not None:
            self.update(*self.in_flight.pop())
        return launched

    def pipelined_step(self):
        """As the engine with ``async_scheduling``: launches a step (two when none is in
        flight), then updates the oldest."""
        if not self.in_flight:
            self.launch()
        if self.in_flight:
            self.launch()
            self.update(*self.in_flight.pop(0))

    def launch(self):
        """Schedules, checks and runs one step (None if empty), leaving it in flight."""
        live = [r for r in self.live() if r is not None]
        before = {r.request_id: r.num_tokens for r in live}
        ready = {
            r.request_id
            for r in live
            if r.status is RequestStatus.RUNNING and r.is_decoding and not r.reached_max_tokens
        }
        step = self.scheduler.schedule()
        self.num_preemptions += len(step.preempted)
        if step.is_empty:
            return None
        self.check_step(step, before, ready)
        prefill, decode = self.builder.build(step)
        self.check_batches(step, prefill, decode)
        for i, scheduled in enumerate(step.decodes):
            if scheduled.token_id == PLACEHOLDER:  # sampled by the step in flight
                decode.token_ids[i] = self.in_flight[-1][1][scheduled.request_id]
        self.in_flight.append((step, self.device.run(step, prefill, decode)))
        self.steps.append(step)
        return step

    def update(self, step, sampled):
        for request in self.scheduler.update_from_step(step, sampled):
            assert PLACEHOLDER not in request.output_token_ids
            self.outputs[request.request_id] = list(request.output_token_ids)
        for scheduled in step.decodes:
            if scheduled.draft_token_ids:
                self.accepted[len(sampled[scheduled.request_id]) - 1] += 1
        if self.config.speculative_tokens:
            self.draft()

    def draft(self):
        """Drafts for every running request: the reference's next tokens, half the time
        with one of them wrong."""
        for request in self.live():
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            prompt, sampling = self.sequences[request.request_id]
            done = len(request.output_token_ids)
            drafts = reference_output(prompt, sampling)[done : done + self.config.speculative_tokens]
            if drafts and self.rng.random() < 0.5:
                wrong = self.rng.randrange(len(drafts))
                drafts[wrong] = (drafts[wrong] + 1) % VOCAB
            self.scheduler.set_drafts(request.request_id, drafts)

    def check_step(self, step, num_tokens, ready):
        config = self.config
        assert step.num_tokens <= config.budget
        if step.prefills:  # decodes come first: no prefill while a ready decode waits
            assert ready <= {d.request_id for d in step.decodes} | set(step.preempted)
        for scheduled in step.prefills:
            span, length = scheduled.span, num_tokens[scheduled.request_id]
            assert span.start % P == 0
            assert span.end == length or span.end % P == 0
            assert len(span.checkpoints) <= retention_capacity(config.dcp)
            assert all(p % P == 0 and span.start < p < span.end for p in span.checkpoints)
            assert span.retain_end <= (config.prefix_caching and span.end % P == 0)
            planned = plan_prefill(
                length,
                span.start,
                dcp=config.dcp,
                budget=config.budget,
                coalesce=config.coalesce,
            )[0]
            cut = cut_span_to_budget(planned, span.num_tokens)
            assert (span.start, span.end) == (cut.start, cut.end)
            assert set(span.checkpoints) <= set(cut.checkpoints)
            assert len(scheduled.checkpoint_slots) == len(span.checkpoints)
            assert scheduled.samples == (span.end == length)

    def check_batches(self, step, prefill, decode):
        buckets = self.builder.buckets
        if prefill is not None:
            assert prefill.token_ids.shape[0] in buckets.tokens
            assert prefill.state_slots.shape[0] in buckets.seqs
            assert prefill.block_tables.shape[1] in buckets.block_table_widths
            for i, scheduled in enumerate(step.prefills):
                offsets = prefill.checkpoint_offsets[i]
                relative = [p - scheduled.span.start for p in scheduled.span.checkpoints]
                assert offsets[: len(relative)].tolist() == relative
                assert np.all(offsets[len(relative) :] == -1)
        if decode is not None:
            assert decode.positions.shape[0] in buckets.seqs
            assert decode.block_tables.shape[1] in buckets.block_table_widths
        if isinstance(decode, VerifyBatch):
            assert decode.token_ids.shape[0] == self.config.speculative_tokens + 1
            for i, scheduled in enumerate(step.decodes):
                count = len(scheduled.draft_token_ids)
                assert decode.num_drafts[i] == count == len(set(scheduled.draft_slots))
                request = self.scheduler.get_request(scheduled.request_id)
                # schedule() appended the decode's placeholder: the drafts fit after it
                assert count <= request.sampling.max_tokens - len(request.output_token_ids)

    def run(self, arrivals=(), max_steps=2000):
        """Adds each (step index, id, prompt, max_tokens) when due; runs until all finish."""
        arrivals = sorted(arrivals, key=lambda a: a[0])
        index = 0
        while arrivals or self.scheduler.has_unfinished() or self.in_flight:
            while arrivals and arrivals[0][0] <= index:
                _, request_id, prompt, max_tokens = arrivals.pop(0)
                self.add(request_id, prompt, max_tokens)
            if self.config.async_scheduling:
                self.pipelined_step()
            else:
                self.step()
            index += 1
            assert index < max_steps, "no progress"

    def check_finished(self):
        """Every output matches the reference, all memory is unreferenced, states correct."""
        for request_id, (prompt, sampling) in self.sequences.items():
            assert self.outputs[request_id] == reference_output(prompt, sampling), request_id
        assert self.cache.blocks.usage().used == 0
        assert self.cache.states.usage().used == 0
        for prompt, sampling in self.sequences.values():
            tokens = prompt + reference_output(prompt, sampling)
            for j, prefix_hash in enumerate(chained_block_hashes(tokens, P)):
                slot = self.cache.states.find(StateKey(prefix_hash, (j + 1) * P))
                if slot is not None:
                    assert self.device.state[slot] == ((j + 1) * P, crc(tokens[: (j + 1) * P]))


@st.composite
def workloads(draw, crowded=False, max_tokens=6):
    """Arrivals of prompts of random lengths, often sharing prefixes, and a scheduler setup.

    ``crowded``: several long prompts at once into a pool that fits only the largest, with
    budgets that make prefills take several steps, so growing requests preempt others.
    """
    dcp = draw(st.sampled_from([1, 2, 4]))
    align = P * dcp
    rng = random.Random(draw(st.integers(0, 2**32)))
    if crowded:
        budget = min(8192, align * rng.choice([1, 2, 3, 4]))
    else:
        budget = align * draw(st.sampled_from([1, 2, 3, 8192 // align]))
    bases = [[rng.randrange(VOCAB) for _ in range(6000)] for _ in range(2)]
    arrivals = []
    # Counts and lengths come from the seeded rng: uniform, where hypothesis favours small.
    for i in range(rng.randint(3, 6) if crowded else rng.randint(1, 6)):
        if crowded:
            length = rng.randint(budget // 2, 6000)
        else:
            length = rng.choice([rng.randint(1, 6000), rng.choice([1, P - 1, P, P + 1, budget])])
        shared = rng.choice([0, length, rng.randrange(length + 1)])  # prefixes of a base
        prompt = rng.choice(bases)[:shared]
        prompt += [rng.randrange(VOCAB) for _ in range(length - len(prompt))]
        arrival = 0 if crowded else rng.choice([0, rng.randint(0, 8)])
        arrivals.append((arrival, f"r{i}", prompt, rng.randint(1, max_tokens)))
    need = max(-(-(len(a[2]) + a[3]) // align) + 1 for a in arrivals)
    if crowded:
        num_blocks, num_slots = need + rng.randint(0, 1), rng.randint(2, 8)
    elif draw(st.booleans()):  # tight: eviction, sometimes preemption
        num_blocks, num_slots = need + rng.randint(0, 2), rng.randint(2, 6)
    else:
        num_blocks, num_slots = 200, 64
    return dict(
        arrivals=arrivals,
        num_blocks=num_blocks,
        num_slots=num_slots,
        dcp=dcp,
        budget=budget,
        coalesce=draw(st.booleans()),
        prefix_caching=crowded or draw(st.sampled_from([True, True, False])),
        async_scheduling=draw(st.booleans()),
    )


def run_and_check(workload):
    arrivals = workload.pop("arrivals")
    harness = Harness(**workload)
    harness.run(arrivals)
    harness.check_finished()
    event(f"preempted: {harness.num_preemptions > 0}")
    event(f"prefix hits: {harness.cache.stats().hits > 0}")
    event(f"async: {harness.config.async_scheduling}")
    return harness


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_generated_workloads_complete_correctly_and_free_everything(workload):
    run_and_check(workload)


@settings(max_examples=40, deadline=None)
@given(workloads(crowded=True))
def test_crowded_pool_preempts_and_every_request_matches_an_unconstrained_run(workload):
    """The reference output is the unconstrained run: the model on the true sequence."""
    run_and_check(workload)


@settings(max_examples=40, deadline=None)
@given(
    st.one_of(workloads(max_tokens=24), workloads(crowded=True, max_tokens=24)),
    st.integers(1, 3),
)
def test_speculative_workloads_match_the_reference_and_free_everything(workload, n):
    """Verified drafts (right, wrong, cut by max_tokens or a stop) change nothing but the
    steps: outputs, retained states and freed memory are as without speculation."""
    harness = run_and_check(workload | dict(speculative_tokens=n, async_scheduling=False))
    event(f"some decode accepted {n} drafts: {harness.accepted[n] > 0}")
    event(f"some decode accepted none: {harness.accepted[0] > 0}")


def test_small_pool_forces_preemption_and_every_request_still_completes():
    rng = random.Random(0)
    harness = Harness(num_blocks=8, num_slots=4, budget=2048)
    arrivals = [(0, f"r{i}", [rng.randrange(VOCAB) for _ in range(2500)], 6) for i in range(4)]
    harness.run(arrivals)
    assert harness.num_preemptions > 0
    harness.check_finished()


def test_8k_prompt_schedules_match_design():
    prompt = [t % VOCAB for t in range(8192)]
    ladder = Harness(num_blocks=64, num_slots=16, coalesce=False, log_schedule=True)
    ladder.run([(0, "a", prompt, 1)])
    spans = [entry["prefills"][0] for entry in ladder.scheduler.schedule_log if entry["prefills"]]
    assert [s["end"] - s["start"] for s in spans] == [4096, 2048, 1024, 512, 512]
    coalesced = Harness(num_blocks=64, num_slots=16, dcp=4, log_schedule=True)
    coalesced.run([(0, "a", prompt, 1)])
    (entry,) = coalesced.scheduler.schedule_log
    assert entry["prefills"] == [
        {
            "request_id": "a",
            "start": 0,
            "end": 8192,
            "checkpoints": [4096, 6144, 7168, 7680],
            "retain_end": True,
        }
    ]
    ladder.check_finished()
    coalesced.check_finished()


def test_coalesced_prefill_beside_a_decode_is_cut_to_the_block_grid():
    harness = Harness(num_blocks=64, num_slots=16)
    harness.add("a", [1] * 100, max_tokens=5, stop=())
    harness.step()
    harness.add("b", [t % VOCAB for t in range(8192)], max_tokens=2)
    step = harness.step()
    assert [d.request_id for d in step.decodes] == ["a"]
    (prefill,) = step.prefills
    assert (prefill.span.start, prefill.span.end) == (0, 7680)
    assert prefill.span.checkpoints == (7168,) and prefill.span.retain_end
    assert step.retain_state_copies == ((prefill.state_slot, prefill.retain_slot),)
    harness.run()
    harness.check_finished()


def test_several_prefills_share_one_step():
    harness = Harness(num_blocks=64, num_slots=32)
    for i, length in enumerate([1000, 2000, 3000]):
        harness.add(f"r{i}", [i] * length, max_tokens=2)
    step = harness.step()
    assert [(p.span.start, p.span.end) for p in step.prefills] == [(0, 1000), (0, 2000), (0, 3000)]
    harness.run()
    harness.check_finished()


@pytest.mark.parametrize("dcp", [1, 4])
def test_second_request_sharing_a_prefix_counts_cached_tokens(dcp):
    harness = Harness(num_blocks=64, num_slots=32, dcp=dcp)
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(3000)]
    harness.run([(0, "a", prompt, 3)])
    # dcp 1: one span [0, 3000) checkpointing 2048 and 2560; dcp 4: one span, 2048 and 2560.
    harness.add("b", prompt[:2600] + [5, 6, 7], max_tokens=3)
    step = harness.step()
    assert harness.scheduler.get_request("b").num_cached_tokens == 2560
    assert len(step.block_copies) == (dcp > 1)  # 2560 is inside a 2048-token block at dcp 4
    harness.run()
    assert harness.cache.stats().hit_tokens == 2560
    harness.check_finished()


def test_cached_tokens_and_copy_on_write_at_dcp4():
    harness = Harness(num_blocks=32, num_slots=16, dcp=4)
    rng = random.Random(2)
    prompt = [rng.randrange(VOCAB) for _ in range(8192)]
    harness.run([(0, "a", prompt, 2)])
    harness.add("b", prompt[:7680] + [9] * 600, max_tokens=2)
    step = harness.step()
    request = harness.scheduler.get_request("b")
    assert request.num_cached_tokens == 7680
    assert len(step.block_copies) == 1 and len(step.resume_state_copies) == 1
    assert step.prefills[0].span.start == 7680 and step.prefills[0].has_initial
    harness.run()
    harness.check_finished()


def test_request_arriving_while_the_prefix_is_computed_hits_after_it():
    harness = Harness(num_blocks=64, num_slots=32, budget=1024)
    prompt = [t % VOCAB for t in range(4000)]
    harness.run([(0, "a", prompt, 2), (4, "b", prompt + [1, 2], 2)])
    assert harness.cache.stats().hit_tokens == 3584  # b resumes from a's state at 3584
    harness.check_finished()


@pytest.mark.parametrize("in_flight", [False, True])
@pytest.mark.parametrize("phase", ["prefill", "decode", "waiting"])
def test_abort_frees_everything(phase, in_flight):
    harness = Harness(num_blocks=64, num_slots=16, budget=1024)
    harness.add("a", [t % VOCAB for t in range(3000)], max_tokens=8, stop=())
    if phase != "waiting":
        harness.step()
        if phase == "decode":
            while not harness.scheduler.get_request("a").is_decoding:
                harness.step()
    step = harness.scheduler.schedule() if in_flight else None
    cached = harness.cache.states.usage().cached
    assert harness.scheduler.abort("a")
    assert not harness.scheduler.abort("a")
    if step is not None and not step.is_empty:
        prefill, decode = harness.builder.build(step)
        harness.scheduler.update_from_step(step, harness.device.run(step, prefill, decode))
        assert harness.cache.states.usage().cached == cached  # nothing registered for it
    assert harness.cache.blocks.usage().used == 0
    assert harness.cache.states.usage().used == 0
    assert not harness.scheduler.has_unfinished()


def test_prefix_caching_off_retains_nothing():
    harness = Harness(num_blocks=64, num_slots=8, prefix_caching=False)
    prompt = [t % VOCAB for t in range(5000)]
    harness.run([(0, "a", prompt, 2), (3, "b", prompt, 2)])
    assert harness.cache.states.usage().cached == 0
    assert all(
        not p.span.checkpoints and not p.span.retain_end for s in harness.steps for p in s.prefills
    )
    harness.check_finished()


def test_requests_that_can_never_fit_are_rejected():
    harness = Harness(num_blocks=4, num_slots=4, max_model_len=4096)
    with pytest.raises(ValueError, match="exceeds max_model_len 4096"):
        harness.scheduler.add_request("a", [1] * 4000, SamplingParams(max_tokens=97))
    harness = Harness(num_blocks=4, num_slots=4)
    with pytest.raises(ValueError, match="need 5 KV blocks, the pool has 4"):
        harness.scheduler.add_request("a", [1] * 2100, SamplingParams(max_tokens=1))
    harness.scheduler.add_request("a", [1] * 2048, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already live"):
        harness.scheduler.add_request("a", [1])
    with pytest.raises(ValueError, match="empty prompt"):
        harness.scheduler.add_request("b", [])
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)


def test_config_and_step_protocol_are_checked():
    with pytest.raises(ValueError, match="multiple of block_size \\* dcp = 1024"):
        SchedulerConfig(max_model_len=100, dcp=2, budget=1536)
    harness = Harness(num_blocks=8, num_slots=4)
    harness.add("a", [1] * 10)
    step = harness.scheduler.schedule()
    with pytest.raises(RuntimeError, match="still in flight"):
        harness.scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        harness.scheduler.update_from_step(step, {})
    with pytest.raises(ValueError, match="not sampled in this step"):
        harness.scheduler.update_from_step(step, {"a": 1, "zz": 2})
    harness.scheduler.update_from_step(step, {"a": 1})
    with pytest.raises(ValueError, match="not the step in flight"):
        harness.scheduler.update_from_step(step, {"a": 1})


def test_async_protocol_and_a_stop_with_the_next_step_in_flight():
    """Two steps in flight at most, updated oldest first; a stop token sampled by the
    older one drops the newer one's token for the request, and its placeholder."""
    harness = Harness(num_blocks=8, num_slots=4, async_scheduling=True)
    harness.add("a", [1] * 10, max_tokens=5)
    first = harness.scheduler.schedule()
    request = harness.scheduler.get_request("a")
    assert (request.num_computed, request.output_token_ids) == (10, [PLACEHOLDER])
    second = harness.scheduler.schedule()
    assert [(d.token_id, d.position) for d in second.decodes] == [(PLACEHOLDER, 10)]
    assert request.output_token_ids == [PLACEHOLDER, PLACEHOLDER]
    with pytest.raises(RuntimeError, match="still in flight"):
        harness.scheduler.schedule()
    with pytest.raises(ValueError, match="not the step in flight"):
        harness.scheduler.update_from_step(second, {"a": 7})
    assert harness.scheduler.update_from_step(first, {"a": STOP}) == [request]
    assert request.output_token_ids == [STOP] and request.status is RequestStatus.FINISHED
    assert harness.scheduler.update_from_step(second, {"a": 7}) == []
    assert request.output_token_ids == [STOP]
    assert harness.cache.blocks.usage().used == harness.cache.states.usage().used == 0
    assert not harness.scheduler.has_unfinished()


def test_a_failure_while_recording_a_step_frees_the_slots_it_held():
    harness = Harness(num_blocks=64, num_slots=32)
    for i, length in enumerate([3000, 2000]):
        harness.add(f"r{i}", [i] * length, max_tokens=2)
    step = harness.scheduler.schedule()
    held = [slot for p in step.prefills
            for slot in (*p.checkpoint_slots, *([p.retain_slot] if p.retain_slot is not None
                                                 else []))]
    assert len(held) > 2 and all(harness.cache.states.refcount(s) for s in held)
    prefill, decode = harness.builder.build(step)
    tokens = harness.device.run(step, prefill, decode)

    def broken(request, prefill):
        raise RuntimeError("injected")

    harness.scheduler._register = broken
    with pytest.raises(RuntimeError, match="injected"):
        harness.scheduler.update_from_step(step, tokens)
    assert [harness.cache.states.refcount(s) for s in held] == [0] * len(held)
