"""Decode through the serving engine against its memory floor.

    python -m bench.decode --quick                                     # CPU smoke run
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m bench.decode         # H200

Model: `--preset` (kimi-linear-48b) whole (27 layers, 256 experts; `--num-layers` and
`--num-experts` cut it), seeded random bf16 weights drawn on the device
(`glmjax.random_weights.random_model`), on one device.

Each case is a batch B of `--batches` (1, 16, 64): B requests with fresh random prompts of
`--context` tokens (8192) are added one by one, as users send them, each with
`--decode-room` tokens to generate (no request finishes while timed), and the engine steps
until every one has its first token (prefill steps, decodes of the earlier ones beside).
Then `--warmup` decode steps, untimed, and `--steps` decode steps back to back, each timed
on its own (`Engine.step()` ends with a blocking device-to-host fetch; with asynchronous
scheduling the host builds step n + 1 while the device runs step n, so a step's time is
the longer of the two). Every timed step must generate exactly B tokens. Reported per
case: the median step time, the mean (the timed steps' wall time over their count),
tokens/s = B / mean, the engine thread's wait for the device per step (its
`device_wait_seconds`) and the host's share, the mean step less that wait (a wait near
zero: the host sets the pace), and the memory floor of each timed step (`bench.decode_floor`: the weights,
the routed experts B rows touch, the KDA states read and written, the MLA latents read over
each row's actual context, at 4.8 TB/s), with the ratio step / floor. The requests are
then aborted. Prefix caching is off (`--prefix-caching` turns it on): the prompts are
distinct and the decode steps are the same either way.

Compiles: a dry run of the same requests through the scheduler and batch builder lists
every batch shape the run uses; they compile ahead (`--compile-workers` threads) while the
weights are drawn (`bench.buckets`), and `compiles_during_timing` counts any compile in a
timed step (the sampler and copies compile in the untimed steps).

Profile (`--profile`, the default on a GPU without `--quick`): after the cases, one more
decode step at `--profile-batch` (the largest by default) traced with `jax.profiler`
(`bench.profile`: device time by op category). Writes JSON to
bench/results/decode_<preset>.json (`--json`) after every case.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax
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
    positive_sizes,
    write_json,
)
from bench.decode_floor import decode_sizes, decode_step_bytes, floor_seconds
from bench.prefill import RESULTS, model_config
from bench.prefill_cases import Session
from bench.profile import (
    kernel_events,
    load_trace,
    print_profile,
    profile_call,
    record_trace,
    summarize,
    traceable,
)
from glmjax import compile_cache
from glmjax.model import HybridModel, decode_into, decode_step
from glmjax.random_weights import random_model
from glmjax.sharding import ModelSteps, single_device_steps
from serving.compiles import CompileLog
from serving.engine import Engine, EngineConfig

ENGINE_STEPS = 4  # steps of the engine's own programs traced after the twin step
FULL = dict(preset="kimi-linear-48b", num_layers=None, num_experts=None, context=8192,
            batches="1,16,64", block_size=512, budget=8192, decode_room=512, steps=16,
            warmup=2, compile_workers=8)  # fmt: skip
QUICK = dict(preset="tiny", num_layers=None, num_experts=None, context=96, batches="1,3",
             block_size=32, budget=128, decode_room=16, steps=3, warmup=1,
             compile_workers=2)  # fmt: skip


def engine_config(args) -> EngineConfig:
    """Room for the largest batch at `--context` + `--decode-room` tokens each."""
    largest = max(args.batch_sizes)
    max_len = args.context + args.decode_room
    return EngineConfig(
        max_model_len=max_len, block_size=args.block_size, budget=args.budget,
        prefix_caching=args.prefix_caching, max_num_seqs=largest,
        num_kv_blocks=largest * -(-max_len // args.block_size) + 8,
        num_state_slots=largest + 8,
    )  # fmt: skip


class Case:
    """One batch of requests decoding together in a session (an engine or a dry run)."""

    def __init__(self, session: Session, args, batch: int, rng: np.random.Generator,
                 vocab_size: int, name: str = "b"):
        self.session, self.ids = session, [f"{name}{batch}-{k}" for k in range(batch)]
        self.prompts = {r: rng.integers(0, vocab_size, args.context).tolist() for r in self.ids}
        for request_id, prompt in self.prompts.items():
            session.add(request_id, prompt, args.decode_room)

    def contexts(self) -> list[int]:
        """Positions each row attends over in the next decode step (its new one included)."""
        outputs = self.session.outputs
        return [len(self.prompts[r]) + len(outputs[r].output_token_ids) for r in self.ids]

    def step(self) -> float:
        """One decode step of the whole batch; its seconds.

        Raises:
          RuntimeError: the step did not generate one token for every request.
        """
        before = self.session.generated(self.ids)
        start = time.perf_counter()
        self.session.step()
        seconds = time.perf_counter() - start
        if (made := self.session.generated(self.ids) - before) != len(self.ids):
            raise RuntimeError(f"a decode step of {len(self.ids)} requests made {made} "
                               "tokens (raise --decode-room?)")
        return seconds

    def close(self) -> None:
        for request_id in self.ids:
            self.session.engine.abort(request_id)
        self.session.step()
        for request_id in self.ids:
            del self.session.outputs[request_id]


def run_case(session: Session, args, batch: int, rng, config, sizes, compile_log) -> dict:
    case = Case(session, args, batch, rng, config.vocab_size)
    for _ in range(args.warmup):
        case.step()
    # Each step adds one position to every row: the floors are known before timing, so the
    # timed steps run back to back (host work between them would let the device drain and
    # break the overlap of one step's host work with the previous step's device work).
    contexts = case.contexts()
    floors = [decode_step_bytes(config, sizes, [c + i for c in contexts])
              for i in range(args.steps)]
    compiles = compile_log.count
    waited = session.device_wait_seconds()
    start = time.perf_counter()
    times = [case.step() for _ in range(args.steps)]
    wall_s = time.perf_counter() - start
    waited = session.device_wait_seconds() - waited
    compiles = compile_log.count - compiles
    device = device_time(case, args) if args.device_time else {}
    case.close()
    step_s = statistics.median(times)
    floor = {key: statistics.median(f[key] for f in floors) for key in floors[0]}
    floor_s = floor_seconds(floor["total"])
    return dict(batch=batch, context=args.context, step_s=times, median_step_s=step_s,
                mean_step_s=wall_s / args.steps, tokens_per_s=batch * args.steps / wall_s,
                device_wait_ms_per_step=waited / args.steps * 1e3,
                host_ms_per_step=(wall_s - waited) / args.steps * 1e3,
                floor_bytes=floor, floor_s=floor_s,
                floor_tokens_per_s=batch / floor_s, step_over_floor=step_s / floor_s,
                compiles_during_timing=compiles, **device)


def device_time(case: Case, args) -> dict:
    """The device's busy time per step over `ENGINE_STEPS` more steps of the engine's own
    programs, traced: unlike the wall time, it does not move with the host's speed, which
    sets a batch-1 step and varies ~3x between lent machines."""
    trace_dir = Path(tempfile.mkdtemp(prefix="decode_device_", dir=args.trace_dir))
    _, _, own = trace_engine_steps(case, trace_dir)
    return dict(device_ms_per_step=own["busy_ms"] / ENGINE_STEPS,
                traced_span_ms_per_step=own["span_ms"] / ENGINE_STEPS)


def trace_engine_steps(case: Case, trace_dir: Path):
    """`ENGINE_STEPS` steps of the engine's own programs (its CUDA graphs) under the
    profiler: the trace's path, its device ops and their summary (`bench.profile`)."""
    path = record_trace(lambda: ([case.step() for _ in range(ENGINE_STEPS)],
                                 case.session.engine.caches)[1], trace_dir)
    events = kernel_events(load_trace(path))
    return path, events, summarize(events)


