"""XLA compile options of the model's step programs (prefill, decode, mixed, speculative).

`STEP_OPTIONS` turns each step into CUDA graphs (XLA "command buffers") as whole as XLA can
make them. XLA's defaults put fusions, cuBLAS/cuDNN calls and custom calls (our Pallas
kernels) in command buffers but not while loops or conditionals, and only runs of 5 or more
ops, so a decode step still launched most of its ~2,400 kernels one by one from the host.
On the H200, kimi-linear-48b whole (27 layers, 256 experts), 8K of context
(`python -m bench.decode`): a batch-1 decode step took 20.6 ms with the defaults and 10.1
ms with these options (`bench/results/decode_kimi_b1*.json`); an 8K prefill step was
unchanged (186 / 183 ms, `model_prefill_kimi27_cmdbuf.json`). The keys are XLA debug
options: other backends accept and ignore them.

`stable_temporaries` asks XLA for one more thing no compile option can give, since it
picks the allocator when JAX starts its GPU client: fixed addresses for the step programs'
temporaries (`--xla_gpu_command_buffer_update_mode=SKIP_TEMP`, backed by XLA's VMM
allocator). With the default allocator a temporary lands elsewhere each step, so each
replay of a decode step's CUDA graph first re-points every node that touches one: ~670 of
them at batch 1, 1.3-2.5 ms of host time a step, while the device needs ~3.3 ms. With the
flag 28 nodes change (parameters and outputs). Three alternating pairs on one H200
(kimi-linear-48b, batch 1, 8K of context, 64 steps: `bench/results/
decode_kimi_b1_skip_temp_pairs_2026-12-02.json`) gave 3.95 / 4.49 / 4.16 ms median steps
against 4.47 / 5.10 / 6.16 with the default.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

STEP_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
}


UPDATE_MODE_FLAG = "--xla_gpu_command_buffer_update_mode"


def stable_temporaries(*, devices: int, environ: MutableMapping[str, str] = os.environ
                       ) -> bool:
    """Adds `--xla_gpu_command_buffer_update_mode=SKIP_TEMP` to XLA_FLAGS for a process
    that drives one device; call before JAX starts its backends (XLA reads the flag once,
    when it makes the GPU client). Left alone: a mesh or several processes (the VMM
    allocator is untried with NCCL here), JAX_PLATFORMS naming only the CPU, and an
    XLA_FLAGS that already sets an update mode (`ALWAYS_UPDATE` turns this off). Returns
    whether it added the flag."""
    flags = environ.get("XLA_FLAGS", "")
    platforms = environ.get("JAX_PLATFORMS", "")
    if devices != 1 or UPDATE_MODE_FLAG in flags or platforms.strip().lower() == "cpu":
        return False
    environ["XLA_FLAGS"] = f"{flags} {UPDATE_MODE_FLAG}=SKIP_TEMP".strip()
    return True
