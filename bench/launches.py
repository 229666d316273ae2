"""The kernels a model step launches on the H200, counted without a GPU.

    make deviceless-plugin        # once: the CUDA PJRT plugin's wheels into .cuda-plugin
    JAX_PLATFORMS=cpu PYTHONPATH=.cuda-plugin .venv/bin/python -m bench.launches \\
        --preset kimi-linear-48b --step prefill --tokens 8192

XLA compiles a program for a GPU it does not have through the CUDA plugin's compile-only
topology (`jax.experimental.topologies`, an H200 described by `H200_TARGET`); the Pallas
kernels lower for sm_90 as on the device. Read from the optimised program: every kernel
the step launches (fusions, custom calls, copies, sorts, scatters) by kind and by the op
that made it, the while loops with their trip counts (each iteration launches its body
again: `runtime_launches` counts them), and the copies of the donated caches. What it
cannot see: autotuned GEMM configs (the defaults are used), cuDNN calls (MLA attention
runs on the Pallas kernel here), the CUB sort (XLA falls back without its scratch data),
time. It found the latent pool copied twice per MLA layer per prefill step and mHC's
Sinkhorn loop (~9,000 launches a glm step) (docs/PERFORMANCE.md, "Kernel launches per
step").
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_json

RESULTS = Path(__file__).parent / "results"
# The H200's device description for XLA (stream_executor.GpuTargetConfigProto, text): the
# fields its GPU compiler reads, from NVIDIA's published figures.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 151397597184
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200"
"""
BOOKKEEPING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "call",
               "after-all", "partition-id", "replica-id", "opt-barrier"}


@dataclasses.dataclass
class Launches:
    """What one optimised program launches: by kind and op, each kernel once (`static`);
    `runtime` a run's launches, a while loop's condition and body once an iteration (its
    known trip count, else once) and a conditional's largest branch."""

    by_kind: collections.Counter
    by_op: collections.Counter
    loops: list[dict]
    runtime: int
    cache_copies: list[str]

    @property
    def static(self) -> int:
        return sum(self.by_kind.values())


def computations(hlo: str) -> dict[str, list[str]]:
    """The program's computations by name (the entry as "ENTRY"): their instruction lines."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"(ENTRY )?%(\S+) .*\{$", line)
        if head and not line.startswith(" "):
            name = "ENTRY" if head.group(1) else head.group(2)
            comps[name] = []
        elif name and line.startswith("  "):
            comps[name].append(line)
    return comps


def count_launches(hlo: str) -> Launches:
    """The kernels of optimised HLO text (`Compiled.as_text()`): the entry computation's and
    those of the loops and branches it runs, each bookkeeping instruction left out."""
    comps = computations(hlo)
    by_kind, by_op, loops, copies = collections.Counter(), collections.Counter(), [], []

    def walk(name: str) -> int:
        """Kernels one run of computation `name` launches, its loops' iterations counted."""
        launched = 0
        for line in comps.get(name, ()):
            inst = re.match(r"\s*(?:ROOT )?%(\S+) = .*? ([a-z\-]+)\(", line)
            if not inst or inst.group(2) in BOOKKEEPING:
                continue
            op_name = re.search(r'op_name="([^"]+)"', line)
            scope = re.sub(r"^jit\([^)]*\)/", "", op_name.group(1)) if op_name else inst.group(1)
            if inst.group(2) == "while":  # the condition and the body, once an iteration
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                n = int(trips.group(1)) if trips else 1
                inner = sum(walk(c) for c in re.findall(r"(?:condition|body)=%([\w.\-]+)", line))
                loops.append(dict(op=scope, trips=n, launches_an_iteration=inner))
                launched += n * inner
                continue
            if inst.group(2) == "conditional":  # one branch runs: the largest counted
                branches = re.findall(r"%([\w.\-]+)", line.split("branch_computations={")[-1]
                                      .split("}")[0]) if "branch_computations" in line else (
                    re.findall(r"(?:true|false)_computation=%([\w.\-]+)", line))
                launched += max((walk(b) for b in branches), default=0)
                continue
            kind = inst.group(2)
            detail = re.search(r'custom_call_target="([^"]+)"|kind=(k\w+)', line)
            if detail:
                kind += ":" + (detail.group(1) or detail.group(2))
            by_kind[kind] += 1
            by_op[kind, scope] += 1
            if inst.group(2) == "copy" and re.search(r"copy\(%caches", line):
                copies.append(line.strip()[:160])
            launched += 1
        return launched

    runtime = walk("ENTRY")
    return Launches(by_kind, by_op, loops, runtime, copies)


