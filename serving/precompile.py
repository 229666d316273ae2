"""Compiling every program an engine can call before it serves, so no request waits on XLA.

An engine pads each batch to a bucket (``serving.batch_builder.BatchBuckets``): prefill
batches to (tokens T, sequences N, block-table width M), decode batches to (N, M). Every
bucket it can reach is one compiled prefill or decode program; the KV-block and state-slot
copies have one shape each, and the sampler one per sequence bucket. ``reachable_programs``
lists them all for an engine's buckets, and ``precompile`` compiles them on a thread pool
(XLA compiles outside the GIL), with a progress bar. A later call of the same jitted step
finds the executable in JAX's compilation cache, so it does not compile again; with the
persistent cache (``glmjax.compile_cache``) a restart reads them from disk.

Which buckets are reachable: a prefill batch holds at least one token per sequence, so
its sequence bucket N is reachable with T tokens when the bucket below N is smaller than T;
every width up to the longest request's; decode batches any (N, M).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable

import jax
import numpy as np
from tqdm import tqdm

from glmjax.batch import CHECKPOINT_CAPACITY, DecodeBatch, PrefillBatch
from serving import speculative
from serving.batch_builder import BatchBuckets
from serving.sampling import SamplingTensors

SPECULATIVE_KINDS = ("spec_prefill", "verify", "sample_verify", "draft_prefill", "draft_verify")


@dataclasses.dataclass(frozen=True)
class Program:
    """One program an engine calls: its kind and static shape."""

    kind: str  # "prefill", "decode", "copy_kv_blocks", "copy_state_slots", "sample", or one
    # of SPECULATIVE_KINDS
    shape: tuple[int, ...]  # prefill (T, N, M), decode (N, M), sample (N,), copies ()


def reachable_programs(buckets: BatchBuckets, speculative_tokens: int = 0) -> list[Program]:
    """Every program an engine padding to ``buckets`` can call, cheapest first (with
    ``speculative_tokens``, those of ``serving.speculative`` instead of prefill and decode)."""
    # A bucket of n rows holds more than the bucket below it (k spans need k tokens), so it
    # is reachable with t tokens when that lower bucket is smaller than t.
    below = dict(zip(buckets.seqs, (0, *buckets.seqs[:-1])))
    prefill = [
        Program("prefill", (t, n, m))
        for t in buckets.tokens
        for n in buckets.seqs
        if below[n] < t
        for m in buckets.block_table_widths
    ]
    decode = [Program("decode", (n, m)) for n in buckets.seqs for m in buckets.block_table_widths]
    sample = [Program("sample", (n,)) for n in buckets.seqs]
    copies = [Program("copy_kv_blocks", ()), Program("copy_state_slots", ())]
    if speculative_tokens:
        shapes = [p.shape for p in prefill]
        return copies + sample + [Program(kind, shape) for kind, shape in
                                  speculative.programs(buckets, shapes)]
    return copies + sample + decode + prefill


def padding_prefill(t: int, n: int, m: int) -> PrefillBatch:
    """A prefill batch of the bucket's shape whose every row is padding."""
    return PrefillBatch(
        token_ids=np.zeros(t, np.int32),
        positions=np.zeros(t, np.int32),
        cu_seqlens=np.zeros(n + 1, np.int32),
        state_slots=np.full(n, -1, np.int32),
        has_initial=np.zeros(n, bool),
        checkpoint_offsets=np.full((n, CHECKPOINT_CAPACITY), -1, np.int32),
        checkpoint_slots=np.full((n, CHECKPOINT_CAPACITY), -1, np.int32),
        block_tables=np.full((n, m), -1, np.int32),
        prefix_lens=np.zeros(n, np.int32),
    )


def padding_decode(n: int, m: int) -> DecodeBatch:
    """A decode batch of the bucket's shape whose every row is padding."""
    return DecodeBatch(
        token_ids=np.zeros(n, np.int32),
        positions=np.zeros(n, np.int32),
        state_slots=np.full(n, -1, np.int32),
        block_tables=np.full((n, m), -1, np.int32),
    )


def _lower(engine, program: Program, logits_sharding=None):
    """The program lowered with arguments shaped and placed as the engine passes them
    (the sampler's logits placed as the model steps return them)."""
    steps, rows = engine.steps, engine.sampler_rows
    if program.kind in SPECULATIVE_KINDS:
        return speculative.lower(engine, program.kind, program.shape)
    if program.kind == "prefill":
        batch = jax.device_put(padding_prefill(*program.shape))
        return steps.prefill.lower(engine.model_state, engine.caches, batch)
    if program.kind == "decode":
        batch = jax.device_put(padding_decode(*program.shape))
        return steps.decode.lower(engine.model_state, engine.caches, batch)
    if program.kind == "sample":
        (n,) = program.shape
        logits = np.zeros((n, engine.model_config.vocab_size), np.float32)
        logits = jax.device_put(logits, logits_sharding)
        params = SamplingTensors.host([], rows)
        return engine.sampler.lower(logits, np.zeros(rows, np.int32), params)
    pairs = np.full(rows, -1, np.int32)
    return getattr(steps, program.kind).lower(engine.caches, pairs, pairs)


@dataclasses.dataclass(frozen=True)
class PrecompileReport:
    programs: int
    seconds: float  # wall time
    compile_seconds: float  # summed over programs (threads overlap)


def precompile(engine, *, workers: int | None = None, progress: bool = True,
               log: Callable[[str], None] | None = None) -> PrecompileReport:
    """Compiles every program ``engine`` (a ``serving.engine.Engine``) can call.

    Args:
      workers: compile threads (default: the machine's cores).
      progress: show a progress bar (tqdm, on stderr).
      log: called once with a summary line.
    """
    programs = reachable_programs(engine.builder.buckets, engine.config.speculative_tokens)
    workers = workers or os.cpu_count() or 1
    start = time.perf_counter()

    # The sampler's logits come out of the model steps: on a mesh the first decode program
    # tells how they are sharded, so it compiles before the samplers. On one device the
    # steps return uncommitted arrays, which a plain device_put reproduces (naming their
    # device would put a sharding into the sampler's program and miss the cache).
    first_decode = next(p for p in programs if p.kind in ("decode", "verify"))
    bar = tqdm(total=len(programs), desc="precompiling", unit="program", disable=not progress)
    begin = time.perf_counter()
    compiled = _lower(engine, first_decode).compile()
    logits_sharding = None if engine.steps.mesh is None else compiled.output_shardings.logits
    seconds = [time.perf_counter() - begin]
    bar.update()

    def compile_one(program: Program) -> float:
        begin = time.perf_counter()
        _lower(engine, program, logits_sharding).compile()
        bar.update()
        return time.perf_counter() - begin

    with concurrent.futures.ThreadPoolExecutor(workers) as pool, bar:
        seconds += pool.map(compile_one, [p for p in programs if p != first_decode])
    report = PrecompileReport(len(programs), time.perf_counter() - start, sum(seconds))
    if log is not None:
        log(f"precompiled {report.programs} programs in {report.seconds:.1f} s "
            f"({report.compile_seconds:.1f} s of compiles on {workers} threads)")
    return report
