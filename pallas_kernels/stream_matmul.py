"""Few-row products that stream their weights: x [M, K] @ w_i [K, N_i] for several weights
sharing one input, in one launch.

A decode step multiplies one to a few dozen rows by each weight, so each product is a read
of the weight and nothing else: its time is the weight's bytes over the bandwidth the
launch reaches. One row of [K, N] split only by columns (the grouped GEMM's tiling) leaves
each program a long serial k loop over small tiles, latency-bound (kimi's 2304 x 4096 at
1.5 TB/s, its 2304 x 128 gate projections at a fraction of that). Here each weight is cut
into `splits` slices along K as well as into column tiles, so the launch holds enough
programs to fill the GPU whatever the shape; each program writes its fp32 partial sum and
the partials are added in one fixed order (`pallas_kernels.partials`). Several weights of
one input (a KDA layer's q, k, v, gate and beta projections) are one launch: the grid is
the concatenation of each weight's programs.

Batch invariance: the tiling depends on the weight's shape and the device, never on the
rows, and the partial sums are added in an order fixed by the splits alone rather than by
an XLA reduction (whose order may change with the rows), so a row's result does not depend
on how many rows share the launch. MTP's verify step runs N + 1 rows per sequence where
plain decoding runs one, and its greedy tokens must be the same.

Implementations behind `stream_matmul`: "pallas" (`stream_matmul_pallas`, Triton lowering;
interpret mode on the CPU) and "xla" (`stream_matmul_reference`: jnp.dot per weight in fp32
accumulation, the oracle).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import resolve_interpret
from pallas_kernels.gmm_tuning import largest_dividing
from pallas_kernels.stream_matmul_pallas import (
    StreamConfig,
    StreamTiling,
    padded_rows,
    stream_matmul_pallas,
)
from pallas_kernels.tuning import DeviceSpec, device_spec

STREAM_ROWS = 64  # most rows a stream launch takes (a decode batch bucket)
IMPLEMENTATIONS = ("pallas", "xla")
TILE_ELEMENTS = 8192  # weight elements per [block_k, block_n] tile: 16 KB in bf16
MIN_BLOCK_N = 32
MIN_BLOCK_K = 64
PROGRAMS_PER_SM = 2
PARTIAL_SHARE = 0.25  # most partial-sum bytes per weight byte


def select_tiling(spec: DeviceSpec, k: int, n: int) -> StreamTiling:
    """Tiles of TILE_ELEMENTS (block_n up to 128 columns), then the fewest K splits giving
    PROGRAMS_PER_SM programs per SM; while even a split per k step falls short, narrower
    columns (down to MIN_BLOCK_N), then shallower steps (down to MIN_BLOCK_K). The fp32
    partial sums of STREAM_ROWS rows (splits x STREAM_ROWS x N x 4 bytes) stay within
    PARTIAL_SHARE of the weight's bytes. The rows a launch holds do not enter: one tiling
    for every row count keeps each row's sums in one order (batch invariance)."""
    target = PROGRAMS_PER_SM * spec.num_sms
    max_splits = max_stream_splits(k)
    block_n = largest_dividing(128, n)
    block_k = largest_dividing(TILE_ELEMENTS // block_n, k)

    def most_programs(block_n, block_k):
        return n // block_n * min(k // block_k, max_splits)

    while (block_n > MIN_BLOCK_N and most_programs(block_n, block_k) < target
           and n % (block_n // 2) == 0):
        block_n //= 2
    while block_k > MIN_BLOCK_K and most_programs(block_n, block_k) < target:
        block_k //= 2
    splits = fewest_splits(k // block_k, n // block_n, target, max_splits)
    return StreamTiling(block_n=block_n, block_k=block_k, splits=splits)


def max_stream_splits(k: int) -> int:
    """The most K splits of a [k, N] weight: STREAM_ROWS rows of fp32 partials per split
    within PARTIAL_SHARE of the weight's bf16 bytes."""
    return max(1, int(k * PARTIAL_SHARE) // (2 * STREAM_ROWS))


def fewest_splits(k_blocks: int, column_tiles: int, target: int, max_splits: int) -> int:
    """The fewest splits of `k_blocks` k steps (a divisor, at most `max_splits`) that give
    `column_tiles` x splits >= `target` programs; the most allowed when none does."""
    divisors = [s for s in range(1, min(k_blocks, max_splits) + 1) if k_blocks % s == 0]
    return next((s for s in divisors if column_tiles * s >= target), divisors[-1])


def select_config(spec: DeviceSpec, rows: int, shapes: Sequence[tuple[int, int]], *,
                  operand_bytes: int = 2) -> StreamConfig:
    """The launch for `rows` rows against weights of `shapes` [(K, N_i)] in operands of
    `operand_bytes` (2: bf16, 4: fp32): 4 pipeline stages where shared memory allows,
    fewer where not (sm_12x's 99 KB at 64 rows, or fp32)."""
    tilings = tuple(select_tiling(spec, k, n) for k, n in shapes)
    stages = 4
    while stages > 1 and max(estimate_shared_memory(t, padded_rows(rows), stages,
                                                    operand_bytes=operand_bytes)
                             for t in tilings) > spec.smem_per_block:
        stages -= 1
    return StreamConfig(tilings=tilings, num_stages=stages)


def estimate_shared_memory(tiling: StreamTiling, rows: int, stages: int, *,
                           operand_bytes: int = 2) -> int:
    """Bytes per block: every stage buffers one x tile and one weight tile, plus the
    [rows, block_n] fp32 epilogue layout conversion."""
    per_stage = operand_bytes * tiling.block_k * (rows + tiling.block_n)
    return stages * per_stage + 4 * rows * tiling.block_n


def check_operands(x: jax.Array, weights: Sequence[jax.Array]) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    rows, k = x.shape
    if not 1 <= rows <= STREAM_ROWS:
        raise ValueError(f"x has {rows} rows; a stream launch takes 1..{STREAM_ROWS}")
    if not weights:
        raise ValueError("stream_matmul needs at least one weight")
    for i, w in enumerate(weights):
        if w.ndim != 2 or w.shape[0] != k:
            raise ValueError(f"weight {i} must be [K={k}, N], got shape {w.shape}")
        if w.dtype != x.dtype:
            raise ValueError(f"weight {i} is {w.dtype}, x is {x.dtype}")
        if k % 16 or w.shape[1] % 16:
            raise ValueError(f"weight {i} shape {w.shape}: K and N must be multiples of 16")


def out_dtypes_of(x: jax.Array, weights: Sequence[jax.Array], out_dtypes) -> tuple:
    """Each product's output dtype: `out_dtypes` (None: x.dtype for all), x.dtype or fp32."""
    dtypes = tuple(jnp.dtype(d) for d in (out_dtypes or (x.dtype,) * len(weights)))
    if len(dtypes) != len(weights):
        raise ValueError(f"out_dtypes has {len(dtypes)} entries for {len(weights)} weights")
    for i, dtype in enumerate(dtypes):
        if dtype not in (x.dtype, jnp.dtype(jnp.float32)):
            raise ValueError(f"out_dtypes[{i}] must be x's dtype or float32, got {dtype}")
    return dtypes


def stream_matmul_reference(x: jax.Array, weights: Sequence[jax.Array], out_dtypes=None, *,
                            keep_partials: Sequence[int] = ()) -> tuple[jax.Array, ...]:
    """The oracle: each x @ w_i accumulated in fp32 (HIGHEST precision), in out_dtypes[i]. A
    product of `keep_partials` comes as one partial sum [1, M, N_i] (the whole product)."""
    products = (jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32).astype(dtype)
                for w, dtype in zip(weights, out_dtypes_of(x, weights, out_dtypes)))
    return tuple(p[None] if i in keep_partials else p for i, p in enumerate(products))


def stream_matmul(x: jax.Array, weights: Sequence[jax.Array], *, out_dtypes=None,
                  keep_partials: Sequence[int] = (), implementation: str = "pallas",
                  interpret: bool | None = None, config: StreamConfig | None = None
                  ) -> tuple[jax.Array, ...]:
    """x [M, K] @ each weights[i] [K, N_i] -> tuple of [M, N_i], accumulated in fp32; M in
    1..STREAM_ROWS, K and every N multiples of 16, bf16 or fp32 operands.

    out_dtypes: each product's dtype, x.dtype or float32 (None: x.dtype for all);
    keep_partials: indices of float32 products returned as their fp32 partial sums
    [S, M, N_i] for the consumer to add (`pallas_kernels.partials.ordered_sum` gives the
    product bit for bit; S = the weight's K splits, 1 for the reference);
    implementation: "pallas" (one launch for every weight) or "xla" (the reference);
    interpret: Pallas interpret mode (default: on the CPU); config: tiling override (one
    StreamTiling per weight)."""
    check_operands(x, weights)
    out_dtypes = out_dtypes_of(x, weights, out_dtypes)
    keep_partials = tuple(sorted(set(keep_partials)))
    for i in keep_partials:
        if not 0 <= i < len(weights) or out_dtypes[i] != jnp.float32:
            raise ValueError(f"keep_partials names product {i}: it must be a float32 product "
                             f"of the {len(weights)}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if implementation == "xla":
        return stream_matmul_reference(x, weights, out_dtypes, keep_partials=keep_partials)
    shapes = tuple(w.shape for w in weights)
    config = config or select_config(device_spec(), x.shape[0], shapes,
                                     operand_bytes=x.dtype.itemsize)
    if len(config.tilings) != len(weights):
        raise ValueError(f"config has {len(config.tilings)} tilings for {len(weights)} weights")
    for (k, n), t in zip(shapes, config.tilings):
        if n % t.block_n or k % (t.splits * t.block_k):
            raise ValueError(f"tiling {t} does not divide weight shape {(k, n)}")
    return stream_matmul_pallas(x, tuple(weights), config=config, out_dtypes=out_dtypes,
                                keep_partials=keep_partials,
                                interpret=resolve_interpret(interpret))
