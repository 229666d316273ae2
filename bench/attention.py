"""MLA prefill attention benchmark: our Pallas flash kernel vs cuDNN vs the score rectangle.

    python -m bench.attention                         # every case, every implementation
    python -m bench.attention --cases glm-8K,glm-8x1K --impls pallas,cudnn
    python -m bench.attention --quick                 # CPU smoke: tiny shapes, interpret mode
    python -m bench.attention --impls pallas --sweep  # also every tiling in SWEEP

Cases, at both presets' MLA head shapes (kimi-linear-48b: 32 heads, qk 192 = nope 128 +
rope 64, v 128; glm5.3-flash: 64 heads, qk 256, v 256), bf16: one causal 8K span, a packed
batch of 8 x 1K spans (the bar: at most 1/4 of the 8K span), and a 4K span after a 4K
cached prefix. Rows (`prefill_attention` implementations):
- pallas: our flash kernel with the device's tuning-table config;
- cudnn: cuDNN flash attention over packed segments (sm_90+; v padded to qk's head dim);
- reference: the score rectangle, 1024 queries at a time against every key of the batch,
  masked (the MLA prefill before issue 18, without its padded prefix capacity).
TFLOP/s counts useful causal FLOPs only: 2 (qk + v) per head per visible (query, key)
pair. Errors are max |x - reference| / max |reference| over the output, in fp32.

Timing: warm-up, then `--samples` samples of `--iters` queued calls closed by one device
synchronisation; the median is reported. The table is printed and the JSON (--out,
default bench/results/attention.json) rewritten after every case.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import relative_error, time_calls, write_json
from pallas_kernels.attention import prefill_attention
from pallas_kernels.attention_cudnn import cudnn_available
from pallas_kernels.attention_pallas import FlashConfig, select_flash_config

RESULTS = Path(__file__).parent / "results"
PRESETS = {"kimi": (32, 192, 128), "glm": (64, 256, 256)}  # heads, qk, v
SPANS = {"8K": ([8192], [0]), "8x1K": ([1024] * 8, [0] * 8), "4K+4K": ([4096], [4096])}
CASES = {f"{p}-{s}": (p, s) for p in PRESETS for s in SPANS}
QUICK = {"tiny-100": ((2, 48, 32), [100], [0]), "tiny-3x40+prefix": ((2, 48, 32), [40] * 3,
                                                                    [0, 17, 64])}
IMPLEMENTATIONS = ("pallas", "cudnn", "reference")
# Tilings that compile for sm_90 at both head shapes (`python -m pallas_kernels.aot`).
SWEEP = (FlashConfig(128, 64, 8, 2), FlashConfig(128, 64, 8, 3), FlashConfig(64, 64, 8, 2),
         FlashConfig(64, 64, 8, 3), FlashConfig(128, 32, 8, 2), FlashConfig(64, 32, 4, 2),
         FlashConfig(128, 128, 8, 2))


def make_inputs(heads, head_qk, head_v, lens, prefixes, seed=0):
    """Packed bf16 spans continuing their prefixes (keys = prefix + span per sequence)."""
    rng = np.random.default_rng(seed)
    lens, prefixes = np.asarray(lens), np.asarray(prefixes)
    cu_q = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens + prefixes)]).astype(np.int32)

    def normal(rows, dim):
        return jnp.asarray(rng.standard_normal((rows, heads, dim), np.float32), jnp.bfloat16)

    return dict(q=normal(cu_q[-1], head_qk), k=normal(cu_k[-1], head_qk),
                v=normal(cu_k[-1], head_v), cu_seqlens_q=jnp.asarray(cu_q),
                cu_seqlens_k=jnp.asarray(cu_k))


def causal_flops(heads, head_qk, head_v, lens, prefixes):
    """Useful FLOPs: query i of a span after p cached keys sees p + i + 1 keys."""
    pairs = sum(n * p + n * (n + 1) // 2 for n, p in zip(lens, prefixes))
    return 2 * heads * (head_qk + head_v) * pairs


def run_case(name, shape, lens, prefixes, impls, args):
    heads, head_qk, head_v = shape
    inputs = make_inputs(heads, head_qk, head_v, lens, prefixes)
    flops = causal_flops(heads, head_qk, head_v, lens, prefixes)
    variants = {impl: (impl, FlashConfig(16, 16) if args.quick else None) for impl in impls}
    if args.sweep and "pallas" in impls:
        variants.update({f"pallas {c.block_q}x{c.block_k} w{c.num_warps} s{c.num_stages}":
                         ("pallas", c) for c in SWEEP})
    rows, outputs = {}, {}
    for row, (impl, config) in variants.items():
        fn = jax.jit(lambda i, impl=impl, config=config: prefill_attention(
            **i, implementation=impl, config=config)[0])
        try:
            ms, _ = time_calls(lambda fn=fn: fn(inputs), iters=args.iters, samples=args.samples)
        except Exception as error:  # out of memory, a shape refused: the row says so
            rows[row] = {"error": f"{type(error).__name__}: {error}"[:300]}
            print(f"{name} {row}: {rows[row]['error']}", flush=True)
            continue
        outputs[row] = fn(inputs)
        rows[row] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        print(f"{name} {row}: {ms:.3f} ms, {rows[row]['tflops']:.1f} TFLOP/s", flush=True)
    if "reference" in outputs:
        for impl, out in outputs.items():
            rows[impl]["error_vs_reference"] = relative_error(out, outputs["reference"])
    if not args.quick:
        rows["pallas_config"] = str(select_flash_config(head_qk=head_qk, head_v=head_v))
    return {"heads": heads, "head_qk": head_qk, "head_v": head_v, "lens": list(lens),
            "prefixes": list(prefixes), "useful_tflop": flops / 1e12, "rows": rows}


def format_table(results) -> str:
    lines = [f"{'case':18} {'impl':24} {'ms':>9} {'TFLOP/s':>8} {'err':>9}"]
    for name, case in results.items():
        for impl, row in case["rows"].items():
            if not isinstance(row, dict):
                continue
            if "error" in row:
                lines.append(f"{name:18} {impl:24} {row['error'][:60]}")
            else:
                err = row.get("error_vs_reference")
                lines.append(f"{name:18} {impl:24} {row['ms']:9.3f} {row['tflops']:8.1f} "
                             f"{'' if err is None else f'{err:9.1e}'}")
    for preset in PRESETS:  # the packing bar: 8 x 1K at most 1/4 of one 8K span
        single, packed = results.get(f"{preset}-8K"), results.get(f"{preset}-8x1K")
        if not (single and packed):
            continue
        for impl in IMPLEMENTATIONS:
            a, b = single["rows"].get(impl, {}), packed["rows"].get(impl, {})
            if "ms" in a and "ms" in b:
                lines.append(f"{preset} {impl}: 8x1K / 8K = {b['ms'] / a['ms']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="also time every SWEEP tiling")
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke test: tiny shapes, Pallas in interpret mode")
    parser.add_argument("--out", type=Path, default=RESULTS / "attention.json")
    args = parser.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    unknown = set(impls) - set(IMPLEMENTATIONS)
    if unknown:
        parser.error(f"unknown implementations {sorted(unknown)}")
    if "cudnn" in impls and not cudnn_available():
        print("cudnn skipped: needs a GPU of sm_90 or later")
        impls.remove("cudnn")
    if args.quick:
        cases = dict(QUICK)
        args.iters, args.samples = 1, 1
    else:
        names = [c for c in args.cases.split(",") if c]
        if set(names) - set(CASES):
            parser.error(f"unknown cases {sorted(set(names) - set(CASES))}")
        cases = {n: (PRESETS[CASES[n][0]], *SPANS[CASES[n][1]]) for n in names}
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "host": platform.node(), "args": {k: str(v) for k, v in vars(args).items()},
              "cases": {}}
    for name, (shape, lens, prefixes) in cases.items():
        record["cases"][name] = run_case(name, shape, lens, prefixes, impls, args)
        write_json(record, args.out)
    print(format_table(record["cases"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
