"""One side of a KDA prefill A/B, timed in this process alone: ours (the runtime's config,
or fields set over it) or fla's `chunk_kda` (its default and safe_gate paths).

Kernel work times trees and tilings against each other and against fla. fla's 8K time
moved 18-37% between two H100s where ours moved ~3% (docs/KERNEL.md, twenty-sixth
session), and a process that timed one side first can change the other's time, so each
side runs in its own process, in turn (`bench/device_calls.sh kda_ab`), and appends one
JSON line to --out; `--summary` gives each row's median over the runs and ours against
fla's medians.

Two times a row: "ms", the wall time per call with calls queued (what a caller waits), and
"device_ms", the GPU's busy time per call (the summed durations of its kernels and copies
over --iters calls: jax.profiler for ours, torch.profiler for fla; on a GPU only). The wall
time of a peer that runs several launches from Python also holds whatever host time the GPU
does not hide; the device time does not, and does not move with the host's speed.

    python -m bench.kda_ab --case 8K --tree main --any --out ab.jsonl
    python -m bench.kda_ab --case 8K --tree main --set scan_prefetch=false --out ab.jsonl
    python -m bench.kda_ab --case 8K --fla --out ab.jsonl
    python -m bench.kda_ab --summary ab.jsonl

Inputs and timing are `bench.kda_kernel`'s (4 snapshots; median of --samples batches of
--iters calls). `--quick`: the CPU smoke run (2 heads of 32, interpret mode, one call).
This file also runs from an older tree's folder (copied there), so it imports only what
`bench.kda_kernel` has long had.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import jax

import bench.kda_kernel as kda_bench
from bench.common import time_calls
from bench.profile import profile_call
from pallas_kernels import kda_prefill
from pallas_kernels.tuning import KernelConfig, device_spec, select_config

FLA_ROWS = {"fla chunk_kda": {},
            "fla safe_gate": dict(safe_gate=True, lower_bound=kda_bench.GATE_LOWER_BOUND)}
TORCH_DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # torch trace categories
MEASURES = {"ms": "wall", "device_ms": "device"}  # a line's times: its summary tables


def config_overrides(settings: list[str]) -> dict:
    """`FIELD=VALUE` strings as `KernelConfig` field values (ints, or true / false)."""
    fields = {f.name: f.type for f in dataclasses.fields(KernelConfig)}
    overrides = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        if name not in fields or not value:
            raise ValueError(f"--set {setting!r}: expected FIELD=VALUE with FIELD one of "
                             f"{sorted(fields)}")
        overrides[name] = (value.lower() == "true" if fields[name] in (bool, "bool")
                           else int(value))
    return overrides


def jax_device_ms(call, calls: int) -> float:
    """The device's busy ms per `call` (compiled and warm): its kernels' and copies'
    summed durations over `calls` calls under jax.profiler (`bench.profile`'s "busy")."""
    with tempfile.TemporaryDirectory() as folder:
        profile = profile_call(lambda: [call() for _ in range(calls)], Path(folder),
                               flops=None, device_kind="")
    return profile["busy_ms"] / calls


def torch_device_ms(call, sync, calls: int) -> float:
    """`jax_device_ms` of a PyTorch `call` (warm), under torch.profiler's CUDA activity."""
    import torch

    with tempfile.TemporaryDirectory() as folder:
        cuda = torch.profiler.ProfilerActivity.CUDA
        with torch.profiler.profile(activities=[cuda]) as profile:
            sync([call() for _ in range(calls)][-1])
        path = Path(folder) / "trace.json"
        profile.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return sum(e["dur"] for e in events if e.get("ph") == "X"
               and e.get("cat") in TORCH_DEVICE_EVENTS) / calls / 1e3


def time_ours(lens, config: KernelConfig, *, any_decay: bool, timing: dict
              ) -> tuple[dict, dict]:
    """Wall and device ms of kda_prefill with 4 snapshots, bounded gate (and any decay):
    ({row: ms}, {row: device ms})."""
    inputs, offsets = kda_bench.make_inputs(lens), kda_bench.snapshot_offsets(lens, 4)
    wall, device = {}, {}
    for row, bound in (("bounded", kda_bench.GATE_LOWER_BOUND), ("any decay", None)):
        if row == "any decay" and not any_decay:
            continue
        fn = jax.jit(lambda i, off, b=bound: kda_prefill(
            **i, checkpoint_offsets=off, config=config, gate_lower_bound=b))
        wall[row] = time_calls(lambda fn=fn: fn(inputs, offsets), **timing)[0]
        if jax.default_backend() == "gpu":  # a CPU trace of interpret mode: seconds, no GPU
            device[row] = jax_device_ms(lambda fn=fn: fn(inputs, offsets), timing["iters"])
    return wall, device


def time_fla(lens, timing: dict) -> tuple[dict, dict]:
    """`time_ours` of fla's chunk_kda as its users call it (`bench.kda_kernel.fla_runner`):
    both empty where fla or torch cannot run."""
    inputs = kda_bench.make_inputs(lens)
    wall, device = {}, {}
    for row, options in FLA_ROWS.items():
        call, sync = kda_bench.fla_runner(inputs, lens, **options)
        if call is not None:
            wall[row] = time_calls(call, sync, **timing)[0]
            device[row] = torch_device_ms(call, sync, timing["iters"])
    return wall, device


def summarize(lines: list[dict], measure: str = "ms") -> list[dict]:
    """Each (case, heads, side, row)'s median of `measure` (a `MEASURES` key; lines
    without it are left out) over the lines; ours also as fla's median (safe_gate for the
    bounded row, `chunk_kda` for any decay) over its own."""
    runs = collections.defaultdict(list)
    for line in lines:
        for row, ms in line.get(measure, {}).items():
            runs[line["case"], line["heads"], line["side"], row].append(ms)
    medians = {key: statistics.median(values) for key, values in runs.items()}
    peer = {"bounded": "fla safe_gate", "any decay": "fla chunk_kda"}
    table = []
    for (case, heads, side, row), median in medians.items():
        fla = medians.get((case, heads, "fla", peer.get(row)))
        table.append(dict(case=case, heads=heads, side=side, row=row, runs=runs[case, heads,
                                                                                side, row],
                          median_ms=median, fla_over_ours=fla / median if fla else None))
    return table


def print_summary(table: list[dict], measure: str = "ms") -> None:
    print(f"{MEASURES[measure]} time\n{'case':6} {'H':>3} {'side':24} {'row':16} "
          f"{'median ms':>9} {'fla/ours':>8}  runs")
    for r in table:
        ratio = f"{r['fla_over_ours']:8.3f}" if r["fla_over_ours"] else f"{'':8}"
        runs = " ".join(f"{ms:.3f}" for ms in r["runs"])
        print(f"{r['case']:6} {r['heads']:3d} {r['side']:24} {r['row']:16} "
              f"{r['median_ms']:9.3f} {ratio}  {runs}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="8K", choices=sorted(kda_bench.CASES))
    parser.add_argument("--heads", type=int, default=kda_bench.HEADS)
    parser.add_argument("--tree", default="this", help="a name for this tree in the summary")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a KernelConfig field over the runtime's pick (repeatable)")
    parser.add_argument("--any", action="store_true", help="also the any-decay path")
    parser.add_argument("--fla", action="store_true", help="time fla instead of ours")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--summary", type=Path, help="print the medians of this file's runs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.summary:
        lines = [json.loads(line) for line in args.summary.read_text().splitlines()
                 if line.strip()]
        tables = {measure: summarize(lines, measure) for measure in MEASURES}
        for measure, table in tables.items():
            print_summary(table, measure)
        return tables
    if args.out is None:
        parser.error("--out is required unless --summary")
    if args.quick:
        kda_bench.HEAD_K = kda_bench.HEAD_V = kda_bench.QUICK_HEAD_DIM
        args.heads, args.case, args.iters, args.samples = kda_bench.QUICK_HEADS, "quick", 1, 1
    kda_bench.HEADS = args.heads  # make_inputs' and fla_runner's shapes
    lens = kda_bench.CASES[args.case]
    timing = dict(iters=args.iters, samples=args.samples)
    line = dict(case=args.case, heads=args.heads, device=jax.devices()[0].device_kind)
    if args.fla:
        line["side"] = "fla"
        line["ms"], line["device_ms"] = time_fla(lens, timing)
    else:
        config = dataclasses.replace(
            select_config(device_spec(), num_seqs=len(lens), num_heads=args.heads,
                          head_k=kda_bench.HEAD_K, head_v=kda_bench.HEAD_V,
                          num_tokens=sum(lens)), **config_overrides(args.set))
        side = " ".join([args.tree, *args.set])
        line.update(side=side, config=dataclasses.asdict(config))
        line["ms"], line["device_ms"] = time_ours(lens, config, any_decay=args.any,
                                                  timing=timing)
    for row, ms in line["ms"].items():
        device = line["device_ms"].get(row)
        print(f"{args.case} H={args.heads} {line['side']} {row}: {ms:.3f} ms"
              + (f", device {device:.3f} ms" if device is not None else ""), flush=True)
    with args.out.open("a") as f:
        f.write(json.dumps(line) + "\n")
    return line


if __name__ == "__main__":
    main()
