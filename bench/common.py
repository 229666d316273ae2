"""What the benchmarks share: timing queued calls, the relative error they report, and
writing their JSON."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np


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


def write_json(result: dict, path: Path) -> None:
    """`result` to `path` (its folder made if missing); values JSON cannot hold as strings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
