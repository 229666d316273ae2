"""The real routed-expert shapes, one list shared by bench.moe, the AOT check and the GPU
tests so they never drift apart (tests/test_gmm.py checks them against the presets)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.gmm_pallas import Epilogue
from pallas_kernels.moe_experts import PER_ROW_COPIES


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """One preset's routed experts: x [T, hidden] -> top_k of `experts` SwiGLU experts."""

    preset: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    swiglu_limit: float | None

    def useful_flops(self, tokens: int) -> int:
        """Gate, up and down GEMMs of the chosen experts only: 2 * T * k * D * I * 3."""
        return 2 * tokens * self.top_k * self.hidden * self.inter * 3

    def weight_bytes(self, dtype=jnp.bfloat16) -> int:
        """Every expert's three matrices, read once: the memory floor's traffic."""
        return 3 * self.experts * self.hidden * self.inter * jnp.dtype(dtype).itemsize


MOE_SHAPES = (
    MoEShape("glm5.3-flash", hidden=4096, inter=2048, experts=288, top_k=8, swiglu_limit=10.0),
    MoEShape("kimi-linear-48b", hidden=2304, inter=1024, experts=256, top_k=8,
             swiglu_limit=None),
)
TOKEN_COUNTS = (512, 2048, 8192)


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """One grouped-GEMM launch of the routed experts: abstract operands and its epilogue."""

    name: str
    lhs: jax.ShapeDtypeStruct
    rhs: tuple[jax.ShapeDtypeStruct, ...]
    group_sizes: jax.ShapeDtypeStruct
    epilogue: Epilogue
    rows: int
    copies_per_token: int | None = None  # set: the per-row schedule (`gmm_pallas`)


def gemm_specs(shape: MoEShape, tokens: int, dtype=jnp.bfloat16) -> list[GemmSpec]:
    """The launches of one MoE layer: gate/up (plain, gathered, gathered + SwiGLU) and down
    (plain, with the combine epilogue); at most PER_ROW_COPIES copies (a decode step), the
    two fused launches of the per-row schedule, which is all that runs there."""
    rows = tokens * shape.top_k
    sds = jax.ShapeDtypeStruct
    sizes = sds((shape.experts,), jnp.int32)
    up = sds((shape.experts, shape.hidden, shape.inter), dtype)
    down = sds((shape.experts, shape.inter, shape.hidden), dtype)
    sorted_x, x = sds((rows, shape.hidden), dtype), sds((tokens, shape.hidden), dtype)
    h = sds((rows, shape.inter), dtype)
    fused = Epilogue(gather=True, swiglu=True, limit=shape.swiglu_limit)
    if rows <= PER_ROW_COPIES:
        return [GemmSpec("gmm_gather_swiglu", x, (up, up), sizes, fused, rows, shape.top_k),
                GemmSpec("gmm_combine", h, (down,), sizes, Epilogue(combine=True), rows,
                         shape.top_k)]
    return [
        GemmSpec("gmm", sorted_x, (up,), sizes, Epilogue(), rows),
        GemmSpec("gmm_gather", x, (up,), sizes, Epilogue(gather=True), rows),
        GemmSpec("gmm_gather_swiglu", x, (up, up), sizes, fused, rows),
        GemmSpec("gmm_down", h, (down,), sizes, Epilogue(), rows),
        GemmSpec("gmm_combine", h, (down,), sizes, Epilogue(combine=True), rows),
    ]
