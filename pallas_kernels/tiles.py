"""Tile-level helpers shared by the KDA Pallas kernels (fp32 accumulation everywhere)."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def dot(a, b, precision):
    """a @ b, accumulated in fp32."""
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def dot_tn(a, b, precision):
    """a^T @ b without materialising the transpose."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def dot_nt(a, b, precision):
    """a @ b^T."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def check_tile_sizes(config, names) -> None:
    """ValueError unless each named field of `config` is a power of two >= 16 (a tile edge
    Triton and the tensor cores take)."""
    for name in names:
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def iota(shape, dim):
    """int32 indices along `dim` of an array of `shape` (rows / columns of a tile)."""
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def operand_dtype(exact):
    """The stored dtype of matmul operands: bf16 on the fast path; fp32 when exact (states
    and accumulation are fp32 either way)."""
    return jnp.float32 if exact else jnp.bfloat16


def matmul_precision(exact):
    """IEEE fp32 matmuls when exact, the default (bf16 / tf32 operands) otherwise."""
    return lax.Precision.HIGHEST if exact else lax.Precision.DEFAULT


LOG2_E = 1 / math.log(2)


def exp2_ftz(x):
    """2^x of fp32 `x` by one `ex2.approx.ftz.f32` (one MUFU.EX2). libdevice's `exp2f`, which
    `jnp.exp2` lowers to, wraps the same instruction in a range check and two scalings so
    that results below 2^-126 come out subnormal: 4 SASS instructions an element (sm_90,
    XLA's Triton). The kernels' decay factors never need those (they flush to zero here)."""
    return plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def exp_base(exact: bool, *, interpret: bool) -> tuple[float, Callable]:
    """(scale, exp) for exponentials in a kernel: exp(x) = exp(scale x) of the second,
    so a kernel that multiplies its log-decays by `scale` once, as they load, forms every
    decay with the second alone.

    Exact: (1, `jnp.exp`), which the Triton lowering makes libdevice's `expf` (~1 ulp, ~9
    SASS instructions an element on sm_90). Otherwise (log2 e, `exp2_ftz`): one MUFU
    instruction (~2 ulp, plus |x| times the scaling's rounding: ~1e-6 relative at |x| =
    16); `jnp.exp2` in interpret mode, where inline PTX cannot run. fla forms its decays in
    base 2 likewise."""
    if exact:
        return 1.0, jnp.exp
    return LOG2_E, jnp.exp2 if interpret else exp2_ftz


def exp_function(exact: bool, *, interpret: bool) -> Callable:
    """exp of natural-log arguments, through `exp_base` (2 instructions an element on the
    fast path, the scaling included)."""
    scale, exp = exp_base(exact, interpret=interpret)
    return exp if scale == 1.0 else lambda x: exp(x * scale)


def load_rows(ref, rows, head, valid, cols=slice(None)):
    """Rows `rows` (a `pl.ds`) of one head of a [T, H, D] ref as fp32, zero where `valid`
    ([R, 1]) is false; a [T, H] ref (beta) loads as an [R, 1] column."""
    at = ref.at[rows, pl.ds(head, 1)] if len(ref.shape) == 2 else ref.at[rows, head, cols]
    return plgpu.load(at, mask=valid, other=0).astype(jnp.float32)
