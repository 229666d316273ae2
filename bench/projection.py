"""Decode-shaped projections: the weight stream (`glmjax.layers.projection.stream_matmul`)
against XLA's product, and the tiling sweep that should pick `gmm_tuning.stream_config`.

    python -m bench.projection                  # kimi-linear-48b's shapes at 1, 16 and 64 rows
    python -m bench.projection --sweep          # also every stream tiling at 1 row
    python -m bench.projection --quick          # CPU smoke run: tiny preset, interpret mode

Shapes: every distinct (d_in, d_out) of the `Projection` modules a decode step runs (the
decoder's layers; the MTP heads left out), counted per step, from the preset's model
built abstractly; those whose widths the kernel does not tile (not multiples of 16) stay
on XLA in the model and are only listed (`not_streamed`). Per shape and row count, each a
jitted call on random bf16 operands:
- `stream`: the grouped GEMM with one group at the device's tiling
  (`select_gmm_config`, which takes `stream_config` for one group of few rows): what
  `Projection` runs on one GPU.
- `xla`: `jnp.dot(x, w)` in bf16, as `nnx.Linear` computes it: what XLA gives the same
  product (a multiply and a column reduction below 10M operand elements).
- with `--sweep`, at `--sweep-rows` rows: every tiling of the sweep grid that divides the
  shape and fits the device's shared memory.

Floor: the weight read once (d_in x d_out x 2 bytes) at 4.8 TB/s and at the copy bandwidth
measured here; each row reports GB/s of weight streamed. The summary estimates the
projections' part of a decode step at each row count: the per-step count of each shape
times its time. Timing as `bench.kda_kernel` (median of `--samples` samples of `--iters`
queued calls). The JSON (`--out`) is rewritten after every shape.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import fill_defaults, positive_sizes, relative_error, time_calls, write_json
from bench.kda_kernel import measure_copy_bandwidth
from glmjax.config import ModelConfig
from glmjax.layers.projection import Projection
from glmjax.model import HybridModel
from pallas_kernels.gmm import grouped_matmul
from pallas_kernels.gmm_tuning import GmmConfig, estimate_shared_memory, select_gmm_config
from pallas_kernels.tuning import device_spec

RESULTS = Path(__file__).parent / "results"
H200_BANDWIDTH = 4.8e12
FULL = dict(preset="kimi-linear-48b", rows="1,16,64", iters=20, samples=5)
QUICK = dict(preset="tiny", rows="1,4", iters=2, samples=2)
SWEEP = [GmmConfig(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s, swizzle=1)
         for m in (16, 64) for n in (16, 32, 64, 128) for k in (64, 128, 256)
         for w in (2, 4) for s in (3, 4)]


def decode_projections(config: ModelConfig) -> collections.Counter:
    """(d_in, d_out) -> how many `Projection` modules of that shape the decoder holds."""
    model = nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0)))
    counts = collections.Counter()
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Projection) and not any("mtp" in str(key) for key in path):
            counts[(node.in_features, node.out_features)] += 1
    return counts


def sweep_configs(d_in: int, d_out: int) -> list[GmmConfig]:
    """The sweep grid's tilings that divide the shape and fit the device's shared memory."""
    limit = device_spec().smem_per_block
    return [c for c in SWEEP
            if d_in % c.block_k == 0 and d_out % c.block_n == 0
            and estimate_shared_memory(c) <= limit]


def label(config: GmmConfig) -> str:
    return (f"m{config.block_m} n{config.block_n} k{config.block_k} w{config.num_warps} "
            f"s{config.num_stages}")


def run_shape(d_in: int, d_out: int, rows: int, args, bandwidth: float) -> dict:
    """Every implementation (and with --sweep every tiling) of one [rows, d_in] @ [d_in,
    d_out] product: ms, GB/s of weight, error against an fp32 NumPy product."""
    rng = np.random.default_rng(d_in * 7 + d_out + rows)
    x = jnp.asarray(rng.standard_normal((rows, d_in), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((d_in, d_out), np.float32) / np.sqrt(d_in),
                    jnp.bfloat16)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    sizes = jnp.full((1,), rows, jnp.int32)
    interpret = jax.default_backend() != "gpu"

    def stream(config=None):
        return jax.jit(lambda x, w: grouped_matmul(
            x, w[None], sizes, implementation="pallas", interpret=interpret, config=config))

    calls = {"stream": stream(), "xla": jax.jit(jnp.dot)}
    if args.sweep and rows == args.sweep_rows:
        calls |= {f"stream {label(c)}": stream(c) for c in sweep_configs(d_in, d_out)}
    weight_bytes = d_in * d_out * 2
    out = dict(d_in=d_in, d_out=d_out, rows=rows, weight_bytes=weight_bytes,
               stream_config=label(select_gmm_config(device_spec(), rows=rows, k=d_in,
                                                      n=d_out, num_groups=1)),
               floor_ms={"h200_4.8TBps": weight_bytes / H200_BANDWIDTH * 1e3,
                         "copy_bandwidth": weight_bytes / bandwidth * 1e3},
               ms={}, gb_per_s={}, relative_error={})
    for name, call in calls.items():
        ms, _ = time_calls(lambda call=call: call(x, w), iters=args.iters, samples=args.samples)
        out["ms"][name] = ms
        out["gb_per_s"][name] = weight_bytes / (ms * 1e-3) / 1e9
        out["relative_error"][name] = relative_error(call(x, w), want)
    timed = {k: v for k, v in out["ms"].items() if k.startswith("stream")}
    out["fastest_stream"] = min(timed, key=timed.get)
    return out


def step_estimate(results: list[dict], counts: collections.Counter) -> dict:
    """Per row count and implementation: ms of the decoder's projections in one step."""
    estimate = collections.defaultdict(dict)
    for r in results:
        count = counts[(r["d_in"], r["d_out"])]
        for name in ("stream", "xla", "floor"):
            ms = r["floor_ms"]["h200_4.8TBps"] if name == "floor" else r["ms"][name]
            estimate[str(r["rows"])][name] = estimate[str(r["rows"])].get(name, 0.0) + count * ms
    return dict(estimate)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.projection",
                                     description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="CPU smoke run: tiny preset, interpret mode")
    add("--preset", help="model preset whose decoder's projections are timed (kimi-linear-48b)")
    add("--rows", help="decode rows per product, comma-separated (1,16,64)")
    add("--sweep", action="store_true", help="also every stream tiling of the sweep grid")
    add("--sweep-rows", type=int, default=1, help="the row count the sweep runs at (1)")
    add("--iters", type=int)
    add("--samples", type=int)
    add("--out", type=Path, help="output (bench/results/projection_<preset>.json)")
    args = parser.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    args.row_counts = positive_sizes(parser, "--rows", args.rows)
    args.out = args.out or RESULTS / f"projection_{args.preset}.json"
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = ModelConfig.preset(args.preset)
    counts = decode_projections(config)
    bandwidth = measure_copy_bandwidth() if jax.default_backend() == "gpu" else H200_BANDWIDTH
    payload = dict(device=jax.devices()[0].device_kind, platform=platform.platform(),
                   jax=jax.__version__, args={k: str(v) for k, v in vars(args).items()},
                   preset=config.name, copy_bandwidth_bytes_per_s=bandwidth,
                   shapes_per_step={f"{i}x{o}": n for (i, o), n in counts.items()},
                   sweep_grid=[dataclasses.asdict(c) for c in SWEEP], results=[])
    print(f"{config.name}: {sum(counts.values())} projections a decode step, "
          f"{len(counts)} shapes; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'shape':>12} {'rows':>4} {'floor us':>8} {'stream us':>9} {'GB/s':>6} "
          f"{'xla us':>7} {'GB/s':>6}  fastest stream tiling")
    streamed = sorted(s for s in counts if s[0] % 16 == 0 and s[1] % 16 == 0)
    payload["not_streamed"] = [f"{i}x{o}" for i, o in sorted(set(counts) - set(streamed))]
    for d_in, d_out in streamed:
        for rows in args.row_counts:
            r = run_shape(d_in, d_out, rows, args, bandwidth)
            payload["results"].append(r)
            payload["step_estimate_ms"] = step_estimate(payload["results"], counts)
            write_json(payload, args.out)
            best = r["fastest_stream"]
            print(f"{d_in:>5}x{d_out:<6} {rows:>4} {r['floor_ms']['h200_4.8TBps'] * 1e3:>8.1f} "
                  f"{r['ms']['stream'] * 1e3:>9.1f} {r['gb_per_s']['stream']:>6.0f} "
                  f"{r['ms']['xla'] * 1e3:>7.1f} {r['gb_per_s']['xla']:>6.0f}  {best} "
                  f"{r['ms'][best] * 1e3:.1f} us")
    for rows, row in payload["step_estimate_ms"].items():
        print(f"decoder projections at {rows} rows: stream {row['stream']:.3f} ms, xla "
              f"{row['xla']:.3f} ms, floor {row['floor']:.3f} ms")
    print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
