"""`head_matmul`: each head's rows against that head's slice of one shared weight, the two
per-head products of MLA's absorbed decode.

MLA keeps W_uk and W_uv as one weight w [C, H, W] (kv_b_proj's kernel, W = nope + v; C the
latent width). Decode multiplies each head's query by W_uk (absorb) and each head's output
latent by W_uv (expand):

    transposed (absorb):  out[n, h, c] = sum_d x[n, h, d] w[c, h, offset + d]     [N, H, C]
    plain (expand):       out[n, h, j] = sum_c x[n, h, c] w[c, h, offset + j]     [N, H, width]

accumulated in fp32. XLA runs these as batched products whose algorithm, and so the order
of each row's sums, changes with N; MTP's verify step runs N + 1 rows per sequence where
plain decoding runs one, and its greedy tokens must be the same. The Pallas kernel
(`head_matmul_pallas`) tiles by the shapes alone, so a row's result does not depend on the
rows beside it, and reads the weight's slices where they lie (no sliced copy).
Implementations: "pallas" (interpret mode on the CPU) and "xla" (`head_matmul_reference`,
jnp.einsum at HIGHEST precision: the oracle).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import resolve_interpret
from pallas_kernels.head_matmul_pallas import HeadTiling, head_matmul_pallas, select_tiling

IMPLEMENTATIONS = ("pallas", "xla")


def _check(x, w, transposed: bool, offset: int, width: int | None) -> int:
    """The output width (ValueError naming the bad value otherwise)."""
    if x.ndim != 3 or w.ndim != 3:
        raise ValueError(f"x must be [N, H, K] and w [C, H, W], got {x.shape}, {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} heads, w {w.shape[1]}")
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype}, w is {w.dtype}")
    contracted = x.shape[2]
    if transposed:
        width = w.shape[0]
        if offset < 0 or offset + contracted > w.shape[2]:
            raise ValueError(f"offset {offset} + {contracted} contracted columns exceed w's "
                             f"{w.shape[2]}")
    else:
        if contracted != w.shape[0]:
            raise ValueError(f"x's last dimension {contracted} must be w's first {w.shape[0]}")
        if width is None or width < 1 or offset < 0 or offset + width > w.shape[2]:
            raise ValueError(f"columns [{offset}, {offset} + {width}) are not inside w's "
                             f"{w.shape[2]}")
    if contracted % 16 or width % 16:
        raise ValueError(f"the contracted dimension {contracted} and the output width {width} "
                         f"must be multiples of 16")
    return width


def head_matmul_reference(x, w, *, transposed: bool, offset: int, width: int):
    """The oracle: jnp.einsum over the weight's slice, fp32 accumulation, HIGHEST precision."""
    if transposed:
        part = w[..., offset:offset + x.shape[2]]
        return jnp.einsum("nhd,chd->nhc", x, part, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    part = w[..., offset:offset + width]
    return jnp.einsum("nhc,chj->nhj", x, part, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)


def head_matmul(x: jax.Array, w: jax.Array, *, transposed: bool, offset: int = 0,
                width: int | None = None, implementation: str = "pallas",
                interpret: bool | None = None, tiling: HeadTiling | None = None) -> jax.Array:
    """Per-head products against one shared weight (module doc).

    Args:
      x: [N, H, K] rows (bf16 or fp32); w: [C, H, W] in x's dtype.
      transposed: absorb (K = the slice's width, output [N, H, C]) or expand (K = C, output
        [N, H, width]).
      offset, width: the weight's columns [offset, offset + K) (absorb) or
        [offset, offset + width) (expand); K and the output width multiples of 16.
      implementation: "pallas" or "xla"; interpret: Pallas interpret mode (default: on the
        CPU); tiling: override (default `select_tiling`, from the shapes alone).
    Returns fp32 [N, H, C or width].
    """
    width = _check(x, w, transposed, offset, width)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if implementation == "xla":
        return head_matmul_reference(x, w, transposed=transposed, offset=offset, width=width)
    tiling = tiling or select_tiling(width, x.shape[2])
    if width % tiling.block_n or x.shape[2] % tiling.block_k:
        raise ValueError(f"tiling {tiling} does not divide width {width} and K {x.shape[2]}")
    return head_matmul_pallas(x, w, transposed=transposed, offset=offset, width=width,
                              tiling=tiling, interpret=resolve_interpret(interpret))
