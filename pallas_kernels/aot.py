"""Compile every production Pallas kernel ahead of time for GB10 (sm_121) and H200 (sm_90).

    python -m pallas_kernels.aot --device gb10|h200|all

No GPU is needed. For each device the KDA prefill is lowered under an abstract mesh whose
device kind is that GPU, with exactly the `KernelConfig` the runtime picks for it, at the
real shapes (H = 32 and 64, compiled once per distinct config; K = V = 128, capacity 4,
bf16 inputs), on both gate paths
(bounded, as GLM's gate, and any decay, as Kimi's), the scan that forms W and U itself
and the one that reads them from the W/U pass (`kda_chunk_scan_w_u`, the runtime's pick,
and `kda_chunk_scan`), and the segment-parallel scan's two
kernels (`kda_segment_*`) at 16 heads and one 32K-token prompt with the config the runtime
picks there (`segment_config`; 4 segments where it keeps the plain scan, as on GB10); the
KDA decode kernel likewise, at 1 and 64 rows on a 256-slot pool, with the tiling the
runtime picks for each (`kda_decode_bv*` in the table); the MLA prefill flash attention at
both presets' heads and head dims (`ATTENTION_SHAPES`) with the tuning table's config; the
DSA sparse attention at glm5.3-flash's shape (`SPARSE_SHAPES`: 64 heads over 512-wide
latents, top-k 2048), its indexer's scores (`INDEX_SHAPES`) and its exact top-k selection
(`TOP_K_SHAPES`: 32K rows held in registers, 64K rows streamed), and mHC's Sinkhorn
projection (`SINKHORN_SHAPE`). So is the routed experts'
grouped GEMM (`pallas_kernels.gmm_pallas`), each launch of a MoE layer (plain, gathered,
gathered +
SwiGLU, down, down + combine) at both presets' real shapes (`pallas_kernels.moe_shapes`)
with the `GmmConfig` the runtime picks at 512 and 8192 tokens; and the decode projections'
weight stream (`pallas_kernels.stream_matmul`, `PROJECTION_LAUNCHES`). Each Triton module the
Pallas lowering
embeds is then compiled by the official Triton compiler for that target, and ptxas reports
registers and spills (`pallas_kernels.triton_compile`). The table shows shared memory against the
device's per-block limit; the exit status is non-zero when a kernel fails to compile or
exceeds a limit (register spills are reported, they cost speed, not correctness). The SASS
column counts the kernel's static instructions (what `cuobjdump -sass` lists): straight-line code too
large for the instruction cache stalls the warps (docs/KERNEL.md), so it is a speed proxy
that needs no GPU.

What this proves: the kernels compile for sm_121 and fit its 99 KB of shared memory per
block and its register file. What it does not: speed or numerics on GB10 hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.aot_decode import (
    DECODE_ROWS,
    FUSED_DECODE_GATES,
    HEAD_DIM,
    HEAD_MATMUL_SHAPES,
    MLA_DECODE_SHAPES,
    check_projections,
    lower_head_matmul,
    lower_kda_decode,
    lower_kda_decode_fused,
    lower_mla_decode,
    lower_route_top_k,
)
from pallas_kernels.attention_pallas import (
    FlashConfig,
    flash_attention_pallas,
    select_flash_config,
)
from pallas_kernels.gmm_pallas import gmm_pallas
from pallas_kernels.gmm_tuning import GmmConfig, select_gmm_config
from pallas_kernels.index_scores_pallas import (
    IndexConfig,
    index_scores_pallas,
    select_index_config,
)
from pallas_kernels.kda_conv_pallas import ConvShape, kda_conv_pallas
from pallas_kernels.kda_pallas import kda_prefill_pallas
from pallas_kernels.moe_shapes import MOE_SHAPES, GemmSpec, gemm_specs
from pallas_kernels.sinkhorn_pallas import sinkhorn_pallas
from pallas_kernels.sparse_attention_pallas import (
    SparseConfig,
    select_sparse_config,
    sparse_attention_pallas,
)
from pallas_kernels.top_k_pallas import TopKConfig, select_top_k_config, select_top_k_pallas
from pallas_kernels.triton_compile import (
    KernelReport,
    TritonModule,
    compile_module,
    format_table,
    triton_modules,
)
from pallas_kernels.tuning import (
    KNOWN_DEVICES,
    DeviceSpec,
    KernelConfig,
    select_config,
)

HEAD_COUNTS = (32, 64)
# The segment-parallel scan's kernels, at the shape it is for: TP4's 16 of GLM's 64 KDA
# heads, one long prompt (the runtime's pick there; 4 segments if it keeps the plain scan).
SEGMENT_HEADS, SEGMENT_TOKENS = 16, 32768
NUM_TOKENS = 8192
CAPACITY = 4
# MLA prefill attention (heads, qk dim, v dim): kimi-linear-48b, glm5.3-flash.
ATTENTION_SHAPES = ((32, 192, 128), (64, 256, 256))
# DSA sparse attention (heads, kv_lora, rope, top_k): glm5.3-flash.
SPARSE_SHAPES = ((64, 512, 0, 2048),)
# DSA index scores (index heads, head dim): glm5.3-flash; 1024 queries (the layer's block).
INDEX_SHAPES = ((32, 128),)
INDEX_ROWS = 1024
# DSA top-k selection (row length, k) over INDEX_ROWS rows: glm5.3-flash at 32K (the row in
# registers) and 64K (streamed from L2).
TOP_K_SHAPES = ((32768, 2048), (65536, 2048))
# mHC's Sinkhorn projection (streams, iterations): glm5.3-flash's, over NUM_TOKENS tokens.
SINKHORN_SHAPE = (4, 20)
# The two ends of bench.moe (they get different tilings) and a decode step's one token (the
# per-row schedule).
GMM_TOKENS = (1, 512, 8192)


def lower_kda_prefill(spec: DeviceSpec, heads: int, config: KernelConfig | None = None, *,
                      bounded_gates: bool = False) -> list[TritonModule]:
    """The Triton modules of the bf16 KDA prefill for `spec`, by default with the config
    the runtime picks for that device (bounded_gates: see `kda_prefill`'s
    `gate_lower_bound`)."""
    config = config or select_config(spec, num_seqs=1, num_heads=heads, head_k=HEAD_DIM,
                                     head_v=HEAD_DIM)
    shape = jax.ShapeDtypeStruct
    tokens_hk = (NUM_TOKENS, heads, HEAD_DIM)
    args = (shape(tokens_hk, jnp.bfloat16), shape(tokens_hk, jnp.bfloat16),
            shape(tokens_hk, jnp.bfloat16), shape(tokens_hk, jnp.float32),
            shape((NUM_TOKENS, heads), jnp.bfloat16), shape((2,), jnp.int32),
            shape((1, heads, HEAD_DIM, HEAD_DIM), jnp.float32),
            shape((1, CAPACITY), jnp.int32))

    def prefill(*arrays):
        return kda_prefill_pallas(*arrays, scale=HEAD_DIM ** -0.5,
                                  bounded_gates=bounded_gates, config=config,
                                  interpret=False, exact=False)

    return triton_modules(prefill, args, spec)


def segment_config(spec: DeviceSpec) -> KernelConfig:
    """The config of the segment-parallel scan that `check_devices` compiles for `spec`."""
    config = select_config(spec, num_seqs=1, num_heads=SEGMENT_HEADS, head_k=HEAD_DIM,
                           head_v=HEAD_DIM, num_tokens=SEGMENT_TOKENS)
    return config if config.scan_segments > 1 else dataclasses.replace(config, scan_segments=4)


def lower_kda_conv(spec: DeviceSpec, heads: int) -> list[TritonModule]:
    """The Triton modules of the KDA prefill conv (`kda_conv`) for `spec`: NUM_TOKENS bf16
    rows of q, k and v, each `heads` x HEAD_DIM channels, kernel width 4, CAPACITY
    sequences: q's launch first (the caller keeps it: k's is the same module, v's the same
    without the L2 norm)."""
    channels, width = 3 * heads * HEAD_DIM, 4
    shape = ConvShape(heads=heads, dim=HEAD_DIM, width=width, num_seqs=CAPACITY, l2_eps=1e-6)
    rows = jax.ShapeDtypeStruct((NUM_TOKENS,), jnp.int32)
    args = ((jax.ShapeDtypeStruct((NUM_TOKENS, channels // 3), jnp.bfloat16),) * 3,
            jax.ShapeDtypeStruct((width, channels), jnp.float32),
            jax.ShapeDtypeStruct((CAPACITY * (width - 1), channels), jnp.bfloat16),
            jax.ShapeDtypeStruct((CAPACITY + 1,), jnp.int32), rows, rows)

    def conv(*arrays):
        return kda_conv_pallas(*arrays, shape=shape, interpret=False)

    return triton_modules(conv, args, spec)


def lower_flash_attention(spec: DeviceSpec, heads: int, head_qk: int, head_v: int,
                          config: FlashConfig | None = None) -> list[TritonModule]:
    """The Triton module of the bf16 MLA prefill attention for `spec` at one preset's heads
    and head dims, by default with the tuning table's config for that device."""
    config = config or select_flash_config(head_qk=head_qk, head_v=head_v, spec=spec)
    shape = jax.ShapeDtypeStruct
    args = (shape((NUM_TOKENS, heads, head_qk), jnp.bfloat16),
            shape((NUM_TOKENS, heads, head_qk), jnp.bfloat16),
            shape((NUM_TOKENS, heads, head_v), jnp.bfloat16),
            shape((NUM_TOKENS,), jnp.int32), shape((NUM_TOKENS,), jnp.int32))

    def attend(*arrays):
        return flash_attention_pallas(*arrays, scale=head_qk ** -0.5, config=config,
                                      interpret=False)

    return triton_modules(attend, args, spec)