def dry_run_buckets(args, buckets, config) -> dict:
    """Every case through the scheduler and batch builder alone: a batch per bucket."""
    dry = DryRun(engine_config(args), buckets)
    session, rng = Session(dry, {}), np.random.default_rng(args.seed)
    for batch in args.batch_sizes:
        case = Case(session, args, batch, rng, config.vocab_size)
        for _ in range(args.warmup + args.steps):
            case.step()
        case.close()
    return dry.batches


def profile_step(session: Session, args, batch: int, rng, config, device_kind, step_s):
    """One decode step of `batch` fresh requests traced, once they all decode: a twin of the
    decode step whose kernels keep their op names, compiled in an untraced step first.
    Then `ENGINE_STEPS` steps of the engine's own programs (CUDA graphs) traced under
    ``engine_programs``: their device busy time against their span says how much of a step
    the device waits for the host."""
    engine, timed = session.engine, session.engine.steps
    case = Case(session, args, batch, rng, config.vocab_size, name="profile")
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="decode_trace_"))
    try:
        engine.steps = timed._replace(
            decode=traceable(decode_step, donate_argnums=1),
            decode_pinned=timed.decode_pinned and traceable(decode_into, donate_argnums=(1, 3),
                                                            keep_unused=True))
        case.step()
        summary = profile_call(lambda: (case.step(), engine.caches)[1], trace_dir / "twin",
                               flops=None, device_kind=device_kind, step_s=step_s)
        engine.steps = timed
        case.step()
        path, events, own = trace_engine_steps(case, trace_dir / "engine")
        modules = collections.Counter()
        for e in events:
            modules[e.hlo_module or "(unnamed)"] += e.duration_us / 1e3 / ENGINE_STEPS
        own = dict(steps=ENGINE_STEPS, trace=str(path), kernels=own["kernels"],
                   busy_ms_per_step=own["busy_ms"] / ENGINE_STEPS,
                   span_ms_per_step=own["span_ms"] / ENGINE_STEPS,
                   by_module_ms_per_step=dict(modules.most_common()))
        return summary | {"batch": batch, "engine_programs": own}
    finally:
        engine.steps = timed
        case.close()


