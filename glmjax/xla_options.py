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
"""

from __future__ import annotations

import os

from jax._src import xla_bridge

STEP_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
}

# XLA re-sets every command of a CUDA graph from the host when any buffer it uses moved
# since its last launch. A step program's temporaries move between calls under XLA's
# default allocator; this mode keeps them at one virtual address (XLA's VMM allocator),
# which with the decode program's other buffers pinned (`serving.pinned`) leaves nothing
# to re-set. Process-wide, read once, when JAX starts its first backend.
PIN_TEMPORARIES = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"


def pin_temporaries() -> bool:
    """Adds `PIN_TEMPORARIES` to ``XLA_FLAGS`` unless it names a command-buffer update mode
    already (the user's choice stands). Whether SKIP_TEMP is then asked for.

    Raises:
      RuntimeError: JAX has started a backend, so XLA would not read the flag.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_command_buffer_update_mode" in flags:
        return "SKIP_TEMP" in flags
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("pin_temporaries: JAX has started its backends; XLA_FLAGS is read "
                           "before that")
    os.environ["XLA_FLAGS"] = f"{flags} {PIN_TEMPORARIES}".strip()
    return True


# XLA's GPU GEMMs split the reduction over K when the rows are few, so a row's product
# depends on how many rows share the call (7-54% of kimi's MoE rows moved a bf16 step
# between 2048- and 4096-row steps on an H100, `prefill_invariance_kimi_h100_2026-12-07.json`).
# Without split-K every op of the prefill was batch-invariant there
# (`prefill_invariance_kimi_splitk1_h100_2026-12-07.json`). Process-wide, as above.
NO_SPLIT_K = "--xla_gpu_experimental_force_split_k=1"


def batch_invariant_gemms() -> None:
    """Adds `NO_SPLIT_K` to ``XLA_FLAGS`` (kept if there already).

    Raises:
      RuntimeError: JAX has started a backend without it, so XLA would not read it.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if NO_SPLIT_K in flags.split():
        return
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("batch_invariant_gemms: JAX has started its backends; XLA_FLAGS "
                           "is read before that")
    os.environ["XLA_FLAGS"] = f"{flags} {NO_SPLIT_K}".strip()
