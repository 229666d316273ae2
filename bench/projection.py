"""Decode-shaped projections: the weight stream (`pallas_kernels.stream_matmul`) against
XLA's product, one launch per layer input against one per weight, and a tiling sweep.

    python -m bench.projection                  # kimi-linear-48b's shapes at 1, 16 and 64 rows
    python -m bench.projection --sweep          # also stream tilings at --sweep-rows rows
    python -m bench.projection --quick          # CPU smoke run: tiny preset, interpret mode

Shapes: every distinct (d_in, d_out) of the `Projection` modules a decode step runs (the
decoder's layers; the MTP heads left out), counted per step, from the preset's model
built abstractly; those whose widths the kernel does not tile (not multiples of 16) stay
on XLA in the model and are only listed (`not_streamed`). Per shape and row count, on
random bf16 operands:
- `stream`: `stream_matmul` with the device's tiling (`select_config`): what `Projection`
  runs on one GPU.
- `xla`: `jnp.dot(x, w)` in bf16, as `nnx.Linear` computes it: what XLA gives the same
  product (a multiply and a column reduction below 10M operand elements).
- with `--sweep`, at `--sweep-rows` rows: the stream at every tiling of the sweep grid
  that divides the shape and fits the device's shared memory.
Launches (`launches`): a KDA layer's six input projections and a shared expert's gate + up
as the model runs them (`project_together`: one launch) against one launch per weight.

Timing: each timed call is one jitted program compiled as a CUDA graph (`STEP_OPTIONS`, as
the decode step) that runs `products` products, each of its own input and its own weights
(XLA merges products that share an operand into one: a first version that cycled through
fewer weights timed XLA's merged product), as many as fit in `--weight-bytes` (1 GiB: far
beyond L2) within 8 and `--products` (64); a product's time is the program's over
`products`, the median of
`--samples` samples of `--iters` queued programs. (Timing one small product per jitted
call measures the host's dispatch, ~40 us, not the GPU.) Floor: the weight read once at
4.8 TB/s and at the copy bandwidth measured here; each row reports GB/s of weight
streamed. The summary estimates the projections' part of a decode step at each row count:
the per-step count of each shape times its time. The JSON (`--out`) is rewritten after
every shape.
"""

from __future__ import annotations

import argparse
import collections
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
from glmjax.xla_options import STEP_OPTIONS
from pallas_kernels.stream_matmul import (
    estimate_shared_memory,
    fewest_splits,
    padded_rows,
    select_config,
    stream_matmul,
)
from pallas_kernels.stream_matmul_pallas import StreamConfig, StreamTiling
from pallas_kernels.tuning import device_spec

RESULTS = Path(__file__).parent / "results"
H200_BANDWIDTH = 4.8e12
FULL = dict(preset="kimi-linear-48b", rows="1,16,64", iters=10, samples=5, products=64,
            weight_bytes=2**30)
QUICK = dict(preset="tiny", rows="1,4", iters=2, samples=2, products=2, weight_bytes=2**20)
# (block_n, block_k, programs per SM the splits aim at, warps, stages)
SWEEP = [(n, k, per_sm, 4, st) for n in (32, 64, 128) for k in (64, 128)
         for per_sm in (1, 2, 4) for st in (3, 4)]
# Launches of one input, as `project_together` runs them: name -> the weights' (d_in, d_out).
LAUNCHES = {"kda_in": lambda c: [(c.hidden_size, c.kda_num_heads * c.kda_head_dim)] * 3
            + [(c.hidden_size, c.kda_head_dim)] * 2 + [(c.hidden_size, c.kda_num_heads)],
            "shared_gate_up": lambda c: [(c.hidden_size, c.moe_intermediate_size
                                          * c.num_shared_experts)] * 2}


def decode_projections(config: ModelConfig) -> collections.Counter:
    """(d_in, d_out) -> how many `Projection` modules of that shape the decoder holds."""
    model = nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0)))
    counts = collections.Counter()
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Projection) and not any("mtp" in str(key) for key in path):
            counts[(node.in_features, node.out_features)] += 1
    return counts