def run_benchmark(args) -> dict:
    start = time.perf_counter()
    on_gpu = not args.quick and jax.default_backend() == "gpu"
    if args.profile is None:
        args.profile = on_gpu
    if args.device_time is None:
        args.device_time = on_gpu
    if args.trace_dir:  # the device-time traces go in folders made inside it
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    config = model_config(args)
    sizes = decode_sizes(config)
    abstract = nnx.split(nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0))))
    result = dict(
        device=jax.devices()[0].device_kind, platform=platform.platform(), jax=jax.__version__,
        commit=git_commit(), args=vars(args), xla_flags=os.environ.get("XLA_FLAGS", ""),
        complete=False,
        model=dict(name=config.name, num_layers=config.num_layers,
                   num_experts=config.num_experts,
                   experts_per_token=config.num_experts_per_token,
                   kda_backend=config.resolved_kda_backend()),
        floor_sizes=sizes._asdict(), engine=dataclasses.asdict(engine_config(args)),
    )  # fmt: skip
    log(f"{config.name}: drawing the weights while compiling")
    with CompileLog() as compile_log, concurrent.futures.ThreadPoolExecutor(1) as host:
        weights = host.submit(lambda: (random_model(config, args.seed), time.perf_counter()))
        steps = model_steps(config, args.unpinned)
        probe = Engine(config, abstract, engine_config(args), steps=steps)
        batches = dry_run_buckets(args, probe.builder.buckets, config)
        log(f"dry run: {len(batches)} buckets {sorted(batches)}")
        mark = time.perf_counter()
        result["buckets"] = precompile(step_functions(probe), batches, probe.model_state,
                                       probe.caches, args.compile_workers)
        result["setup_s"] = {"precompile": time.perf_counter() - mark}
        del probe
        model, drawn = weights.result()
        result["setup_s"]["weights_ready"] = drawn - start
        engine = Engine(config, nnx.split(model), engine_config(args), steps=steps)
        del model
        session, rng = Session(engine, {}), np.random.default_rng(args.seed + 1)
        for batch in args.batch_sizes:
            log(f"batch {batch}: {batch} prompts of {args.context} tokens, then decode")
            entry = run_case(session, args, batch, rng, config, sizes, compile_log)
            log(f"batch {batch}: step {entry['median_step_s'] * 1e3:.2f} ms, "
                f"{entry['tokens_per_s']:.1f} tokens/s, floor {entry['floor_s'] * 1e3:.2f} ms "
                f"(x{entry['step_over_floor']:.2f})")
            result.setdefault("cases", []).append(entry)
            _update_totals(result, compile_log, start)
            write_json(result, args.json)
        if args.profile:
            traced = next(c for c in result["cases"] if c["batch"] == args.profile_batch)
            result["profile"] = profile_step(session, args, traced["batch"], rng, config,
                                             result["device"], traced["median_step_s"])
        _update_totals(result, compile_log, start)
    result["complete"] = True
    write_json(result, args.json)
    return result


def _update_totals(result: dict, compile_log: CompileLog, start: float) -> None:
    stats = jax.devices()[0].memory_stats() or {}
    result.update(compiles=compile_log.by_function(),
                  compiles_during_timing=sum(c["compiles_during_timing"]
                                             for c in result.get("cases", [])),
                  peak_bytes_in_use=stats.get("peak_bytes_in_use"),
                  bytes_limit=stats.get("bytes_limit"), wall_s=time.perf_counter() - start)


