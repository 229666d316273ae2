"""Offline prefill of one long prompt along the planner's spans, retaining KDA states.

    python -m glmjax.prefill --random-tokens 8192                       # tiny, random weights
    python -m glmjax.prefill --prompt-file ids.txt --save-states /tmp/s   # ids: whitespace ints
    python -m glmjax.prefill --prompt-file doc.txt --bytes --load-states /tmp/s
    python -m glmjax.prefill --preset kimi-linear-48b --weights /ckpt/hf --family kimi ...

The prompt is cut by `serving.plan.plan_prefill` into spans of at most `--budget` tokens on
a `--block-size` grid; each span is one jitted `glmjax.model.prefill` step (one compile: every
span is padded to the longest). Inside a span the KDA kernel snapshots the span's
checkpoints into state slots 1..4; a span with `retain_end` leaves its retained state in the
running slot 0. With `--save-states` both are copied to the host after the span and written
at the end, with the final state, as one orbax checkpoint (see `save_states`).

`--checkpoints auto` retains what the planner retains (every span's checkpoints and
retained ends); `--checkpoints p1,p2,...` retains exactly those positions (1..L; L, the final
state, is always saved): a span holding more than 4 of them is split at the 5th.

`--load-states DIR` resumes: it takes the longest saved position p <= L - 1 whose prefix
hash equals that of the new prompt's first p tokens (and whose model fingerprint matches),
puts the states of every KDA layer at p in the running slot and the saved MLA latent blocks
(positions < p) in the paged cache, and computes only [p, L). No match: a cold prefill,
never a guess. The MLA key/values of the prefix are saved, not recomputed: an MLA layer's
input depends on the KDA layers below it, so its prefix KV cannot be rebuilt without
running the whole prefix again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from glmjax import compile_cache
from glmjax.batch import CHECKPOINT_CAPACITY, PrefillBatch
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.fingerprint import model_fingerprint
from glmjax.layers.paged_cache import MLACache
from glmjax.model import ModelState, prefill
from glmjax.random_weights import random_model
from glmjax.state_pool import PoolStatus, StatePool
from serving.plan import PrefillSpan, plan_prefill

# /2: the fingerprint covers whole tensors and the config (`glmjax.fingerprint`).
FORMAT = "glmjax-offline-prefill-states/2"
RUNNING_SLOT = 0  # checkpoint c of a span goes to slot 1 + c
NUM_SLOTS = 1 + CHECKPOINT_CAPACITY


class SavedStates(NamedTuple):
    """Host copies of retained states: R positions, every KDA layer, plus the MLA latents."""

    positions: tuple[int, ...]  # ascending; state r holds the state after positions[r] tokens
    recurrent: list[np.ndarray]  # per KDA layer, fp32 [R, H, K, V]
    conv: list[np.ndarray]  # per KDA layer, [R, C, W - 1]
    mla: list[dict[str, np.ndarray]]  # per MLA layer, "latent" [M, P, D] (+ "index_keys")
    prefix_sha256: tuple[str, ...]  # per position, `prefix_hash(prompt, p)`
    prompt_sha256: str  # prefix_hash of the whole prompt
    prompt_len: int
    block_size: int
    fingerprint: str  # `model_fingerprint` of the weights and config behind the states


class PrefillResult(NamedTuple):
    logits: np.ndarray  # fp32 [vocab] after the prompt's last token
    retained: tuple[int, ...]  # positions whose states the run retained, final included
    resumed_from: int  # 0: cold start
    spans: tuple[PrefillSpan, ...]
    compile_s: float
    run_s: float
    states: SavedStates | None  # with --save-states


# --- inputs ---------------------------------------------------------------------------------

def read_prompt(path: str | Path, *, as_bytes: bool, vocab_size: int) -> np.ndarray:
    """Token ids from `path`: its raw bytes (0..255) with `as_bytes`, else whitespace-separated
    decimal integers. Returns int32 [L]; raises ValueError naming a bad or out-of-range id."""
    path = Path(path)
    if as_bytes:
        tokens = np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32)
    else:
        words = path.read_text().split()
        for word in words:
            if not word.lstrip("-").isdigit():
                raise ValueError(f"{path}: token id {word!r} is not an integer")
        tokens = np.array([int(word) for word in words], np.int32)
    if tokens.size == 0:
        raise ValueError(f"{path}: the prompt is empty")
    bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if bad.size:
        raise ValueError(f"{path}: token id {int(bad[0])} is outside [0, {vocab_size})")
    return tokens


def parse_checkpoints(text: str, prompt_len: int) -> tuple[int, ...] | None:
    """``"auto"`` -> None; ``"p1,p2,..."`` -> sorted distinct positions in 1..prompt_len."""
    if text == "auto":
        return None
    positions = set()
    for word in text.split(","):
        try:
            position = int(word)
        except ValueError:
            raise ValueError(f"--checkpoints: {word!r} is not an integer position") from None
        if not 1 <= position <= prompt_len:
            raise ValueError(f"--checkpoints: position {position} is outside the prompt "
                             f"(1..{prompt_len})")
        positions.add(position)
    return tuple(sorted(positions))


def schedule(prompt_len: int, start: int, *, block_size: int, budget: int,
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
        spans += plan_prefill(prompt_len, aligned, block_size=block_size, budget=budget)
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


def prefix_hash(tokens: np.ndarray, length: int) -> str:
    """sha256 of the first `length` token ids as little-endian int32."""
    return hashlib.sha256(np.asarray(tokens[:length], "<i4").tobytes()).hexdigest()


def random_model_state(config: ModelConfig, seed: int) -> ModelState:
    """The default weights: `random_model(config, seed)`, split for the jitted steps."""
    return nnx.split(random_model(config, seed))


# --- saving and loading ---------------------------------------------------------------------

def save_states(path: str | Path, states: SavedStates) -> None:
    """One orbax checkpoint in the new directory `path`: item ``arrays`` (positions, per KDA
    layer recurrent [R, H, K, V] and conv [R, C, W - 1], per MLA layer its latent blocks) and
    item ``meta`` (JSON: format, positions, prefix hashes, prompt hash, model fingerprint)."""
    arrays = dict(positions=np.asarray(states.positions, np.int32),
                  kda=[dict(recurrent=r, conv=c) for r, c in zip(states.recurrent, states.conv)],
                  mla=list(states.mla))
    meta = dict(format=FORMAT, positions=list(states.positions),
                prefix_sha256=list(states.prefix_sha256), prompt_sha256=states.prompt_sha256,
                prompt_len=states.prompt_len, block_size=states.block_size,
                fingerprint=states.fingerprint)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(Path(path).absolute(), args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)))


def load_states(path: str | Path) -> SavedStates:
    """What `save_states` wrote at `path`, as host arrays."""
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(Path(path).absolute(), args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    meta, arrays = restored["meta"], jax.tree.map(np.asarray, restored["arrays"])
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} checkpoint (format {meta.get('format')!r})")
    return SavedStates(
        tuple(meta["positions"]), [layer["recurrent"] for layer in arrays["kda"]],
        [layer["conv"] for layer in arrays["kda"]], list(arrays["mla"]),
        tuple(meta["prefix_sha256"]), meta["prompt_sha256"], meta["prompt_len"],
        meta["block_size"], meta["fingerprint"])


def resume_position(saved: SavedStates, tokens: np.ndarray, fingerprint: str,
                    block_size: int) -> int:
    """The longest saved position p <= L - 1 whose prefix equals the prompt's; 0: none."""
    if saved.fingerprint != fingerprint or saved.block_size != block_size:
        raise ValueError(f"saved states were made by other weights, config or block size "
                         f"({saved.block_size}); this run has block size {block_size}")
    matches = [p for p, digest in zip(saved.positions, saved.prefix_sha256)
               if p <= len(tokens) - 1 and prefix_hash(tokens, p) == digest]
    return max(matches, default=0)


