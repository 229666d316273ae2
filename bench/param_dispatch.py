"""Host time of a jitted call that takes a preset's whole parameter tree, in each form.

    python -m bench.param_dispatch [--preset kimi-linear-48b] [--calls 1000] [--repeats 5]

A batch-1 decode step is host-bound (docs/PERFORMANCE.md, "Decode through the engine"),
and every jitted call flattens its arguments on the host. This times a trivial jitted
function (x + 1) called with the parameters as the engine could pass them: an
``nnx.State`` (flattened variable by variable in Python), nested dicts of arrays, and
`glmjax.model.FlatParams` (`pure_state`'s form: the leaves one level deep, the dicts'
treedef as static aux data), against no parameters at all. The leaves are one-element
arrays of the preset's tree (no weights are drawn; their size does not enter a call's
host time). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import git_commit, write_json
from glmjax.config import ModelConfig
from glmjax.model import HybridModel, pure_state

RESULTS = Path(__file__).parent / "results"


def parameter_forms(preset: str) -> dict:
    """The preset's parameter tree (one-element leaves) in each form the step could take."""
    config = ModelConfig.preset(preset)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0))))
    small = jax.tree.map(lambda _: jnp.zeros((1,), jnp.float32), state)
    return {"nnx.State": (graphdef, small), "nested dicts": (graphdef, nnx.to_pure_dict(small)),
            "FlatParams (pure_state)": pure_state((graphdef, small)), "no parameters": None}


def host_us_per_call(params, *, calls: int, repeats: int) -> float:
    """Best of `repeats` means over `calls` calls of a jitted x + 1 taking `params`."""
    step = jax.jit(lambda p, x: x + 1)
    x = jnp.zeros(())
    for _ in range(10):  # compile, warm the dispatch cache
        x = step(params, x)
    jax.block_until_ready(x)
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            x = step(params, x)
        jax.block_until_ready(x)
        means.append((time.perf_counter() - start) / calls * 1e6)
    return min(means)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.param_dispatch",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="kimi-linear-48b")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    out = args.out or RESULTS / f"param_dispatch_{args.preset}.json"
    rows = []
    for name, params in parameter_forms(args.preset).items():
        leaves = len(jax.tree.leaves(params))
        us = host_us_per_call(params, calls=args.calls, repeats=args.repeats)
        rows.append(dict(form=name, leaves=leaves, host_us_per_call=us))
        print(f"{name:24} {leaves:5} leaves  {us:8.1f} us a call", flush=True)
    result = dict(preset=args.preset, device=jax.devices()[0].device_kind,
                  host=platform.processor() or platform.machine(), commit=git_commit(),
                  args={k: str(v) for k, v in vars(args).items()}, rows=rows)
    write_json(result, out)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
