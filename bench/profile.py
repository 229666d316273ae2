"""GPU time of one step by op category, read from a `jax.profiler` trace.

    summary = profile_call(run_step, trace_dir, flops=step_flops(config, spans),
                           device_kind=jax.devices()[0].device_kind)
    print_profile(summary)

`profile_call` runs an already compiled and warmed-up step once under
``jax.profiler.trace(..., create_perfetto_trace=True)``, blocked on its result, and reads
back the ``perfetto_trace.json.gz`` jax writes (Chrome-trace JSON).

Which events are kernels. On a GPU the trace has one process per device plane
(``/device:GPU:0``) whose threads are its CUDA streams (``Stream #7(Kernel,MemcpyD2D)``);
every event on a stream is device time (kernels, memcpys, memsets). XLA wraps each kernel
launch in an annotation ``XlaModule:#prefix=P,hlo_module=M,program_id=I#`` /
``Thunk:#name=N,hlo_op=H,...#`` (xla/backends/gpu/runtime/annotation.cc) and the CUPTI
collector copies its keys into the event's args: ``hlo_op``, ``hlo_module``, ``prefix``
(the op-name prefix common to the whole module) and ``name`` (the fused ops' longest
common op-name prefix, P removed), plus ``op_name`` (the full path) at the detailed
annotation level. (Read from XLA's source; jax 0.11.2's CUDA plugin holds these
annotation formats. The tests run the parser on events shaped so and on a real CPU trace.)
On a CPU there is no device process: XLA's thunks run on host threads as events carrying
``hlo_op`` and ``hlo_module`` but no op name, so the caller passes the compiled HLO text
(`jax.stages.Compiled.as_text`) and the op name comes from its metadata (`hlo_op_paths`);
without it every CPU op lands in "projections" or "other". The same text is the fallback
for a GPU kernel whose annotation names no op.

Command buffers (CUDA graphs) hide the per-kernel annotations: on the H200 with jax 0.11.2
the kernels of a step compiled with XLA's defaults reach the trace as ``hlo_op`` =
``command_buffer_N`` with no op name (875 of 1,186 kernels of a glm5.3-flash prefill; the
first run of this profile put the MoE at 0 ms). So the traced step is a twin of the timed
one compiled without command buffers (`traceable`): the same kernels, each launched on
its own, so it may launch slower than the timed step. Hence both the summed kernel time
("busy") and the device span are reported, beside the timed step.

Per category the summary keeps the ops with the most time (`top_ops_ms`, op paths with the
layers' numeric suffixes dropped) and, for each, its launches and the HLO ops (fusions)
that ran it (`top_ops`): "decoder_block/add" alone does not say whether the residual add
ran on its own or fused into a norm.

Categories come from the `jax.named_scope`s in the op path (`SCOPES`), the first rule that
matches wins; a kernel outside them is a projection if it is a matrix product (`GEMM_MARKS`
in its kernel or HLO op name) and "other" otherwise (norms, convolution, gates, routing
sorts and gathers, cache writes, sampling).
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax

from bench.flops import MEASURED_MATMUL_BF16, PEAK_BF16, by_category, device_peak
from glmjax.xla_options import STEP_OPTIONS

# (category, scope names): a kernel whose op path has one of the names as a component
# belongs to the category; rules are tried in order (the indexer runs inside attention).
SCOPES = (
    ("dsa_indexer", ("dsa_indexer",)),
    ("kda_kernel", ("kda_scan",)),
    ("mla_attention", ("attention",)),
    ("moe", ("routed_experts",)),
    ("shared_experts", ("shared_experts",)),
    ("mhc", ("mhc_read", "mhc_write")),
)
CATEGORIES = ("moe", "shared_experts", "mla_attention", "dsa_indexer", "kda_kernel",
              "projections", "mhc", "other")
# Lower-case marks of a matrix product in a kernel name, an HLO op name or the last
# component of the op path: cuBLAS (nvjet, xmma, cutlass kernels; "cublas-gemm" custom
# calls), XLA's Triton GEMM fusions, jax's "dot_general".
GEMM_MARKS = ("gemm", "dot", "matmul", "cublas", "nvjet", "xmma", "cutlass")
GPU_PROCESS = "/device:GPU"
TOP_OPS = 12  # per category, the ops with the most device time (`top_ops_ms`)
HLO_OPS_SHOWN = 3  # per top op, the HLO ops (fusions) that ran it, most time first


class KernelEvent(NamedTuple):
    """One device op of the trace."""

    name: str  # the kernel (GPU) or thunk (CPU)
    device: int  # the trace's process id: one per GPU, the host's for a CPU run
    op_path: str  # jax op name, "jit(f)/scope/.../primitive" ("" when unknown)
    hlo_op: str
    hlo_module: str
    start_us: float
    duration_us: float


def categorize(event: KernelEvent) -> str:
    """The profile row of one kernel (see the module docstring)."""
    components = set(event.op_path.split("/"))
    for category, names in SCOPES:
        if components.intersection(names):
            return category
    label = f"{event.name} {event.hlo_op} {event.op_path.rsplit('/', 1)[-1]}".lower()
    return "projections" if any(mark in label for mark in GEMM_MARKS) else "other"


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = ")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="([^"]*)"')
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)"
                    r"|(?:branch_computations|called_computations)=\{([^}]*)\}")


def _common_prefix(paths: Iterable[str]) -> str:
    """Longest common prefix by "/"-separated components, as XLA's GPU annotations take it."""
    split = [p.split("/") for p in paths]
    if not split:
        return ""
    common = []
    for parts in zip(*split):
        if any(part != parts[0] for part in parts):
            break
        common.append(parts[0])
    return "/".join(common)