def _resumed_caches(caches: Caches, saved: SavedStates, position: int) -> Caches:
    """`caches` with the saved states at `position` in the running slot and the saved MLA
    latents of the positions before it in blocks 0.."""
    row = saved.positions.index(position)
    kda = tuple(StatePool(pool.recurrent.at[RUNNING_SLOT].set(rec[row]),
                          pool.conv.at[RUNNING_SLOT].set(conv[row]))
                for pool, rec, conv in zip(caches.kda, saved.recurrent, saved.conv, strict=True))

    def prefix_blocks(pages: jax.Array, stored: np.ndarray) -> jax.Array:
        count = min(pages.shape[0], stored.shape[0])
        blocks = stored[:count].copy()
        flat = blocks.reshape(-1, *blocks.shape[2:])
        flat[position:] = 0  # rows past the prefix are recomputed; keep no stale ones
        return pages.at[:count].set(jnp.asarray(flat.reshape(blocks.shape), pages.dtype))

    mla = tuple(MLACache(prefix_blocks(c.latent, s["latent"]),
                         None if c.index_keys is None else prefix_blocks(c.index_keys,
                                                                         s["index_keys"]))
                for c, s in zip(caches.mla, saved.mla, strict=True))
    return Caches(kda, mla)


# --- the run --------------------------------------------------------------------------------

