"""KDA decode benchmark: the recurrent decode kernel against the chunked path the model used
before it, and against the memory floor.

    python -m bench.kda_decode                # 1, 16 and 64 rows at glm5.3-flash's KDA shapes
    python -m bench.kda_decode --sweep        # also every (block_v, num_warps) at 64 rows
    python -m bench.kda_decode --quick        # CPU smoke run: tiny shapes, interpret mode

Shapes: glm5.3-flash's KDA layer (H = 64, K = V = 128), a pool of 256 slots, bf16 q/k/v and
fp32 g/beta as the layer passes them; each case's rows hold distinct random slots. Rows of
the table, each a jitted call with the pool donated, as in the model's decode step:
- `decode kernel`: `kda_decode` (Pallas), the state read and written in place.
- `decode jax.numpy`: the same contract in XLA (a gather, the step, a scatter).
- `chunked path (before)`: what the decode step ran before the kernel: gather the rows'
  states from the pool, `kda_prefill` with one one-token sequence per row (GLM's bounded
  gate path, no snapshot), scatter the final states back.
- `chunked kernel alone`: that `kda_prefill` call on gathered states, no pool traffic.
- `conv history (XLA)`: the conv-history half of the decode step (`conv_decode`: gather,
  shift, scatter), to weigh its bytes against the recurrent state's.

Floor: the recurrent state read and written once per row and head (2 x 4 H K V bytes per
row; the token's inputs and output add under 1%) at 4.8 TB/s (H200 HBM3e), at 273 GB/s
(GB10 LPDDR5x) and at the copy bandwidth measured here. Timing as `bench.kda_kernel`:
`--samples` samples of `--iters` queued calls, one sync each, the median reported. Each
call continues from the pool the previous one returned. The JSON (`--out`) is rewritten
after every case.
"""

from __future__ import annotations

import argparse
import functools
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import relative_error, time_calls, write_json
from bench.kda_kernel import measure_copy_bandwidth
from glmjax.layers.conv import conv_decode
from pallas_kernels import kda_decode, kda_prefill
from pallas_kernels.tuning import DecodeConfig, device_spec, select_decode_config

RESULTS = Path(__file__).parent / "results"
H200_BANDWIDTH, GB10_BANDWIDTH = 4.8e12, 273e9
GATE_LOWER_BOUND = -5.0  # GLM's bounded gate
FULL = dict(heads=64, head_dim=128, pool_slots=256, rows=(1, 16, 64))
QUICK = dict(heads=2, head_dim=32, pool_slots=8, rows=(1, 4))
SWEEP = [DecodeConfig(block_v=bv, num_warps=w) for bv in (16, 32, 64, 128) for w in (1, 2, 4, 8)]


def make_case(rows, *, heads, head_dim, pool_slots, seed=0):
    """Random step inputs for `rows` rows on distinct slots, a random state pool and a
    random bf16 conv-history pool of 3 H K channels."""
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.standard_normal(shape, np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    shape = (rows, heads, head_dim)
    channels = 3 * heads * head_dim
    return dict(
        q=jnp.asarray(unit(shape), jnp.bfloat16),
        k=jnp.asarray(unit(shape), jnp.bfloat16),
        v=jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16),
        g=jnp.asarray(GATE_LOWER_BOUND * rng.uniform(0.0, 0.3, shape), jnp.float32),
        beta=jnp.asarray(rng.uniform(0.05, 0.95, (rows, heads)), jnp.float32),
        slots=jnp.asarray(rng.permutation(pool_slots)[:rows], jnp.int32),
        pool=0.1 * jax.random.normal(jax.random.key(seed), (pool_slots, heads, head_dim,
                                                            head_dim), jnp.float32),
        conv_x=jnp.asarray(rng.standard_normal((rows, channels), np.float32), jnp.bfloat16),
        conv_weight=jnp.asarray(rng.standard_normal((channels, 4), np.float32), jnp.bfloat16),
        conv_pool=jnp.asarray(rng.standard_normal((pool_slots, channels, 3), np.float32),
                              jnp.bfloat16),
    )