def hlo_op_paths(hlo_text: str) -> tuple[str, dict[str, str]]:
    """Compiled HLO text -> (module name, {instruction name: op path}).

    An instruction's path is its own op_name metadata; one without (XLA CPU's library
    fusions) gets the longest common prefix of the op names inside the computations it
    calls, as XLA's GPU annotations do, or else that of the computation it is in (a fusion
    inside a while loop's body). Names without a "/" (parameters of reduction regions) are
    ignored."""
    module = re.search(r"^HloModule ([^\s,]+)", hlo_text, re.MULTILINE)
    inside: dict[str, list[str]] = {}  # computation -> the op names of its instructions
    own: dict[str, str] = {}
    calls: dict[str, list[str]] = {}
    parent: dict[str, str] = {}
    current = ""
    for line in hlo_text.splitlines():
        if header := _COMPUTATION.match(line):
            current = header.group(1)
            inside[current] = []
        elif instruction := _INSTRUCTION.match(line):
            name = instruction.group(1)
            parent[name] = current
            op_name = _OP_NAME.search(line)
            if op_name and "/" in op_name.group(1):
                own[name] = op_name.group(1)
                inside.setdefault(current, []).append(op_name.group(1))
            calls[name] = [c.strip().lstrip("%") for single, listed in _CALLS.findall(line)
                           for c in ([single] if single else listed.split(","))]
    paths = dict(own)
    for name, called in calls.items():
        if name not in own:
            paths[name] = (_common_prefix([p for c in called for p in inside.get(c, [])])
                           or _common_prefix(inside.get(parent[name], [])))
    return (module.group(1) if module else ""), paths


def _op_path(args: dict, hlo_paths: dict[str, dict[str, str]]) -> str:
    if args.get("op_name"):
        return args["op_name"]
    if args.get("name"):
        return "/".join(filter(None, (args.get("prefix"), args["name"])))
    path = hlo_paths.get(args.get("hlo_module", ""), {}).get(args.get("hlo_op", ""))
    if path:
        return path
    tf_op = args.get("tf_op", "")
    return tf_op if "/" in tf_op else ""


def _leaves(events: list[dict]) -> list[dict]:
    """Drops events that enclose a later event of the same thread (a CPU while-loop thunk
    around its body's thunks), so no time is counted twice. Kernels on a stream never
    overlap, so on a GPU this keeps everything."""
    rows: dict[tuple, list[dict]] = {}
    for e in events:
        rows.setdefault((e["pid"], e["tid"]), []).append(e)
    kept = []
    for row in rows.values():
        row.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        kept += [e for e, nxt in zip(row, row[1:] + [None])
                 if nxt is None or nxt["ts"] >= e["ts"] + e.get("dur", 0)]
    return kept