def print_table(result: dict) -> None:
    print(f"\ndecode at {result['args']['context']} tokens of context, {result['model']['name']}"
          f" on {result['device']} (floor: bytes a step must move at 4.8 TB/s)")
    print(f"{'batch':>5} {'step ms':>9} {'mean ms':>8} {'host ms':>8} {'wait ms':>8} "
          f"{'device ms':>9} {'tokens/s':>9} {'floor ms':>9} {'x floor':>8} {'floor GB':>9} "
          f"{'weights':>8} {'experts':>8} {'states':>7} {'kv':>6}")
    for e in result.get("cases", []):
        gb = {k: v / 1e9 for k, v in e["floor_bytes"].items()}
        device = e.get("device_ms_per_step")
        print(f"{e['batch']:>5} {e['median_step_s'] * 1e3:>9.2f} {e['mean_step_s'] * 1e3:>8.2f} "
              f"{e['host_ms_per_step']:>8.2f} {e['device_wait_ms_per_step']:>8.2f} "
              f"{'-' if device is None else f'{device:.2f}':>9} {e['tokens_per_s']:>9.1f} "
              f"{e['floor_s'] * 1e3:>9.3f} {e['step_over_floor']:>8.2f} {gb['total']:>9.2f} "
              f"{gb['weights']:>8.2f} {gb['experts']:>8.2f} {gb['states']:>7.2f} "
              f"{gb['kv']:>6.2f}")
    if "profile" in result:
        print_profile(result["profile"], f"one decode step of {result['profile']['batch']} rows")
        own = result["profile"]["engine_programs"]
        print(f"engine's own programs, {own['steps']} steps: device busy "
              f"{own['busy_ms_per_step']:.2f} ms of a {own['span_ms_per_step']:.2f} ms span "
              "per step; " + ", ".join(f"{m} {ms:.2f}"
                                       for m, ms in own["by_module_ms_per_step"].items()))
    peak = result["peak_bytes_in_use"]
    print(f"\n{len(result['buckets'])} buckets compiled ahead in "
          f"{result['setup_s']['precompile']:.0f} s; {result['compiles_during_timing']} "
          "compiles while timing; peak device memory "
          + ("n/a" if peak is None else f"{peak / 2**30:.1f} GiB"))


def model_steps(config, unpinned: bool) -> ModelSteps | None:
    """With ``unpinned``, the engine's one-device steps without pinned decode buffers (each
    step's batch, logits and status in new buffers, `serving.pinned`); else None, the
    engine's own."""
    return single_device_steps(config)._replace(decode_pinned=None) if unpinned else None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.decode",
                                     description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="CPU smoke run: tiny preset, short prompts")
    add("--preset", help="model preset (kimi-linear-48b)")
    add("--num-layers", type=int, help="layers kept (all)")
    add("--num-experts", type=int, help="routed experts kept (all)")
    add("--scan-layers", action="store_true",
        help="prefill the repeated layer groups as one scan (glmjax.layer_scan)")
    add("--context", type=int, help="prompt tokens of every request (8192)")
    add("--batches", help="requests decoding together, comma-separated (1,16,64)")
    add("--decode-room", type=int, help="max_tokens of every request (512)")
    add("--steps", type=int, help="timed decode steps per batch (16)")
    add("--warmup", type=int, help="untimed decode steps first (2)")
    add("--budget", type=int, help="tokens per step (8192)")
    add("--block-size", type=int, help="P, tokens per KV block (512)")
    add("--prefix-caching", action="store_true", help="turn the prefix cache on")
    add("--compile-workers", type=int, help="threads compiling buckets ahead (8)")
    add("--profile", action=argparse.BooleanOptionalAction,
        help="trace one decode step (default: on a GPU, off with --quick)")
    add("--device-time", action=argparse.BooleanOptionalAction,
        help=f"trace {ENGINE_STEPS} more steps of every batch for the device's busy ms a "
             "step (default: on a GPU, off with --quick)")
    add("--profile-batch", type=int, help="the batch traced (the largest of --batches)")
    add("--trace-dir", type=Path, help="where the trace goes (a new temp dir)")
    add("--unpinned", action="store_true",
        help="decode without the pinned buffers (serving.pinned): the batch, logits and "
             "status of each step in new buffers, as before 2026-12-06, to time what pinning "
             "saves")
    add("--seed", type=int, default=0)
    add("--json", type=Path, help="output (bench/results/decode_<preset>.json)")
    add_pin_temporaries(parser)
    add_batch_invariant(parser)
    compile_cache.add_arguments(parser)
    args = parser.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    args.batch_sizes = positive_sizes(parser, "--batches", args.batches)
    args.profile_batch = args.profile_batch or args.batch_sizes[-1]
    if args.profile_batch not in args.batch_sizes:
        parser.error(f"--profile-batch {args.profile_batch}: not one of --batches {args.batches}")
    args.dcp = 1  # one device (bench.prefill.model_config reads it)
    args.dtype = "preset"  # the preset's bf16 (read there too)
    args.json = args.json or RESULTS / f"decode_{args.preset}.json"
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    pin_temporaries(args)  # as the server runs its steps
    batch_invariant(args)
    compile_cache.enable_from_args(args)
    result = run_benchmark(args)
    print_table(result)
    print(f"wrote {result['args']['json']}")
    return result


if __name__ == "__main__":
    main()
