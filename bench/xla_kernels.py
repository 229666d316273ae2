"""The KDA prefill's (or the MLA flash attention's) Pallas kernels as the device compiles
them, counted without a GPU.

    make deviceless-plugin        # once: the CUDA PJRT plugin's wheels into .cuda-plugin
    JAX_PLATFORMS=cpu PYTHONPATH=.cuda-plugin:. .venv/bin/python -m bench.xla_kernels \\
        --tokens 8192 --heads 32
    ... -m bench.xla_kernels --op attention --tokens 8192   # both presets' MLA heads
    ... -m bench.xla_kernels --op sparse --tokens 1024      # glm's DSA sparse attention

On the device, XLA compiles a Pallas kernel's Triton IR with the Triton inside jaxlib, not
the pip `triton` that `pallas_kernels.aot` compiles with, and the two make different code
(the prep kernel's key-slice loop: 3,433 SASS instructions a warp through XLA, 2,658
through pip Triton 3.9; an ncu count of the device's run matched the first). Here XLA
compiles `kda_prefill` for a compile-only H200 (`bench.launches.h200_device`) with its dump
on, and each kernel's PTX goes through `ptxas` for sm_90a: registers, spills, SASS
instructions, and the instructions of each loop body (one iteration), by opcode with
`--mix`. Needs a `ptxas` that reads the dump's PTX (CUDA 13: `--ptxas`, default the first
on PATH or under /usr/local/cuda*/bin) and `cuobjdump` (pip Triton's). `--set
prep_num_warps=1 --set prep_block_k=16` compiles another tiling than the runtime's pick
(any `KernelConfig` field); `--keep DIR` leaves each kernel's PTX and SASS there to read.
`--op attention` compiles `prefill_attention`'s flash kernel instead, one causal span of
`--tokens` at kimi-linear-48b's and glm5.3-flash's MLA head shapes (`bench.attention`'s
`PRESETS`; the reports are named by preset); `--op sparse` the DSA sparse attention at
glm5.3-flash's shape (`pallas_kernels.aot.SPARSE_SHAPES`), `--tokens` queries over 32K
latents.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.common import write_json
from bench.kda_ab import config_overrides
from pallas_kernels.triton_compile import ptxas_resources, sass_instructions

SASS_LINE = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def find_ptxas(path: str | None) -> str:
    found = path or shutil.which("ptxas") or next(
        iter(sorted(glob.glob("/usr/local/cuda*/bin/ptxas"), reverse=True)), None)
    if not found:
        raise SystemExit("no ptxas: pass --ptxas (CUDA 13's reads XLA's PTX)")
    return found


def cuobjdump() -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump")


def loop_bodies(sass: str) -> list[list[str]]:
    """Each backward branch's body, as opcodes (predicates and modifiers dropped)."""
    ops = [(int(m.group(1), 16), m.group(2).split(".")[0], line)
           for line in sass.splitlines() if (m := SASS_LINE.match(line))]
    bodies = []
    for address, _, line in ops:
        target = re.search(r"BRA (0x[0-9a-f]+)", line)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            bodies.append([op for a, op, _ in ops if start <= a <= address])
    return bodies


