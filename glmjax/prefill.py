"""Offline prefill of one long prompt along the planner's spans, retaining KDA states.

    python -m glmjax.prefill --random-tokens 8192                       # tiny, random weights
    python -m glmjax.prefill --prompt-file ids.txt --save-states /tmp/s   # ids: whitespace ints
    python -m glmjax.prefill --prompt-file doc.txt --bytes --load-states /tmp/s
    python -m glmjax.prefill --preset kimi-linear-48b --weights /ckpt/hf --family kimi ...
    python -m glmjax.prefill --random-tokens 8192 --tp 4 --dcp 2            # a (2, 2) mesh

The prompt is cut by `serving.plan.plan_prefill` into spans of at most `--budget` tokens on
a `--block-size` grid; each span is one jitted `glmjax.model.prefill` step (one compile: every
span is padded to the longest; the loop is `glmjax.prefill_loop`). Inside a span the KDA
kernel snapshots the span's checkpoints into state slots 1..4; a span with `retain_end`
leaves its retained state in the running slot 0. With `--save-states` both are copied to
the host after the span and written at the end, with the final state, as one orbax
checkpoint (see `save_states`).

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

`--tp N --dcp M` runs every span on the ``(N // M, M)`` mesh of `glmjax.sharding` (the
server's and `glmjax.shard`'s): KDA heads and state pools split over all N devices, the MLA
latent cache by token over the M dcp ranks; `--tp 1 --dcp M` emulates dcp on one device
(a KV block of ``P * M`` tokens either way). On a CPU the tool asks JAX for N host
devices. Over several processes or hosts (``--coordinator HOST:PORT --num-processes N
--process-id I``, `glmjax.distributed`) every process runs the same command on the mesh of
all their devices; retained states are gathered from every process, and process 0 alone
prints, draws the progress bar and writes `--save-states` (`--load-states` is read by every
process, so it must be on every host). States resume under the same weights, `--block-size`
and `--dcp` (the fingerprint covers the config); the mesh itself may differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import jax
import numpy as np
from flax import nnx

from glmjax import compile_cache, distributed
from glmjax.config import ModelConfig
from glmjax.fingerprint import model_fingerprint
from glmjax.model import ModelState
from glmjax.prefill_loop import PrefillResult, run_prefill, schedule
from glmjax.prefill_states import load_states, resume_position, save_states
from glmjax.random_weights import random_model
from glmjax.sharding import ShardingPlan, make_mesh, request_cpu_devices
from serving.plan import plan_prefill

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


def random_model_state(config: ModelConfig, seed: int) -> ModelState:
    """The default weights: `random_model(config, seed)`, split for the jitted steps."""
    return nnx.split(random_model(config, seed))


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
    parser.add_argument("--block-size", type=int, default=512,
                        help="KV block per dcp rank and the planner's grid, P")
    parser.add_argument("--budget", type=int, default=8192,
                        help="most tokens per step, a multiple of P * dcp")
    parser.add_argument("--save-states", metavar="DIR", help="written by process 0 alone")
    parser.add_argument("--load-states", metavar="DIR", help="read by every process")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel devices: a (tp // dcp, dcp) mesh (1: one device)")
    parser.add_argument("--dcp", type=int, default=1, choices=(1, 2, 4),
                        help="decode-context-parallel ranks: the MLA cache split by token "
                             "(emulated on one device with --tp 1)")
    parser.add_argument("--dcp-interleave", type=int, default=1,
                        help="consecutive tokens per dcp rank in the MLA latent cache")
    compile_cache.add_arguments(parser)
    distributed.add_arguments(parser)
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
    """Run the command line; returns the result (raises ValueError on bad arguments). Over
    several processes every process returns it; process 0 alone prints, draws the progress
    bar and writes --save-states."""
    args = _parser().parse_args(argv)
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if args.tp > 1:
        request_cpu_devices(args.tp)
    distributed.initialize(args, tp=args.tp, flags=vars(args))
    leader = jax.process_index() == 0  # also where a caller started jax.distributed itself
    compile_cache.enable_from_args(args)
    config = dataclasses.replace(ModelConfig.preset(args.preset),
                                 kv_block_size=args.block_size * args.dcp)
    plan = None
    if args.tp > 1:
        plan = ShardingPlan(config, make_mesh(args.tp, args.dcp), interleave=args.dcp_interleave)
    if args.random_tokens is not None:
        if args.random_tokens < 1:
            raise ValueError(f"--random-tokens must be >= 1, got {args.random_tokens}")
        tokens = np.random.default_rng(args.seed).integers(
            0, config.vocab_size, args.random_tokens).astype(np.int32)
    else:
        tokens = read_prompt(args.prompt_file, as_bytes=args.bytes,
                             vocab_size=config.vocab_size)
    checkpoints = parse_checkpoints(args.checkpoints, len(tokens))
    plan_prefill(len(tokens), 0, block_size=args.block_size, dcp=args.dcp,
                 budget=args.budget)  # validates
    if leader and args.save_states and Path(args.save_states).exists():
        raise ValueError(f"--save-states {args.save_states} already exists")
    if args.load_states and not Path(args.load_states).is_dir():
        raise ValueError(f"--load-states {args.load_states} is not a directory")

    model_state = _load_model(args, config)
    resume = None
    if args.load_states:
        saved = load_states(args.load_states)
        position = resume_position(saved, tokens, model_fingerprint(model_state, config),
                                   config.kv_block_size)
        resume = (saved, position) if position else None
    start = resume[1] if resume else 0
    spans = schedule(len(tokens), start, block_size=args.block_size, dcp=args.dcp,
                     budget=args.budget, checkpoints=checkpoints)
    result = run_prefill(model_state, config, tokens, spans,
                         keep_states=args.save_states is not None, resume=resume,
                         progress=progress if leader else None, plan=plan)
    if not leader:
        return result
    if args.save_states:
        save_states(args.save_states, result.states)

    computed = len(tokens) - start
    kinds = config.layer_types
    where = "one device" if plan is None else (
        f"a (tpo, dcp) = ({args.tp // args.dcp}, {args.dcp}) mesh of {args.tp} devices"
        + ("" if jax.process_count() == 1 else f" over {jax.process_count()} processes"))
    print(f"{config.name}: {kinds.count('kda')} KDA + {kinds.count('mla')} MLA layers on "
          f"{where}, prompt {len(tokens)} tokens, block {args.block_size} x dcp {args.dcp}, "
          f"budget {args.budget}, {len(spans)} spans")
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
