"""Time to ready of ``python -m serving.server``: cold, with a warm compilation cache, and
without the precompile.

    python -m bench.startup --quick                 # CPU: tiny preset, one batch shape
    python -m bench.startup                         # tiny preset, the server's defaults
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m bench.startup \\
        --server-args "--preset kimi-linear-48b --single-bucket"       # H200
    ... --runs cold --cache-dir D, later ... --runs warm --cache-dir D  # in two calls

Each run starts the server (`bench.local_server.LocalServer`: a subprocess on a free
loopback port, ``JAX_LOG_COMPILES=1``) with `--server-args` and times it from the process
start to its first ``/health`` answer (the server answers only once it is ready), then
stops it. Runs (`--runs`, in this order):
- cold: an empty persistent compilation cache (a fresh folder); the server precompiles
  every program its flags reach (``--precompile all``, its default);
- warm: the same flags and the cache the cold run filled (this one, or an earlier one
  given the same `--cache-dir`): the programs are read from disk;
- lazy: ``--precompile none`` and an empty cache: the server compiles only what its
  warm-up request needs, and every later shape stalls a request the first time.
Per run: seconds to ready, the server's own "precompiled N programs in S s" and "ready
after S s" figures, and from JAX's log lines the programs it lowered (``Compiling``
lines, also logged when the persistent cache then supplies the executable), the seconds
spent lowering them to MLIR and in the backend (an XLA compile, or loading a cache entry),
summed over threads, and the persistent-cache hits. A server that exits or is not ready
within `--start-timeout` is stopped and recorded with its error and the precompile's
last progress (programs done, of total, and the time it took), and the runs go on. Writes
JSON to bench/results/startup_<preset>.json (`--json`), with the device the server
runs on (asked of JAX in a short subprocess: this process never starts a JAX backend,
which on a GPU would take the memory the server needs).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import write_json
from bench.local_server import LocalServer
from bench.prefill import RESULTS

RUNS = ("cold", "warm", "lazy")
QUICK_SERVER_ARGS = ("--preset tiny --block-size 64 --max-num-batched-tokens 128 "
                     "--max-model-len 512 --max-num-seqs 4 --num-kv-blocks 48 "
                     "--num-state-slots 32 --single-bucket")
H200_COMMAND = ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 -m bench.startup --server-args "
                "\"--preset kimi-linear-48b --single-bucket\" "
                "--json $OUT/startup_kimi-linear-48b_single_bucket.json")
PRECOMPILED = re.compile(r"precompiled (\d+) programs in ([\d.]+) s \(([\d.]+) s of compiles")
READY = re.compile(r"ready after ([\d.]+) s")
# jax's log lines (JAX_LOG_COMPILES) of each program's lowering, its backend compile (or,
# on a persistent-cache hit, its load) and each hit.
LOWERED = re.compile(r"Finished jaxpr to MLIR module conversion \S+ in ([\d.]+) sec")
COMPILED = re.compile(r"Finished XLA compilation of \S+ in ([\d.]+) sec")
CACHE_HIT = "Persistent compilation cache hit"
PROGRESS = re.compile(r"precompiling:.*?(\d+)/(\d+) \[([\d:]+)")


def start_once(server_args: list[str], cache_dir: Path, log_path: Path, timeout_s: float,
               platform_env: dict[str, str]) -> dict:
    """Starts the server, waits for ``/health``, stops it: what the start took."""
    args = [*server_args, "--compile-cache-dir", str(cache_dir), "--log-level", "info"]
    begin, server = time.perf_counter(), LocalServer(args, log_path, env=platform_env,
                                                     start_timeout_s=timeout_s)
    try:
        with server:
            ready_s, error = time.perf_counter() - begin, None
            log, compiled = server.log(), server.compiled()
    except RuntimeError as failed:  # exited, or not ready within timeout_s (then stopped)
        ready_s, error = None, str(failed).splitlines()[0]
        log, compiled = server.log(), server.compiled()
    return dict(ready_s=ready_s, error=error, log=str(log_path), compiles_logged=len(compiled),
                **log_figures(log))


def log_figures(log: str) -> dict:
    """What a server's log (``--log-level info``, ``JAX_LOG_COMPILES=1``) says of its start."""
    precompiled, ready = PRECOMPILED.search(log), READY.search(log)
    return dict(
        precompiled_programs=precompiled and int(precompiled[1]),
        precompile_s=precompiled and float(precompiled[2]),
        compile_s_summed=precompiled and float(precompiled[3]),
        server_ready_after_s=ready and float(ready[1]),
        lowering_s_summed=sum(map(float, LOWERED.findall(log))),
        backend_s_summed=sum(map(float, COMPILED.findall(log))),
        cache_hits=log.count(CACHE_HIT),
        # The precompile's progress bar when the log ends: (done, total, elapsed).
        last_progress=(PROGRESS.findall(log) or [None])[-1],
    )  # fmt: skip


