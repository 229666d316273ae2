"""End-to-end prefill through the serving engine: coalesced spans against the ladder.

    python -m bench.prefill --quick                                    # CPU smoke run
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m bench.prefill        # H200
    python -m bench.prefill --tp 4 --dcp 2                             # four GPUs, (2, 2) mesh

Model: `--preset` (glm5.3-flash) cut to `--num-layers` (4: 3 KDA + 1 MLA) and
`--num-experts` (16), seeded random bf16 weights (`glmjax.random_weights.random_model`).
At 16 experts that is 3.23 B parameters, 6.0 GiB: embedding and LM head 2.4 GiB, the three
KDA layers with their dense MLPs 1.5, the MLA + MoE layer 1.0, the MTP head (held, not run)
1.1; each expert adds 48 MiB to the MoE layer and to the MTP head. All 288 experts (31.5 GiB)
would fit too, but the host draws only ~50-100 M random values a second. Caches are small
beside that (a 32K request holds 40 MiB of MLA latents and index keys, a KDA state slot
4 MiB per layer): free memory goes to the prefill's temporaries.

Two engines share the weights and the buckets: coalescing on and off (the ladder), prefix
caching on. `--tp N` (N > 1) runs both on a (N // dcp, dcp) mesh of N devices
(`glmjax.sharding`); otherwise `--dcp` is emulated on one device. Each case feeds both
the same requests, sample by sample, alternating which goes first; the first `--warmup`
samples of a case are not timed.
- cold: a fresh random prompt of each `--lengths` and `--unaligned` length (no prefix-cache
  hit: checked), one greedy token; median time to first token (TTFT), prompt tokens / TTFT,
  the ratio ladder TTFT / coalesced TTFT, and the engine's wait for the device within each
  TTFT (`device_wait_s`; the rest of a TTFT is the host's).
- beside: the same beside `--decoders` requests decoding at `--decode-context` tokens; also
  their decode tokens/s while the prompt prefills.
- decode: `--concurrency` requests decoding at `--decode-context` tokens, tokens/s over
  samples of `--decode-steps` steps; ratio coalesced / ladder.
The two engines' greedy tokens are compared request by request (`greedy` in the JSON);
`--dtype float32` runs the model in fp32, where the schedules must agree to rounding;
`--batch-invariant` (the server's flag) makes them agree bit for bit on a GPU.

Profile (`--profile`, the default on a GPU without `--quick`): after the cases, one cold
prompt of `--profile-length` tokens (the budget) per engine, its first step traced with
`jax.profiler` (the coalesced span; the ladder's first step: 4096 tokens of an 8192-token
prompt): device time by op category (MoE, shared experts, MLA attention, DSA indexer, KDA kernel, projections, mHC,
other), the step's useful FLOPs and MFU (`bench.profile`, `bench.flops`; `profile` in the
JSON, traces under `--trace-dir`).

Compiles: a dry run of the same requests through the scheduler and batch builder alone
lists every prefill and decode batch shape (bucket) the run builds. Each is compiled ahead
in `--compile-workers` threads while the host draws the weights (`buckets`: seconds and
XLA's temporary bytes), so timed samples never compile (`compiles_during_timing` counts any
that did). A case needing a bucket whose memory exceeds what is free is skipped, with the
reason. Writes JSON to bench/results/prefill_<preset>.json (`_tp<N>_dcp<M>` added on a
mesh; `--json`) after every case; peak memory per device.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.buckets import DryRun, log, precompile, step_functions
from bench.common import (
    add_batch_invariant,
    add_pin_temporaries,
    batch_invariant,
    fill_defaults,
    git_commit,
    pin_temporaries,
    write_json,
)
from bench.prefill_cases import CASES, MODES, Run, Session, compare_greedy, profile_case
from bench.profile import print_profile
from glmjax import compile_cache
from glmjax.config import ModelConfig
from glmjax.model import HybridModel
from glmjax.random_weights import random_model
from glmjax.sharding import ModelSteps, ShardingPlan, make_mesh, request_cpu_devices
from serving.batch_builder import BatchBuckets
from serving.compiles import CompileLog
from serving.engine import Engine, EngineConfig
from serving.request import MAX_TOP_LOGPROBS

RESULTS = Path(__file__).parent / "results"
FULL = dict(
    preset="glm5.3-flash", num_layers=4, num_experts=16, block_size=512, budget=8192,
    lengths="8192,16384,32768", unaligned=16228, beside_lengths="8192,16228", decoders=3,
    decode_context=8192, concurrency="1,4", samples=5, decode_steps=16, compile_workers=4,
    single_bucket=False,
)  # fmt: skip
QUICK = dict(
    preset="tiny", num_layers=None, num_experts=None, block_size=32, budget=128,
    lengths="256,512", unaligned=350, beside_lengths="350", decoders=1, decode_context=128,
    concurrency="1,2", samples=2, decode_steps=4, compile_workers=2, single_bucket=True,
)  # fmt: skip


def case_list(args) -> list[tuple[str, int]]:
    """Cheapest first, so that a run cut short keeps most; the longest cold prompt last."""
    cold = sorted(set(_ints(args.lengths) + [args.unaligned]) - {0})
    return ([("decode", c) for c in _ints(args.concurrency)]
            + [("beside", n) for n in _ints(args.beside_lengths)] + [("cold", n) for n in cold])


def model_config(args) -> ModelConfig:
    config = ModelConfig.preset(args.preset)
    if args.num_layers or args.num_experts:
        config = config.replace_depth(args.num_layers or config.num_layers, args.num_experts)
    if args.dtype == "float32":
        config = dataclasses.replace(config, dtype=jnp.float32, param_dtype=jnp.float32)
    return dataclasses.replace(config, kv_block_size=args.block_size * args.dcp,
                               scan_layers=args.scan_layers,
                               batch_invariant=args.batch_invariant)


def model_steps(args, config: ModelConfig) -> ModelSteps | None:
    """The steps on the (tp // dcp, dcp) mesh; None (one device) at tp 1."""
    if args.tp == 1:
        return None
    return ShardingPlan(config, make_mesh(args.tp, args.dcp)).steps()


def engine_config(args, coalesce: bool) -> EngineConfig:
    """Room for the largest case: a cold prompt, or decoders beside one."""
    blocks = lambda tokens: -(-tokens // (args.block_size * args.dcp))  # noqa: E731
    cold = max(_ints(args.lengths) + _ints(args.beside_lengths) + [args.unaligned])
    concurrency = max(_ints(args.concurrency), default=1)  # `--concurrency ''`: cold cases only
    num_blocks = max(concurrency * blocks(args.decode_context),
                     args.decoders * blocks(args.decode_context) + blocks(cold + 1))
    return EngineConfig(
        max_model_len=max(cold + 1, args.decode_context), block_size=args.block_size,
        dcp=args.dcp, budget=args.budget, coalesce=coalesce, prefix_caching=True,
        max_num_seqs=max(concurrency, args.decoders + 1), num_kv_blocks=num_blocks + 8,
        num_state_slots=32, single_bucket=args.single_bucket,
        async_scheduling=args.async_scheduling,
    )  # fmt: skip


def dry_run(args, buckets: BatchBuckets, vocab_size: int, compile_log: CompileLog):
    """Every case through the schedulers and batch builders alone: (a batch per bucket, the
    buckets of each case)."""
    dry = {mode: DryRun(engine_config(args, on), buckets) for mode, on in MODES.items()}
    run = Run({mode: Session(d, {}) for mode, d in dry.items()}, args, vocab_size, compile_log,
              np.random.default_rng(args.seed))
    case_buckets = {}
    for kind, size in case_list(args):
        for d in dry.values():
            d.used.clear()
        CASES[kind](run, size)
        case_buckets[kind, size] = set().union(*(d.used for d in dry.values()))
    return {key: batch for d in dry.values() for key, batch in d.batches.items()}, case_buckets


def run_benchmark(args) -> dict:
    start = time.perf_counter()
    if args.profile is None:
        args.profile = not args.quick and jax.default_backend() == "gpu"
    config = model_config(args)
    abstract = nnx.split(nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0))))
    leaves = jax.tree.leaves(abstract[1])
    result = dict(
        device=jax.devices()[0].device_kind, platform=platform.platform(), jax=jax.__version__,
        commit=git_commit(), args=vars(args), xla_flags=os.environ.get("XLA_FLAGS", ""),
        complete=False,
        model=dict(name=config.name, layer_types=list(config.layer_types),
                   num_layers=config.num_layers, num_experts=config.num_experts,
                   experts_per_token=config.num_experts_per_token,
                   hidden_size=config.hidden_size,
                   vocab_size=config.vocab_size, kda_backend=config.resolved_kda_backend(),
                   params=sum(math.prod(x.shape) for x in leaves),
                   param_bytes=sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)),
    )  # fmt: skip
    log(f"{config.name}: {result['model']['params'] / 1e9:.2f} B parameters, "
         f"{result['model']['param_bytes'] / 2**30:.2f} GiB; drawing them while compiling")
    with CompileLog() as compile_log, concurrent.futures.ThreadPoolExecutor(1) as host:
        weights = host.submit(lambda: (random_model(config, args.seed), time.perf_counter()))
        steps_on_devices = model_steps(args, config)
        probe = Engine(config, abstract, engine_config(args, coalesce=True),
                       steps=steps_on_devices)
        result["engine"] = dataclasses.asdict(probe.config) | {"coalesce": "both"}
        batches, case_buckets = dry_run(args, probe.builder.buckets, config.vocab_size,
                                        compile_log)
        log(f"dry run: {len(batches)} buckets {sorted(batches)}")
        mark = time.perf_counter()
        steps = step_functions(probe)
        # The abstract parameters as `probe` holds them (dicts, and on a mesh with their
        # shardings), so the executables compiled here are the ones the engines' calls find.
        buckets = precompile(steps, batches, probe.model_state, probe.caches,
                             args.compile_workers)
        del probe
        result["setup_s"] = {"precompile": time.perf_counter() - mark}
        model, drawn = weights.result()
        result["setup_s"]["weights_ready"] = drawn - start  # the draw overlaps the compiles
        model_state = nnx.split(model)

        def fresh_sessions():
            return {mode: Session(Engine(config, model_state, engine_config(args, on),
                                         steps=steps_on_devices),
                                  outputs[mode], top_logprobs=MAX_TOP_LOGPROBS)
                    for mode, on in MODES.items()}

        outputs = {mode: {} for mode in MODES}
        run = Run(fresh_sessions(), args, config.vocab_size, compile_log,
                  np.random.default_rng(args.seed + 1))
        stats = jax.devices()[0].memory_stats()
        free = None if stats is None else stats["bytes_limit"] - stats["bytes_in_use"]
        if free is None:  # XLA's VMM allocator (--pin-temporaries on a GPU) reports none
            log("no memory statistics: every case runs, none is skipped as too big")
        for bucket in buckets:  # None: unknown
            bucket["predicted_oom"] = None if free is None else bool(
                bucket["need_bytes"] and bucket["need_bytes"] > free)
        result.update(buckets=buckets, free_bytes=free)
        too_big = {(b["kind"], *b["shape"]) for b in buckets if b["predicted_oom"]}

        for kind, size in case_list(args):
            if needed := sorted(case_buckets[kind, size] & too_big):
                entry = {"skipped": f"buckets {needed} need more than the {free / 2**30:.1f} "
                         "GiB free (raise XLA_PYTHON_CLIENT_MEM_FRACTION or shrink the step)"}
            else:
                log(f"{kind} {size}")
                try:
                    entry = CASES[kind](run, size)
                except jax.errors.JaxRuntimeError as error:
                    if "RESOURCE_EXHAUSTED" not in str(error):
                        raise
                    entry = {"error": str(error).splitlines()[0]}
                    run.sessions = fresh_sessions()  # a failed step leaves the caches unusable
            entry.setdefault("concurrency" if kind == "decode" else "tokens", size)
            log(f"{kind} {size}: {_summary(kind, entry)}")
            result.setdefault(kind, []).append(entry)
            _update_totals(result, run, outputs, steps, start)
            write_json(result, args.json)
        if args.profile:
            length = args.profile_length or args.budget
            log(f"profile {length}")
            trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="prefill_trace_"))
            try:
                result["profile"] = profile_case(run, length, config, result["device"],
                                                 trace_dir)
            except jax.errors.JaxRuntimeError as error:
                if "RESOURCE_EXHAUSTED" not in str(error):
                    raise
                result["profile"] = {"tokens": length, "error": str(error).splitlines()[0]}
            _update_totals(result, run, outputs, steps, start)
    result["complete"] = True
    write_json(result, args.json)
    return result


