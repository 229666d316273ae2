"""Sharding experiments: a preset on a (tp, dcp) mesh, checked against one device.

    python -m glmjax.shard --preset tiny --tp 4 --dcp 2 --tokens 2048
    python -m glmjax.shard --preset glm5.3-flash --num-layers 4 --num-experts 8 \\
        --tp 2 --dcp 2 --tokens 8192 --json bench/results/shard_tp2_dcp2_8192.json

One prompt of `--tokens` random tokens is prefilled in one step (run `--repeats` times) that
snapshots every KDA layer at the planner's checkpoints (up to 4, the prompt's end included),
then `--decode-steps` tokens are decoded. The same steps run on JAX's default device and on
the mesh, from the same seeded random weights (bf16 for the real presets, fp32 for `tiny`).
The tool prints the largest differences of the logits of every step, of every retained KDA
state (recurrent and conv, each slot) and of the MLA caches (the mesh's latents put back
in token order), the compile time (first call minus the median call) and median step time
of each run, and the bytes the fullest device holds of parameters and caches.

On a CPU the mesh needs host devices: the tool asks JAX for max(8, tp) of them before JAX
starts (an XLA_FLAGS=--xla_force_host_platform_device_count=N already set wins).

Over several processes (``--coordinator HOST:PORT --num-processes N --process-id I``, see
``glmjax.distributed``) every process runs the same workload on the mesh of all their
devices; process 0 alone runs the one-device reference and prints (the caches are
gathered from every process before they are compared).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from glmjax import distributed
from glmjax.batch import CHECKPOINT_CAPACITY, DecodeBatch, PrefillBatch
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.random_weights import random_model
from glmjax.sharding import (
    ModelSteps,
    ShardingPlan,
    device_bytes,
    host_copy,
    make_mesh,
    request_cpu_devices,
    single_device_steps,
)
from glmjax.state_pool import PoolStatus
from serving.plan import plan_prefill


class Workload(NamedTuple):
    """Host batches run in order (prefills, then decodes) on fresh caches."""

    prefills: list  # PrefillBatch of NumPy arrays
    decodes: list  # DecodeBatch of NumPy arrays
    num_state_slots: int
    num_kv_blocks: int
    retained: dict[int, int]  # state slot -> tokens of the prompt its state follows


class RunResult(NamedTuple):
    """What one run of a workload leaves, on the host."""

    prefill_logits: list[np.ndarray]  # per prefill step, fp32 [N, vocab]
    decode_logits: list[np.ndarray]  # per decode step, fp32 [N, vocab]
    caches: Caches  # of NumPy arrays, MLA latents in token order
    prefill_s: list[float]  # wall time of each prefill call (the first includes the compile)
    decode_s: list[float]
    bytes_per_device: dict[str, int]  # the fullest device's bytes of each kind


def prompt_workload(config: ModelConfig, prompt_len: int, decode_steps: int, *,
                    block_size: int, dcp: int, repeats: int = 1, seed: int = 0) -> Workload:
    """One cold prefill of `prompt_len` random tokens with the planner's checkpoints (and
    the prompt's end) snapshotted into slots 1.., `repeats` times, then `decode_steps`
    decode steps of random tokens. Running slot 0; blocks 0.. in order."""
    align = block_size * dcp
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size,
                                                  prompt_len + decode_steps, dtype=np.int32)
    (span,) = plan_prefill(prompt_len, 0, block_size=block_size, dcp=dcp,
                           budget=-(-prompt_len // align) * align)
    offsets = [*span.checkpoints, prompt_len][-CHECKPOINT_CAPACITY:]
    num_blocks = -(-(prompt_len + decode_steps) // align)
    table = np.arange(num_blocks, dtype=np.int32)[None]
    capacity = np.full((1, CHECKPOINT_CAPACITY), -1, np.int32)
    prefill = PrefillBatch(
        token_ids=tokens[:prompt_len], positions=np.arange(prompt_len, dtype=np.int32),
        cu_seqlens=np.array([0, prompt_len], np.int32), state_slots=np.zeros(1, np.int32),
        has_initial=np.zeros(1, bool),
        checkpoint_offsets=_fill(capacity, offsets),
        checkpoint_slots=_fill(capacity, range(1, 1 + len(offsets))),
        block_tables=table, prefix_lens=np.zeros(1, np.int32))
    decodes = [DecodeBatch(tokens[prompt_len + i: prompt_len + i + 1],
                           np.array([prompt_len + i], np.int32), np.zeros(1, np.int32), table)
               for i in range(decode_steps)]
    retained = {1 + c: p for c, p in enumerate(offsets)}
    retained[0] = prompt_len + decode_steps
    return Workload([prefill] * repeats, decodes, 1 + CHECKPOINT_CAPACITY, num_blocks, retained)


def _fill(row: np.ndarray, values) -> np.ndarray:
    out = row.copy()
    values = list(values)
    out[0, :len(values)] = values
    return out


def run_workload(steps: ModelSteps, model_state, workload: Workload, *,
                 progress=None) -> RunResult:
    """Runs `workload` with `steps` on fresh caches; `progress(kind, index, count, seconds)`
    is called after every step (the first of each kind includes its compile).

    Raises:
      RuntimeError: if the model refuses a step.
    """
    model_state = steps.place(model_state)
    caches = steps.init_caches(workload.num_state_slots, workload.num_kv_blocks)
    results = {"prefill": ([], []), "decode": ([], [])}
    for kind, batches, step in (("prefill", workload.prefills, steps.prefill),
                                ("decode", workload.decodes, steps.decode)):
        for index, batch in enumerate(batches):
            start = time.perf_counter()
            out = step(model_state, caches, batch)
            logits = np.asarray(out.logits)
            results[kind][1].append(time.perf_counter() - start)
            if progress is not None:
                progress(kind, index, len(batches), results[kind][1][-1])
            caches = out.caches
            if int(out.status) != PoolStatus.OK:
                raise RuntimeError(f"{kind} refused: {PoolStatus(int(out.status)).name}")
            results[kind][0].append(logits)

    def fullest(tree) -> int:
        return max(device_bytes(tree).values(), default=0)

    held = {
        "params": fullest(model_state[1]),
        "kda_pools": fullest(caches.kda),
        "mla_latent": fullest([c.latent for c in caches.mla]),
        "mla_index_keys": fullest([c.index_keys for c in caches.mla if c.index_keys is not None]),
    }
    host = host_copy(caches)
    block = host.mla[0].latent.shape[1] if host.mla else 0
    rows = np.asarray(steps.layout.block_rows(block)) if block else None
    host = host._replace(mla=tuple(c._replace(latent=c.latent[:, rows]) for c in host.mla))
    (prefill_logits, prefill_s), (decode_logits, decode_s) = results.values()
    return RunResult(prefill_logits, decode_logits, host, prefill_s, decode_s, held)


def max_difference(reference, other) -> dict[str, float]:
    """{"max_abs", "max_rel"}: the largest |other - reference| over a list of arrays, and it
    over the largest |reference|."""
    reference = [np.asarray(r, np.float64) for r in reference]
    other = [np.asarray(o, np.float64) for o in other]
    diff = max((float(np.max(np.abs(o - r), initial=0)) for r, o in zip(reference, other,
                                                                            strict=True)),
               default=0.0)
    scale = max((float(np.max(np.abs(r), initial=0)) for r in reference), default=0.0)
    return {"max_abs": diff, "max_rel": diff / scale if scale else diff}


def compare(reference: RunResult, other: RunResult, retained: dict[int, int]) -> dict:
    """Largest differences of `other` from `reference`, by kind; `retained` names the KDA
    state slots to compare (slot -> position)."""
    ref, new = reference.caches, other.caches
    by_slot = {
        str(slot): {
            "position": position,
            "recurrent": max_difference([p.recurrent[slot] for p in ref.kda],
                                        [p.recurrent[slot] for p in new.kda]),
            "conv": max_difference([p.conv[slot] for p in ref.kda], [p.conv[slot] for p in new.kda]),
        } for slot, position in sorted(retained.items())}
    slots = sorted(retained)
    return {
        "prefill_logits": max_difference(reference.prefill_logits, other.prefill_logits),
        "decode_logits": max_difference(reference.decode_logits, other.decode_logits),
        "kda_recurrent": max_difference([p.recurrent[slots] for p in ref.kda],
                                        [p.recurrent[slots] for p in new.kda]),
        "kda_conv": max_difference([p.conv[slots] for p in ref.kda],
                                   [p.conv[slots] for p in new.kda]),
        "mla_latent": max_difference([c.latent for c in ref.mla], [c.latent for c in new.mla]),
        "mla_index_keys": max_difference(
            [c.index_keys for c in ref.mla if c.index_keys is not None],
            [c.index_keys for c in new.mla if c.index_keys is not None]),
        "kda_states_by_slot": by_slot,
    }


def timings(run: RunResult) -> dict[str, float]:
    """Compile (first call minus the median of the rest) and median step, in s and ms."""
    def split(times):
        if not times:
            return 0.0, 0.0
        median = statistics.median(times[1:]) if len(times) > 1 else times[0]
        return max(times[0] - median, 0.0), median

    prefill_compile, prefill_median = split(run.prefill_s)
    decode_compile, decode_median = split(run.decode_s)
    return {"prefill_compile_s": prefill_compile, "prefill_median_ms": 1e3 * prefill_median,
            "decode_compile_s": decode_compile, "decode_median_ms": 1e3 * decode_median}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m glmjax.shard",
                                description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", help="glmjax.config.PRESETS")
    p.add_argument("--num-layers", type=int, help="reduced depth (KDA / MLA interleave kept)")
    p.add_argument("--num-experts", type=int, help="fewer routed experts")
    p.add_argument("--tp", type=int, required=True, help="devices of the mesh")
    p.add_argument("--dcp", type=int, default=1, help="decode-context-parallel ranks (1, 2, 4)")
    p.add_argument("--interleave", type=int, default=1, help="DCP interleave of the MLA cache")
    p.add_argument("--tokens", type=int, required=True, help="prompt length")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="prefill calls (median of the rest)")
    p.add_argument("--block-size", type=int, default=512, help="KV block per dcp rank, P")
    p.add_argument("--seed", type=int, default=0, help="weights and tokens")
    p.add_argument("--json", type=Path, help="also write the results here")
    distributed.add_arguments(p)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict | None:
    """The experiment `args` describe; returns the results (what `--json` writes), or None
    in a process other than process 0 of several."""
    mesh = make_mesh(args.tp, args.dcp)
    config = ModelConfig.preset(args.preset)
    if args.num_layers is not None or args.num_experts is not None:
        config = config.replace_depth(args.num_layers or config.num_layers, args.num_experts)
    config = dataclasses.replace(config, kv_block_size=args.block_size * args.dcp)
    plan = ShardingPlan(config, mesh, interleave=args.interleave)
    workload = prompt_workload(config, args.tokens, args.decode_steps, block_size=args.block_size,
                               dcp=args.dcp, repeats=args.repeats, seed=args.seed)
    model_state = nnx.split(random_model(config, args.seed))

    def progress_of(label):
        def report(kind, index, count, seconds):
            print(f"{label}: {kind} {index + 1}/{count} {seconds:.2f} s", file=sys.stderr,
                  flush=True)
        return report

    sharded = run_workload(plan.steps(), model_state, workload,
                           progress=progress_of(f"mesh tp={args.tp} dcp={args.dcp}"))
    if jax.process_index() != 0:
        return None
    single = run_workload(single_device_steps(config), model_state, workload,
                          progress=progress_of("one device"))
    return {
        "preset": config.name, "tp": args.tp, "dcp": args.dcp, "interleave": args.interleave,
        "tokens": args.tokens, "decode_steps": args.decode_steps, "block_size": args.block_size,
        "processes": jax.process_count(),
        "checkpoints": sorted(p for s, p in workload.retained.items() if s),
        "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__, "kda_backend": config.resolved_kda_backend(),
        "differences": compare(single, sharded, workload.retained),
        "timings": {"single_device": timings(single), "mesh": timings(sharded)},
        "bytes_per_device": {"single_device": single.bytes_per_device,
                             "mesh": sharded.bytes_per_device},
    }


def print_table(results: dict, out=sys.stdout) -> None:
    r = results
    print(f"{r['preset']} on {r['platform']} ({r['device_kind']}): tp={r['tp']} dcp={r['dcp']} "
          f"interleave={r['interleave']}, {r['tokens']} tokens, checkpoints {r['checkpoints']}, "
          f"{r['decode_steps']} decode steps, KDA {r['kda_backend']}", file=out)
    print(f"{'difference (mesh - one device)':32} {'max abs':>10} {'max rel':>10}", file=out)
    for kind, d in r["differences"].items():
        if kind != "kda_states_by_slot":
            print(f"{kind:32} {d['max_abs']:10.2e} {d['max_rel']:10.2e}", file=out)
    for slot, d in r["differences"]["kda_states_by_slot"].items():
        print(f"{'  slot ' + slot + ' @ ' + str(d['position']):32} "
              f"{max(d['recurrent']['max_abs'], d['conv']['max_abs']):10.2e} "
              f"{max(d['recurrent']['max_rel'], d['conv']['max_rel']):10.2e}", file=out)
    print(f"{'timing':32} {'one device':>12} {'mesh':>12}", file=out)
    for key in r["timings"]["single_device"]:
        print(f"{key:32} {r['timings']['single_device'][key]:12.2f} "
              f"{r['timings']['mesh'][key]:12.2f}", file=out)
    print(f"{'bytes on the fullest device':32} {'one device':>12} {'mesh':>12} {'ratio':>7}",
          file=out)
    for key, one in r["bytes_per_device"]["single_device"].items():
        mesh = r["bytes_per_device"]["mesh"][key]
        ratio = f"{one / mesh:7.2f}" if mesh else f"{'-':>7}"
        print(f"{key:32} {one:12d} {mesh:12d} {ratio}", file=out)


def main(argv=None) -> None:
    args = parse_args(argv)
    request_cpu_devices(max(8, args.tp))
    try:
        distributed.initialize(args, tp=args.tp, flags=vars(args))
        results = run(args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    if results is None:
        return
    print_table(results)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
