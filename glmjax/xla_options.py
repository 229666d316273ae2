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

STEP_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
}
