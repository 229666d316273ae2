"""One KDA prefill call of each kind inside a profiled range, for `ncu` (issue 20's profile).

    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_enable_command_buffer= \\
        ncu --profile-from-start off --set full -k 'regex:kda_chunk|chunk_kda' --csv \\
        --page details python3 -m bench.kda_ncu --case 8K > ncu_kda_8K.csv

(`bench/device_calls.sh ncu_kda` says why each setting is there.)

Every call runs (compiles, autotunes) twice outside the range first, so ncu profiles one
launch of each kernel of: our kernel on its bounded-gate and any-decay paths with 4
snapshots, and fla `chunk_kda` (default and `safe_gate`) on the same inputs when fla
imports. The range is opened and closed with `cudaProfilerStart` / `Stop` through torch,
which shares the process's CUDA context with JAX, so without torch nothing is profiled
and the script says so. Inputs and snapshot offsets are `bench.kda_kernel`'s.
"""

from __future__ import annotations

import argparse

import jax

from bench.kda_kernel import CASES, GATE_LOWER_BOUND, fla_runner, make_inputs, snapshot_offsets
from pallas_kernels import kda_prefill


def calls(lens, with_fla: bool) -> dict:
    """Name -> (call, sync) for every kernel kind on the case's inputs."""
    inputs = make_inputs(lens)
    offsets = snapshot_offsets(lens, 4)
    out = {}
    for name, bound in (("ours bounded", GATE_LOWER_BOUND), ("ours any decay", None)):
        fn = jax.jit(lambda i, off, bound=bound: kda_prefill(**i, checkpoint_offsets=off,
                                                             gate_lower_bound=bound))
        out[name] = (lambda fn=fn: fn(inputs, offsets), jax.block_until_ready)
    if with_fla:
        for name, options in (("fla chunk_kda", {}), ("fla safe_gate", dict(
                safe_gate=True, lower_bound=GATE_LOWER_BOUND))):
            call, sync = fla_runner(inputs, lens, **options)
            if call is not None:
                out[name] = (call, sync)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="8K", choices=sorted(CASES))
    parser.add_argument("--no-fla", action="store_true")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError as error:
        raise SystemExit("torch is needed to open the profiled range (cudaProfilerStart)"
                         ) from error
    work = calls(CASES[args.case], with_fla=not args.no_fla)
    for call, sync in work.values():  # compile and autotune outside the range
        for _ in range(2):
            sync(call())
    torch.cuda.profiler.start()
    for name, (call, sync) in work.items():
        with torch.cuda.nvtx.range(name):
            sync(call())
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(work))


if __name__ == "__main__":
    main()
