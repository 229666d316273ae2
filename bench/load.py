"""Load test of the HTTP server: ``python -m bench.load``.

    python -m bench.load                                  # starts a tiny-preset server
    python -m bench.load --server-args "--preset tiny --block-size 64 --single-bucket"
    python -m bench.load --url http://127.0.0.1:8000 --clients 16 --requests 128

N concurrent clients (``bench.load_client``, default 64) share one queue of sends
(``bench.load_workload``):
streaming and whole answers, ``/v1/completions`` and ``/v1/chat/completions``, bodies on a
few shared prefixes, some disconnecting mid-request or mid-stream. The run is bounded by
``--requests`` and ``--duration``. Then:

- every temperature-0 body is sent again alone (one at a time, after the load by default:
  ``--reference``) and each answer under load must equal it (text and finish reason);
- each send is reported completed, failed (an HTTP error, a broken stream, a timeout),
  wrong (completed but not the answer alone) or disconnected (by the client, on purpose);
- TTFT (streams: the first event with text) and latency p50 / p95 / p99, tokens/s
  (completion tokens of completed sends over the load's wall time);
- compiles during the load: the server's own counter if ``/metrics`` has one (a name with
  ``compil``), else, for a server this command started, the "Compiling" lines that
  ``JAX_LOG_COMPILES=1`` makes it log; else unknown;
- whether the server went back to idle after the load (``/metrics``: running, waiting,
  kv_blocks_used, state_slots_used all 0; cached KV blocks and retained state slots are
  not "used") and ``/health`` answers 200 at the end.

Prints a table and writes the whole report as JSON (``--out``, with the server's log
beside it when this command started the server). Exit status 1 if a send failed or was
wrong, or the server did not go back to idle.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from bench.load_client import run_clients, send_alone
from bench.load_workload import WorkloadOptions, make_bodies, make_sends
from bench.local_server import LocalServer, check_loopback, compile_counter, read_metrics

IDLE_GAUGES = (
    "glmjax_running",
    "glmjax_waiting",
    "glmjax_kv_blocks_used",
    "glmjax_state_slots_used",
)
DEFAULT_SERVER_ARGS = "--preset tiny"  # what `make serve` runs


@dataclasses.dataclass(frozen=True)
class RunOptions:
    clients: int = 64
    duration_s: float = 300.0  # no send starts after this
    request_timeout_s: float = 300.0
    reference: str = "after"  # send the checked bodies alone "before" or "after" the load
    idle_timeout_s: float = 30.0

    def __post_init__(self):
        if self.clients < 1:
            raise ValueError(f"clients={self.clients}: must be at least 1")
        if self.reference not in ("before", "after"):
            raise ValueError(f"reference={self.reference!r}: 'before' or 'after'")


def wait_idle(url: str, timeout_s: float) -> tuple[bool, dict[str, float]]:
    """(whether running, waiting, kv_blocks_used and state_slots_used all reached 0 within
    ``timeout_s``, the last values read)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = read_metrics(None, url)
        values = {name: metrics.get(name, float("nan")) for name in IDLE_GAUGES}
        if all(v == 0 for v in values.values()):
            return True, values
        if time.monotonic() > deadline:
            return False, values
        time.sleep(0.2)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    p = np.percentile(values, [50, 95, 99])
    return {"p50": float(p[0]), "p95": float(p[1]), "p99": float(p[2])}


