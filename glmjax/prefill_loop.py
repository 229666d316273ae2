"""The offline prefill's loop: one long prompt along the planner's spans, retaining states.

`schedule` cuts [start, L) into spans (`serving.plan.plan_prefill`'s, or retaining exactly
the positions asked for); `run_prefill` runs them as one compiled `glmjax.model.prefill`
step (every span padded to the longest) on one device or on a sharding plan's mesh and,
when asked, copies each retained state to the host: a span's kernel checkpoints from state
slots 1..4, a retained end (and the final state) from the running slot 0. The command line
is `glmjax.prefill`; saving, loading and resuming states is `glmjax.prefill_states`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import NamedTuple, TextIO

import jax
import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from glmjax.batch import CHECKPOINT_CAPACITY, PrefillBatch
from glmjax.config import ModelConfig
from glmjax.fingerprint import model_fingerprint
from glmjax.model import ModelState
from glmjax.prefill_states import (
    RUNNING_SLOT,
    SavedStates,
    host_latents,
    kda_slots,
    prefix_hash,
    resumed_caches,
)
from glmjax.sharding import ShardingPlan, put, single_device_steps
from glmjax.state_pool import PoolStatus
from serving.plan import PrefillSpan, plan_prefill

NUM_SLOTS = 1 + CHECKPOINT_CAPACITY


class PrefillResult(NamedTuple):
    logits: np.ndarray  # fp32 [vocab] after the prompt's last token
    retained: tuple[int, ...]  # positions whose states the run retained, final included
    resumed_from: int  # 0: cold start
    spans: tuple[PrefillSpan, ...]
    compile_s: float
    run_s: float
    states: SavedStates | None  # with keep_states (--save-states)


def schedule(prompt_len: int, start: int, *, block_size: int, budget: int, dcp: int = 1,
             checkpoints: Sequence[int] | None = None) -> list[PrefillSpan]:
    """Spans computing [start, prompt_len).

    The planner's spans (`plan_prefill`); a `start` off the block grid first computes up to
    the next block boundary. With explicit `checkpoints`, each span retains exactly those
    inside it (kernel snapshots) or at its end (retain_end) instead of the planner's
    choice; positions <= start are ignored.
    """
    aligned = min(-(-start // block_size) * block_size, prompt_len)
    spans = [PrefillSpan(start, aligned, retain_end=aligned % block_size == 0)] \
        if aligned > start else []
    if aligned < prompt_len:
        spans += plan_prefill(prompt_len, aligned, block_size=block_size, dcp=dcp,
                              budget=budget)
    if checkpoints is None:
        return spans
    wanted = set(checkpoints)
    out = []
    for span in spans:
        begin = span.start
        inside = sorted(p for p in wanted if span.start < p < span.end)
        while len(inside) > CHECKPOINT_CAPACITY:
            cut = inside[CHECKPOINT_CAPACITY]
            out.append(PrefillSpan(begin, cut, tuple(inside[:CHECKPOINT_CAPACITY]), True))
            begin, inside = cut, inside[CHECKPOINT_CAPACITY + 1:]
        out.append(PrefillSpan(begin, span.end, tuple(inside), span.end in wanted))
    return out


def _span_batch(tokens: np.ndarray, span: PrefillSpan, rows: int, num_blocks: int
                ) -> PrefillBatch:
    """The span's step metadata, NumPy arrays (one sequence, running slot 0, blocks 0..)."""
    n = span.num_tokens
    ids, positions = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    ids[:n] = tokens[span.start:span.end]
    positions[:n] = np.arange(span.start, span.end)
    offsets = np.full((1, CHECKPOINT_CAPACITY), -1, np.int32)
    slots = np.full((1, CHECKPOINT_CAPACITY), -1, np.int32)
    for c, position in enumerate(span.checkpoints):
        offsets[0, c], slots[0, c] = position - span.start, 1 + c
    return PrefillBatch(
        token_ids=ids, positions=positions, cu_seqlens=np.array([0, n], np.int32),
        state_slots=np.array([RUNNING_SLOT], np.int32), has_initial=np.array([span.start > 0]),
        checkpoint_offsets=offsets, checkpoint_slots=slots,
        block_tables=np.arange(num_blocks, dtype=np.int32)[None],
        prefix_lens=np.array([span.start], np.int32))


