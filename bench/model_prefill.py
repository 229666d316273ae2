"""Prefill throughput of the hybrid model: one cold prompt, four retained checkpoints.

    python -m bench.model_prefill --preset tiny --tokens 2048            # CPU
    python -m bench.model_prefill --preset kimi-linear-48b --num-layers 4 --num-experts 8 \\
        --tokens 8192                                                    # H200
    ... --mla-attention pallas|cudnn|reference     # MLA prefill attention (default: by device)
    ... --scan-layers                  # repeated layer groups as one scan (glmjax.layer_scan)

Random weights (normal * 0.02, norm gains 1): throughput does not depend on the values.
Prints the first call's time (compile included), the median time of `--repeats` jitted prefills (each synchronised),
tokens/s, and writes JSON to bench/results/model_prefill_<preset>_<tokens>.json.

`--profile` (the default on a GPU) then traces one more prefill and prints its device time
by op category, its useful FLOPs and MFU (`bench.profile`, `bench.flops`; under "profile"
in the JSON). `--num-layers` and `--num-experts` cut the preset, each on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import write_json
from bench.flops import Span, step_flops
from bench.profile import print_profile, profile_call, traceable
from glmjax import compile_cache
from glmjax.batch import PrefillBatch
from glmjax.caches import Caches
from glmjax.config import MLA_ATTENTIONS, ModelConfig
from glmjax.model import prefill, prefill_step
from glmjax.random_weights import random_model
from pallas_kernels.attention import default_implementation

BLOCK_SIZE = 512
RESULTS = Path(__file__).parent / "results"


def cold_prompt_batch(tokens: np.ndarray) -> PrefillBatch:
    """One span [0, L) from a cold start, snapshots at L/4, L/2, 3L/4 and L into slots 1-4."""
    length = len(tokens)
    blocks = -(-length // BLOCK_SIZE)
    offsets = [length // 4, length // 2, 3 * length // 4, length]
    return PrefillBatch(
        token_ids=jnp.asarray(tokens, jnp.int32),
        positions=jnp.arange(length, dtype=jnp.int32),
        cu_seqlens=jnp.array([0, length], jnp.int32),
        state_slots=jnp.array([0], jnp.int32),
        has_initial=jnp.array([False]),
        checkpoint_offsets=jnp.array([offsets], jnp.int32),
        checkpoint_slots=jnp.array([[1, 2, 3, 4]], jnp.int32),
        block_tables=jnp.arange(blocks, dtype=jnp.int32)[None],
        prefix_lens=jnp.array([0], jnp.int32),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--num-experts", type=int)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction,
                        help="trace one more prefill: time by op category, MFU (default: on "
                             "a GPU)")
    parser.add_argument("--trace-dir", type=Path, help="where the trace goes (a new temp dir)")
    compile_cache.add_arguments(parser)
    parser.add_argument("--mla-attention", choices=MLA_ATTENTIONS,
                        help="MLA prefill attention implementation (default: by device)")
    parser.add_argument("--scan-layers", action="store_true",
                        help="run the repeated layer groups as one scan (config.scan_layers)")
    args = parser.parse_args()
    compile_cache.enable_from_args(args)

    config = ModelConfig.preset(args.preset)
    if args.num_layers or args.num_experts:
        config = config.replace_depth(args.num_layers or config.num_layers, args.num_experts)
    config = dataclasses.replace(config, mla_attention=args.mla_attention,
                                 scan_layers=args.scan_layers)
    model_state = nnx.split(random_model(config, seed=0))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, args.tokens)
    batch = cold_prompt_batch(tokens)
    caches = Caches.init(config, num_state_slots=5,
                         num_kv_blocks=batch.block_tables.shape[1])

    start = time.perf_counter()
    out = prefill(model_state, caches, batch)
    jax.block_until_ready(out.logits)
    compile_s = time.perf_counter() - start
    if int(out.status) != 0:
        raise RuntimeError(f"prefill refused the batch: status {int(out.status)}")
    times = []
    caches = out.caches
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = prefill(model_state, caches, batch)
        jax.block_until_ready(out.logits)
        times.append(time.perf_counter() - start)
        caches = out.caches
    median = statistics.median(times)
    result = dict(
        preset=args.preset, model=config.name, num_layers=len(config.layer_types),
        scan_layers=config.scan_layers,
        num_experts=config.num_experts, layer_types=list(config.layer_types),
        tokens=args.tokens, device=jax.devices()[0].device_kind,
        kda_backend=config.resolved_kda_backend(),
        mla_attention=config.mla_attention or default_implementation(
            num_sequences=batch.block_tables.shape[0], dtype=config.dtype),
        first_call_s=compile_s, median_s=median, samples_s=times,
        tokens_per_s=args.tokens / median,
    )
    print(f"{args.preset} ({result['num_layers']} layers) on {result['device']}: "
          f"{args.tokens} tokens, first call {compile_s:.1f} s, median {median * 1e3:.1f} ms, "
          f"{result['tokens_per_s']:.0f} tokens/s")
    if args.profile if args.profile is not None else jax.default_backend() == "gpu":
        traced = traceable(prefill_step, donate_argnums=1, static_argnames="return_logprobs")
        state = {"caches": caches}

        def step():
            out = traced(model_state, state["caches"], batch)
            state["caches"] = out.caches
            return out

        jax.block_until_ready(step())  # compiled outside the trace
        # Its HLO names the ops of a CPU trace, whose events carry no op names.
        hlo = traced.lower(model_state, state["caches"], batch).compile().as_text()
        trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="model_prefill_trace_"))
        result["profile"] = profile_call(
            step, trace_dir, flops=step_flops(config, [Span(args.tokens)]),
            device_kind=result["device"], hlo_texts=[hlo], step_s=median)
        print_profile(result["profile"], f"one cold prefill of {args.tokens} tokens")
    out_path = args.out or RESULTS / f"model_prefill_{args.preset}_{args.tokens}.json"
    write_json(result, out_path)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