def chunked_path(q, k, v, g, beta, slots, pool, *, gather_scatter=True):
    """The decode step's KDA update before the kernel: gather, chunked scan, scatter."""
    rows, num_slots = q.shape[0], pool.shape[0]
    index = jnp.where(slots >= 0, slots, num_slots)
    initial = pool.at[index].get(mode="fill", fill_value=0) if gather_scatter else pool
    o, final, _ = kda_prefill(q, k, v, g, beta, jnp.arange(rows + 1, dtype=jnp.int32),
                              initial, jnp.full((rows, 1), -1, jnp.int32),
                              gate_lower_bound=GATE_LOWER_BOUND)
    return o, (pool.at[index].set(final, mode="drop") if gather_scatter else final)


def pool_runner(fn, args, pool):
    """A call that runs `fn(*args, pool)` (jitted, pool donated) and keeps the returned pool
    for the next call; it returns that pool."""
    step = jax.jit(fn, donate_argnums=len(args))
    box = [jnp.copy(pool)]

    def call():
        _, box[0] = step(*args, box[0])
        return box[0]

    # In interpret mode the first Pallas call imports a module that adds a value to JAX's
    # trace context (jax 0.11.2), so the second call traces again: warm up here, and
    # time_calls warms up once more.
    jax.block_until_ready(call())
    return call


def state_bytes(rows, heads, head_dim):
    """The floor's traffic: each row's fp32 state read once and written once."""
    return 2 * rows * heads * head_dim * head_dim * 4


def run_case(rows, shape, args, bandwidth, config=None):
    case = make_case(rows, **shape)
    step_args = tuple(case[n] for n in ("q", "k", "v", "g", "beta", "slots"))
    kernel = functools.partial(kda_decode, config=config)
    calls = {
        "decode kernel": pool_runner(kernel, step_args, case["pool"]),
        "decode jax.numpy": pool_runner(functools.partial(kda_decode, backend="reference"),
                                        step_args, case["pool"]),
        "chunked path (before)": pool_runner(chunked_path, step_args, case["pool"]),
        "chunked kernel alone": pool_runner(
            functools.partial(chunked_path, gather_scatter=False), step_args,
            case["pool"][case["slots"]]),
        "conv history (XLA)": pool_runner(
            lambda x, weight, slots, pool: conv_decode(x, weight, pool, slots),
            (case["conv_x"], case["conv_weight"], case["slots"]), case["conv_pool"]),
    }
    ms = {}
    for name, call in calls.items():
        ms[name] = time_calls(call, jax.block_until_ready, iters=args.iters,
                              samples=args.samples)[0]
        print(f"{rows:3} rows  {name:22} {ms[name]:9.4f} ms", flush=True)

    # One step from the same pool on both paths, against the jax.numpy path.
    check = jax.jit(lambda *a: kda_decode(*a, config=config))(*step_args, case["pool"])
    want = jax.jit(lambda *a: kda_decode(*a, backend="reference"))(*step_args, case["pool"])
    slots = np.asarray(case["slots"])
    errors = {"o": relative_error(check[0], want[0]),
              "states": relative_error(np.asarray(check[1])[slots], np.asarray(want[1])[slots])}
    nbytes = state_bytes(rows, shape["heads"], shape["head_dim"])
    conv_bytes = 2 * rows * 3 * 3 * shape["heads"] * shape["head_dim"] * 2
    kernel_ms = ms["decode kernel"]
    return dict(
        rows=rows, ms=ms, relative_error_vs_jax_numpy=errors,
        state_bytes=nbytes, conv_history_bytes=conv_bytes,
        floor_ms={"h200_4.8TBps": nbytes / H200_BANDWIDTH * 1e3,
                  "gb10_273GBps": nbytes / GB10_BANDWIDTH * 1e3,
                  "measured_copy": nbytes / bandwidth * 1e3},
        kernel_over_floor=kernel_ms / (nbytes / H200_BANDWIDTH * 1e3),
        speedup_vs_chunked_path=ms["chunked path (before)"] / kernel_ms,
        speedup_vs_chunked_kernel=ms["chunked kernel alone"] / kernel_ms,
        achieved_bandwidth_gbs=nbytes / (kernel_ms * 1e-3) / 1e9,
        config=dict(vars(config or select_decode_config(
            device_spec(), num_rows=rows, num_heads=shape["heads"],
            head_k=shape["head_dim"], head_v=shape["head_dim"]))),
    )


