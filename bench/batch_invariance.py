"""Batch invariance of a decode / verify step, op by op: is row i of a batch of R rows
bitwise what row i gives alone?

    python -m bench.batch_invariance                       # kimi-linear-48b's shapes, R 1..64
    python -m bench.batch_invariance --quick               # CPU smoke run: tiny preset
    python -m bench.batch_invariance --ops lm_head,routed_experts --rows 1,4
    python -m bench.batch_invariance --ops mla_in,kda_in,moe_layer --rows 512,8192 \
        --reference-rows 4096                              # a prefill's rows, span by span

Why: MTP verification runs N + 1 rows per sequence where plain decoding runs one, and a
ladder prefill step holds other rows than a coalesced one; greedy outputs stay identical
only where every op rounds a row the same whatever the rows beside it. With
`--reference-rows N` every row below N of each batch is compared with the batch of rows
0 .. N - 1 instead (a prompt's first N tokens as a ladder's step against the same tokens
inside a longer or shorter span), and a part's share of differing rows is reported.

Ops (`bench.batch_invariance_step_ops.OPS`, `--ops` picks some): each built at `--preset`'s
shapes (the MoE layer at its full expert count; `decode_step` a model cut to
`--num-layers` layers and `--num-experts` experts) with fresh random inputs for the
largest R, and called through the function or module the model calls, so it picks its
implementation as the model does (on one GPU the weight stream, the Pallas kernels; on a
CPU XLA and the references). Per R of `--rows`, the batch of rows 0 .. R - 1 runs once
and each checked row i (`--check-rows` below R, and the last row R - 1) is compared, part
by part, with the batch of row i alone (R = 1: one compiled program for every i): bitwise
equal or not, the largest absolute difference and the relative one (that over the row's
largest magnitude). R = 1 checks that the op is deterministic (two runs, one row). The
notes record what the op picks at each R (stream or XLA, the fused KDA step or not, the
MoE's per-row schedule, the MLA kernel's split). Each op's programs compile ahead in
`--compile-workers` threads. An op that fails records its error and the others run. The
JSON (`--out`) is rewritten after every row count of every op.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import platform
import time
import traceback
from pathlib import Path

import jax
import numpy as np

from bench.batch_invariance_ops import Op, Shapes
from bench.batch_invariance_step_ops import OPS
from bench.buckets import log
from bench.common import fill_defaults, positive_sizes, write_json
from glmjax.config import ModelConfig

RESULTS = Path(__file__).parent / "results"
DIFFERING_ROWS_KEPT = 16  # a part's first differing rows kept in the JSON
FULL = dict(preset="kimi-linear-48b", rows="1,2,4,8,16,64", context=4096, block_size=512,
            num_layers=4, num_experts=16, compile_workers=8)
QUICK = dict(preset="tiny", rows="1,2,4", context=48, block_size=16, num_layers=4,
             num_experts=None, compile_workers=2)


def difference(ours: np.ndarray, alone: np.ndarray) -> dict:
    """Row `ours` against row `alone` (one shape): bitwise equal, the share of elements
    that differ, the largest |difference| and that over the largest finite |alone| (0 when
    equal; inf when that is 0 and they differ)."""
    equal = ours.tobytes() == alone.tobytes()
    a, b = ours.astype(np.float64), alone.astype(np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))  # inf == inf: no difference
    with np.errstate(invalid="ignore"):  # NaN against a number: an infinite difference
        gap = np.where(same, 0.0, np.nan_to_num(np.abs(a - b), nan=np.inf))
    max_abs = float(np.max(gap)) if gap.size else 0.0
    finite = np.abs(b[np.isfinite(b)])
    scale = float(np.max(finite)) if finite.size else 0.0
    max_rel = max_abs / scale if scale else (0.0 if max_abs == 0 else float("inf"))
    return dict(equal=equal, differing=float(np.mean(~same)) if same.size else 0.0,
                max_abs=max_abs, max_rel=max_rel)


def compile_programs(op: Op, row_counts: list[int], workers: int) -> dict:
    """R -> the op's program compiled for a batch of R rows, or the exception it raised."""

    def compile_one(rows):
        try:
            return op.program.lower(op.params, *op.inputs(np.arange(rows))).compile()
        except Exception as error:  # recorded in that row count's result
            return error

    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        return dict(zip(row_counts, pool.map(compile_one, row_counts)))