def _span_batch(tokens: np.ndarray, span: PrefillSpan, rows: int, num_blocks: int
                ) -> PrefillBatch:
    n = span.num_tokens
    ids, positions = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    ids[:n] = tokens[span.start:span.end]
    positions[:n] = np.arange(span.start, span.end)
    offsets = np.full((1, CHECKPOINT_CAPACITY), -1, np.int32)
    slots = np.full((1, CHECKPOINT_CAPACITY), -1, np.int32)
    for c, position in enumerate(span.checkpoints):
        offsets[0, c], slots[0, c] = position - span.start, 1 + c
    return PrefillBatch(
        token_ids=jnp.asarray(ids), positions=jnp.asarray(positions),
        cu_seqlens=jnp.array([0, n], jnp.int32),
        state_slots=jnp.array([RUNNING_SLOT], jnp.int32),
        has_initial=jnp.array([span.start > 0]),
        checkpoint_offsets=jnp.asarray(offsets), checkpoint_slots=jnp.asarray(slots),
        block_tables=jnp.arange(num_blocks, dtype=jnp.int32)[None],
        prefix_lens=jnp.array([span.start], jnp.int32))


@jax.jit
def _take_slots(pools: tuple[StatePool, ...], slots: jax.Array) -> list[StatePool]:
    return [StatePool(pool.recurrent[slots], pool.conv[slots]) for pool in pools]


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
                progress: TextIO | None = None) -> PrefillResult:
    """Prefill `tokens` along `spans` (which tile [resumed position, L)); with `keep_states`
    copy every retained state and the final one to the host."""
    length, block_size = len(tokens), config.kv_block_size
    # Buckets: prompts of similar lengths share one compiled step.
    num_blocks = 1 << (math.ceil(length / block_size) - 1).bit_length()
    rows = math.ceil(max(span.num_tokens for span in spans) / block_size) * block_size
    caches = Caches.init(config, NUM_SLOTS, num_blocks)
    start = 0
    if resume is not None:
        start = resume[1]
        caches = _resumed_caches(caches, *resume)
    batches = [_span_batch(tokens, span, rows, num_blocks) for span in spans]

    tic = time.perf_counter()
    step = prefill.lower(model_state, caches, batches[0]).compile()
    compile_s = time.perf_counter() - tic

    kept: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    all_slots = jnp.arange(NUM_SLOTS, dtype=jnp.int32)
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
                pools = jax.device_get(_take_slots(caches.kda, all_slots))
                for c, position in enumerate(span.checkpoints):
                    kept[position] = [(p.recurrent[1 + c], p.conv[1 + c]) for p in pools]
                if span.retain_end or last:
                    kept[span.end] = [(p.recurrent[RUNNING_SLOT], p.conv[RUNNING_SLOT])
                                      for p in pools]
            advance(span, done)

    retained = tuple(sorted({p for s in spans for p in s.retained_positions} | {length}))
    states = None
    if keep_states:
        states = _collect(tokens, kept, caches, block_size,
                          model_fingerprint(model_state, config), resume)
    return PrefillResult(np.asarray(out.logits[0]), retained, start, tuple(spans), compile_s,
                         run_s, states)


def _collect(tokens, kept, caches: Caches, block_size: int, fingerprint: str,
             resume: tuple[SavedStates, int] | None) -> SavedStates:
    """Stack the retained states (with those a resumed run inherited, up to its start)."""
    if resume is not None:
        saved, start = resume
        for r, position in enumerate(saved.positions):
            if position <= start and position not in kept:
                kept[position] = [(rec[r], conv[r])
                                  for rec, conv in zip(saved.recurrent, saved.conv)]
    positions = tuple(sorted(kept))
    num_layers = len(caches.kda)
    mla = [{"latent": np.asarray(c.latent)} | ({} if c.index_keys is None
                                               else {"index_keys": np.asarray(c.index_keys)})
           for c in caches.mla]
    return SavedStates(
        positions,
        [np.stack([kept[p][i][0] for p in positions]) for i in range(num_layers)],
        [np.stack([kept[p][i][1] for p in positions]) for i in range(num_layers)],
        mla, tuple(prefix_hash(tokens, p) for p in positions), prefix_hash(tokens, len(tokens)),
        len(tokens), block_size, fingerprint)


