"""Compiling every program an engine can call before it serves, so no request waits on XLA.

An engine pads each batch to a bucket (``serving.batch_builder.BatchBuckets``): prefill
batches to (tokens T, sequences N, block-table width M), decode batches to (N, M). Every
bucket it can reach is one compiled prefill or decode program; the KV-block and state-slot
copies and the sampler have one shape each (the sampler one program per
``serving.sampling.SamplerVariant``), the gather of the sampled rows one per
sequence bucket, with asynchronous scheduling the feed of placeholder decode tokens one per
sequence bucket (on one device only a mixed step's), and with mixed steps the one forward
over both kinds of rows one per (T, N, M). On one device a decode step writes its batch
into the bucket's pinned buffers (``serving.pinned``: one staging program per (N, M),
which feeds the placeholders too, and one copy of the status). ``reachable_programs``
lists them all for an engine's buckets, and ``precompile`` compiles them on a thread pool
(XLA compiles outside the GIL), with a progress bar. A later call of the same jitted step
finds the executable in JAX's compilation cache, so it does not compile again; with the
persistent cache (``glmjax.compile_cache``) a restart reads them from disk.

Which buckets are reachable: a prefill batch holds at least one token per sequence, so
its sequence bucket N is reachable with T tokens when the bucket below N is smaller than T;
every width up to the longest request's; decode batches any (N, M). Mixed steps are listed
at every (T, N, M) (N holds the decode rows too, so nearly all are reachable).
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
from glmjax.model import DecodeBuffers
from serving import speculative
from serving.batch_builder import BatchBuckets
from serving.dispatch import feed_tokens
from serving.pinned import keep_status, stage_decode
from serving.sampling import SAMPLER_VARIANTS, SamplerVariant, SamplingTensors

SPECULATIVE_KINDS = ("spec_prefill", "verify", "draft_prefill", "draft_verify")


# The output sharding a later program's input takes, from the first compiled program of
# its kind: the model's logits (a DecodeOutput), the gathered rows, the sampled tokens.
OUTPUT_SHARDING = {"decode": lambda out: out.logits, "gather_rows": lambda out: out,
                   "sample": lambda out: out.tokens}


@dataclasses.dataclass(frozen=True)
class Program:
    """One program an engine calls: its kind and static shape."""

    kind: str  # "prefill", "decode", "mixed", "copy_kv_blocks", "copy_state_slots",
    #            "gather_rows", "sample", "feed", "stage", "keep_status", or one of
    #            SPECULATIVE_KINDS
    shape: tuple[int, ...]  # prefill, mixed (T, N, M), decode and stage (N, M), gather_rows
    #                         and feed (N,), sample a SamplerVariant, others ()


def reachable_programs(buckets: BatchBuckets, *, feed: bool = False, mixed: bool = False,
                       speculative_tokens: int = 0, pinned: bool = False) -> list[Program]:
    """Every program an engine padding to ``buckets`` can call, cheapest first (``feed``:
    the engine schedules asynchronously; ``mixed``: it runs mixed steps; with
    ``speculative_tokens``, those of ``serving.speculative`` instead of prefill and decode,
    which needs neither of the other two; ``pinned``: its decode steps go through
    ``serving.pinned``, whose staging feeds their placeholders).

    Raises:
      ValueError: ``speculative_tokens`` with ``feed`` or ``mixed``.
    """
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
    gathers = [Program("gather_rows", (n,)) for n in buckets.seqs]
    # A pinned engine feeds the placeholders of its mixed steps' decode rows alone.
    fed = [Program("feed", (n,)) for n in buckets.seqs] if feed and (mixed or not pinned) else []
    staged = [Program("stage", p.shape) for p in decode] if pinned else []
    small = [Program("copy_kv_blocks", ()), Program("copy_state_slots", ()),
             *(Program("sample", variant) for variant in SAMPLER_VARIANTS),
             *([Program("keep_status", ())] if pinned else [])]
    both = [Program("mixed", (t, n, m)) for t in buckets.tokens for n in buckets.seqs
            for m in buckets.block_table_widths] if mixed else []
    if speculative_tokens:
        if feed or mixed:
            raise ValueError(f"speculative_tokens={speculative_tokens} runs synchronous, "
                             f"unmixed steps (got feed={feed}, mixed={mixed})")
        # Verified decodes' logits have (N + 1) n rows: their gathers too.
        chain = speculative_tokens + 1
        gathers += [Program("gather_rows", (chain * n,)) for n in buckets.seqs
                    if chain * n not in buckets.seqs]
        shapes = [p.shape for p in prefill]
        return small + gathers + [Program(kind, shape) for kind, shape in
                                  speculative.programs(buckets, shapes)]
    return small + gathers + fed + staged + decode + prefill + both


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


def _lower(engine, program: Program, shardings: dict | None = None):
    """The program lowered with arguments shaped and placed as the engine passes them:
    the gather's logits as the model steps return them (``shardings["logits"]``), the
    sampler's as the gather returns them (``shardings["gathered"]``), the fed tokens as the
    sampler returns them (``shardings["tokens"]``)."""
    steps, rows, shardings = engine.steps, engine.sampler_rows, shardings or {}
    vocab = engine.model_config.vocab_size
    if program.kind in SPECULATIVE_KINDS:
        return speculative.lower(engine, program.kind, program.shape)
    if program.kind == "feed":
        host = np.zeros(program.shape, np.int32)
        sampled = jax.device_put(np.zeros(rows, np.int32), shardings.get("tokens"))
        return feed_tokens.lower(host, host, sampled, sampled)
    if program.kind == "prefill":
        batch = jax.device_put(padding_prefill(*program.shape))
        return steps.prefill.lower(engine.model_state, engine.caches, batch)
    if program.kind == "stage":
        host = padding_decode(*program.shape)
        sampled = jax.device_put(np.zeros(rows, np.int32), shardings.get("tokens"))
        return stage_decode.lower(jax.device_put(host), host, host.token_ids, sampled, sampled)
    if program.kind == "keep_status":
        return keep_status.lower(jax.device_put(np.int32(0)))
    if program.kind == "decode":
        batch = jax.device_put(padding_decode(*program.shape))
        if engine.pinned_decode:
            buffers = jax.device_put(DecodeBuffers.zeros(program.shape[0], vocab))
            return steps.decode_pinned.lower(engine.model_state, engine.caches, batch, buffers)
        return steps.decode.lower(engine.model_state, engine.caches, batch)
    if program.kind == "mixed":
        t, n, m = program.shape
        batches = jax.device_put((padding_prefill(t, n, m), padding_decode(n, m)))
        return steps.mixed.lower(engine.model_state, engine.caches, *batches)
    if program.kind == "gather_rows":
        (n,) = program.shape
        logits = jax.device_put(np.zeros((n, vocab), np.float32), shardings.get("logits"))
        return engine.row_gather.lower(logits, np.zeros(rows, np.int32))
    if program.kind == "sample":
        logits = jax.device_put(np.zeros((rows, vocab), np.float32), shardings.get("gathered"))
        return engine.sampler.lower(logits, SamplingTensors.host([], rows),
                                    variant=SamplerVariant(*program.shape))
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
    config = engine.config
    programs = reachable_programs(engine.builder.buckets, feed=config.async_scheduling,
                                  mixed=config.mixed_steps,
                                  speculative_tokens=config.speculative_tokens,
                                  pinned=engine.pinned_decode)
    workers = workers or os.cpu_count() or 1
    start = time.perf_counter()

    # The gathers' logits come out of the model steps, the sampler's out of a gather and the
    # fed tokens out of the sampler: on a mesh the first decode program tells how the logits
    # are sharded, the first gather how its rows are and the sampler how its tokens are, so
    # those three compile first. On one device the steps return uncommitted arrays, which a
    # plain device_put reproduces (naming their device would put a sharding into the
    # programs and miss the cache). (Speculation: one device.)
    decode = "verify" if config.speculative_tokens else "decode"
    first = [next(p for p in programs if p.kind == kind)
             for kind in (decode, "gather_rows", "sample")]
    bar = tqdm(total=len(programs), desc="precompiling", unit="program", disable=not progress)
    shardings, seconds = {}, []
    for program, name in zip(first, ("logits", "gathered", "tokens")):
        begin = time.perf_counter()
        compiled = _lower(engine, program, shardings).compile()
        if engine.steps.mesh is not None:
            shardings[name] = OUTPUT_SHARDING[program.kind](compiled.output_shardings)
        seconds.append(time.perf_counter() - begin)
        bar.update()

    def compile_one(program: Program) -> float:
        begin = time.perf_counter()
        _lower(engine, program, shardings).compile()
        bar.update()
        return time.perf_counter() - begin

    with concurrent.futures.ThreadPoolExecutor(workers) as pool, bar:
        seconds += pool.map(compile_one, [p for p in programs if p not in first])
    report = PrecompileReport(len(programs), time.perf_counter() - start, sum(seconds))
    if log is not None:
        log(f"precompiled {report.programs} programs in {report.seconds:.1f} s "
            f"({report.compile_seconds:.1f} s of compiles on {workers} threads)")
    return report
