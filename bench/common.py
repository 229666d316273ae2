"""What the benchmarks share: timing queued calls, the relative error they report, and
writing their JSON, the commit a result comes from, and the server's XLA flag."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import jax
import numpy as np

from glmjax import xla_options


def time_calls(call, sync=jax.block_until_ready, *, iters, samples):
    """Median milliseconds per call over `samples` batches of `iters` queued calls, each
    batch closed by one `sync` of the last output (after one warm-up call), and every
    batch's time."""
    sync(call())
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(iters):
            out = call()
        sync(out)
        times.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(times), times


def relative_error(ours, reference):
    """max |ours - reference| / max |reference|, in fp32."""
    ours, reference = (np.asarray(x, np.float32) for x in (ours, reference))
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def fill_defaults(args, quick: dict, full: dict) -> None:
    """Each flag of `args` left unset (None) takes its value from `quick` (a `--quick` run)
    or `full`."""
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def positive_sizes(parser, flag: str, text) -> list[int]:
    """The distinct sizes of a comma-separated flag value, ascending; a parser error (exit 2)
    unless there is one or more and all are >= 1."""
    sizes = sorted({int(x) for x in str(text).split(",") if x})
    if not sizes or sizes[0] < 1:
        parser.error(f"{flag} {text!r}: give one or more sizes >= 1")
    return sizes


def write_json(result: dict, path: Path) -> None:
    """`result` to `path` (its folder made if missing); values JSON cannot hold as strings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))


def git_commit() -> str | None:
    """GLMJAX_COMMIT if set (a copied tree whose .git is stale or absent, as on the lent
    device machines), else the checkout's HEAD."""
    if os.environ.get("GLMJAX_COMMIT"):
        return os.environ["GLMJAX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def add_pin_temporaries(parser) -> None:
    """``--pin-temporaries / --no-pin-temporaries``, the server's flag of that name."""
    parser.add_argument(
        "--pin-temporaries", action=argparse.BooleanOptionalAction, default=True,
        help="as the server's flag: XLA_FLAGS SKIP_TEMP before JAX starts (not with --quick, "
             "which runs where JAX may have started already)")


def pin_temporaries(args) -> None:
    """What ``--pin-temporaries`` asks for, before JAX starts (never with ``--quick``)."""
    if args.pin_temporaries and not args.quick:
        xla_options.pin_temporaries()


def add_batch_invariant(parser) -> None:
    """``--batch-invariant``, the server's flag of that name."""
    parser.add_argument(
        "--batch-invariant", action="store_true",
        help="as the server's flag: the model's batch-invariant prefill, and XLA_FLAGS "
             "without split-K GEMMs before JAX starts (not with --quick, which runs where "
             "JAX may have started already; no effect on a CPU)")


def batch_invariant(args) -> None:
    """The XLA flag ``--batch-invariant`` asks for, before JAX starts (never with
    ``--quick``); the model config carries the rest."""
    if args.batch_invariant and not args.quick:
        xla_options.batch_invariant_gemms()
