"""The decode path's kernels for `python -m pallas_kernels.aot`: the KDA decode kernel and
fused step, the router's top-k, MLA decode's attention and per-head products, and the few-row
weight stream, each lowered with the tiling the runtime picks for the device (see
`pallas_kernels.aot` for what the check proves).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.head_matmul_pallas import head_matmul_pallas
from pallas_kernels.head_matmul_pallas import select_tiling as select_head_tiling
from pallas_kernels.kda_decode_fused import DecodeLayerWeights
from pallas_kernels.kda_decode_fused_pallas import FusedDecodeShape, kda_decode_fused_pallas
from pallas_kernels.kda_decode_pallas import kda_decode_pallas
from pallas_kernels.mla_decode_pallas import mla_decode_pallas
from pallas_kernels.mla_decode_pallas import select_tiling as select_mla_decode_tiling
from pallas_kernels.moe_routing_pallas import route_top_k_pallas
from pallas_kernels.stream_matmul import select_config as select_stream_config
from pallas_kernels.stream_matmul_pallas import StreamConfig, stream_matmul_pallas
from pallas_kernels.triton_compile import (
    KernelReport,
    TritonModule,
    compile_module,
    triton_modules,
)
from pallas_kernels.tuning import KNOWN_DEVICES, DecodeConfig, DeviceSpec, select_decode_config

HEAD_DIM = 128  # KDA's K = V (both presets)
DECODE_ROWS = (1, 64)  # the decode kernel's tiling depends on the row count (tuning.py)
DECODE_POOL_SLOTS = 256
FUSED_DECODE_GATES = {32: "softplus", 64: "sigmoid_bound"}  # kimi-linear-48b, glm5.3-flash
# MLA decode attention (heads, kv_lora, rope, DSA mask): kimi-linear-48b, glm5.3-flash; one
# sequence of 8192 + 512 positions in blocks of 512 (a batch-1 decode step: the most splits).
MLA_DECODE_SHAPES = ((32, 512, 64, False), (64, 512, 0, True))
MLA_DECODE_BLOCKS, MLA_DECODE_BLOCK_SIZE = 17, 512
# MLA decode's per-head products (heads, nope, v; kv_lora 512): kimi-linear-48b,
# glm5.3-flash, at HEAD_MATMUL_ROWS rows (one full row tile).
HEAD_MATMUL_SHAPES = ((32, 128, 128), (64, 192, 256))
HEAD_MATMUL_ROWS = 64
# The decode projections' weight-stream launches (`glmjax.layers.projection`): kimi-linear-48b's
# KDA input launch (q, k, v, f_a, g_a, beta of one input) and its o projection, at 1 and 64
# rows.
PROJECTION_LAUNCHES = {"kda_in": ((2304, 4096),) * 3 + ((2304, 128),) * 2 + ((2304, 32),),
                       "kda_o": ((4096, 2304),)}
PROJECTION_ROWS = (1, 64)
PROJECTION_FP32 = ("kda_o", 1)  # one launch also in fp32 operands (fp32 models), at 1 row


def lower_kda_decode(spec: DeviceSpec, heads: int, config: DecodeConfig | None = None,
                     *, rows: int = 64) -> list[TritonModule]:
    """The Triton module of the KDA decode kernel for `spec` at `rows` rows of bf16 q/k/v
    and fp32 gates (as the layer passes them) on a pool of DECODE_POOL_SLOTS slots, by
    default with the config the runtime picks for that device and row count; named
    `kda_decode_bv{block_v}` (the tiling differs with the row count)."""
    config = config or select_decode_config(spec, num_rows=rows, num_heads=heads,
                                            head_k=HEAD_DIM, head_v=HEAD_DIM)
    shape = jax.ShapeDtypeStruct
    rows_hk = (rows, heads, HEAD_DIM)
    args = (shape(rows_hk, jnp.bfloat16), shape(rows_hk, jnp.bfloat16),
            shape(rows_hk, jnp.bfloat16), shape(rows_hk, jnp.float32),
            shape((rows, heads), jnp.float32), shape((rows,), jnp.int32),
            shape((DECODE_POOL_SLOTS, heads, HEAD_DIM, HEAD_DIM), jnp.float32))

    def decode(*arrays):
        return kda_decode_pallas(*arrays, scale=HEAD_DIM ** -0.5, config=config,
                                 interpret=False)

    return [dataclasses.replace(module, name=f"{module.name}_bv{config.block_v}")
            for module in triton_modules(decode, args, spec)]


def lower_kda_decode_fused(spec: DeviceSpec, heads: int, *, rows: int = 1,
                          gate: str = "sigmoid_bound") -> list[TritonModule]:
    """The Triton module of the fused KDA decode step (`pallas_kernels.kda_decode_fused`):
    `rows` rows of bf16 activations, bf16 weights and conv pool, an fp32 state pool of
    DECODE_POOL_SLOTS slots, conv width 4."""
    shape = jax.ShapeDtypeStruct
    bf16, hk = jnp.bfloat16, heads * HEAD_DIM
    weights = DecodeLayerWeights(shape((3 * hk, 4), bf16), shape((HEAD_DIM, hk), bf16),
                                 shape((hk,), jnp.float32), shape((heads,), jnp.float32),
                                 shape((HEAD_DIM, hk), bf16), shape((HEAD_DIM,), bf16))
    args = (shape((rows, 3 * hk + 2 * HEAD_DIM), bf16), shape((rows, heads), jnp.float32),
            weights, shape((rows,), jnp.int32),
            shape((DECODE_POOL_SLOTS, heads, HEAD_DIM, HEAD_DIM), jnp.float32),
            shape((DECODE_POOL_SLOTS, 3 * hk, 3), bf16))
    launch = FusedDecodeShape(heads=heads, dim=HEAD_DIM, width=4, gate=gate, gate_bound=-5.0,
                              norm_eps=1e-5, l2_eps=1e-6)

    def decode(*arrays):
        return kda_decode_fused_pallas(*arrays, shape=launch, interpret=False)

    return [dataclasses.replace(module, name=f"{module.name}_{gate}")
            for module in triton_modules(decode, args, spec)]


def lower_route_top_k(spec: DeviceSpec, num_experts: int, top_k: int, hidden: int,
                      tokens: int = 64) -> list[TritonModule]:
    """The Triton module of the router's top-k (`pallas_kernels.moe_routing`) as a decode
    step runs it: the logits as the weight stream's partial sums (its K splits of the
    [hidden, num_experts] router on `spec`); its tiling does not depend on the token count.
    (Prefill passes one partial, the logits: the same kernel with one load.)"""
    splits = select_stream_config(spec, tokens, ((hidden, num_experts),),
                                  operand_bytes=2).tilings[0].splits
    args = (jax.ShapeDtypeStruct((splits, tokens, num_experts), jnp.float32),
            jax.ShapeDtypeStruct((num_experts,), jnp.float32))

    def route(logits, bias):
        return route_top_k_pallas(logits, bias, top_k=top_k, scaling=2.5, interpret=False)

    return [dataclasses.replace(module, name=f"{module.name}_e{num_experts}")
            for module in triton_modules(route, args, spec)]


def lower_head_matmul(spec: DeviceSpec, heads: int, nope: int, v: int) -> list[TritonModule]:
    """The Triton modules of MLA decode's absorb and expand (`pallas_kernels.head_matmul`)
    with the runtime's tiling, bf16, kv_lora 512."""
    modules = []
    weight = jax.ShapeDtypeStruct((512, heads, nope + v), jnp.bfloat16)
    for name, transposed, k, offset, width in (("absorb", True, nope, 0, 512),
                                              ("expand", False, 512, nope, v)):
        x = jax.ShapeDtypeStruct((HEAD_MATMUL_ROWS, heads, k), jnp.bfloat16)

        def call(x, w, transposed=transposed, offset=offset, width=width, k=k):
            return head_matmul_pallas(x, w, transposed=transposed, offset=offset, width=width,
                                      tiling=select_head_tiling(width, k), interpret=False)

        modules += [dataclasses.replace(module, name=f"{module.name}_{name}_h{heads}")
                    for module in triton_modules(call, (x, weight), spec)]
    return modules


