"""Tiles, warps and pipeline stages of the grouped GEMM, picked from the device.

One table per device kind (compute capability major): sm_90 / sm_100 feed wgmma from shared
memory with a deep pipeline (227 KB per block); sm_12x (GB10, 99 KB per block) and sm_80
use mma.sync with cp.async stages, so their tiles are smaller. `estimate_shared_memory` keeps
a choice inside the per-block limit (the compile-and-measure check is
`python -m pallas_kernels.aot`).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.tiles import check_tile_sizes
from pallas_kernels.tuning import DeviceSpec

BF16_BYTES = 2


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Static tiling of one grouped-GEMM launch (hashable: a jit static argument).

    block_m rows of one group x block_n columns per program, block_k deep k steps;
    swizzle: work items (m tiles) sharing one launch window across every n tile, so a
    group's weight slab and a tile's rows are both read from L2 while they are hot;
    half_tiles: an item of at most block_m / 2 rows (a group's last) runs a tile of that
    height, so the tensor cores skip the masked half (block_m >= 32: a Triton dot takes
    at least 16 rows).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    swizzle: int = 8
    half_tiles: bool = True

    @property
    def half_m(self) -> int | None:
        """The short items' tile height, or None when every item runs block_m rows."""
        return self.block_m // 2 if self.half_tiles and self.block_m >= 32 else None

    def __post_init__(self):
        check_tile_sizes(self, ("block_m", "block_n", "block_k"))
        if self.swizzle < 1:
            raise ValueError(f"swizzle must be >= 1, got {self.swizzle}")


def estimate_shared_memory(config: GmmConfig, *, num_rhs: int = 1,
                           operand_bytes: int = BF16_BYTES) -> int:
    """Upper estimate of shared memory per block in bytes: every pipeline stage buffers one
    [block_m, block_k] lhs tile and `num_rhs` [block_k, block_n] weight tiles (two for the
    fused gate + up), plus the epilogue's [block_m, block_n] fp32 layout conversion."""
    per_stage = operand_bytes * config.block_k * (config.block_m + num_rhs * config.block_n)
    epilogue = 4 * config.block_m * config.block_n
    return max(config.num_stages, 1) * per_stage + epilogue // 2


# (compute capability major, fused gate+up) -> the starting configuration; smaller tiles for
# few rows per group (see select_gmm_config).
_TABLE = {
    (9, False): GmmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
    (9, True): GmmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    (12, False): GmmConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3),
    (12, True): GmmConfig(block_m=128, block_n=64, block_k=32, num_warps=8, num_stages=3),
}
_TABLE[(10, False)], _TABLE[(10, True)] = _TABLE[(9, False)], _TABLE[(9, True)]
_TABLE[(8, False)], _TABLE[(8, True)] = _TABLE[(12, False)], _TABLE[(12, True)]


def select_gmm_config(spec: DeviceSpec, *, rows: int, k: int, n: int, num_groups: int,
                      num_rhs: int = 1, operand_bytes: int = BF16_BYTES) -> GmmConfig:
    """The tiling for `rows` sorted rows over `num_groups` groups, [K, N] weights.

    Few rows per group (below 64 on average: e.g. 512 tokens x top-8 over 288 experts)
    make the launch a stream of expert weights with mostly masked rows: block_m drops to 64
    and the weight tile to 128 columns in all (64 per stack when fused), so that a few
    programs per SM keep more loads in flight. Tiles shrink to the problem (tests, small
    models); stages drop while the estimate exceeds the limit. (The starting points are
    reasoned, not yet swept on the H200: `python -m bench.moe --sweep`.)
    """
    major = spec.compute_capability[0]
    config = _TABLE.get((major, num_rhs == 2), _TABLE[(12, num_rhs == 2)])
    if rows < 64 * num_groups:
        config = dataclasses.replace(config, block_m=64, num_warps=4,
                                     block_n=min(config.block_n, 128 // num_rhs))
    config = dataclasses.replace(
        config, block_m=min(config.block_m, pow2_at_least_16(rows)),
        block_n=largest_dividing(config.block_n, n), block_k=largest_dividing(config.block_k, k))
    while (estimate_shared_memory(config, num_rhs=num_rhs, operand_bytes=operand_bytes)
           > spec.smem_per_block and config.num_stages > 1):
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


def pow2_at_least_16(x: int) -> int:
    """The smallest power of two >= x, at least 16 (the smallest tile a Triton dot takes)."""
    return max(16, 1 << max(x - 1, 0).bit_length())


def largest_dividing(block: int, dim: int) -> int:
    """The largest power of two <= block dividing dim (at least 16; the caller checks)."""
    while block > 16 and dim % block:
        block //= 2
    return block