def h200_device():
    """A compile-only H200 (the CUDA PJRT plugin's topology); SystemExit without the plugin."""
    from jax.experimental import topologies
    try:
        topology = topologies.get_topology_desc("cuda", "cuda", target_config=H200_TARGET,
                                                topology="1x1x1")
    except (RuntimeError, NotImplementedError, ValueError) as error:
        raise SystemExit("bench.launches needs the CUDA PJRT plugin on PYTHONPATH with "
                         "JAX_PLATFORMS=cpu: run `make deviceless-plugin`, then "
                         f"JAX_PLATFORMS=cpu PYTHONPATH=.cuda-plugin ({error})") from None
    return topology.devices[0]


def as_gpu(device) -> None:
    """Make this process's kernel choices those of one H200: the model's "one GPU?" checks
    read `jax.devices()` / `jax.default_backend()`, Pallas's Triton lowering its GPU info."""
    from jax._src.pallas.triton import gpu_info
    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    gpu_info.get_gpu_info = lambda: info
    jax.devices = lambda *args, **kwargs: [device]
    jax.default_backend = lambda: "gpu"


def compile_step(args, device) -> str:
    """The optimised HLO of the preset's prefill or decode step (`glmjax.model`), with the
    caches donated and the step's compile options, as the engine runs it."""
    from flax import nnx

    from bench.model_prefill import cold_prompt_batch
    from glmjax.batch import DecodeBatch
    from glmjax.caches import Caches
    from glmjax.config import ModelConfig
    from glmjax.model import HybridModel, decode_step, prefill_step
    from glmjax.xla_options import STEP_OPTIONS

    config = ModelConfig.preset(args.preset)
    if args.num_layers or args.num_experts:
        config = config.replace_depth(args.num_layers or config.num_layers, args.num_experts)
    config = dataclasses.replace(config, mla_attention="pallas", scan_layers=args.scan_layers)
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
    graph, state = nnx.split(nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0))))
    if args.step == "prefill":
        batch = jax.eval_shape(lambda: cold_prompt_batch(np.zeros(args.tokens, np.int32)))
        num_slots, num_blocks = 5, batch.block_tables.shape[1]
        step = jax.jit(prefill_step, donate_argnums=1, static_argnames="return_logprobs",
                       compiler_options=STEP_OPTIONS)
    else:
        rows, width = args.tokens, -(-args.context // config.kv_block_size)
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        batch = DecodeBatch(i32(rows), i32(rows), i32(rows), i32(rows, width))
        num_slots, num_blocks = rows + 8, rows * width + 8
        step = jax.jit(decode_step, donate_argnums=1, compiler_options=STEP_OPTIONS)
    caches = jax.eval_shape(lambda: Caches.init(config, num_state_slots=num_slots,
                                                num_kv_blocks=num_blocks))
    return step.trace((graph, placed(state)), placed(caches), placed(batch)).lower(
        ).compile().as_text()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="kimi-linear-48b")
    parser.add_argument("--num-layers", type=int, help="layers kept (all)")
    parser.add_argument("--num-experts", type=int, help="routed experts kept (all)")
    parser.add_argument("--step", choices=("prefill", "decode"), default="prefill")
    parser.add_argument("--scan-layers", action="store_true",
                        help="the repeated layer groups as one scan (config.scan_layers)")
    parser.add_argument("--tokens", type=int, default=8192,
                        help="prefill: the prompt's tokens; decode: the rows")
    parser.add_argument("--context", type=int, default=8192, help="decode: positions a row holds")
    parser.add_argument("--top", type=int, default=40, help="ops listed")
    parser.add_argument("--out", type=Path, help="JSON (bench/results/launches_<...>.json)")
    args = parser.parse_args(argv)
    device = h200_device()
    as_gpu(device)
    start = time.perf_counter()
    hlo = compile_step(args, device)
    seconds = time.perf_counter() - start
    found = count_launches(hlo)
    print(f"{args.preset} {args.step} ({args.tokens} {'tokens' if args.step == 'prefill' else 'rows'})"
          f" for the H200, compiled in {seconds:.1f} s: {found.static} kernels in the program, "
          f"{found.runtime} launched a step with every loop iteration; "
          f"{len(found.cache_copies)} copies of a cache")
    for kind, n in found.by_kind.most_common():
        print(f"{n:7d}  {kind}")
    for (kind, op), n in found.by_op.most_common(args.top):
        print(f"{n:7d}  {kind:32.32} {op[-110:]}")
    out = args.out or RESULTS / f"launches_{args.preset}_{args.step}_{args.tokens}.json"
    write_json(dict(args=vars(args), compile_s=seconds, static=found.static,
                    runtime=found.runtime, by_kind=dict(found.by_kind),
                    by_op=[[k, op, n] for (k, op), n in found.by_op.most_common()],
                    loops=found.loops, cache_copies=found.cache_copies), out)
    return found


if __name__ == "__main__":
    main()