def kernel_events(trace: dict, hlo_texts: Iterable[str] = ()) -> list[KernelEvent]:
    """The device ops of a Chrome-trace dict: GPU stream events when the trace has a GPU
    process, else (a CPU run) host-thread events naming an ``hlo_op``."""
    hlo_paths = dict(hlo_op_paths(text) for text in hlo_texts)
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpus = {pid for pid, name in processes.items() if name.startswith(GPU_PROCESS)}
    complete = [e for e in events if e.get("ph") == "X"]
    if gpus:
        # Streams only: xprof's derived lines ("XLA Ops", "XLA Modules", ...) would count
        # every kernel again; an unnamed line is kept.
        chosen = [e for e in complete if e["pid"] in gpus
                  and threads.get((e["pid"], e["tid"]), "Stream").startswith("Stream")]
    else:
        chosen = _leaves([e for e in complete if "hlo_op" in e.get("args", {})])
    return [KernelEvent(e["name"], e["pid"], _op_path(e.get("args", {}), hlo_paths),
                        e.get("args", {}).get("hlo_op", ""),
                        e.get("args", {}).get("hlo_module", ""), float(e["ts"]),
                        float(e.get("dur", 0.0)))
            for e in sorted(chosen, key=lambda e: e["ts"])]


def load_trace(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


# XLA's command buffers off: see the module docstring.
TRACE_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


def traceable(fn: Callable, **jit_kwargs) -> Callable:
    """``jax.jit(fn, **jit_kwargs)`` of a model step whose GPU kernels keep their op
    annotations in a trace: the step's own compile options (`STEP_OPTIONS`) with command
    buffers off on a GPU, unchanged elsewhere (so a CPU trace reuses the step's program)."""
    options = dict(STEP_OPTIONS)
    if jax.default_backend() == "gpu":
        options.update(TRACE_COMPILER_OPTIONS)
    return jax.jit(fn, compiler_options=options, **jit_kwargs)


def record_trace(run: Callable[[], Any], trace_dir: Path) -> Path:
    """Runs `run` once under the profiler, blocked on what it returns; the perfetto trace.

    `run` must already be compiled and warmed up: a compile inside the trace is traced too.
    """
    trace_dir = Path(trace_dir)
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        jax.block_until_ready(run())
    return max(trace_dir.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)


def _op_label(event: KernelEvent) -> str:
    """Where a kernel's time goes in `top_ops_ms`: its op path without the jit prefix and
    numeric suffixes (so a layer's 27 copies add up), else its kernel name."""
    if not event.op_path:
        return event.name
    return re.sub(r"\.\d+|\[\d+\]", "", event.op_path.split("/", 1)[-1])


def _per_second(flops: float, seconds: float | None) -> float | None:
    return flops / seconds if seconds else None


def summarize(events: Sequence[KernelEvent], flops: dict[str, int] | None = None, *,
              device_kind: str = "", step_s: float | None = None) -> dict:
    """Time per category, useful FLOPs (`bench.flops.step_flops` terms) and MFU.

    MFU is useful FLOP/s over the device's dense bf16 peak (`PEAK_BF16`) and over its
    measured matmul rate (`MEASURED_MATMUL_BF16`), each against the summed kernel time
    ("busy"), the device span (first kernel start to last kernel end) and, when given,
    `step_s` (a timed, untraced step); the last two times the number of devices in the
    trace (a mesh's kernels are summed over its devices, the FLOPs are the whole step's).
    """
    rows = {c: {"ms": 0.0, "kernels": 0} for c in CATEGORIES}
    ops = {c: collections.Counter() for c in CATEGORIES}
    launches = collections.Counter()  # (category, op label): kernels
    fusions = collections.defaultdict(collections.Counter)  # (category, label): HLO op ms
    for e in events:
        category, label = categorize(e), _op_label(e)
        rows[category]["ms"] += e.duration_us / 1e3
        rows[category]["kernels"] += 1
        ops[category][label] += e.duration_us / 1e3
        launches[category, label] += 1
        fusions[category, label][re.sub(r"\.\d+$", "", e.hlo_op or e.name)] += e.duration_us / 1e3
    for category, row in rows.items():
        top = ops[category].most_common(TOP_OPS)
        row["top_ops_ms"] = dict(top)
        # what the labels alone hide: how many launches, and which fusions ran an op
        row["top_ops"] = {label: dict(
            kernels=launches[category, label],
            hlo_ops=[name for name, _ in fusions[category, label].most_common(HLO_OPS_SHOWN)])
            for label, _ in top}
    busy_ms = sum(r["ms"] for r in rows.values())
    span_ms = (max(e.start_us + e.duration_us for e in events) - events[0].start_us) / 1e3 \
        if events else 0.0
    flop_rows = by_category(flops) if flops else {}
    for category, row in rows.items():
        row["share"] = row["ms"] / busy_ms if busy_ms else 0.0
        if flops:
            row["tflop"] = flop_rows.get(category, 0) / 1e12
            row["tflop_per_s"] = _per_second(row["tflop"], row["ms"] / 1e3)
    devices = len({e.device for e in events})
    out = dict(device=device_kind, devices=devices, kernels=len(events), busy_ms=busy_ms,
               span_ms=span_ms, step_s=step_s, categories=rows)
    if flops:
        total = sum(flops.values())
        times = {"busy": busy_ms / 1e3, "span": devices * span_ms / 1e3,
                 "step": step_s and devices * step_s}
        peaks = {"peak": device_peak(device_kind, PEAK_BF16),
                 "measured_matmul": device_peak(device_kind, MEASURED_MATMUL_BF16)}
        out.update(
            useful_tflop=total / 1e12, flops_by_term=flops,
            peaks_tflop_per_s={k: v and v / 1e12 for k, v in peaks.items()},
            mfu={f"{p}_{t}": (total / seconds / peak if peak and seconds else None)
                 for p, peak in peaks.items() for t, seconds in times.items()},
        )  # fmt: skip
    return out


def profile_call(run: Callable[[], Any], trace_dir: Path, *, flops: dict[str, int] | None,
                 device_kind: str, hlo_texts: Iterable[str] = (),
                 step_s: float | None = None) -> dict:
    """`record_trace` then `summarize`; the trace's path under ``trace``."""
    path = record_trace(run, trace_dir)
    events = kernel_events(load_trace(path), hlo_texts)
    return summarize(events, flops, device_kind=device_kind, step_s=step_s) | {
        "trace": str(path)}


def print_profile(summary: dict, title: str = "step") -> None:
    """One row per category: device ms, % of the summed kernel time, useful GFLOP, TFLOP/s."""
    print(f"\nper-op profile, {title}: {summary['kernels']} device ops, busy "
          f"{summary['busy_ms']:.2f} ms, span {summary['span_ms']:.2f} ms "
          f"{summary.get('trace', '')}")
    print(f"{'category':>15} {'ms':>9} {'%':>6} {'GFLOP':>9} {'TFLOP/s':>8}")
    for category, row in summary["categories"].items():
        rate = row.get("tflop_per_s")
        print(f"{category:>15} {row['ms']:>9.3f} {100 * row['share']:>6.1f} "
              f"{1e3 * row.get('tflop', 0):>9.1f} {'-' if rate is None else f'{rate:.1f}':>8}")
        for op, ms in list(row.get("top_ops_ms", {}).items())[:3]:
            print(f"{'':>17}{ms:>9.3f}  {op[-90:]}")
    if "useful_tflop" not in summary:
        return
    mfu = {k: "-" if v is None else f"{100 * v:.1f}%" for k, v in summary["mfu"].items()}
    peaks = summary["peaks_tflop_per_s"]
    print(f"useful {summary['useful_tflop']:.3f} TFLOP; MFU vs bf16 peak {peaks['peak']} "
          f"TFLOP/s: busy {mfu['peak_busy']}, span {mfu['peak_span']}, timed step "
          f"{mfu['peak_step']}; vs measured matmul {peaks['measured_matmul']} TFLOP/s: busy "
          f"{mfu['measured_matmul_busy']}, span {mfu['measured_matmul_span']}, timed step "
          f"{mfu['measured_matmul_step']}")