def sweep_configs(rows: int, d_in: int, d_out: int) -> dict[str, StreamConfig]:
    """The sweep grid's tilings that divide the shape and fit the device's shared memory,
    by label."""
    spec = device_spec()
    configs = {}
    for block_n, block_k, per_sm, warps, stages in SWEEP:
        if d_in % block_k or d_out % block_n:
            continue
        splits = fewest_splits(d_in // block_k, d_out // block_n, per_sm * spec.num_sms,
                               d_in // block_k)
        tiling = StreamTiling(block_n=block_n, block_k=block_k, splits=splits)
        if estimate_shared_memory(tiling, padded_rows(rows), stages) > spec.smem_per_block:
            continue
        configs[f"n{block_n} k{block_k} s{splits} w{warps} st{stages}"] = StreamConfig(
            (tiling,), num_warps=warps, num_stages=stages)
    return configs


def label(config: StreamConfig) -> str:
    return " ".join(f"n{t.block_n} k{t.block_k} s{t.splits}" for t in config.tilings) + (
        f" w{config.num_warps} st{config.num_stages}")


def products_for(weight_bytes: int, args) -> int:
    """Products per timed program: their weights fill `--weight-bytes`, 8 to `--products`."""
    return int(np.clip(args.weight_bytes // weight_bytes, min(8, args.products), args.products))


def timed(product, xs, weight_sets, args) -> float:
    """ms per product: `product(x, weights)` for each input and its own weights, in one
    CUDA-graph program (module doc)."""
    program = jax.jit(lambda xs, sets: [product(x, ws) for x, ws in zip(xs, sets)],
                      compiler_options=STEP_OPTIONS)
    ms, _ = time_calls(lambda: program(xs, weight_sets), iters=args.iters,
                       samples=args.samples)
    return ms / len(xs)


def random_operands(seed: int, rows: int, shapes, count: int) -> tuple[list, list]:
    """`count` bf16 inputs [rows, d_in] and weight sets (one [d_in, d_out] per shape,
    scaled by 1 / sqrt(d_in)), drawn on the device."""
    keys = iter(jax.random.split(jax.random.key(seed), count * (len(shapes) + 1)))
    normal = jax.jit(jax.random.normal, static_argnums=(1, 2))
    xs = [normal(next(keys), (rows, shapes[0][0]), jnp.bfloat16) for _ in range(count)]
    sets = [tuple((normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])).astype(
        jnp.bfloat16) for shape in shapes) for _ in range(count)]
    return xs, sets


def run_shape(d_in: int, d_out: int, rows: int, args, bandwidth: float) -> dict:
    """Every implementation (and with --sweep every tiling) of one [rows, d_in] @ [d_in,
    d_out] product: ms, GB/s of weight, error against an fp32 NumPy product."""
    weight_bytes = d_in * d_out * 2
    xs, sets = random_operands(d_in * 7 + d_out + rows, rows, [(d_in, d_out)],
                               products_for(weight_bytes, args))
    x = xs[0]
    want = np.asarray(x, np.float32) @ np.asarray(sets[0][0], np.float32)

    def stream(config=None):  # interpret mode on the CPU (stream_matmul's default)
        return lambda x, ws: stream_matmul(x, ws, config=config)[0]

    products = {"stream": stream(), "xla": lambda x, ws: jnp.dot(x, ws[0])}
    if args.sweep and rows == args.sweep_rows and f"{d_in}x{d_out}" in args.sweep_shapes:
        products |= {f"stream {name}": stream(c)
                     for name, c in sweep_configs(rows, d_in, d_out).items()}
    out = dict(d_in=d_in, d_out=d_out, rows=rows, weight_bytes=weight_bytes, products=len(xs),
               stream_config=label(select_config(device_spec(), rows, [(d_in, d_out)])),
               floor_ms={"h200_4.8TBps": weight_bytes / H200_BANDWIDTH * 1e3,
                         "copy_bandwidth": weight_bytes / bandwidth * 1e3},
               ms={}, gb_per_s={}, relative_error={})
    for name, product in products.items():
        out["ms"][name] = ms = timed(product, xs, sets, args)
        out["gb_per_s"][name] = weight_bytes / (ms * 1e-3) / 1e9
        out["relative_error"][name] = relative_error(jax.jit(product)(x, sets[0]), want)
    stream_times = {k: v for k, v in out["ms"].items() if k.startswith("stream")}
    out["fastest_stream"] = min(stream_times, key=stream_times.get)
    return out


def run_launch(name: str, shapes: list, rows: int, args) -> dict:
    """One input's weights as one stream launch, as one launch per weight, and as XLA
    (widths the kernel does not tile left out, as the model leaves them to XLA)."""
    shapes = [(i, o) for i, o in shapes if i % 16 == 0 and o % 16 == 0]
    weight_bytes = sum(i * o * 2 for i, o in shapes)
    xs, sets = random_operands(rows, rows, shapes, products_for(weight_bytes, args))
    products = {
        "one_launch": lambda x, ws: stream_matmul(x, ws),
        "launch_per_weight": lambda x, ws: [stream_matmul(x, (w,))[0] for w in ws],
        "xla": lambda x, ws: [jnp.dot(x, w) for w in ws]}
    ms = {k: timed(p, xs, sets, args) for k, p in products.items()}
    return dict(launch=name, rows=rows, shapes=[f"{i}x{o}" for i, o in shapes],
                weight_bytes=weight_bytes, products=len(xs), ms=ms,
                gb_per_s={k: weight_bytes / (v * 1e-3) / 1e9 for k, v in ms.items()},
                floor_ms=weight_bytes / H200_BANDWIDTH * 1e3)


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
    add("--sweep-shapes", default="2304x4096,2304x128",
        help="the shapes swept, comma-separated d_inxd_out (2304x4096,2304x128)")
    add("--iters", type=int)
    add("--samples", type=int)
    add("--products", type=int, help="most products per timed program (64)")
    add("--weight-bytes", type=int, help="weight bytes per timed program (1 GiB)")
    add("--out", type=Path, help="output (bench/results/projection_<preset>.json)")
    args = parser.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    args.row_counts = positive_sizes(parser, "--rows", args.rows)
    args.sweep_shapes = set(args.sweep_shapes.split(","))
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
                   sweep_grid=[dict(zip(("block_n", "block_k", "programs_per_sm", "warps",
                                         "stages"), c)) for c in SWEEP],
                   results=[], launches=[])
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
    for name, shapes_of in LAUNCHES.items():
        for rows in args.row_counts:
            r = run_launch(name, shapes_of(config), rows, args)
            payload["launches"].append(r)
            write_json(payload, args.out)
            print(f"{name} at {rows} rows ({r['weight_bytes'] / 1e6:.1f} MB, floor "
                  f"{r['floor_ms'] * 1e3:.1f} us): " + ", ".join(
                      f"{k} {v * 1e3:.1f} us" for k, v in r["ms"].items()))
    for rows, row in payload["step_estimate_ms"].items():
        print(f"decoder projections at {rows} rows: stream {row['stream']:.3f} ms, xla "
              f"{row['xla']:.3f} ms, floor {row['floor']:.3f} ms")
    print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
