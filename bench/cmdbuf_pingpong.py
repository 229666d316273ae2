"""Does alternating two copies of a step's executable spare XLA's CUDA-graph updates?

    python -m bench.cmdbuf_pingpong [--kernels 600] [--calls 300]

A decode step at batch 1 is host-bound on the H200 (docs/PERFORMANCE.md, "Decode through
the engine"): XLA updates every command of the step's CUDA graph on every call, because
the step's temporary allocation moves between calls (XLA's VMM mode, which pins it, cut
the updates from 670 to 28). With asynchronous dispatch step n + 1 is enqueued while step
n still holds its temporaries, so consecutive calls of one executable alternate between
two addresses. Two executables of the same program, called in turn, would each see the
address its previous call had, two steps back, if the allocator hands it out again.

This times a chain of small kernels (a few-row product and an activation, `--kernels`
launches in all) dispatched as the engine dispatches a decode step (call n + 1 before
waiting for call n), once with one executable and once with two called in turn, a fresh
host input each call. Host-bound, the wall time per call is the host's: what the
graph's update costs shows as the difference. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_json
from glmjax.xla_options import STEP_OPTIONS

RESULTS = Path(__file__).parent / "results"


def chain(x, w, *, kernels: int):
    """x [R, D] through `kernels` // 2 products with w[i % 4] [D, D], each followed by
    an activation XLA keeps as its own kernel (a reduction over the row)."""
    for i in range(kernels // 2):
        y = x @ w[i % w.shape[0]]
        x = y / (1 + jnp.max(jnp.abs(y), axis=-1, keepdims=True))
    return x


def make_step(name: str, kernels: int):
    """A jitted copy of `chain` whose executable is its own (the module name differs)."""
    def step(x, w):
        return chain(x, w, kernels=kernels)

    step.__name__ = step.__qualname__ = name
    return jax.jit(step, compiler_options=STEP_OPTIONS)


def run(steps, w, *, calls: int, rows: int, dim: int, rng) -> list[float]:
    """Seconds per call, dispatched as the engine does: call n + 1 is enqueued, then call
    n's result fetched."""
    inputs = [rng.normal(size=(rows, dim)).astype(np.float32) for _ in range(calls)]
    times, previous = [], None
    for i in range(calls):
        start = time.perf_counter()
        out = steps[i % len(steps)](inputs[i], w)
        if previous is not None:
            np.asarray(previous[0, 0])  # one small blocking transfer, as the engine's fetch
        previous = out
        times.append(time.perf_counter() - start)
    jax.block_until_ready(previous)
    return times[calls // 10:]  # past the warm-up


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=600)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "cmdbuf_pingpong.json")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(4, args.dim, args.dim)) / np.sqrt(args.dim), jnp.float32)
    variants = {"one executable": [make_step("step_a", args.kernels)],
                "two in turn": [make_step("step_a2", args.kernels),
                                make_step("step_b2", args.kernels)]}
    for steps in variants.values():  # compile outside the timing
        for step in steps:
            jax.block_until_ready(step(np.zeros((args.rows, args.dim), np.float32), w))
    result = dict(device=jax.devices()[0].device_kind, args={k: str(v) for k, v in
                                                            vars(args).items()}, runs=[])
    for repeat in range(args.repeats):  # alternate the variants: the host's speed drifts
        for name, steps in variants.items():
            times = run(steps, w, calls=args.calls, rows=args.rows, dim=args.dim, rng=rng)
            row = dict(variant=name, repeat=repeat, median_ms=statistics.median(times) * 1e3,
                       mean_ms=statistics.mean(times) * 1e3)
            result["runs"].append(row)
            print(f"{name:16} repeat {repeat}: median {row['median_ms']:.3f} ms, "
                  f"mean {row['mean_ms']:.3f} ms a call", flush=True)
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