def lower_sparse_attention(spec: DeviceSpec, heads: int, kv_lora: int, rope: int, top_k: int,
                           config: SparseConfig | None = None) -> list[TritonModule]:
    """The Triton module of the bf16 DSA sparse attention for `spec` at one preset's shape
    (queries over NUM_TOKENS latents), by default with the tuning table's config."""
    config = config or select_sparse_config(num_heads=heads, spec=spec)
    shape = jax.ShapeDtypeStruct
    args = (shape((NUM_TOKENS, heads, kv_lora + rope), jnp.bfloat16),
            shape((NUM_TOKENS, kv_lora + rope), jnp.bfloat16),
            shape((NUM_TOKENS, top_k), jnp.int32))

    def attend(*arrays):
        return sparse_attention_pallas(*arrays, kv_lora=kv_lora,
                                       scale=(kv_lora + rope) ** -0.5, config=config,
                                       interpret=False)

    return triton_modules(attend, args, spec)


def lower_index_scores(spec: DeviceSpec, heads: int, dim: int,
                       config: IndexConfig | None = None) -> list[TritonModule]:
    """The Triton module of the bf16 DSA index scores for `spec` (INDEX_ROWS queries over
    NUM_TOKENS keys), by default with the tuning table's config."""
    config = config or select_index_config(spec)
    shape = jax.ShapeDtypeStruct
    args = (shape((INDEX_ROWS, heads, dim), jnp.bfloat16),
            shape((INDEX_ROWS, heads), jnp.float32), shape((NUM_TOKENS, dim), jnp.bfloat16),
            shape((INDEX_ROWS,), jnp.int32), shape((INDEX_ROWS,), jnp.int32))

    def scores(*arrays):
        return index_scores_pallas(*arrays, config=config, interpret=False)

    return triton_modules(scores, args, spec)


