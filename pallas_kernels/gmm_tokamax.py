"""tokamax's Mosaic GPU ragged_dot behind `grouped_matmul`'s contract (optional extra).

Mosaic GPU kernels exist for sm_90 and sm_100 only. tokamax is an optional dependency
(`pip install -e '.[tokamax]'`); without it `supported` is False and the core path
(`jax.lax.ragged_dot` on the CPU, our Pallas kernel on GPUs) is unaffected.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp

MOSAIC_GPU_MAJORS = (9, 10)


@functools.cache
def available() -> bool:
    """tokamax imports (the `tokamax` extra is installed)."""
    return importlib.util.find_spec("tokamax") is not None


def supported(device: jax.Device | None = None) -> bool:
    """tokamax is installed and the device is an sm_90 / sm_100 GPU."""
    device = device or jax.devices()[0]
    if device.platform != "gpu" or not available():
        return False
    return int(str(device.compute_capability).split(".")[0]) in MOSAIC_GPU_MAJORS


def grouped_matmul(lhs, rhs, group_sizes):
    """[M, K] x [E, K, N] -> [M, N] in lhs.dtype, fp32 accumulation; rows past the sum are
    zeroed here (the Mosaic GPU kernel leaves rows no group owns unwritten)."""
    if not supported():
        raise ValueError("implementation 'tokamax' needs the tokamax extra and an sm_90 / "
                         f"sm_100 GPU; this device is {jax.devices()[0].device_kind}")
    import tokamax

    out = tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32,
                             implementation="mosaic")
    rows = jnp.arange(lhs.shape[0])[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, 0).astype(lhs.dtype)