def sweep(shape, args, rows):
    """The kernel alone at `rows` rows for every tiling of SWEEP (failures reported)."""
    out = []
    case = make_case(rows, **shape)
    step_args = tuple(case[n] for n in ("q", "k", "v", "g", "beta", "slots"))
    for config in SWEEP:
        if config.block_v > shape["head_dim"]:
            continue
        try:
            call = pool_runner(functools.partial(kda_decode, config=config), step_args,
                               case["pool"])
            ms = time_calls(call, jax.block_until_ready, iters=args.iters,
                            samples=args.samples)[0]
        except Exception as error:  # a tiling that does not compile is a result too
            print(f"sweep {config}: failed: {type(error).__name__}: {str(error)[:200]}")
            ms = None
        floor = state_bytes(rows, shape["heads"], shape["head_dim"]) / H200_BANDWIDTH * 1e3
        out.append(dict(config=vars(config), ms=ms,
                        kernel_over_floor=None if ms is None else ms / floor))
        print(f"sweep {rows} rows {config}: {ms} ms", flush=True)
    return out


def print_table(results):
    print(f"{'rows':>4} {'path':22} {'ms':>9} {'vs kernel':>10}")
    for r in results:
        for name, ms in r["ms"].items():
            print(f"{r['rows']:4} {name:22} {ms:9.4f} {ms / r['ms']['decode kernel']:9.2f}x")
        floors = ", ".join(f"{k} {1e3 * v:.1f} us" for k, v in r["floor_ms"].items())
        print(f"{'':4} floor: {floors}; kernel {r['kernel_over_floor']:.2f}x the H200 floor, "
              f"{r['achieved_bandwidth_gbs']:.0f} GB/s, "
              f"{r['speedup_vs_chunked_path']:.1f}x faster than the chunked path "
              f"({r['speedup_vs_chunked_kernel']:.1f}x its kernel alone); "
              f"error vs jax.numpy o {r['relative_error_vs_jax_numpy']['o']:.1e}, "
              f"states {r['relative_error_vs_jax_numpy']['states']:.1e}")
    at64 = [r for r in results if r["rows"] == 64]
    if at64:
        r = at64[0]
        ok = r["speedup_vs_chunked_path"] >= 4 and r["kernel_over_floor"] <= 2
        print(f"bar at 64 rows (>= 4x the chunked path, <= 2x the 4.8 TB/s floor): "
              f"{'met' if ok else 'NOT met'}")


def write_results(path, args, bandwidth, shape, results, sweep_results):
    device = jax.devices()[0]
    payload = dict(
        args={k: str(v) for k, v in vars(args).items()}, device=device.device_kind,
        platform=device.platform, jax=jax.__version__, python=platform.python_version(),
        copy_bandwidth_tbs=bandwidth / 1e12, shape=shape,
        timing="median of samples; each sample = iters queued calls / one sync; pool donated",
        results=results, sweep=sweep_results,
    )
    write_json(payload, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=None, help="comma-separated row counts")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--sweep", action="store_true", help="every tiling at 64 rows")
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run: tiny shapes, 2 x 2 calls per row")
    parser.add_argument("--out", type=Path, default=RESULTS / "kda_decode.json")
    args = parser.parse_args(argv)
    shape = dict(QUICK if args.quick else FULL)
    default_rows = shape.pop("rows")
    rows = [int(r) for r in args.rows.split(",")] if args.rows else list(default_rows)
    if args.quick:
        args.iters, args.samples = 2, 2
    if any(r < 1 or r > shape["pool_slots"] for r in rows):
        parser.error(f"--rows must be in [1, {shape['pool_slots']}], got {rows}")

    bandwidth = H200_BANDWIDTH if args.quick else measure_copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results, sweep_results = [], []
    for count in rows:
        results.append(run_case(count, shape, args, bandwidth))
        write_results(args.out, args, bandwidth, shape, results, sweep_results)
    if args.sweep:
        sweep_results = sweep(shape, args, rows=max(rows))
        write_results(args.out, args, bandwidth, shape, results, sweep_results)
    print_table(results)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
