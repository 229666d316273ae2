"""MTP speculative decoding benchmark: the same greedy requests through a plain engine and a
speculative one; checks the outputs are identical and reports decode throughput, engine
steps, acceptance rate and tokens per verified decode.

    python -m bench.speculative --out $OUT/speculative.json          # glm5.3-flash, 4 layers
    python -m bench.speculative --drafts oracle --out $OUT/spec_oracle.json
    python -m bench.speculative --quick                               # CPU smoke run (tiny)

Weights are random (`glmjax.random_weights`), so the MTP head's own drafts are almost never
right: with ``--drafts mtp`` (default) the run measures exactness and the cost of
speculating, not its gain. ``--drafts oracle`` replaces every draft by the plain run's next
tokens (a fraction ``--oracle-error`` of the draft lists with one token wrong): the speed-up
the verify machinery gives at a known, high acceptance. Both engines pad every batch to one
bucket (``single_bucket``), and each first runs a few warm-up requests so that the timed
run compiles nothing (the JSON counts the compiles it did). Timed: ``--prompts`` random
prompts of ``--prompt-len`` tokens, at most ``--batch`` per step, ``--max-tokens`` each,
all added at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import fill_defaults, write_json
from glmjax import compile_cache
from glmjax.config import ModelConfig
from glmjax.random_weights import random_model
from serving.compiles import CompileLog
from serving.engine import Engine, EngineConfig
from serving.request import SamplingParams

RESULTS = Path(__file__).parent / "results"
FULL = dict(preset="glm5.3-flash", layers=4, experts=16, prompts=100, prompt_len=256,
            max_tokens=64, batch=16, block_size=256)
QUICK = dict(preset="tiny", layers=None, experts=None, prompts=8, prompt_len=40, max_tokens=8,
             batch=4, block_size=64)


def make_engine(config, model, args, speculative_tokens: int) -> Engine:
    max_len = args.prompt_len + args.max_tokens
    blocks_per_request = -(-max_len // args.block_size)
    return Engine(config, model, EngineConfig(
        max_model_len=max_len, block_size=args.block_size, budget=4 * args.block_size,
        max_num_seqs=args.batch, num_kv_blocks=(args.batch + 1) * blocks_per_request,
        num_state_slots=(args.batch + 1) * (speculative_tokens + 1) + 1,
        single_bucket=True, speculative_tokens=speculative_tokens, prefix_caching=False))


def use_oracle_drafts(engine: Engine, want: dict, num: int, error: float, seed: int) -> None:
    """Every draft list becomes the plain run's next tokens; a fraction `error` of them
    gets one wrong token."""
    runner, rng = engine._speculative, np.random.default_rng(seed)
    set_drafts = runner.set_drafts

    def oracle(engine):
        for request_id in runner.drafts:
            request = engine.scheduler.get_request(request_id)
            if request is None or request_id not in want:
                continue
            done = len(request.output_token_ids)
            drafts = list(want[request_id][done : done + num])
            if drafts and rng.random() < error:
                drafts[rng.integers(len(drafts))] ^= 1
            runner.drafts[request_id] = tuple(drafts)
        set_drafts(engine)

    runner.set_drafts = oracle


def run(engine: Engine, prompts: dict, max_tokens: int) -> tuple[dict, float, int]:
    """Outputs of every prompt, the wall time and the compiles during the run."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    with CompileLog() as compiles:
        start = time.perf_counter()
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, sampling)
        outputs = engine.run_until_done()
        seconds = time.perf_counter() - start
    return {i: o.output_token_ids for i, o in outputs.items()}, seconds, compiles.count


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.speculative",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny preset")
    parser.add_argument("--preset")
    parser.add_argument("--layers", type=int, help="keep this many layers of the preset")
    parser.add_argument("--experts", type=int, help="routed experts kept with --layers")
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--batch", type=int, help="most requests per step")
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--speculative-tokens", type=int, default=3)
    parser.add_argument("--drafts", choices=("mtp", "oracle"), default="mtp")
    parser.add_argument("--oracle-error", type=float, default=0.25)
    parser.add_argument("--dtype", choices=("preset", "float32"), default="preset",
                        help="float32: activations, caches and weights in fp32, to tell "
                        "rounding (matmuls of other row counts) from logic in a mismatch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    compile_cache.add_arguments(parser)
    args = parser.parse_args(argv)
    compile_cache.enable_from_args(args)
    fill_defaults(args, QUICK, FULL)
    config = ModelConfig.preset(args.preset)
    if args.layers is not None:
        config = config.replace_depth(args.layers, args.experts)
    config = dataclasses.replace(config, kv_block_size=args.block_size)
    if args.dtype == "float32":
        config = dataclasses.replace(config, dtype=jnp.float32, param_dtype=jnp.float32)
    model = random_model(config, args.seed)
    rng = np.random.default_rng(args.seed)
    prompts = {f"p{i}": rng.integers(0, config.vocab_size, args.prompt_len).tolist()
               for i in range(args.prompts)}
    warm = {f"warm{i}": rng.integers(0, config.vocab_size, args.prompt_len).tolist()
            for i in range(min(args.batch, 2))}

    plain = make_engine(config, model, args, 0)
    run(plain, warm, min(args.max_tokens, 4))
    plain_steps = plain.metrics().steps
    want, plain_s, plain_compiles = run(plain, prompts, args.max_tokens)
    plain_steps = plain.metrics().steps - plain_steps
    spec = make_engine(config, model, args, args.speculative_tokens)
    run(spec, warm, min(args.max_tokens, 4))
    if args.drafts == "oracle":
        use_oracle_drafts(spec, want, args.speculative_tokens, args.oracle_error, args.seed)
    before = spec.metrics()
    got, spec_s, spec_compiles = run(spec, prompts, args.max_tokens)
    after = spec.metrics()
    verified = after.spec_verified_decodes - before.spec_verified_decodes
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    mismatched = {i: _first_difference(got[i], want[i]) for i in prompts if got[i] != want[i]}
    tokens = sum(len(t) for t in want.values())
    result = dict(
        device=jax.devices()[0].device_kind, host=platform.node(), model=config.name,
        prompts=args.prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
        batch=args.batch, speculative_tokens=args.speculative_tokens, drafts=args.drafts,
        dtype=str(jnp.dtype(config.dtype)), identical=not mismatched,
        mismatched=mismatched, generated_tokens=tokens,
        plain=dict(seconds=plain_s, tokens_per_s=tokens / plain_s, steps=plain_steps,
                   compiles=plain_compiles, async_scheduling=plain.config.async_scheduling),
        speculative=dict(seconds=spec_s, tokens_per_s=tokens / spec_s, compiles=spec_compiles,
                         steps=after.steps - before.steps, verified_decodes=verified,
                         draft_tokens=drafted, accepted_tokens=accepted,
                         acceptance_rate=accepted / max(drafted, 1),
                         tokens_per_verified_decode=(verified + accepted) / max(verified, 1)),
    )
    s = result["speculative"]
    print(f"{config.name}, {args.prompts} prompts x {args.max_tokens} tokens, batch "
          f"{args.batch}, N = {args.speculative_tokens} ({args.drafts} drafts)")
    print(f"  plain:       {plain_s:7.2f} s  {tokens / plain_s:8.1f} tokens/s")
    print(f"  speculative: {spec_s:7.2f} s  {tokens / spec_s:8.1f} tokens/s  acceptance "
          f"{s['acceptance_rate']:.3f}  {s['tokens_per_verified_decode']:.2f} tokens per "
          f"verified decode")
    if plain_compiles or spec_compiles:
        print(f"  warning: the timed runs compiled {plain_compiles} (plain) and "
              f"{spec_compiles} (speculative) programs")
    print(f"  greedy outputs identical: {not mismatched}"
          + (f" ({len(mismatched)} differ; prompt: first differing token {mismatched})"
             if mismatched else ""))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
