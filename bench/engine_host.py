"""Host time of the engine's batch-1 decode step, with the model's steps stubbed (no GPU).

    python -m bench.engine_host [--steps 300] [--repeats 3] [--out PATH]

A batch-1 decode step on the H200 is host-bound (docs/PERFORMANCE.md, "Decode through the
engine"). This times `Engine.step()` on the CPU with the model's prefill and decode
replaced by jitted stubs that take the same arguments and do no work (every parameter
and cache leaf kept, `keep_unused=True`; the caches donated and returned; zero logits),
so a step's wall time is the host's: scheduling, batch building and its validation, the
sampler's host tensors, each jitted call's dispatch with its real arguments, the step's
one fetch. The staging of the decode batch into its pinned buffers, the status copy, the
row gather and the sampler are the engine's own programs (over the model's vocabulary of
1,024 here, so they cost little). The model is kimi-linear-48b's
structure (27 layers: 563 parameter leaves, 47 cache leaves) at tiny widths; the engine
is configured as `bench.decode`'s (64 sequences, 512-token blocks, an 8K prompt).

Not measured: the model's device time, the GPU runtime's share of a call (the CUDA
graph's update and launch), transfers over PCIe. The phases are timers around the
engine's own methods, inclusive: `model call` is the stubbed pinned decode's dispatch
(since 2026-12-06 the batch's transfer is the staging program's, outside it), `batch`
the builder (packing and validation), `validation` its checks alone, `fetch` the one
blocking transfer and the draws, `schedule` and `update` the scheduler's two calls.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import git_commit, write_json
from glmjax.config import ModelConfig
from glmjax.model import DecodeOutput, HybridModel, PrefillOutput
from glmjax.sharding import single_device_steps
from serving.engine import Engine, EngineConfig
from serving.request import SamplingParams

RESULTS = Path(__file__).parent / "results"
PHASES = ("model call", "batch", "validation", "fetch", "schedule", "update")


def kimi_tree_config() -> ModelConfig:
    """kimi-linear-48b's layers and parameter tree at tiny widths (fp32)."""
    return dataclasses.replace(
        ModelConfig.preset("kimi-linear-48b"), name="kimi-tree-tiny", vocab_size=1024,
        hidden_size=256, kda_num_heads=4, kda_head_dim=64, mla_num_heads=4, kv_lora_rank=64,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=512,
        num_experts=8, num_experts_per_token=2, moe_intermediate_size=128,
        dtype=jnp.float32, param_dtype=jnp.float32)


def stub_steps(config: ModelConfig):
    """`single_device_steps` with prefill and decode as jitted stubs: same arguments (every
    leaf kept), caches donated and returned untouched, zero logits, status OK."""
    def decode(model_state, caches, batch, buffers=None):
        rows = batch.token_ids.shape[0]
        return DecodeOutput(jnp.zeros((rows, config.vocab_size), jnp.float32), caches,
                            jnp.int32(0))

    def prefill(model_state, caches, batch, return_logprobs=False):
        rows = batch.state_slots.shape[0]
        return PrefillOutput(jnp.zeros((rows, config.vocab_size), jnp.float32), caches,
                             jnp.int32(0), None)

    options = dict(donate_argnums=1, keep_unused=True)
    return single_device_steps(config)._replace(
        decode=jax.jit(decode, **options),
        decode_pinned=jax.jit(decode, **options | dict(donate_argnums=(1, 3))),
        prefill=jax.jit(prefill, static_argnames="return_logprobs", **options))


class PhaseTimer:
    """Seconds spent inside wrapped callables, by phase."""

    def __init__(self):
        self.seconds = collections.Counter()

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
        return timed


def timed_engine(config: ModelConfig, context: int, room: int) -> tuple[Engine, PhaseTimer]:
    """An engine on the stubbed steps, its phases wrapped, one request prefilled."""
    max_len = context + room
    block = config.kv_block_size
    engine_config = EngineConfig(max_model_len=max_len, block_size=block, budget=8192,
                                 max_num_seqs=64, prefix_caching=False,
                                 num_kv_blocks=64 * -(-max_len // block) + 8,
                                 num_state_slots=72)
    model = HybridModel(config, nnx.Rngs(0))
    engine = Engine(config, model, engine_config, steps=stub_steps(config))
    timer = PhaseTimer()
    engine.steps = engine.steps._replace(
        decode_pinned=timer.wrap("model call", engine.steps.decode_pinned))
    validator = engine.builder.validator
    for obj, name, phase in ((engine.builder, "build", "batch"),
                             (validator, "validate_decode", "validation"),
                             (validator, "validate_step", "validation"),
                             (engine, "fetch", "fetch"),
                             (engine.scheduler, "schedule", "schedule"),
                             (engine.scheduler, "update_from_step", "update")):
        setattr(obj, name, timer.wrap(phase, getattr(obj, name)))
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, context).tolist()
    engine.add_request("r0", prompt, SamplingParams(max_tokens=room, ignore_eos=True))
    while not engine.step():
        pass
    return engine, timer


def measure(engine: Engine, timer: PhaseTimer, steps: int, warmup: int) -> dict:
    """Median step and mean phase times (us) over `steps` decode steps after `warmup`."""
    for _ in range(warmup):
        engine.step()
    timer.seconds.clear()
    durations = []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        durations.append(time.perf_counter() - start)
        if len(outputs) != 1:
            raise RuntimeError(f"a decode step returned {len(outputs)} outputs, expected 1")
    return dict(step_us_median=statistics.median(durations) * 1e6,
                step_us_mean=statistics.fmean(durations) * 1e6,
                phases_us={p: timer.seconds[p] / steps * 1e6 for p in PHASES})


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_host",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps a repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=RESULTS / "engine_host_kimi_tree.json")
    args = parser.parse_args(argv)
    config = dataclasses.replace(kimi_tree_config(), kv_block_size=512)
    room = args.warmup + args.repeats * args.steps + 8
    engine, timer = timed_engine(config, args.context, room)
    runs = [measure(engine, timer, args.steps, args.warmup if i == 0 else 0)
            for i in range(args.repeats)]
    best = min(runs, key=lambda r: r["step_us_median"])
    params = jax.tree.leaves(engine.model_state)
    print(f"{len(params)} parameter leaves, {len(jax.tree.leaves(engine.caches))} cache "
          f"leaves; step us (median) by repeat: "
          + ", ".join(f"{r['step_us_median']:.0f}" for r in runs))
    for phase, us in best["phases_us"].items():
        print(f"  {phase:12} {us:8.1f} us a step")
    result = dict(device=jax.devices()[0].device_kind,
                  host=platform.processor() or platform.machine(), commit=git_commit(),
                  args={k: str(v) for k, v in vars(args).items()},
                  parameter_leaves=len(params), runs=runs, best=best)
    write_json(result, args.out)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