def lower_sinkhorn(spec: DeviceSpec) -> list[TritonModule]:
    """The Triton module of mHC's Sinkhorn projection (`pallas_kernels.sinkhorn`) at
    SINKHORN_SHAPE; its tiling does not depend on the token count."""
    streams, iters = SINKHORN_SHAPE
    args = (jax.ShapeDtypeStruct((NUM_TOKENS, streams, streams), jnp.float32),)
    return triton_modules(lambda x: sinkhorn_pallas(x, iters=iters, interpret=False), args,
                          spec)


def lower_top_k(spec: DeviceSpec, num_keys: int, k: int,
                config: TopKConfig | None = None) -> list[TritonModule]:
    """The Triton module of the DSA top-k selection for `spec` (INDEX_ROWS rows of
    `num_keys` fp32 scores and their lengths), by default with the tuning table's config;
    named `select_top_k_<S / 1024>K`."""
    config = config or select_top_k_config(spec)
    args = (jax.ShapeDtypeStruct((INDEX_ROWS, num_keys), jnp.float32),
            jax.ShapeDtypeStruct((INDEX_ROWS,), jnp.int32))

    def select(scores, lengths):
        return select_top_k_pallas(scores, lengths, k=k, config=config, interpret=False)

    return [dataclasses.replace(module, name=f"{module.name}_{num_keys // 1024}K")
            for module in triton_modules(select, args, spec)]


