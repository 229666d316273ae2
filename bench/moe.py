"""Routed-expert benchmark: every grouped-GEMM implementation beside a dense matmul and the
memory floor, at both presets' real shapes (`pallas_kernels.moe_shapes`).

    python -m bench.moe                        # 512, 2048, 8192 tokens, both presets
    python -m bench.moe --tokens 8192 --out bench/results/moe_8k.json
    python -m bench.moe --quick                # CPU smoke run: tiny shapes, interpret mode
    python -m bench.moe --tokens 8192 --sweep 40   # also 40 other tilings of our kernel
    python -m bench.moe --tokens 8192 --parts moe --sweep-fused   # the model's two launches
    python -m bench.moe --tokens 8192 --parts moe --sweep-fused 0 # ... the pick, whole tiles

Two parts per (preset, tokens):
  gemm:   one gate-shaped grouped GEMM, sorted rows [T * k, D] x [E, D, I] (the unit of the
          issue's bar) for ragged_dot, tokamax (when it imports), ours; "dense" is one
          [T * k, D] x [D, I] matmul (the same useful work);
  moe:    the whole routed-expert computation (sort, gate, up, SwiGLU, down, combine) for
          ragged_dot, tokamax, ours plain and with each fusion alone and all together;
          "dense" is the same three matmuls against one expert's weights.
Memory floor: every expert's weights read once at 4.8 TB/s (H200) and 273 GB/s (GB10).
TFLOP/s counts useful FLOPs only (the chosen experts: 2 * T * k * D * I per GEMM); a
Pallas row's `mma_rows_per_row` is the rows its tiles run per useful row (first routing).

Timing: warm-up, then the median of `--samples` samples of `--iters` queued calls, cycling
through `--rotate` input sets (random x and routing; the weights are one random set: at
288 experts they are 14.5 GB). Every implementation's output is checked against a chunked
`jax.lax.ragged_dot` reference (relative Frobenius error). The JSON at --out is rewritten
after every case, so a timeout still leaves the finished ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.common import write_json
from pallas_kernels import gmm_tokamax, moe_experts
from pallas_kernels.gmm import grouped_matmul, grouped_matmul_reference
from pallas_kernels.gmm_pallas import Epilogue, gmm_pallas, issued_rows
from pallas_kernels.gmm_tuning import GmmConfig, estimate_shared_memory, select_gmm_config
from pallas_kernels.moe_shapes import MOE_SHAPES, TOKEN_COUNTS, MoEShape
from pallas_kernels.tuning import device_spec

RESULTS = Path(__file__).parent / "results"
BANDWIDTHS = {"h200": 4.8e12, "gb10": 273e9}  # bytes/s: the floors' assumed bandwidths
QUICK_SHAPE = MoEShape("quick", hidden=64, inter=32, experts=16, top_k=4, swiglu_limit=10.0)
REFERENCE_CHUNK = 4096  # rows per ragged_dot call of the reference (its [rows, E * K] fits)
PALLAS_FUSIONS = {
    "pallas-plain": (),
    "pallas-gather": ("gather",),
    "pallas-swiglu": ("swiglu",),
    "pallas-gather-swiglu": ("gather", "swiglu"),
    "pallas-fused": moe_experts.FUSIONS,
}


def time_calls(call, inputs, *, iters, samples):
    """Median ms per call over `samples` batches of `iters` queued calls, inputs rotated."""
    for args in inputs:  # warm-up: compiles, and a first call's one-time retrace
        jax.block_until_ready(call(*args))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for i in range(iters):
            out = call(*inputs[i % len(inputs)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(times)


def chunked_reference(lhs, rhs, group_sizes, chunk=REFERENCE_CHUNK):
    """jax.lax.ragged_dot over row chunks: XLA expands each call to [rows, E * K], which
    at the real expert counts only fits a few thousand rows at a time."""
    ends = jnp.cumsum(group_sizes)
    outs = []
    for start in range(0, lhs.shape[0], chunk):
        stop = min(start + chunk, lhs.shape[0])
        local_ends = jnp.clip(ends - start, 0, stop - start)
        sizes = jnp.diff(local_ends, prepend=0).astype(jnp.int32)
        outs.append(grouped_matmul_reference(lhs[start:stop], rhs, sizes))
    return jnp.concatenate(outs)


def reference_moe(x, weights, experts, w_gate, w_up, w_down, limit):
    order, sizes = moe_experts.sort_by_expert(experts, w_gate.shape[0])
    xs = x[order // experts.shape[1]]
    h = moe_experts.swiglu(chunked_reference(xs, w_gate, sizes),
                           chunked_reference(xs, w_up, sizes), limit)
    ys = chunked_reference(h, w_down, sizes)
    ys = jnp.zeros_like(ys).at[order].set(ys).reshape(*experts.shape, -1)
    return jnp.einsum("tk,tkd->td", weights, ys.astype(jnp.float32)).astype(x.dtype)


def relative_error(actual, expected) -> float:
    actual, expected = jnp.asarray(actual, jnp.float32), jnp.asarray(expected, jnp.float32)
    return float(jnp.linalg.norm(actual - expected) / jnp.maximum(jnp.linalg.norm(expected),
                                                                   1e-30))


def make_weights(shape: MoEShape, key):
    k1, k2, k3 = jax.random.split(key, 3)
    up = (shape.experts, shape.hidden, shape.inter)
    normal = lambda k, s, fan_in: (jax.random.normal(k, s, jnp.bfloat16)  # noqa: E731
                                   * fan_in ** -0.5).astype(jnp.bfloat16)
    return (normal(k1, up, shape.hidden), normal(k2, up, shape.hidden),
            normal(k3, (shape.experts, shape.inter, shape.hidden), shape.inter))


def make_routing(shape: MoEShape, tokens: int, key):
    """x bf16 [T, D], combine weights fp32 [T, k], distinct random experts int32 [T, k]."""
    kx, kr, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (tokens, shape.hidden), jnp.bfloat16)
    _, experts = jax.lax.top_k(jax.random.uniform(kr, (tokens, shape.experts)), shape.top_k)
    weights = jax.random.uniform(kw, (tokens, shape.top_k), jnp.float32)
    return x, weights / weights.sum(-1, keepdims=True), experts.astype(jnp.int32)


def implementations(quick: bool) -> list[str]:
    names = ["ragged_dot"]
    if not quick and gmm_tokamax.supported():
        names.append("tokamax")
    return names + ["pallas"]


def run_case(shape: MoEShape, tokens: int, args, record):
    """Time and check both parts of one (preset, tokens) case; `record(row)` stores a row."""
    timing = dict(iters=args.iters, samples=args.samples)
    expert_weights = make_weights(shape, jax.random.key(0))
    routings = [make_routing(shape, tokens, jax.random.key(1 + i)) for i in range(args.rotate)]
    base = dict(preset=shape.preset, tokens=tokens, experts=shape.experts)

    def measure(part, impl, call, inputs, expected, flops, floor_bytes, **extra):
        row = dict(base, part=part, impl=impl, useful_tflop=flops / 1e12, **extra)
        row.update({f"floor_ms_{name}": floor_bytes / bw * 1e3 for name, bw in BANDWIDTHS.items()})
        try:
            ms = time_calls(call, inputs, **timing)
            row.update(ms=ms, tflops=flops / ms / 1e9)
            if expected is not None:
                row["rel_error"] = relative_error(call(*inputs[0]), expected)
        except Exception as error:  # noqa: BLE001 - OOM and compile failures are results
            text = str(error)
            row["error"] = ("oom" if "RESOURCE_EXHAUSTED" in text or "out of memory" in text
                            else f"{type(error).__name__}: {text[:300]}")
        record(row)

    if "gemm" in args.parts:
        run_gemm_part(shape, tokens, args, expert_weights, routings, measure)
    if args.sweep_fused is not None:
        run_fused_sweep(shape, tokens, expert_weights, routings, measure, args.sweep_fused)
    if "moe" in args.parts:
        run_moe_part(shape, tokens, args, expert_weights, routings, measure)


def run_gemm_part(shape: MoEShape, tokens: int, args, expert_weights, routings, measure):
    """One gate-shaped grouped GEMM over rows already sorted by expert."""
    w_gate = expert_weights[0]
    rows = tokens * shape.top_k
    gemm_flops = 2 * rows * shape.hidden * shape.inter
    # The weights are arguments, never closed over: jit would embed them as constants.
    sorted_inputs = []
    for x, _, experts in routings:
        order, sizes = moe_experts.sort_by_expert(experts, shape.experts)
        sorted_inputs.append((x[order // shape.top_k], w_gate, sizes))
    expected = chunked_reference(*sorted_inputs[0])
    gemm_floor = shape.experts * shape.hidden * shape.inter * 2
    picked = select_gmm_config(device_spec(), rows=rows, k=shape.hidden, n=shape.inter,
                               num_groups=shape.experts)
    sizes = sorted_inputs[0][2]
    for impl in implementations(args.quick):
        call = jax.jit(functools.partial(grouped_matmul, implementation=impl))
        extra = pallas_extras(picked, sizes, rows) if impl == "pallas" else {}
        measure("gemm", impl, call, sorted_inputs, expected, gemm_flops, gemm_floor, **extra)
    for config in sweep_configs(args, shape, picked):
        call = jax.jit(functools.partial(grouped_matmul, implementation="pallas", config=config))
        measure("gemm", f"pallas {config_label(config)}", call, sorted_inputs, expected,
                gemm_flops, gemm_floor, **pallas_extras(config, sizes, rows))
    dense = jax.jit(lambda lhs, w, sizes: jnp.dot(lhs, w[0], preferred_element_type=jnp.float32)
                    .astype(lhs.dtype))
    measure("gemm", "dense", dense, sorted_inputs, None, gemm_flops,
            shape.hidden * shape.inter * 2)


def run_moe_part(shape: MoEShape, tokens: int, args, expert_weights, routings, measure):
    """The whole routed-expert computation: sort, gate, up, SwiGLU, down, combine."""
    expected = reference_moe(*routings[0], *expert_weights, shape.swiglu_limit)
    moe_flops, floor = shape.useful_flops(tokens), shape.weight_bytes()
    moe_inputs = [(*routing, *expert_weights) for routing in routings]
    variants = [(impl, impl, ()) for impl in implementations(args.quick) if impl != "pallas"]
    variants += [(name, "pallas", fusions) for name, fusions in PALLAS_FUSIONS.items()]
    for name, impl, fusions in variants:
        call = jax.jit(functools.partial(moe_experts.routed_experts, limit=shape.swiglu_limit,
                                         implementation=impl, fusions=fusions))
        measure("moe", name, call, moe_inputs, expected, moe_flops, floor)

    def dense_moe(x, w, e, w_gate, w_up, w_down):
        del w, e
        xs = jnp.repeat(x, shape.top_k, axis=0)  # the same rows, one expert's weights
        h = moe_experts.swiglu(xs @ w_gate[0], xs @ w_up[0], shape.swiglu_limit)
        return (h @ w_down[0]).reshape(tokens, shape.top_k, -1).sum(1)

    measure("moe", "dense", jax.jit(dense_moe), moe_inputs, None, moe_flops,
            3 * shape.hidden * shape.inter * 2)


# (block_m, block_n, block_k, warps, stages, swizzle) tried by --sweep-fused beside the pick:
# sorted rows (prefill sizes), and the per-row schedule (a decode step's few copies, one row
# a program: narrow column tiles and deep k steps give more programs and loads in flight).
FUSED_SWEEP = ((128, 128, 64, 8, 4, 8), (128, 64, 64, 4, 4, 8), (128, 64, 64, 8, 4, 8),
               (128, 128, 32, 8, 4, 8), (64, 128, 64, 4, 3, 8), (256, 64, 64, 8, 3, 8),
               (128, 256, 64, 8, 3, 8), (128, 256, 32, 8, 4, 8), (256, 128, 64, 8, 3, 8),
               (64, 256, 64, 4, 3, 8), (128, 128, 64, 4, 3, 8), (128, 128, 64, 8, 3, 16))
PER_ROW_SWEEP = ((16, 32, 64, 4, 4, 8), (16, 32, 128, 4, 4, 8), (16, 16, 128, 4, 4, 8),
                 (16, 64, 128, 4, 3, 8), (16, 32, 64, 2, 6, 8), (16, 16, 256, 4, 3, 8),
                 (16, 32, 256, 4, 3, 8), (16, 64, 64, 4, 4, 8), (16, 128, 64, 4, 3, 8),
                 (16, 16, 64, 2, 8, 8))


def run_fused_sweep(shape: MoEShape, tokens: int, expert_weights, routings, measure,
                    count: int):
    """The model's two fused launches alone, as `routed_experts` runs them (rows sorted by
    expert, or the per-row schedule for at most PER_ROW_COPIES copies): gather + gate / up +
    SwiGLU, and down + combine, at the device's tiling, at it with whole tiles for every
    item (sorted rows) and at those of the first `count` tilings of FUSED_SWEEP
    (PER_ROW_SWEEP) that fit; errors are against the device's tiling."""
    w_gate, w_up, w_down = expert_weights
    rows, spec = tokens * shape.top_k, device_spec()
    per_row = rows <= moe_experts.PER_ROW_COPIES
    touched = int(jnp.unique(routings[0][2]).size)  # experts whose weights the floor reads
    launches = {"gate_up": ((w_gate, w_up), Epilogue(gather=True, swiglu=True,
                                                      limit=shape.swiglu_limit)),
                "down": ((w_down,), Epilogue(combine=True))}
    for name, (stacks, epilogue) in launches.items():
        inputs = []
        for i, (x, weights, experts) in enumerate(routings):
            order, sizes = moe_experts.sort_by_expert(experts, shape.experts)
            groups = experts.reshape(-1) if per_row else None
            if not epilogue.gather:
                x = jax.random.normal(jax.random.key(100 + i), (rows, shape.inter),
                                      jnp.bfloat16)
            scale = weights.reshape(-1) if per_row else weights.reshape(-1)[order]
            inputs.append((x, stacks, sizes,
                           None if per_row or not epilogue.gather else order // shape.top_k,
                           scale if epilogue.combine else None,
                           order if epilogue.combine and not per_row else None, groups))
        _, k, n = stacks[0].shape
        picked = select_gmm_config(spec, rows=rows, k=k, n=n, num_groups=shape.experts,
                                   num_rhs=len(stacks))
        tried = (PER_ROW_SWEEP if per_row else FUSED_SWEEP)[:count]
        # The pick with whole tiles for every item too: what `half_tiles` buys, same run.
        whole = [] if per_row else [dataclasses.replace(picked, half_tiles=False)]
        configs = [picked, *whole] + [c for c in (GmmConfig(*t) for t in tried)
                                      if c not in (picked, *whole) and n % c.block_n == 0
                                      and k % c.block_k == 0
                                      and estimate_shared_memory(c, num_rhs=len(stacks))
                                      <= spec.smem_per_block]
        expected = None
        label = f"{name}{' per-row' if per_row else ''}"
        for config in configs:
            call = jax.jit(functools.partial(_fused_launch, config=config, epilogue=epilogue,
                                             copies_per_token=shape.top_k if per_row else 1))
            if expected is None:
                expected = call(*inputs[0])
            measure("moe", f"{label} {config_label(config)}", call, inputs, expected,
                    2 * rows * shape.hidden * shape.inter * len(stacks),
                    touched * k * n * len(stacks) * 2, picked=config == picked,
                    **({} if per_row else pallas_extras(config, inputs[0][2], rows)))