def run_load(
    url: str,
    workload: WorkloadOptions,
    options: RunOptions,
    *,
    log_compiles: Callable[[], list[str]] | None = None,
) -> dict:
    """Runs the load against the server at ``url`` and returns the report (see the module
    docstring). ``log_compiles``: what the server has logged compiling so far
    (``LocalServer.compiled``), when that is known."""
    url = check_loopback(url)
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    bodies = make_bodies(workload, model)
    sends = make_sends(workload, bodies)
    reference = {}
    if options.reference == "before":
        reference = asyncio.run(send_alone(url, bodies, options.request_timeout_s))
    before = read_metrics(None, url)
    logged_before = log_compiles() if log_compiles else None
    results, wall_s = asyncio.run(
        run_clients(url, sends, options.clients, options.duration_s, options.request_timeout_s)
    )
    after = read_metrics(None, url)
    idle, idle_values = wait_idle(url, options.idle_timeout_s)
    compiled = None if log_compiles is None else log_compiles()[len(logged_before) :]
    compiles, compiles_source = None, "unknown: no compile counter in /metrics, no server log"
    if compile_counter(after) is not None:
        compiles = compile_counter(after) - (compile_counter(before) or 0)
        compiles_source = "/metrics"
    elif compiled is not None:
        compiles, compiles_source = len(compiled), "server log (JAX_LOG_COMPILES=1)"
    if options.reference == "after":
        reference = asyncio.run(send_alone(url, bodies, options.request_timeout_s))
    checked = {b.key for b in bodies if b.checked}
    wrong = []
    for r in results:
        ref = reference.get(r.key)
        if r.outcome != "completed" or r.key not in checked or ref is None:
            continue
        if ref.outcome != "completed" or (r.text, r.finish_reason) != (ref.text, ref.finish_reason):
            r.outcome = "wrong"
            wrong.append(
                {
                    "index": r.index,
                    "key": r.key,
                    "stream": r.stream,
                    "path": r.path,
                    "got": [r.text, r.finish_reason],
                    "alone": [ref.text, ref.finish_reason],
                    "alone_error": ref.error,
                }
            )
    counts = {
        k: sum(r.outcome == k for r in results)
        for k in ("completed", "failed", "wrong", "disconnected")
    }
    tokens = sum(r.completion_tokens for r in results if r.outcome in ("completed", "wrong"))
    health = httpx.get(f"{url}/health", timeout=30)
    return {
        "url": url,
        "model": model,
        "workload": dataclasses.asdict(workload),
        "options": dataclasses.asdict(options),
        "sends": len(results),
        "not_sent": len(sends) - len(results),
        **counts,
        "reference_failed": [
            {"key": k, "status": r.status, "error": r.error}
            for k, r in sorted(reference.items())
            if r.outcome != "completed"
        ],
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "completion_tokens": tokens,
        "ttft_s": _percentiles(
            [r.ttft_s for r in results if r.ttft_s is not None and r.outcome != "failed"]
        ),
        "latency_s": _percentiles([r.latency_s for r in results if r.latency_s is not None]),
        "compiles_during_load": compiles,
        "compiles_source": compiles_source,
        "compiled_during_load": compiled,
        "idle_after_load": idle,
        "idle_gauges": idle_values,
        "health_after": {"status": health.status_code, "body": health.text[:500]},
        "failures": [dataclasses.asdict(r) for r in results if r.outcome == "failed"][:50],
        "wrong_answers": wrong[:50],
        "prefix_cache_hits": after.get("glmjax_prefix_cache_hits_total", 0)
        - before.get("glmjax_prefix_cache_hits_total", 0),
    }


def ok(report: dict) -> bool:
    return (
        report["failed"] == 0
        and report["wrong"] == 0
        and not report["reference_failed"]
        and report["idle_after_load"]
        and report["health_after"]["status"] == 200
    )


def table(report: dict) -> str:
    def ms(p: dict) -> str:
        return " / ".join(
            "-" if p[k] is None else f"{1000 * p[k]:.0f}" for k in ("p50", "p95", "p99")
        )

    rows = [
        ("sends (not sent)", f"{report['sends']} ({report['not_sent']})"),
        (
            "completed / failed / wrong / disconnected",
            " / ".join(str(report[k]) for k in ("completed", "failed", "wrong", "disconnected")),
        ),
        ("bodies failing alone", str(len(report["reference_failed"]))),
        ("TTFT p50 / p95 / p99 (ms)", ms(report["ttft_s"])),
        ("latency p50 / p95 / p99 (ms)", ms(report["latency_s"])),
        ("tokens/s (completion)", f"{report['tokens_per_s']:.1f}"),
        ("wall time (s)", f"{report['wall_s']:.1f}"),
        ("prefix-cache hits", f"{report['prefix_cache_hits']:.0f}"),
        ("compiles during load", f"{report['compiles_during_load']} ({report['compiles_source']})"),
        ("idle after load", f"{report['idle_after_load']} {report['idle_gauges']}"),
        ("/health after", str(report["health_after"]["status"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def parse_args(argv=None) -> argparse.Namespace:
    w, r = WorkloadOptions(), RunOptions()
    p = argparse.ArgumentParser(
        prog="python -m bench.load",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--url", help="a running server (loopback only); default: start one")
    p.add_argument(
        "--server-args",
        default=DEFAULT_SERVER_ARGS,
        help="arguments of the python -m serving.server this command starts",
    )
    p.add_argument("--clients", type=int, default=r.clients, help="concurrent clients")
    p.add_argument(
        "--duration", type=float, default=r.duration_s, help="seconds; no send starts after"
    )
    p.add_argument(
        "--request-timeout", type=float, default=r.request_timeout_s, help="seconds per send"
    )
    p.add_argument(
        "--reference",
        choices=("before", "after"),
        default=r.reference,
        help="when the temperature-0 bodies are sent alone",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=r.idle_timeout_s,
        help="seconds for the server to go back to idle after the load",
    )
    for field in dataclasses.fields(WorkloadOptions):
        p.add_argument(
            "--" + field.name.replace("_", "-"),
            type=type(getattr(w, field.name)),
            default=getattr(w, field.name),
            help="see bench.load_workload.WorkloadOptions",
        )
    p.add_argument("--out", type=Path, default=Path("bench/results/load.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so that a server this command started is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        workload = WorkloadOptions(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(WorkloadOptions)}
        )
        options = RunOptions(
            args.clients, args.duration, args.request_timeout, args.reference, args.idle_timeout
        )
        if args.url:
            report = run_load(args.url, workload, options)
        else:
            log = args.out.with_suffix(".server.log")
            with LocalServer(shlex.split(args.server_args), log) as server:
                report = run_load(server.url, workload, options, log_compiles=server.compiled)
                report["server_args"], report["server_log"] = args.server_args, str(log)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"report: {args.out}")
    return 0 if ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