def lower_mla_decode(spec: DeviceSpec, heads: int, kv_lora: int, rope: int, masked: bool,
                     rows: int = 1) -> list[TritonModule]:
    """The Triton module of the MLA decode attention (`pallas_kernels.mla_decode`) with the
    runtime's tiling for `rows` sequences of MLA_DECODE_BLOCKS blocks, bf16 latents."""
    shape = jax.ShapeDtypeStruct
    width = MLA_DECODE_BLOCKS * MLA_DECODE_BLOCK_SIZE
    tiling = select_mla_decode_tiling(MLA_DECODE_BLOCK_SIZE)
    args = (shape((rows, heads, kv_lora), jnp.bfloat16),
            shape((rows, heads, rope), jnp.bfloat16) if rope else None,
            shape((64, MLA_DECODE_BLOCK_SIZE, kv_lora + rope), jnp.bfloat16),
            shape((rows, MLA_DECODE_BLOCKS), jnp.int32), shape((rows,), jnp.int32),
            shape((rows, width), jnp.bool_) if masked else None)

    def decode(q_abs, q_pe, pages, block_table, context_lens, mask):
        return mla_decode_pallas(q_abs, q_pe, pages, block_table, context_lens, mask,
                                 scale=0.07, tiling=tiling, interpret=False)

    return [dataclasses.replace(module, name=f"{module.name}_h{heads}")
            for module in triton_modules(decode, args, spec)]


def lower_stream(spec: DeviceSpec, rows: int, shapes: tuple[tuple[int, int], ...],
                 dtype=jnp.bfloat16) -> tuple[TritonModule, StreamConfig]:
    """The Triton module of one weight-stream launch for `spec` and the runtime's tiling."""
    config = select_stream_config(spec, rows, shapes, operand_bytes=jnp.dtype(dtype).itemsize)
    x = jax.ShapeDtypeStruct((rows, shapes[0][0]), dtype)
    weights = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape in shapes)

    def call(x, weights):
        return stream_matmul_pallas(x, weights, config=config, interpret=False)

    (module,) = triton_modules(call, (x, weights), spec)
    return module, config


def check_projections(names: list[str]) -> list[KernelReport]:
    """The weight-stream launches of `PROJECTION_LAUNCHES` at `PROJECTION_ROWS` rows in
    bf16, and `PROJECTION_FP32` in fp32."""
    reports = []
    fp32_launch, fp32_rows = PROJECTION_FP32
    cases = [(launch, rows, jnp.bfloat16) for launch in PROJECTION_LAUNCHES
             for rows in PROJECTION_ROWS] + [(fp32_launch, fp32_rows, jnp.float32)]
    for name in names:
        spec = KNOWN_DEVICES[name]
        for launch, rows, dtype in cases:
            module, config = lower_stream(spec, rows, PROJECTION_LAUNCHES[launch], dtype)
            label = (f"{launch} {jnp.dtype(dtype).name} rows={rows} splits "
                     f"{'/'.join(str(t.splits) for t in config.tilings)} "
                     f"w{config.num_warps} s{config.num_stages}")
            reports.append(compile_module(module, spec, 0, kernel="stream_matmul", shape=label))
    return reports