def _fused_launch(lhs, stacks, sizes, row_tokens, row_scale, row_dest, row_groups, *, config,
                  epilogue, copies_per_token):
    return gmm_pallas(lhs, stacks, sizes, row_tokens=row_tokens, row_scale=row_scale,
                      row_dest=row_dest, row_groups=row_groups,
                      copies_per_token=copies_per_token, config=config, epilogue=epilogue,
                      interpret=jax.default_backend() == "cpu")


def config_label(config: GmmConfig) -> str:
    return (f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} "
            f"s{config.num_stages} z{config.swizzle}{' half' if config.half_m else ''}")


def pallas_extras(config: GmmConfig, sizes, rows: int) -> dict:
    """A sorted-row Pallas row's tiling and the MMA rows it runs per useful row."""
    return dict(config=config_label(config),
                mma_rows_per_row=issued_rows(jax.device_get(sizes), config) / rows)


def sweep_configs(args, shape: MoEShape, picked: GmmConfig) -> list[GmmConfig]:
    """With --sweep: tilings other than the device's pick that fit its shared memory."""
    if not args.sweep:
        return []
    spec = device_spec()
    configs = []
    for bm, bn, bk, warps, stages, swizzle in itertools.product(
            (64, 128), (128, 256), (32, 64), (4, 8), (3, 4), (4, 8, 16)):
        config = GmmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                           num_stages=stages, swizzle=swizzle)
        if (config != picked and shape.inter % bn == 0 and shape.hidden % bk == 0
                and (bm == 128 or warps == 4)
                and estimate_shared_memory(config) <= spec.smem_per_block):
            configs.append(config)
    return configs[:args.sweep]


