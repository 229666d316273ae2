"""`index_scores`: the DSA lightning indexer's scores of packed queries against their keys.

Contract:

- q [R, H, d] index queries, weights fp32 [R, H] their head weights, keys [S, d] the index
  keys shared by every query; key_start, key_end int32 [R]: row r sees keys
  [key_start[r], key_end[r]) (empty: none; clipped to [0, S]).
- Output fp32 [R, S]: ``sum_h weights[r, h] * relu(q[r, h] . keys[s])`` where row r sees
  key s, -inf elsewhere (what a top-k over the row needs).

Implementations behind the one signature (`IMPLEMENTATIONS`):
- "reference": jax.numpy: the [R, H, S] head scores in memory, then the weighted sum (the
  indexer before this op); the CPU default.
- "pallas": `pallas_kernels.index_scores_pallas`, one [block_r, block_s] tile per program
  accumulated over the heads in registers, tiles no row sees written as -inf without a
  matmul; every GPU's default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.index_scores_pallas import index_scores_pallas, select_index_config

IMPLEMENTATIONS = ("reference", "pallas")


def default_implementation(device: jax.Device | None = None) -> str:
    """The implementation `index_scores` uses on `device` (default: the first one)."""
    device = device or jax.devices()[0]
    return "pallas" if device.platform == "gpu" else "reference"


def _check(q, weights, keys, key_start, key_end):
    if q.ndim != 3 or weights.shape != q.shape[:2] or keys.ndim != 2:
        raise ValueError(f"q, weights, keys must be [R, H, d], [R, H], [S, d]; got shapes "
                         f"{q.shape}, {weights.shape}, {keys.shape}")
    if keys.shape[1] != q.shape[2]:
        raise ValueError(f"keys must be [S, d={q.shape[2]}], got {keys.shape}")
    for name, x in (("key_start", key_start), ("key_end", key_end)):
        if x.shape != q.shape[:1] or x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [R={q.shape[0]}], got "
                             f"{x.dtype}{list(x.shape)}")


@jax.jit
def index_scores_reference(q, weights, keys, key_start, key_end):
    """jax.numpy `index_scores`: fp32 head scores [R, H, S], relu, weighted head sum."""
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    dots = jnp.einsum("rhd,sd->rhs", q, keys.astype(q.dtype), precision=precision,
                      preferred_element_type=jnp.float32)
    scores = jnp.einsum("rh,rhs->rs", weights.astype(jnp.float32), jax.nn.relu(dots),
                        precision=lax.Precision.HIGHEST)
    cols = jnp.arange(keys.shape[0], dtype=jnp.int32)[None]
    return jnp.where((cols >= key_start[:, None]) & (cols < key_end[:, None]), scores,
                     -jnp.inf)


def index_scores(q, weights, keys, key_start, key_end, *, implementation: str | None = None,
                 interpret: bool | None = None, config=None):
    """Index scores of each row over its key range (see the module docstring).

    Args:
      q: [R, H, d]; weights: fp32 [R, H]; keys: [S, d] (cast to q's dtype; bf16 on a GPU,
        fp32 selects IEEE fp32 matmuls); key_start, key_end: int32 [R].
      implementation: one of `IMPLEMENTATIONS`; None: `default_implementation()`.
      interpret: Pallas interpret mode (default: on the CPU); "pallas" only.
      config: an `index_scores_pallas.IndexConfig` override; "pallas" only.
    Returns:
      fp32 [R, S].
    """
    _check(q, weights, keys, key_start, key_end)
    implementation = implementation or default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    num_keys = keys.shape[0]
    key_start = jnp.clip(key_start, 0, num_keys)
    key_end = jnp.clip(key_end, key_start, num_keys)
    if implementation == "reference":
        return index_scores_reference(q, weights, keys, key_start, key_end)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    config = config or select_index_config()
    return index_scores_pallas(q, weights, keys, key_start, key_end, config=config,
                               interpret=bool(interpret))