def _update_totals(result: dict, run: Run, outputs: dict, steps: dict, start: float) -> None:
    """The run-wide fields, refreshed after every case."""
    per_device = [d.memory_stats() or {} for d in jax.devices()[:result["args"]["tp"]]]
    peaks = [stats.get("peak_bytes_in_use") for stats in per_device]
    compiles = run.compile_log.by_function()
    programs = {kind: compiles.get(f"jit({step.name})", {}).get("count", 0)
                for kind, step in steps.items()}
    programs["other"] = sum(c["count"] for c in compiles.values()) - sum(programs.values())
    result.update(
        compiles=compiles, programs=programs,
        # > 0: a step compiled again after precompile (the executable was not reused).
        recompiles={kind: max(0, programs[kind] - sum(b["kind"] == kind
                                                      for b in result["buckets"]))
                    for kind in steps},
        compiles_during_timing=run.compiles_during_timing,
        peak_bytes_in_use=max(peaks, default=None) if None not in peaks else None,
        peak_bytes_per_device=peaks, bytes_limit=per_device[0].get("bytes_limit"),
        greedy=compare_greedy(outputs["coalesced"], outputs["ladder"]),
        wall_s=time.perf_counter() - start,
    )  # fmt: skip


def _summary(kind: str, entry: dict) -> str:
    if "skipped" in entry or "error" in entry:
        return entry.get("skipped") or entry["error"]
    if kind == "decode":
        return "tokens/s " + ", ".join(
            f"{m} {entry[m]['median_tokens_per_s']:.1f}" for m in MODES)
    return "TTFT " + ", ".join(f"{m} {entry[m]['median_ttft_s'] * 1e3:.0f} ms" for m in MODES)