def lower_gmm(spec: DeviceSpec, gemm: GemmSpec,
              config: GmmConfig | None = None) -> tuple[TritonModule, GmmConfig]:
    """The Triton module of one grouped-GEMM launch for `spec` and the tiling it used (by
    default the runtime's pick for that device and shape)."""
    num_groups, k, n = gemm.rhs[0].shape
    config = config or select_gmm_config(spec, rows=gemm.rows, k=k, n=n, num_groups=num_groups,
                                         num_rhs=len(gemm.rhs))
    row_ints = jax.ShapeDtypeStruct((gemm.rows,), jnp.int32)
    per_row = gemm.copies_per_token is not None
    extras = {"row_groups": row_ints} if per_row else {}
    if gemm.epilogue.gather and not per_row:
        extras["row_tokens"] = row_ints
    if gemm.epilogue.combine:
        extras["row_scale"] = jax.ShapeDtypeStruct((gemm.rows,), jnp.float32)
        if not per_row:
            extras["row_dest"] = row_ints
    if per_row:
        extras["copies_per_token"] = gemm.copies_per_token

    static = {"copies_per_token": extras.pop("copies_per_token")} if per_row else {}

    def call(lhs, rhs, group_sizes, extras):
        return gmm_pallas(lhs, rhs, group_sizes, config=config, epilogue=gemm.epilogue,
                          interpret=False, **extras, **static)

    (module,) = triton_modules(call, (gemm.lhs, gemm.rhs, gemm.group_sizes, extras), spec)
    return module, config


def alternative_modules(spec: DeviceSpec, heads: int, picked: KernelConfig) -> dict:
    """The KDA scan's modules the runtime does not pick, by name: the scan reading W and U
    from the W/U pass (the pick forms them itself) with that pass, and a plain scan with the
    chunk-parallel output pass (the pick computes the output itself, `fuse_output`)."""
    modules = {}
    toggled = dataclasses.replace(picked, form_w_u_in_scan=not picked.form_w_u_in_scan)
    for module in lower_kda_prefill(spec, heads, toggled, bounded_gates=True):
        if module.name in ("kda_chunk_scan", "kda_chunk_scan_w_u", "kda_chunk_w_u"):
            modules[module.name] = module
    unfused = dataclasses.replace(picked, fuse_output=False, form_w_u_in_scan=False)
    for module in lower_kda_prefill(spec, heads, unfused, bounded_gates=True):
        if module.name in ("kda_chunk_scan", "kda_chunk_output"):
            renamed = module.name.replace("scan", "scan_unfused")
            modules[renamed] = dataclasses.replace(module, name=renamed)
    return modules