def run_benchmark(args) -> dict:
    server_args = shlex.split(args.server_args)
    env = {"JAX_PLATFORMS": args.jax_platforms} if args.jax_platforms else {}
    result = dict(device=_device_kind(env), platform=platform.platform(), args=vars(args),
                  server_args=server_args, h200_command=H200_COMMAND, runs={})
    workdir = Path(tempfile.mkdtemp(prefix="startup_"))
    cache = args.cache_dir or workdir / "xla"
    for run in args.runs:
        extra = ["--precompile", "none"] if run == "lazy" else []
        run_cache = workdir / "xla_lazy" if run == "lazy" else cache
        print(f"[{time.strftime('%H:%M:%S')}] {run} start", flush=True)
        entry = start_once(server_args + extra, run_cache, workdir / f"{run}.log",
                           args.start_timeout, env)
        print(f"[{time.strftime('%H:%M:%S')}] {run}: " + (
            f"ready after {entry['ready_s']:.1f} s" if entry["error"] is None else
            f"{entry['error']} (precompile progress {entry['last_progress']})"), flush=True)
        result["runs"][run] = entry
        write_json(result, args.json)
    return result


def _device_kind(env: dict[str, str]) -> str:
    """The kind of the device a server started with `env` runs on."""
    code = "import jax; print(jax.devices()[0].device_kind)"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, check=True).stdout.strip()


def print_table(result: dict) -> None:
    print(f"\nserver start-up on {result['device']}: python -m serving.server {' '.join(result['server_args'])}")
    print(f"{'run':>5} {'ready s':>8} {'programs':>9} {'precompile s':>13} {'lowered':>8} "
          f"{'lower s':>8} {'backend s':>10} {'cache hits':>11}")
    for run, e in result["runs"].items():
        programs = "-" if e["precompiled_programs"] is None else e["precompiled_programs"]
        precompile = "-" if e["precompile_s"] is None else f"{e['precompile_s']:.1f}"
        ready = "-" if e["ready_s"] is None else f"{e['ready_s']:.1f}"
        print(f"{run:>5} {ready:>8} {programs:>9} {precompile:>13} "
              f"{e['compiles_logged']:>8} {e['lowering_s_summed']:>8.1f} "
              f"{e['backend_s_summed']:>10.1f} {e['cache_hits']:>11}")
    print(f"\non the H200 (kimi-linear-48b, random weights drawn on the device):\n  "
          f"{result['h200_command']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.startup",
                                     description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true",
        help=f"CPU smoke run: --server-args {QUICK_SERVER_ARGS!r} unless given")
    add("--server-args", help="flags of python -m serving.server (default: --preset tiny)")
    add("--runs", default=",".join(RUNS), help=f"which runs, comma-separated ({','.join(RUNS)})")
    add("--cache-dir", type=Path, help="the compilation cache of the cold and warm runs "
        "(empty or absent for a cold run; default: a fresh temporary folder)")
    add("--start-timeout", type=float, default=1200.0, help="seconds a start may take")
    add("--jax-platforms", help="JAX_PLATFORMS for the server (e.g. cpu; default: as here)")
    add("--json", type=Path, help="output (bench/results/startup_<preset>.json)")
    args = parser.parse_args(argv)
    if args.server_args is None:
        args.server_args = QUICK_SERVER_ARGS if args.quick else "--preset tiny"
    args.runs = [r for r in args.runs.split(",") if r]
    if not args.runs or set(args.runs) - set(RUNS):
        parser.error(f"--runs {','.join(args.runs)!r}: choose from {RUNS}")
    filled = args.cache_dir is not None and args.cache_dir.is_dir() and any(
        args.cache_dir.iterdir())
    if "cold" in args.runs and filled:
        parser.error(f"--cache-dir {args.cache_dir} is not empty: a cold run needs an empty one")
    if "warm" in args.runs and ("cold" in args.runs[args.runs.index("warm"):]
                                or "cold" not in args.runs and not filled):
        parser.error("--runs: warm reads the cache a cold run filled: run cold first (here, "
                     "or earlier with the same --cache-dir)")
    preset = shlex.split(args.server_args)
    preset = preset[preset.index("--preset") + 1] if "--preset" in preset else "tiny"
    args.json = args.json or RESULTS / f"startup_{preset}.json"
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run_benchmark(args)
    print_table(result)
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
