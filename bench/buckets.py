"""Which batch shapes (buckets) an engine workload uses, and compiling them ahead of time.

`DryRun` drives an engine's scheduler and batch builder without the model and records one
batch per bucket; `precompile` compiles each bucket's jitted step ahead of its first call
(seconds and XLA's memory estimate of each); `serving.compiles.CompileLog` counts the
backend compiles, so a benchmark can prove its timed samples never compiled.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable
from typing import NamedTuple

import jax

from glmjax.batch import DecodeBatch, PrefillBatch
from glmjax.model import DecodeBuffers
from serving.batch_builder import BatchBuckets, BatchBuilder
from serving.block_allocator import BlockAllocator
from serving.engine import Engine, EngineConfig
from serving.prefix_cache import PrefixCache
from serving.scheduler import Scheduler
from serving.state_slots import StateSlotAllocator


def log(message: str) -> None:
    """A timestamped progress line, flushed at once (long device runs are watched live)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def bucket_key(batch: PrefillBatch | DecodeBatch) -> tuple:
    """("prefill", T, N, M) or ("decode", N, M): the static shape a batch compiles for."""
    if isinstance(batch, PrefillBatch):
        return ("prefill", batch.token_ids.shape[0], *batch.block_tables.shape)
    return ("decode", *batch.block_tables.shape)


class Output(NamedTuple):
    """What the cases read of a `RequestOutput`."""

    request_id: str
    output_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    num_cached_tokens: int
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # per token, most likely first


class DryRun:
    """An engine's scheduler and batch builder without the model: the buckets a sequence of
    requests uses. Every sampled token is 0 (shapes do not depend on token values)."""

    def __init__(self, config: EngineConfig, buckets: BatchBuckets):
        sched = config.scheduler_config()
        blocks = BlockAllocator(config.num_kv_blocks, block_size=config.block_size, dcp=config.dcp)
        self.scheduler = Scheduler(
            sched, PrefixCache(blocks, StateSlotAllocator(config.num_state_slots)))
        self.builder = BatchBuilder(sched, num_blocks=config.num_kv_blocks,
                                    num_slots=config.num_state_slots, buckets=buckets)
        self.batches: dict[tuple, PrefillBatch | DecodeBatch] = {}  # one per bucket
        self.used: set[tuple] = set()  # buckets since the caller last cleared it
        self._generated = collections.Counter()

    def add_request(self, request_id, prompt_token_ids, sampling) -> None:
        self.scheduler.add_request(request_id, prompt_token_ids, sampling)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def step(self) -> list[Output]:
        step = self.scheduler.schedule()
        if step.is_empty:
            return []
        for batch in filter(None, self.builder.build(step)):
            self.batches.setdefault(bucket_key(batch), batch)
            self.used.add(bucket_key(batch))
        sampled = step.sampling_request_ids
        self.scheduler.update_from_step(step, dict.fromkeys(sampled, 0))
        self._generated.update(sampled)
        return [Output(r, (0,) * self._generated[r], (0.0,) * self._generated[r], 0)
                for r in sampled]


class StepProgram(NamedTuple):
    """A jitted step `engine` calls: its name as compile logs report it (``jit(name)``) and
    ``lower(model_state, caches, device batch)``."""

    name: str
    lower: Callable


def step_functions(engine: Engine) -> dict[str, StepProgram]:
    """The jitted prefill and decode programs `engine` calls, by step kind (on one device
    its decode writes into pinned buffers, `serving.pinned`)."""
    steps = engine.steps
    decode = StepProgram(steps.decode.__name__, steps.decode.lower)
    if engine.pinned_decode:
        vocab = engine.model_config.vocab_size

        def lower_pinned(model_state, caches, batch):
            buffers = jax.device_put(DecodeBuffers.zeros(batch.token_ids.shape[0], vocab))
            return steps.decode_pinned.lower(model_state, caches, batch, buffers)
        decode = StepProgram(steps.decode_pinned.__name__, lower_pinned)
    return {"prefill": StepProgram(steps.prefill.__name__, steps.prefill.lower),
            "decode": decode}


def precompile(steps: dict, batches: dict, model_state, caches, workers: int) -> list[dict]:
    """Compiles every bucket ahead of its first call (``steps`` from `step_functions`);
    seconds and memory of each. Abstract weights suffice: the jitted step finds the
    executable again for the real ones."""

    def compile_bucket(item):
        key, batch = item
        start = time.perf_counter()
        compiled = steps[key[0]].lower(model_state, caches, jax.device_put(batch)).compile()
        seconds = time.perf_counter() - start
        memory = compiled.memory_analysis()
        log(f"compiled {key} in {seconds:.1f} s")
        return dict(
            kind=key[0], shape=list(key[1:]), compile_s=seconds,
            temp_bytes=None if memory is None else memory.temp_size_in_bytes,
            need_bytes=None if memory is None else (memory.temp_size_in_bytes
                       + memory.output_size_in_bytes - memory.alias_size_in_bytes),
        )  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(compile_bucket, sorted(batches.items())))
