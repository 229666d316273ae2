"""The KDA prefill conv (`pallas_kernels.kda_conv`): the Pallas kernel against the jax.numpy
path XLA fuses (the layer's path before the kernel, and still on a mesh).

    python -m bench.kda_conv                # both presets' head counts at 8K and 32K tokens
    python -m bench.kda_conv --sweep        # also the kernel at each tiling of SWEEP
    python -m bench.kda_conv --quick        # CPU smoke run: interpret mode, small shapes

Cases: `--cases` of TOKENS x HEADS (K = 128, kernel width 4, bf16 rows, fp32 taps), the
tokens packed in 4 sequences of equal length with warm histories, as a prefill step of
four prompts. Each row: median ms of `--samples` samples of `--iters` queued jitted calls
(`bench.common.time_calls`), the GB/s of the least traffic (the q, k, v inputs read once,
q, k and v written once) and the time that traffic takes at 4.8 TB/s; per case the ratio
xla / pallas and the kernel's largest relative difference from the xla path (bf16 rounding
of y); with `--sweep`, the kernel's ms at each (rows a program, warps) of SWEEP (`sweep` in
the JSON, the fastest printed). The JSON (`--out`) is rewritten after every case.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import fill_defaults, relative_error, time_calls, write_json
from pallas_kernels.kda_conv import kda_conv
from pallas_kernels.kda_conv_pallas import ConvTiling

RESULTS = Path(__file__).parent / "results"
HEAD_DIM, WIDTH, SEQS = 128, 4, 4
H200_BANDWIDTH = 4.8e12
QUICK = dict(cases="64x2", iters=1, samples=1)
FULL = dict(cases="8192x32,32768x32,8192x64,32768x64", iters=20, samples=5)
SWEEP = tuple(ConvTiling(rows, warps) for rows, warps in
              ((16, 4), (32, 4), (32, 8), (64, 8), (64, 16), (128, 16)))


def case_inputs(tokens: int, heads: int, seed: int):
    """(q, k, v) inputs [T, H K] each, as the projections leave them; taps, histories and
    cu_seqlens."""
    rng = np.random.default_rng(seed)
    channels = 3 * heads * HEAD_DIM
    parts = tuple(jnp.asarray(rng.normal(size=(tokens, channels // 3)), jnp.bfloat16)
                  for _ in range(3))
    weight = jnp.asarray(rng.normal(size=(channels, WIDTH)) * 0.5, jnp.float32)
    history = jnp.asarray(rng.normal(size=(SEQS, channels, WIDTH - 1)), jnp.bfloat16)
    cu = jnp.asarray(np.linspace(0, tokens, SEQS + 1).astype(np.int32))
    return parts, weight, history, cu


def jitted(heads: int, **options):
    """`kda_conv` at `heads` heads with `options` (implementation, tiling), jitted."""
    return jax.jit(lambda parts, w, h, cu: kda_conv(parts, w, h, cu, heads=heads, **options))


def run_case(tokens: int, heads: int, args) -> dict:
    inputs = case_inputs(tokens, heads, args.seed)
    calls = {impl: jitted(heads, implementation=impl) for impl in ("pallas", "xla")}
    least_bytes = 2 * sum(x.nbytes for x in inputs[0])  # q, k, v in and out
    row = dict(tokens=tokens, heads=heads, least_bytes=least_bytes,
               floor_ms=least_bytes / H200_BANDWIDTH * 1e3, ms={}, gb_per_s={})
    for impl, call in calls.items():
        ms = time_calls(lambda call=call: call(*inputs), iters=args.iters,
                        samples=args.samples)[0]
        row["ms"][impl], row["gb_per_s"][impl] = ms, least_bytes / ms / 1e6
    row["xla_over_pallas"] = row["ms"]["xla"] / row["ms"]["pallas"]
    ours, theirs = calls["pallas"](*inputs), calls["xla"](*inputs)
    row["relative_difference"] = max(relative_error(a, b) for a, b in zip(ours, theirs))
    if args.sweep:
        row["sweep"] = {}
        for tiling in SWEEP:
            call = jitted(heads, implementation="pallas", tiling=tiling)
            row["sweep"][f"{tiling.block_rows}x{tiling.num_warps}"] = time_calls(
                lambda call=call: call(*inputs), iters=args.iters, samples=args.samples)[0]
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.kda_conv",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: small shapes")
    parser.add_argument("--cases", help=f"TOKENSxHEADS, comma-separated ({FULL['cases']})")
    parser.add_argument("--iters", type=int)
    parser.add_argument("--samples", type=int)
    parser.add_argument("--sweep", action="store_true",
                        help="also time the kernel at each tiling of SWEEP")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "kda_conv.json")
    args = parser.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    cases = [tuple(map(int, case.split("x"))) for case in args.cases.split(",") if case]
    result = dict(device=jax.devices()[0].device_kind, platform=platform.platform(),
                  jax=jax.__version__, args=vars(args), rows=[])
    print(f"{'tokens':>7} {'heads':>5} {'pallas ms':>10} {'xla ms':>8} {'xla/pallas':>10} "
          f"{'pallas GB/s':>11} {'floor ms':>8} {'rel diff':>9}")
    for tokens, heads in cases:
        row = run_case(tokens, heads, args)
        result["rows"].append(row)
        write_json(result, args.out)
        print(f"{tokens:>7} {heads:>5} {row['ms']['pallas']:>10.3f} {row['ms']['xla']:>8.3f} "
              f"{row['xla_over_pallas']:>10.2f} {row['gb_per_s']['pallas']:>11.0f} "
              f"{row['floor_ms']:>8.3f} {row['relative_difference']:>9.1e}", flush=True)
        if args.sweep:
            best = min(row["sweep"], key=row["sweep"].get)
            print("  sweep (rows x warps: ms): " + ", ".join(
                f"{name} {ms:.3f}" for name, ms in row["sweep"].items()) + f"; fastest {best}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
