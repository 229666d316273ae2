"""A step with prefill spans and decode rows: two forwards, or one mixed forward.

    python -m bench.mixed_step --quick --out /tmp/mixed.json          # CPU smoke (tiny preset)
    python -m bench.mixed_step --preset glm5.3-flash --num-layers 4 --num-experts 8 \\
        --out $OUT/mixed_step_glm.json                                # H200
    python -m bench.mixed_step --preset kimi-linear-48b --num-layers 4 --num-experts 8 \\
        --out $OUT/mixed_step_kimi.json

One prefill span of `--prefill-tokens` tokens (cold, one snapshot) beside N decode rows
(each of `--decode-rows`), every row at position `--context` of its own request (its KV
blocks and state slot hold whatever the pools hold: the time does not depend on values).
Random weights. Timed, each a jitted call continuing from the caches the previous call
returned (`bench.common.time_calls`: `--samples` samples of `--iters` queued calls,
the median reported), in ms:

- `prefill`: `glmjax.model.prefill` alone (the span).
- `decode`: `glmjax.model.decode` alone (the N rows).
- `two forwards`: prefill then decode, as the engine runs a mixed step today.
- `mixed`: `glmjax.mixed.mixed`, one forward over both.

`saved` is two forwards minus mixed; `mixed_over_prefill` is what the N rows cost on top of
the prefill when they ride along. The JSON is rewritten after every case.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from bench.common import time_calls, write_json
from glmjax import compile_cache
from glmjax.batch import CHECKPOINT_CAPACITY, DecodeBatch, PrefillBatch
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.mixed import mixed
from glmjax.model import decode, prefill
from glmjax.random_weights import random_model
from glmjax.state_pool import PoolStatus

RESULTS = Path(__file__).parent / "results"
QUICK = dict(preset="tiny", prefill_tokens=256, decode_rows="4", context=100, iters=1,
             samples=2)


def span_batch(tokens: np.ndarray, block_size: int) -> PrefillBatch:
    """One cold span in slot 0 over blocks 0.., a snapshot at half its length in slot 1."""
    length = len(tokens)
    offsets = np.full((1, CHECKPOINT_CAPACITY), -1, np.int32)
    slots = np.full((1, CHECKPOINT_CAPACITY), -1, np.int32)
    offsets[0, 0], slots[0, 0] = length // 2, 1
    return PrefillBatch(
        token_ids=np.asarray(tokens, np.int32), positions=np.arange(length, dtype=np.int32),
        cu_seqlens=np.array([0, length], np.int32), state_slots=np.array([0], np.int32),
        has_initial=np.array([False]), checkpoint_offsets=offsets, checkpoint_slots=slots,
        block_tables=np.arange(-(-length // block_size), dtype=np.int32)[None],
        prefix_lens=np.array([0], np.int32))


def rows_batch(rng, rows: int, context: int, first_block: int, block_size: int,
               vocab: int) -> DecodeBatch:
    """`rows` rows in slots 2.., each at position `context` over its own blocks."""
    width = context // block_size + 1
    tables = first_block + np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    return DecodeBatch(
        token_ids=rng.integers(0, vocab, rows).astype(np.int32),
        positions=np.full(rows, context, np.int32),
        state_slots=2 + np.arange(rows, dtype=np.int32), block_tables=tables)


def run_case(model_state, config, rng, args, rows: int) -> dict:
    block_size = config.kv_block_size
    span = jax.device_put(span_batch(rng.integers(0, config.vocab_size, args.prefill_tokens),
                                     block_size))
    first_block = span.block_tables.shape[1]
    batch = jax.device_put(rows_batch(rng, rows, args.context, first_block, block_size,
                                      config.vocab_size))
    caches = Caches.init(config, 2 + rows, first_block + batch.block_tables.size)
    state = {"caches": caches}

    def calls(fn):
        def call():
            out = fn(state["caches"])
            state["caches"] = out[0]
            return out
        return call

    def prefill_only(c):
        out = prefill(model_state, c, span)
        return out.caches, out.logits, out.status

    def decode_only(c):
        out = decode(model_state, c, batch)
        return out.caches, out.logits, out.status

    def two_forwards(c):
        first = prefill(model_state, c, span)
        out = decode(model_state, first.caches, batch)
        return out.caches, first.logits, out.logits, first.status | out.status

    def one_forward(c):
        out = mixed(model_state, c, span, batch)
        return out.caches, out.prefill_logits, out.decode_logits, out.status

    def sync(out):
        if int(out[-1]) != PoolStatus.OK:
            raise RuntimeError(f"a step was refused: status {int(out[-1])}")

    ms = {}
    for name, fn in (("prefill", prefill_only), ("decode", decode_only),
                     ("two forwards", two_forwards), ("mixed", one_forward)):
        ms[name], _ = time_calls(calls(fn), sync, iters=args.iters, samples=args.samples)
        print(f"  {rows:3d} rows  {name:13s} {ms[name]:9.2f} ms", flush=True)
    return dict(decode_rows=rows, ms=ms, saved_ms=ms["two forwards"] - ms["mixed"],
                mixed_over_two=ms["mixed"] / ms["two forwards"],
                mixed_over_prefill=ms["mixed"] / ms["prefill"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: " + str(QUICK))
    parser.add_argument("--preset", default="glm5.3-flash")
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--num-experts", type=int)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--decode-rows", default="16,64", help="comma-separated row counts")
    parser.add_argument("--context", type=int, default=4096, help="tokens each row has cached")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--out", type=Path)
    compile_cache.add_arguments(parser)
    args = parser.parse_args(argv)
    compile_cache.enable_from_args(args)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)

    config = ModelConfig.preset(args.preset)
    if args.num_layers or args.num_experts:
        config = config.replace_depth(args.num_layers or config.num_layers, args.num_experts)
    if args.prefill_tokens % config.kv_block_size and not args.quick:
        raise ValueError(f"--prefill-tokens {args.prefill_tokens} is not a multiple of the "
                         f"KV block size {config.kv_block_size}")
    model_state = nnx.split(random_model(config, seed=0))
    rng = np.random.default_rng(0)
    payload = dict(
        preset=args.preset, model=config.name, num_layers=len(config.layer_types),
        num_experts=config.num_experts, layer_types=list(config.layer_types),
        device=jax.devices()[0].device_kind, prefill_tokens=args.prefill_tokens,
        context=args.context, results=[])
    out = args.out or RESULTS / f"mixed_step_{args.preset}.json"
    print(f"{args.preset} ({payload['num_layers']} layers, {config.num_experts} experts) on "
          f"{payload['device']}: {args.prefill_tokens} prefill tokens", flush=True)
    for rows in (int(r) for r in args.decode_rows.split(",")):
        payload["results"].append(run_case(model_state, config, rng, args, rows))
        write_json(payload, out)
    print(f"wrote {out}")
    return payload


if __name__ == "__main__":
    main()
