"""`grouped_matmul`: rows sorted by group times that group's weight matrix.

    out[r] = lhs[r] @ rhs[g(r)]   for rows r < sum(group_sizes), g(r) the group holding r
    out[r] = 0                    for the rows past sum(group_sizes) (padding)

Implementations behind one signature, picked from the device by `default_implementation`:
  "ragged_dot": `jax.lax.ragged_dot` (the reference; the CPU default);
  "pallas":     our Pallas Triton kernel (`pallas_kernels.gmm_pallas`; interpret mode on CPU);
  "tokamax":    tokamax's Mosaic GPU ragged_dot (sm_90 / sm_100, optional extra `tokamax`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import gmm_tokamax
from pallas_kernels.gmm_pallas import Epilogue, gmm_pallas
from pallas_kernels.gmm_tuning import GmmConfig, select_gmm_config
from pallas_kernels.tuning import device_spec

IMPLEMENTATIONS = ("ragged_dot", "pallas", "tokamax")
# Whether sm_90 / sm_100 GPUs default to tokamax's Mosaic GPU kernel instead of ours (when
# tokamax imports). The lead sets it from bench.moe's measurements on the H200.
PREFER_TOKAMAX_ON_HOPPER = False


def default_implementation(device: jax.Device | None = None) -> str:
    """"ragged_dot" on the CPU, "pallas" on a GPU ("tokamax" on sm_90 / sm_100 when
    PREFER_TOKAMAX_ON_HOPPER and tokamax is installed)."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return "ragged_dot"
    if PREFER_TOKAMAX_ON_HOPPER and gmm_tokamax.supported(device):
        return "tokamax"
    return "pallas"


def check_operands(lhs, rhs, group_sizes) -> None:
    """Static shape and dtype checks shared by every implementation."""
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
    if rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs must be [E, K={lhs.shape[1]}, N], got shape {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],) or group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes must be int32 [E={rhs.shape[0]}], got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"lhs and rhs dtypes differ: {lhs.dtype} vs {rhs.dtype}")


def grouped_matmul_reference(lhs, rhs, group_sizes):
    """jax.lax.ragged_dot with fp32 accumulation, in lhs.dtype; rows past the sum are zero."""
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    rows = jnp.arange(lhs.shape[0])[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, 0).astype(lhs.dtype)


def resolve(implementation: str | None) -> str:
    implementation = implementation or default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    return implementation


def pallas_config(lhs_rows: int, rhs, *, num_rhs: int = 1, config: GmmConfig | None = None,
                  active_groups: int | None = None) -> GmmConfig:
    """`config`, or the device's tiling for this shape; checks that the tiles divide K, N.
    `active_groups`: how many of rhs's groups rows can fall in (default: all), when rhs
    stacks several layers' experts and one layer's are addressed."""
    num_groups, k, n = rhs.shape
    config = config or select_gmm_config(device_spec(), rows=lhs_rows, k=k, n=n,
                                         num_groups=active_groups or num_groups,
                                         num_rhs=num_rhs,
                                         operand_bytes=rhs.dtype.itemsize)
    for name, dim, block in (("K", k, config.block_k), ("N", n, config.block_n)):
        if dim % block:
            raise ValueError(f"{name}={dim} must be a multiple of the kernel's block {block}")
    return config


def grouped_matmul(lhs, rhs, group_sizes, *, implementation: str | None = None,
                   interpret: bool | None = None, config: GmmConfig | None = None):
    """Grouped matmul of sorted rows.

    Args:
      lhs: [M, K] rows sorted by group (group 0's rows first).
      rhs: [E, K, N] one weight matrix per group, same dtype as lhs (bf16 or fp32).
      group_sizes: int32 [E], sum <= M.
      implementation: one of IMPLEMENTATIONS; None picks from the device.
      interpret: Pallas interpret mode (default: on the CPU); config: Pallas tiling override.

    Returns [M, N] in lhs.dtype, accumulated in fp32; rows past sum(group_sizes) are zero.
    """
    check_operands(lhs, rhs, group_sizes)
    implementation = resolve(implementation)
    if implementation == "ragged_dot":
        return grouped_matmul_reference(lhs, rhs, group_sizes)
    if implementation == "tokamax":
        return gmm_tokamax.grouped_matmul(lhs, rhs, group_sizes)
    config = pallas_config(lhs.shape[0], rhs, config=config)
    return gmm_pallas(lhs, (rhs,), group_sizes, config=config, epilogue=Epilogue(),
                      interpret=resolve_interpret(interpret))


def resolve_interpret(interpret: bool | None) -> bool:
    """Pallas interpret mode: as given, by default on the CPU."""
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)