def check_devices(names: list[str], heads: tuple[int, ...] = HEAD_COUNTS, *,
                  alternatives: bool = True) -> list[KernelReport]:
    """Compile every kernel for each device in `names`. The KDA prefill kernels (and the
    conv) compile once per distinct `KernelConfig` the runtime picks over `heads`: heads
    are a grid axis, and at another head count with the same config only the row stride
    differs (identical registers and spills; `check_devices` of every head count before
    the twelfth session). `alternatives`: also the scan's configs the runtime does not
    pick (W and U from the W/U pass; the output pass after a plain scan)."""
    reports = []
    for name in names:
        spec = KNOWN_DEVICES[name]
        compiled_configs = set()
        for num_heads in heads:
            modules = {}  # by name: the two gate paths share the scan and output kernels
            picked = select_config(spec, num_seqs=1, num_heads=num_heads, head_k=HEAD_DIM,
                                   head_v=HEAD_DIM)
            if picked not in compiled_configs:
                compiled_configs.add(picked)
                for bounded in (True, False):
                    for module in lower_kda_prefill(spec, num_heads, bounded_gates=bounded):
                        modules.setdefault(module.name, module)
                if alternatives:
                    modules.update(alternative_modules(spec, num_heads, picked))
                for module in lower_kda_conv(spec, num_heads):
                    modules.setdefault(module.name, module)
            for rows in DECODE_ROWS:
                for module in lower_kda_decode(spec, num_heads, rows=rows):
                    modules.setdefault(module.name, module)
            # The fused step with each preset's gate at its head count (tiling: any rows).
            gate = FUSED_DECODE_GATES[num_heads]
            for module in lower_kda_decode_fused(spec, num_heads, gate=gate):
                modules.setdefault(module.name, module)
            reports.extend(compile_module(module, spec, num_heads) for module in modules.values())
        for module in lower_kda_prefill(spec, SEGMENT_HEADS, segment_config(spec),
                                        bounded_gates=True):
            if module.name.startswith("kda_segment"):  # the rest are the plain path's
                reports.append(compile_module(module, spec, SEGMENT_HEADS))
        for num_heads, head_qk, head_v in ATTENTION_SHAPES:
            for module in lower_flash_attention(spec, num_heads, head_qk, head_v):
                reports.append(compile_module(module, spec, num_heads))
        for num_heads, *shape in MLA_DECODE_SHAPES:
            for module in lower_mla_decode(spec, num_heads, *shape):
                reports.append(compile_module(module, spec, num_heads))
        for num_heads, *shape in HEAD_MATMUL_SHAPES:
            for module in lower_head_matmul(spec, num_heads, *shape):
                reports.append(compile_module(module, spec, num_heads))
        for num_heads, *shape in SPARSE_SHAPES:
            for module in lower_sparse_attention(spec, num_heads, *shape):
                reports.append(compile_module(module, spec, num_heads))
        for num_heads, dim in INDEX_SHAPES:
            for module in lower_index_scores(spec, num_heads, dim):
                reports.append(compile_module(module, spec, num_heads))
        for num_keys, k in TOP_K_SHAPES:
            for module in lower_top_k(spec, num_keys, k):
                reports.append(compile_module(module, spec, 0))
        for shape in MOE_SHAPES:
            for module in lower_route_top_k(spec, shape.experts, shape.top_k, shape.hidden):
                reports.append(compile_module(module, spec, 0))
        reports.extend(compile_module(module, spec, 0) for module in lower_sinkhorn(spec))
    return reports


def check_gmm(names: list[str], tokens: tuple[int, ...] = GMM_TOKENS,
              kernels: tuple[str, ...] | None = None) -> list[KernelReport]:
    """Every grouped-GEMM launch of both presets' MoE layers (`kernels`: only those names)."""
    reports = []
    for name in names:
        spec = KNOWN_DEVICES[name]
        for shape in MOE_SHAPES:
            for num_tokens in tokens:
                for gemm in gemm_specs(shape, num_tokens):
                    if kernels is not None and gemm.name not in kernels:
                        continue
                    module, config = lower_gmm(spec, gemm)
                    label = (f"{shape.preset} T={num_tokens} {config.block_m}x{config.block_n}"
                             f"x{config.block_k} w{config.num_warps} s{config.num_stages}")
                    reports.append(compile_module(module, spec, 0, kernel=gemm.name,
                                                  shape=label))
    return reports


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=[*KNOWN_DEVICES, "all"], default="all")
    args = parser.parse_args(argv)
    names = list(KNOWN_DEVICES) if args.device == "all" else [args.device]
    reports = check_devices(names) + check_gmm(names) + check_projections(names)
    print(format_table(reports))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