def error_text(error: BaseException) -> str:
    """The exception and the last line of its traceback that is ours (where it broke)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "/site-packages/" not in f.filename]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {str(error)[:500]}{where}"


def run_op(name: str, shapes: Shapes, args, entry: dict, save) -> None:
    """Fills `entry` with op `name`'s results, one row count at a time, calling `save()`
    after each."""
    start = time.perf_counter()
    try:
        op = OPS[name](shapes)
        compiled = compile_programs(op, sorted(set(args.row_counts) | {args.reference_rows}),
                                    args.compile_workers)
        if isinstance(compiled[args.reference_rows], Exception):
            raise compiled[args.reference_rows]
    except Exception as error:
        entry["error"] = error_text(error)
        entry["seconds"] = time.perf_counter() - start
        save()
        return
    singles: dict[int, dict] = {}
    base = args.reference_rows

    def reference(row):  # row `row`'s outputs in a batch of its own, or of rows 0..base-1
        key = 0 if base > 1 else row
        if key not in singles:
            indices = np.arange(base) if base > 1 else np.array([row])
            singles[key] = jax.device_get(compiled[base](op.params, *op.inputs(indices)))
        return {part: values[row if base > 1 else 0] for part, values in singles[key].items()}

    for rows in args.row_counts:
        result = dict(rows=rows, notes=op.notes(rows))
        try:
            if isinstance(compiled[rows], Exception):
                raise compiled[rows]
            batch = jax.device_get(compiled[rows](op.params, *op.inputs(np.arange(rows))))
            checked = (list(range(min(rows, base))) if base > 1 else
                       sorted({r for r in args.check_rows if r < rows} | {rows - 1}))
            result["checked_rows"] = checked if base == 1 else f"0..{len(checked) - 1}"
            result["parts"] = {}
            for part, values in batch.items():
                diffs = {r: difference(np.asarray(values[r]), np.asarray(reference(r)[part]))
                         for r in checked}
                differing = [r for r, d in diffs.items() if not d["equal"]]
                result["parts"][part] = dict(
                    differing_rows=differing[:DIFFERING_ROWS_KEPT],
                    differing_row_share=len(differing) / len(diffs),
                    differing_share=max(d["differing"] for d in diffs.values()),
                    max_abs=max(d["max_abs"] for d in diffs.values()),
                    max_rel=max(d["max_rel"] for d in diffs.values()))
            result["bitwise_equal"] = not any(p["differing_rows"]
                                              for p in result["parts"].values())
        except Exception as error:
            result["error"] = error_text(error)
        entry["results"].append(result)
        entry["seconds"] = time.perf_counter() - start
        save()


def verdict(entry: dict) -> str:
    """One word per op: invariant, differs, error (some row count failed) or not run."""
    if entry["error"]:
        return "error"
    results = entry["results"]
    if any("error" in r for r in results):
        return "error"
    if not results:
        return "not run"
    return "invariant" if all(r["bitwise_equal"] for r in results) else "differs"


def print_op(entry: dict, row_counts: list[int]) -> None:
    """The op's table lines: per part, '=' where every checked row is bitwise equal to
    its reference, else the largest relative difference @ the share of checked rows that
    differ; the notes that change with R."""
    name = entry["op"]
    if entry["error"]:
        print(f"{name:<30} error: {entry['error']}")
        return
    by_rows = {r["rows"]: r for r in entry["results"]}
    parts = next((list(r["parts"]) for r in entry["results"] if "parts" in r), [])
    for part in parts:
        cells = []
        for rows in row_counts:
            r = by_rows.get(rows, {})
            p = r.get("parts", {}).get(part)
            cells.append("err" if p is None else "=" if not p["differing_rows"]
                         else f"{p['max_rel']:.0e}@{p['differing_row_share']:.0%}")
        print(f"{name + ' / ' + part:<30}" + "".join(f"{c:>9}" for c in cells))
    for r in entry["results"]:
        if "error" in r:
            print(f"    R={r['rows']}: {r['error']}")
    keys = {k for r in entry["results"] for k in r["notes"]}
    for key in sorted(keys):
        values = [by_rows.get(rows, {}).get("notes", {}).get(key) for rows in row_counts]
        if len(set(map(str, values))) > 1:
            print(f"    {key}: " + " ".join(f"{str(v):>9}" for v in values))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_invariance",
                                     description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="CPU smoke run: tiny preset, small shapes")
    add("--preset", help="the model whose shapes the ops take (kimi-linear-48b)")
    add("--rows", help="batch sizes R, comma-separated (1,2,4,8,16,64)")
    add("--check-rows", default="0,1,3",
        help="rows compared with themselves alone where below R (and R - 1 always)")
    add("--reference-rows", type=int, default=1,
        help="N > 1: every row below N of each batch against the batch of rows 0..N-1 "
             "(a prefill's rows in a longer or shorter span) instead of checked rows alone")
    add("--ops", default=",".join(OPS), help=f"ops to run, comma-separated ({','.join(OPS)})")
    add("--context", type=int, help="MLA contexts drawn in [context / 2, context) (4096)")
    add("--block-size", type=int, help="MLA cache block size (512)")
    add("--num-layers", type=int, help="layers of the decode_step op's model (4)")
    add("--num-experts", type=int, help="experts of the decode_step op's model (16)")
    add("--seed", type=int, default=0)
    add("--compile-workers", type=int, help="threads compiling an op's programs (8)")
    add("--out", type=Path, help="output (bench/results/batch_invariance_<preset>.json)")
    args = parser.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    args.row_counts = positive_sizes(parser, "--rows", args.rows)
    args.check_rows = [int(r) for r in args.check_rows.split(",") if r]
    if any(r < 0 for r in args.check_rows):
        parser.error(f"--check-rows {args.check_rows}: rows are >= 0")
    if args.reference_rows < 1:
        parser.error(f"--reference-rows {args.reference_rows}: at least 1")
    args.op_names = [name for name in args.ops.split(",") if name]
    unknown = sorted(set(args.op_names) - set(OPS))
    if unknown or not args.op_names:
        parser.error(f"--ops: unknown {unknown}; choose from {','.join(OPS)}")
    args.out = args.out or RESULTS / f"batch_invariance_{args.preset}.json"
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = dataclasses.replace(ModelConfig.preset(args.preset), kv_block_size=args.block_size)
    shapes = Shapes(config, max(args.row_counts), args.context, args.num_layers,
                    args.num_experts, args.seed)
    payload = dict(device=jax.devices()[0].device_kind, platform=platform.platform(),
                   jax=jax.__version__, args={k: str(v) for k, v in vars(args).items()},
                   preset=config.name, rows=args.row_counts, ops=[], summary={})

    def save():
        payload["summary"] = {e["op"]: verdict(e) for e in payload["ops"]}
        write_json(payload, args.out)

    against = (f"the batch of rows 0..{args.reference_rows - 1}" if args.reference_rows > 1
               else "row i alone")
    print(f"{config.name} on {payload['device']}: row i of R rows against {against} ('=' "
          "bitwise equal at every checked row, else the largest relative difference @ the "
          "share of checked rows that differ)")
    print(f"{'op / part':<30}" + "".join(f"{'R=' + str(r):>9}" for r in args.row_counts))
    for name in args.op_names:
        entry = dict(op=name, doc=(OPS[name].__doc__ or "").split("\n")[0], error=None,
                     seconds=0.0, results=[])
        payload["ops"].append(entry)
        run_op(name, shapes, args, entry, save)
        print_op(entry, args.row_counts)
        log(f"{name}: {verdict(entry)} ({entry['seconds']:.1f} s)")
    print("summary: " + ", ".join(f"{k} {v}" for k, v in payload["summary"].items()))
    print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