@contextlib.contextmanager
def _progress_bar(stream: TextIO | None, spans: Sequence[PrefillSpan]):
    """Yields `advance(span, done_spans)`, which moves a rich progress bar drawn on `stream`
    (no bar when `stream` is None)."""
    if stream is None:
        yield lambda span, done: None
        return
    columns = (TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens, span"),
               TextColumn("{task.fields[done]}/{task.fields[spans]}"), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(file=stream)) as bar:
        task = bar.add_task("prefill", total=spans[-1].end - spans[0].start, done=0,
                            spans=len(spans))
        yield lambda span, done: bar.update(task, advance=span.num_tokens, done=done)


def run_prefill(model_state: ModelState, config: ModelConfig, tokens: np.ndarray,
                spans: Sequence[PrefillSpan], *, keep_states: bool,
                resume: tuple[SavedStates, int] | None = None,
                progress: TextIO | None = None, plan: ShardingPlan | None = None
                ) -> PrefillResult:
    """Prefill `tokens` along `spans` (which tile [resumed position, L)) on `plan`'s mesh
    (None: JAX's default device); with `keep_states` copy every retained state and the
    final one to the host, whole (gathered from every device and process).

    `model_state` is ``nnx.split(model)`` off the mesh (the same in every process); over
    several processes every process calls this with the same arguments."""
    length, block_size = len(tokens), config.kv_block_size
    # Buckets: prompts of similar lengths share one compiled step.
    num_blocks = 1 << (math.ceil(length / block_size) - 1).bit_length()
    rows = math.ceil(max(span.num_tokens for span in spans) / block_size) * block_size
    fingerprint = model_fingerprint(model_state, config) if keep_states else ""
    steps = single_device_steps(config) if plan is None else plan.steps()
    model_state = steps.place(model_state)
    start = 0
    if resume is None:
        caches = steps.init_caches(NUM_SLOTS, num_blocks)
    else:
        start = resume[1]
        caches = resumed_caches(config, NUM_SLOTS, num_blocks, *resume, plan)
    batches = [_span_batch(tokens, span, rows, num_blocks) for span in spans]
    batches = (jax.device_put(batches) if plan is None
               else put(batches, plan.sharding(plan.specs.replicated)))

    tic = time.perf_counter()
    step = steps.prefill.lower(model_state, caches, batches[0]).compile()
    compile_s = time.perf_counter() - tic

    kept: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    run_s = 0.0
    with _progress_bar(progress, spans) as advance:
        for done, (span, batch) in enumerate(zip(spans, batches), 1):
            tic = time.perf_counter()
            out = step(model_state, caches, batch)
            jax.block_until_ready(out.logits)
            run_s += time.perf_counter() - tic
            if int(out.status) != PoolStatus.OK:
                raise RuntimeError(f"prefill refused span [{span.start}, {span.end}): "
                                   f"{PoolStatus(int(out.status)).name}")
            caches = out.caches
            last = done == len(spans)
            if keep_states and (span.checkpoints or span.retain_end or last):
                slots = kda_slots(caches, list(range(NUM_SLOTS)))
                for c, position in enumerate(span.checkpoints):
                    kept[position] = slots[1 + c]
                if span.retain_end or last:
                    kept[span.end] = slots[RUNNING_SLOT]
            advance(span, done)

    retained = tuple(sorted({p for s in spans for p in s.retained_positions} | {length}))
    states = None
    if keep_states:
        states = _collect(tokens, kept, host_latents(caches, steps.layout), block_size,
                          fingerprint, resume)
    return PrefillResult(np.asarray(out.logits)[0], retained, start, tuple(spans), compile_s,
                         run_s, states)


def _collect(tokens, kept, mla: list[dict[str, np.ndarray]], block_size: int,
             fingerprint: str, resume: tuple[SavedStates, int] | None) -> SavedStates:
    """Stack the retained states (with those a resumed run inherited, up to its start);
    `mla` the MLA layers' latents on the host (`host_latents`)."""
    if resume is not None:
        saved, start = resume
        for r, position in enumerate(saved.positions):
            if position <= start and position not in kept:
                kept[position] = [(rec[r], conv[r])
                                  for rec, conv in zip(saved.recurrent, saved.conv)]
    positions = tuple(sorted(kept))
    num_layers = len(kept[positions[0]])
    return SavedStates(
        positions,
        [np.stack([kept[p][i][0] for p in positions]) for i in range(num_layers)],
        [np.stack([kept[p][i][1] for p in positions]) for i in range(num_layers)],
        mla, tuple(prefix_hash(tokens, p) for p in positions), prefix_hash(tokens, len(tokens)),
        len(tokens), block_size, fingerprint)

