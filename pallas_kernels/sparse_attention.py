"""`sparse_attention`: DSA attention over the MLA latents in the absorbed (MQA) form, each
query against only its selected keys (DeepSeek-V3.2's sparse prefill).

Contract:

- q [T, H, L]: the absorbed queries, ``q_nope W_uk | q_pe`` (L = kv_lora + rope).
- latent [S, L]: the keys, ``c_kv | k_pe`` per token, shared by all heads; the values are
  their first kv_lora columns (c_kv).
- indices int32 [T, K]: row t attends to latent rows indices[t, :]; an entry outside [0, S)
  (e.g. -1) selects nothing. Entries must not repeat within a row (a top-k's never do).
- Outputs: o [T, H, kv_lora] in q's dtype (the attention output before W_uv; zero on rows
  with no key) and lse fp32 [T, H] (natural log; -inf there), what an LSE merge needs.

No [H, T, S] score tensor and no [T, S] mask: the work is T x K x H, independent of S.

Implementations behind the one signature (`IMPLEMENTATIONS`):
- "reference": jax.numpy, `REFERENCE_QUERY_BLOCK` queries at a time, their selected rows
  gathered ([block, K, L]); the CPU default.
- "pallas": the Pallas Triton kernel `pallas_kernels.sparse_attention_pallas`, AOT-checked
  for sm_121 and sm_90; every GPU's default.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.sparse_attention_pallas import select_sparse_config, sparse_attention_pallas

IMPLEMENTATIONS = ("reference", "pallas")
REFERENCE_QUERY_BLOCK = 128


def default_implementation(device: jax.Device | None = None) -> str:
    """The implementation `sparse_attention` uses on `device` (default: the first one)."""
    device = device or jax.devices()[0]
    return "pallas" if device.platform == "gpu" else "reference"


def _check(q, latent, indices, kv_lora):
    if q.ndim != 3 or latent.ndim != 2 or indices.ndim != 2:
        raise ValueError(f"q, latent, indices must be [T, H, L], [S, L], [T, K]; got shapes "
                         f"{q.shape}, {latent.shape}, {indices.shape}")
    if latent.shape[1] != q.shape[2] or indices.shape[0] != q.shape[0]:
        raise ValueError(f"latent must be [S, L={q.shape[2]}] and indices [T={q.shape[0]}, "
                         f"K]; got latent {latent.shape}, indices {indices.shape}")
    if indices.dtype != jnp.int32:
        raise ValueError(f"indices must be int32, got {indices.dtype}")
    if not 0 < kv_lora <= q.shape[2]:
        raise ValueError(f"kv_lora={kv_lora} must be in [1, L={q.shape[2]}]")


@functools.partial(jax.jit, static_argnames=("kv_lora", "scale"))
def sparse_attention_reference(q, latent, indices, *, kv_lora: int, scale: float):
    """jax.numpy `sparse_attention` (fp32 softmax), `REFERENCE_QUERY_BLOCK` queries at a
    time so the gathered [block, K, L] rows stay bounded."""
    num_queries, num_keys = q.shape[0], latent.shape[0]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    latent = latent.astype(q.dtype)

    def attend(q, indices):  # [B, H, L], [B, K]
        ok = (indices >= 0) & (indices < num_keys)
        rows = latent[jnp.where(ok, indices, 0)]  # [B, K, L]
        scores = jnp.einsum("bhl,bkl->bhk", q, rows, precision=precision,
                            preferred_element_type=jnp.float32) * scale
        scores = jnp.where(ok[:, None], scores, -jnp.inf)
        peak = jnp.max(scores, axis=-1, keepdims=True)
        weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0))
        total = jnp.sum(weights, axis=-1, keepdims=True)
        lse = jnp.where(total > 0, peak + jnp.log(jnp.where(total > 0, total, 1)), -jnp.inf)
        probs = (weights / jnp.where(total > 0, total, 1)).astype(q.dtype)
        out = jnp.einsum("bhk,bkc->bhc", probs, rows[..., :kv_lora], precision=precision,
                         preferred_element_type=jnp.float32)
        return out.astype(q.dtype), lse[..., 0]

    block = REFERENCE_QUERY_BLOCK
    if num_queries <= block:
        return attend(q, indices)
    pad = -num_queries % block

    def blocks(x, fill):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(x.shape[0] // block, block, *x.shape[1:])

    out, lse = lax.map(lambda args: attend(*args), (blocks(q, 0), blocks(indices, -1)))
    return (out.reshape(-1, *out.shape[2:])[:num_queries],
            lse.reshape(-1, lse.shape[-1])[:num_queries])


def sparse_attention(q, latent, indices, *, kv_lora: int, scale: float,
                     implementation: str | None = None, interpret: bool | None = None,
                     config=None):
    """Each query's heads attend to its selected latent rows (see the module docstring).

    Args:
      q: [T, H, L]; latent: [S, L]; indices: int32 [T, K]; bf16 on a GPU (fp32 selects
        IEEE fp32 matmuls; latent is cast to q's dtype).
      kv_lora: the value width (c_kv columns); scale: the score scale.
      implementation: one of `IMPLEMENTATIONS`; None: `default_implementation()`.
      interpret: Pallas interpret mode (default: on the CPU); "pallas" only.
      config: a `sparse_attention_pallas.SparseConfig` override; "pallas" only.
    Returns:
      o [T, H, kv_lora] in q's dtype and lse fp32 [T, H].
    """
    _check(q, latent, indices, kv_lora)
    implementation = implementation or default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if implementation == "reference":
        return sparse_attention_reference(q, latent, indices, kv_lora=kv_lora,
                                          scale=float(scale))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    config = config or select_sparse_config(num_heads=q.shape[1])
    return sparse_attention_pallas(q, latent, indices, kv_lora=kv_lora, scale=float(scale),
                                   config=config, interpret=bool(interpret))