def kernel_report(ptx_path: str, name: str, ptxas: str, mix: bool,
                  keep: Path | None = None) -> dict:
    """ptxas -v and the SASS of one dumped PTX file (kernel `name`), for sm_90a; with
    `keep`, the PTX and SASS are copied there as <name>.ptx / .sass."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        result = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx_path, "-o", cubin],
                                capture_output=True, text=True, check=True)
        sass = subprocess.run([cuobjdump(), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
        instructions = sass_instructions(Path(cubin).read_bytes())
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(ptx_path, keep / f"{name}.ptx")
        (keep / f"{name}.sass").write_text(sass)
    registers, spills = ptxas_resources(result.stderr)
    bodies = loop_bodies(sass)
    report = {"registers": registers, "spill_bytes": spills, "sass": instructions,
              "loops": [len(body) for body in bodies]}
    if mix:
        report["loop_mix"] = [dict(collections.Counter(body).most_common(16)) for body in bodies]
    return report


def compile_dumping(fn, inputs: tuple, dump: str) -> None:
    """jit(fn) compiled for `inputs` with XLA's dump into `dump`. Dump options of this
    compile alone (XLA_FLAGS are read once a process); the emitter files (XLA's Triton
    passes) are what make it write the PTX."""
    jax.jit(fn).trace(*inputs).lower().compile(
        {"xla_dump_to": dump, "xla_gpu_dump_llvmir": True, "xla_dump_emitter_re": ".*"})


def h200_spec():
    """ShapeDtypeStruct maker on a compile-only H200 (`bench.launches`)."""
    from bench.launches import as_gpu, h200_device
    device = h200_device()
    as_gpu(device)
    sharding = jax.sharding.SingleDeviceSharding(device)
    return device, lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def compile_attention_and_dump(args, dump: str, preset: str) -> None:
    from bench.attention import PRESETS
    from pallas_kernels.attention import prefill_attention

    _, spec = h200_spec()
    heads, qk, v = PRESETS[preset]
    t = args.tokens
    inputs = (spec((t, heads, qk), jnp.bfloat16), spec((t, heads, qk), jnp.bfloat16),
              spec((t, heads, v), jnp.bfloat16), spec((2,), jnp.int32), spec((2,), jnp.int32))
    compile_dumping(lambda *x: prefill_attention(*x, implementation="pallas"), inputs, dump)


def compile_sparse_and_dump(args, dump: str) -> None:
    from pallas_kernels.aot import SPARSE_SHAPES
    from pallas_kernels.sparse_attention import sparse_attention

    _, spec = h200_spec()
    (heads, kv_lora, rope, top_k), = SPARSE_SHAPES
    t, width = args.tokens, kv_lora + rope
    inputs = (spec((t, heads, width), jnp.bfloat16), spec((32768, width), jnp.bfloat16),
              spec((t, top_k), jnp.int32))
    compile_dumping(lambda *x: sparse_attention(*x, kv_lora=kv_lora, scale=width ** -0.5,
                                                implementation="pallas"), inputs, dump)


def compile_and_dump(args, dump: str) -> None:
    device, spec = h200_spec()
    from pallas_kernels import kda_prefill
    from pallas_kernels.tuning import device_spec, select_config

    t, h, d = args.tokens, args.heads, args.head_dim
    inputs = dict(q=spec((t, h, d), jnp.bfloat16), k=spec((t, h, d), jnp.bfloat16),
                  v=spec((t, h, d), jnp.bfloat16), g=spec((t, h, d), jnp.float32),
                  beta=spec((t, h), jnp.bfloat16), cu_seqlens=spec((2,), jnp.int32),
                  initial_states=spec((1, h, d, d), jnp.float32),
                  checkpoint_offsets=spec((1, 4), jnp.int32))
    bound = None if args.any_decay else -5.0
    config = None if not args.set else dataclasses.replace(  # None: the runtime's pick
        select_config(device_spec(device), num_seqs=1, num_heads=h, head_k=d, head_v=d,
                      num_tokens=t), **config_overrides(args.set))
    compile_dumping(lambda x: kda_prefill(**x, gate_lower_bound=bound, config=config),
                    (inputs,), dump)


def dumped_kernels(dump: str, prefix: str, ptxas: str, args, label=lambda name: name) -> dict:
    """`kernel_report` of every dumped kernel whose name starts with `prefix`."""
    reports = {}
    for path in sorted(glob.glob(f"{dump}/*.ptx")):
        entry = re.search(r"\.entry (\w+)\(", Path(path).read_text())
        if entry and entry.group(1).startswith(prefix):
            name = label(entry.group(1))
            reports[name] = kernel_report(path, name, ptxas, args.mix, args.keep)
    return reports


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("kda", "attention", "sparse"), default="kda")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--any-decay", action="store_true")
    parser.add_argument("--mix", action="store_true", help="each loop body's opcodes")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a KernelConfig field over the runtime's pick (repeatable)")
    parser.add_argument("--keep", type=Path, help="folder for each kernel's PTX and SASS")
    parser.add_argument("--ptxas")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    ptxas = find_ptxas(args.ptxas)
    reports = {}
    if args.op == "kda":
        with tempfile.TemporaryDirectory() as dump:
            compile_and_dump(args, dump)
            reports = dumped_kernels(dump, "kda_", ptxas, args)
    elif args.op == "sparse":
        with tempfile.TemporaryDirectory() as dump:
            compile_sparse_and_dump(args, dump)
            reports = dumped_kernels(dump, "sparse_attention", ptxas, args)
    else:
        from bench.attention import PRESETS
        for preset in PRESETS:
            with tempfile.TemporaryDirectory() as dump:
                compile_attention_and_dump(args, dump, preset)
                reports |= dumped_kernels(dump, "flash_attention", ptxas, args,
                                          label=lambda name, p=preset: f"{name}_{p}")
    for name, r in reports.items():
        print(f"{name:28} {r['registers']:4} registers {r['spill_bytes']:5} B spilled "
              f"{r['sass']:6} SASS  loop bodies {r['loops']}")
        for body in r.get("loop_mix", []):
            print("   ", body)
    if args.out:
        write_json({"args": vars(args), "ptxas": ptxas, "kernels": reports}, args.out)


if __name__ == "__main__":
    main()