def format_row(row) -> str:
    head = f"{row['preset']:16} {row['tokens']:6} {row['part']:5} {row['impl']:30}"
    if "error" in row:
        return f"{head} {row['error'][:80]}"
    err = f"{row['rel_error']:.1e}" if "rel_error" in row else "-"
    return (f"{head} {row['ms']:9.3f} {row['tflops']:8.1f} {err:>8} "
            f"{row['floor_ms_h200']:9.3f} {row['floor_ms_gb10']:9.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKEN_COUNTS))
    parser.add_argument("--presets", nargs="+", default=[s.preset for s in MOE_SHAPES])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--rotate", type=int, default=3, help="input sets cycled per sample")
    parser.add_argument("--out", type=Path, default=RESULTS / "moe.json")
    parser.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    parser.add_argument("--parts", nargs="+", choices=["gemm", "moe"], default=["gemm", "moe"])
    parser.add_argument("--sweep", type=int, default=0, metavar="N",
                        help="also time up to N other Pallas tilings on the gemm part")
    parser.add_argument("--sweep-fused", type=int, nargs="?", const=len(FUSED_SWEEP),
                        metavar="N", help="also time the model's two fused launches at the "
                        "pick, with whole tiles, and at up to N other tilings (default all)")
    args = parser.parse_args(argv)
    if args.quick:
        shapes, args.tokens = [QUICK_SHAPE], [24]
        args.iters = args.samples = 1
        args.rotate = 2
    else:
        known = {s.preset: s for s in MOE_SHAPES}
        unknown = set(args.presets) - set(known)
        if unknown:
            raise ValueError(f"unknown presets {sorted(unknown)}; known: {sorted(known)}")
        shapes = [known[name] for name in args.presets]

    results = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                   host=platform.node(), args={k: str(v) for k, v in vars(args).items()},
                   shapes=[dataclasses.asdict(s) for s in shapes], rows=[])
    print(f"{'preset':16} {'tokens':>6} {'part':5} {'impl':30} {'ms':>9} {'TFLOP/s':>8} "
          f"{'rel err':>8} {'floor H200':>9} {'floor GB10':>9}")

    def record(row):
        results["rows"].append(row)
        print(format_row(row), flush=True)
        write_json(results, args.out)

    for shape in shapes:
        for tokens in args.tokens:
            run_case(shape, tokens, args, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
