"""Compile time of one prefill (and decode) bucket at several depths, layers unrolled and
scanned (`glmjax.layer_scan`), from a cold or a warm persistent compilation cache.

    python -m bench.compile_time --quick                                 # CPU smoke run
    python -m bench.compile_time --preset kimi-linear-48b --layers 10,16,27 \\
        --tokens 8192 --compile-cache-dir /tmp/cc --out $OUT/cold.json  # H200, then again
                                                                        # --out $OUT/warm.json

Nothing runs and no weight is drawn: each step is lowered from abstract arguments (the
full preset's shapes: `--num-experts` cuts the experts only) and compiled, as the
server's precompile does, for a padding batch of the bucket `--tokens` tokens x
`--seqs` spans x `--blocks` MLA blocks per span (decode: `--seqs` rows). Per depth and
mode: seconds to lower and to compile (wall, and this process's CPU seconds). The
persistent compilation cache is a fresh directory unless `--compile-cache-dir` names one:
run twice with the same directory and the second run's compiles are the warm ones (read
from disk, as a restarted server reads them). Writes JSON (`--out`, default
bench/results/compile_time_<preset>.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import tempfile
import time
from pathlib import Path

import jax
from flax import nnx

from bench.common import write_json
from glmjax import compile_cache
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.layer_scan import layer_plan
from glmjax.model import HybridModel, decode, prefill, pure_state
from serving.precompile import padding_decode, padding_prefill

RESULTS = Path(__file__).parent / "results"


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def measure(config: ModelConfig, args, cache_dir: Path) -> dict:
    """Lower and compile `config`'s prefill (and decode) bucket twice: cold, then warm."""
    # As the engine passes them (`ModelSteps.place`): the same programs, and cache keys.
    model_state = pure_state(nnx.split(nnx.eval_shape(lambda: HybridModel(config,
                                                                           nnx.Rngs(0)))))
    caches = jax.eval_shape(lambda: Caches.init(config, args.slots, args.kv_blocks))
    steps = {"prefill": (prefill, padding_prefill(args.tokens, args.seqs, args.blocks))}
    if args.decode:
        steps["decode"] = (decode, padding_decode(args.seqs, args.blocks))
    plan = layer_plan(config)
    result = {"num_layers": config.num_layers, "scan_layers": config.scan_layers,
              "scanned_layers": plan.group_size * plan.num_groups}
    for name, (step, batch) in steps.items():
        # Every program differs (depth, mode, kind): its first compile misses the cache.
        before = _bytes(cache_dir)
        start = time.perf_counter()
        lowered = step.lower(model_state, caches, _abstract(batch))
        lower_s = time.perf_counter() - start
        start, start_cpu = time.perf_counter(), time.process_time()
        lowered.compile()
        compile_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
        # CPU seconds of this process too: wall time on a shared host counts other work.
        result[name] = {"lower_s": lower_s, "compile_s": compile_s, "compile_cpu_s": cpu_s,
                        "cache_bytes": _bytes(cache_dir) - before}
        print(f"  {config.num_layers:3d} layers, scan {'on ' if config.scan_layers else 'off'}"
              f" {name}: lower {lower_s:6.1f} s, compile {compile_s:6.1f} s "
              f"({cpu_s:.1f} CPU s)", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="kimi-linear-48b")
    parser.add_argument("--layers", default="10,16,27", help="comma-separated depths")
    parser.add_argument("--num-experts", type=int)
    parser.add_argument("--modes", default="unrolled,scanned")
    parser.add_argument("--tokens", type=int, default=2048, help="prefill bucket tokens")
    parser.add_argument("--seqs", type=int, default=1, help="spans (decode: rows)")
    parser.add_argument("--blocks", type=int, default=4, help="MLA blocks per span")
    parser.add_argument("--slots", type=int, default=8, help="KDA state slots")
    parser.add_argument("--kv-blocks", type=int, default=16, help="MLA cache blocks")
    parser.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                        help="also the decode bucket of --seqs rows")
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run: tiny preset, 9 layers, 64 tokens")
    parser.add_argument("--compile-cache-dir", type=Path,
                        help="persistent cache to use (default: a fresh one); a second run "
                             "with the same one compiles every program from it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.preset, args.layers, args.tokens, args.blocks = "tiny", "9", 64, 1
    modes = args.modes.split(",")
    if not set(modes) <= {"unrolled", "scanned"}:
        raise ValueError(f"--modes must list unrolled and/or scanned, got {args.modes!r}")
    # A fresh persistent cache unless given; every program is cached, however small (the
    # server's setting).
    cache_dir = args.compile_cache_dir or Path(tempfile.mkdtemp(prefix="compile_time_"))
    compile_cache.enable(cache_dir)

    base = ModelConfig.preset(args.preset)
    runs = []
    for depth in (int(d) for d in args.layers.split(",")):
        for mode in modes:
            config = dataclasses.replace(base.replace_depth(depth, args.num_experts),
                                         scan_layers=mode == "scanned")
            runs.append(measure(config, args, cache_dir))
    result = {"preset": args.preset, "num_experts": args.num_experts or base.num_experts,
              "tokens": args.tokens, "seqs": args.seqs, "blocks": args.blocks,
              "device": jax.devices()[0].device_kind, "host": platform.node(),
              "jax": jax.__version__, "runs": runs}
    out = args.out or RESULTS / f"compile_time_{args.preset}.json"
    write_json(result, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