# --- command line ---------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m glmjax.prefill",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--weights", help="safetensors folder (with --family) or orbax "
                        "directory of converted parameters; default: random weights")
    parser.add_argument("--family", choices=("kimi", "glm"), help="safetensors naming")
    parser.add_argument("--seed", type=int, default=0, help="random weights and tokens")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-file", help="token ids: whitespace-separated integers, or "
                        "the file's raw bytes with --bytes")
    prompt.add_argument("--random-tokens", type=int, metavar="N")
    parser.add_argument("--bytes", action="store_true", help="read --prompt-file as bytes")
    parser.add_argument("--checkpoints", default="auto", help="auto, or positions p1,p2,...")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--save-states", metavar="DIR")
    parser.add_argument("--load-states", metavar="DIR")
    compile_cache.add_arguments(parser)
    return parser


def _load_model(args, config: ModelConfig) -> ModelState:
    if args.weights is None:
        return random_model_state(config, args.seed)
    if list(Path(args.weights).glob("*.safetensors")):
        if args.family is None:
            raise ValueError(f"--weights {args.weights} holds safetensors: give --family")
        from glmjax.weights import load_safetensors
        return nnx.split(load_safetensors(args.weights, config, family=args.family))
    from glmjax.weights import restore_params
    return nnx.split(restore_params(args.weights, config))


def main(argv: Sequence[str] | None = None, *, progress: TextIO | None = sys.stderr
         ) -> PrefillResult:
    """Run the command line; returns the result (raises ValueError on bad arguments)."""
    args = _parser().parse_args(argv)
    compile_cache.enable_from_args(args)
    config = dataclasses.replace(ModelConfig.preset(args.preset),
                                 kv_block_size=args.block_size)
    if args.random_tokens is not None:
        if args.random_tokens < 1:
            raise ValueError(f"--random-tokens must be >= 1, got {args.random_tokens}")
        tokens = np.random.default_rng(args.seed).integers(
            0, config.vocab_size, args.random_tokens).astype(np.int32)
    else:
        tokens = read_prompt(args.prompt_file, as_bytes=args.bytes,
                             vocab_size=config.vocab_size)
    checkpoints = parse_checkpoints(args.checkpoints, len(tokens))
    plan_prefill(len(tokens), 0, block_size=args.block_size, budget=args.budget)  # validates
    if args.save_states and Path(args.save_states).exists():
        raise ValueError(f"--save-states {args.save_states} already exists")
    if args.load_states and not Path(args.load_states).is_dir():
        raise ValueError(f"--load-states {args.load_states} is not a directory")

    model_state = _load_model(args, config)
    resume = None
    if args.load_states:
        saved = load_states(args.load_states)
        position = resume_position(saved, tokens, model_fingerprint(model_state, config),
                                   args.block_size)
        resume = (saved, position) if position else None
    start = resume[1] if resume else 0
    spans = schedule(len(tokens), start, block_size=args.block_size, budget=args.budget,
                     checkpoints=checkpoints)
    result = run_prefill(model_state, config, tokens, spans,
                         keep_states=args.save_states is not None, resume=resume,
                         progress=progress)
    if args.save_states:
        save_states(args.save_states, result.states)

    computed = len(tokens) - start
    kinds = config.layer_types
    print(f"{config.name}: {kinds.count('kda')} KDA + {kinds.count('mla')} MLA layers, "
          f"prompt {len(tokens)} tokens, block {args.block_size}, budget {args.budget}, "
          f"{len(spans)} spans")
    print(f"resumed from position {start} ({args.load_states})" if start else
          "cold start" + (" (no saved prefix matched)" if args.load_states else ""))
    print(f"compile {result.compile_s:.2f} s; run {result.run_s:.3f} s for {computed} tokens, "
          f"{computed / result.run_s:.0f} tokens/s")
    print(f"retained positions: {', '.join(map(str, result.retained))}")
    if args.save_states:
        positions = result.states.positions
        inherited = [p for p in positions if p <= start]
        print(f"saved the states at {len(positions)} positions of every KDA layer and the MLA "
              f"latents to {args.save_states}"
              + (f" (inherited from the resumed run: {', '.join(map(str, inherited))})"
                 if inherited else ""))
    return result


if __name__ == "__main__":
    try:
        main()
    except ValueError as error:
        sys.exit(f"error: {error}")