def _fmt(value, spec: str, scale: float = 1) -> str:
    return "-" if value is None else format(value * scale, spec)


def print_table(result: dict) -> None:
    def get(entry, mode, key):
        return entry.get(mode, {}).get(key)

    print("\ncold prefill: median TTFT (ms), the coalesced TTFT's wait for the device (ms), "
          "prompt tokens/s, ratio ladder / coalesced")
    print(f"{'tokens':>7} {'ladder':>8} {'coal.':>8} {'wait':>8} {'ladder/s':>9} {'coal./s':>9} "
          f"{'ratio':>6} {'target':>6}")
    for e in result.get("cold", []):
        print(f"{e['tokens']:>7} {_fmt(get(e, 'ladder', 'median_ttft_s'), '.0f', 1e3):>8} "
              f"{_fmt(get(e, 'coalesced', 'median_ttft_s'), '.0f', 1e3):>8} "
              f"{_fmt(get(e, 'coalesced', 'median_device_wait_s'), '.0f', 1e3):>8} "
              f"{_fmt(get(e, 'ladder', 'tokens_per_s'), '.0f'):>9} "
              f"{_fmt(get(e, 'coalesced', 'tokens_per_s'), '.0f'):>9} "
              f"{_fmt(e.get('ratio'), '.2f'):>6} {_fmt(e.get('target_ratio'), '.2f'):>6} "
              f"{e.get('skipped') or e.get('error') or ''}")
    print(f"\nbeside {result['args']['decoders']} decoding requests: TTFT (ms), ratio, their "
          "decode tokens/s")
    for e in result.get("beside", []):
        print(f"{e['tokens']:>7} {_fmt(get(e, 'ladder', 'median_ttft_s'), '.0f', 1e3):>8} "
              f"{_fmt(get(e, 'coalesced', 'median_ttft_s'), '.0f', 1e3):>8} "
              f"{_fmt(e.get('ttft_ratio'), '.2f'):>6}  decode: ladder "
              f"{_fmt(get(e, 'ladder', 'median_decode_tokens_per_s'), '.1f')}, coalesced "
              f"{_fmt(get(e, 'coalesced', 'median_decode_tokens_per_s'), '.1f')}")
    print(f"\ndecode tokens/s at {result['args']['decode_context']} tokens: ladder, coalesced, "
          "ratio coalesced / ladder")
    for e in result.get("decode", []):
        print(f"{e['concurrency']:>7} {_fmt(get(e, 'ladder', 'median_tokens_per_s'), '.1f'):>8} "
              f"{_fmt(get(e, 'coalesced', 'median_tokens_per_s'), '.1f'):>8} "
              f"{_fmt(e.get('ratio'), '.3f'):>6}")
    profile = result.get("profile", {})
    if "error" in profile:
        print(f"\nprofile of a {profile['tokens']}-token prompt: {profile['error']}")
    for mode in MODES:
        if mode in profile:
            print_profile(profile[mode], f"{mode} engine, first step of a cold "
                          f"{profile['tokens']}-token prompt ({profile[mode]['step_tokens']} "
                          "tokens)")
    greedy, peak = result["greedy"], result["peak_bytes_in_use"]
    print(f"\n{len(result['buckets'])} buckets compiled ahead in "
          f"{result['setup_s']['precompile']:.0f} s; compiles {result['programs']}, "
          f"{result['compiles_during_timing']} while timing; peak device memory "
          + ("n/a" if peak is None else f"{peak / 2**30:.1f} GiB"))
    print(f"greedy tokens identical: {greedy['identical']} ({greedy['compared_tokens']} tokens "
          f"of {greedy['requests']} requests; max |logprob diff| "
          f"{greedy['max_abs_logprob_diff']:.2e})")
    for request_id, tie in greedy["near_ties"].items():
        print(f"  {request_id} differs at token {tie['position']}: each run's top minus the "
              f"other's choice {tie.get('gaps')} (coalesced, ladder), bound "
              f"{tie.get('bound', 0):.3f}; near tie: {tie['near_tie']}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill",
                                     description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="CPU smoke run: tiny preset, short prompts")
    add("--preset", help="model preset (glm5.3-flash)")
    add("--num-layers", type=int, help="layers kept (4)")
    add("--num-experts", type=int, help="routed experts kept (16)")
    add("--scan-layers", action="store_true",
        help="run the repeated layer groups as one scan (glmjax.layer_scan)")
    add("--lengths", help="cold prompt lengths, comma-separated (8192,16384,32768)")
    add("--unaligned", type=int, help="one more cold length, off the block grid (16228; 0: none)")
    add("--beside-lengths", help="cold lengths prefilled beside decoding requests")
    add("--decoders", type=int, help="requests decoding beside a cold prefill (3)")
    add("--decode-context", type=int, help="tokens of each decoding request (8192)")
    add("--concurrency", help="decoding requests of the decode cases (1,4)")
    add("--samples", type=int, help="timed samples per case and schedule (5)")
    add("--warmup", type=int, default=1, help="untimed samples first, per case")
    add("--decode-steps", type=int, help="steps per decode sample (16)")
    add("--budget", type=int, help="tokens per step (8192)")
    add("--block-size", type=int, help="P, tokens per KV block (512)")
    add("--tp", type=int, default=1, help="devices of a (tp // dcp, dcp) mesh (1: one device)")
    add("--dcp", type=int, default=1, choices=(1, 2, 4),
        help="decode-context-parallel ranks, dividing --tp (with --tp 1: emulated)")
    add("--single-bucket", action="store_true", default=None, help="pad to the largest bucket")
    add("--async-scheduling", action="store_true",
        help="schedule each step while the previous one runs (default off here: the dry run "
             "that lists the buckets to compile schedules one step at a time)")
    add("--compile-workers", type=int, help="threads compiling buckets ahead (4)")
    add("--profile", action=argparse.BooleanOptionalAction,
        help="trace one step per engine: time by op category, MFU (default: on a GPU, "
             "off with --quick)")
    add("--profile-length", type=int, help="prompt tokens of the traced step (--budget)")
    add("--trace-dir", type=Path, help="where the traces go (a new temp dir)")
    add("--dtype", choices=("preset", "float32"), default="preset",
        help="float32: activations, caches and weights in fp32 (with "
             "JAX_DEFAULT_MATMUL_PRECISION=highest), to tell rounding from logic when the "
             "schedules' greedy tokens part")
    add("--seed", type=int, default=0)
    add("--json", type=Path, help="output (bench/results/prefill_<preset>.json)")
    add_pin_temporaries(parser)
    add_batch_invariant(parser)
    compile_cache.add_arguments(parser)
    args = parser.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    mesh = f"_tp{args.tp}_dcp{args.dcp}" if args.tp > 1 else ""
    args.json = args.json or RESULTS / f"prefill_{args.preset}{mesh}.json"
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    pin_temporaries(args)  # as the server runs its steps
    batch_invariant(args)
    request_cpu_devices(args.tp)  # a mesh on a CPU: before JAX starts its backends
    compile_cache.enable_from_args(args)
    result = run_benchmark(args)
    print_table(result)
    print(f"wrote {result['args']['json']}")
    return result


if __name__ == "__main__":
    main()
