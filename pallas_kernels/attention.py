"""`prefill_attention`: causal attention over a packed batch of spans that continue cached
prefixes (the MLA prefill's non-absorbed attention), with its log-sum-exp.

Contract (the usual variable-length flash layout, causal aligned bottom-right):

- Sequence n's queries are rows ``cu_seqlens_q[n] : cu_seqlens_q[n + 1]`` of q, its keys
  rows ``cu_seqlens_k[n] : cu_seqlens_k[n + 1]`` of k and v, with len_k >= len_q: the keys
  are the sequence's cached prefix (len_k - len_q tokens) followed by the span's own tokens.
- Query i of sequence n sees keys ``cu_seqlens_k[n]`` up to and including
  ``cu_seqlens_k[n + 1] - len_q + i``: its prefix and itself, nothing of another sequence.
- With ``seqused_k`` (int32 [N], flash-attn's name for it), sequence n's keys are only the
  first ``seqused_k[n]`` rows of its region ``cu_seqlens_k[n] : cu_seqlens_k[n + 1]``; the
  rest of the region is padding no query sees. Regions that start at multiples of
  `INVARIANT_KEY_ALIGN` make the "pallas" result of every row independent of the other
  sequences in the batch, bit for bit (its key blocks then fall on the same keys of the
  sequence whatever precedes it; what the batch-invariant mode of `glmjax.config` uses).
- Rows of q past ``cu_seqlens_q[N]`` are padding: output zero, LSE -inf; key rows no
  sequence owns are never read into a result.
- Outputs: o [T, H, Dv] in q's dtype and lse fp32 [T, H], the natural-log log-sum-exp of
  each row's scaled scores (what an LSE merge of partial results needs).

Implementations behind the one signature (`IMPLEMENTATIONS`):
- "reference": jax.numpy, queries in blocks of `REFERENCE_QUERY_BLOCK` against all keys
  (a [H, block, S] score tensor per block); the CPU default.
- "pallas": our flash kernel (`pallas_kernels.attention_pallas`), key blocks outside a query
  block's ranges skipped; Pallas Triton, AOT-checked for sm_121 and sm_90.
- "cudnn": cuDNN flash attention over packed segments (`pallas_kernels.attention_cudnn`),
  sm_90 and later.
`default_implementation` picks one from the device, the batch's sequence bucket, the
dtype and whether results must not depend on the batch; `GPU_IMPLEMENTATION` is the switch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.attention_cudnn import attention_cudnn
from pallas_kernels.attention_pallas import flash_attention_pallas, select_flash_config
from pallas_kernels.packing import key_ends, sequence_rows

IMPLEMENTATIONS = ("reference", "pallas", "cudnn")
# By compute capability major: (one sequence, a packed batch). On the H200 (sm_90,
# bench/results/attention_cudnn_fix.json) cuDNN beats our kernel on one span, 1.25x at
# Kimi's heads (192/128) and 2.25x at GLM's (256/256) for 8K tokens, but loses 1.46x on
# Kimi's 8 x 1K packed batch (it launches every segment over the whole query length); on
# GLM's 8 x 1K it wins by 1.10x. Every other GPU runs the Pallas kernel (cuDNN unmeasured
# there; GB10 has no packed cuDNN path).
GPU_IMPLEMENTATION = {9: ("cudnn", "pallas")}
REFERENCE_QUERY_BLOCK = 1024
# Every flash tiling's block_k divides it (tests/test_attention.py checks the table).
INVARIANT_KEY_ALIGN = 128


def default_implementation(device: jax.Device | None = None, *, num_sequences: int = 1,
                           dtype=jnp.bfloat16, batch_invariant: bool = False) -> str:
    """The implementation `prefill_attention` uses on `device` (default: the first one)
    for a batch of `num_sequences` (the static bucket) in `dtype` (cuDNN: bf16/fp16).
    `batch_invariant`: a row's result must not depend on the rest of the batch, which on a
    GPU only our kernel guarantees (cuDNN's differs with the prefix split, the H100's
    `schedule_kimi_8L16E_bf16_splitk1_h100_2026-12-07.json`)."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return "reference"
    if batch_invariant:
        return "pallas"
    major = int(str(device.compute_capability).split(".")[0])
    single, packed = GPU_IMPLEMENTATION.get(major, ("pallas", "pallas"))
    choice = single if num_sequences == 1 else packed
    if choice == "cudnn" and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return "pallas"
    return choice


def key_ranges(cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array, num_queries: int,
               num_keys: int, seqused_k: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """Each query row's visible keys as a half-open row range of k.

    Returns int32 [T] start and end (start == end: no key, padding rows among them), clipped
    to the row's own sequence and to [0, num_keys) so that bad metadata cannot read
    another sequence's rows or past the array.
    """
    rows = jnp.arange(num_queries, dtype=jnp.int32)
    seq, _ = sequence_rows(cu_seqlens_q, num_queries)
    real = rows < cu_seqlens_q[-1]
    ends = key_ends(cu_seqlens_k, seqused_k)
    first, last = cu_seqlens_k[seq], jnp.minimum(ends[seq], num_keys)
    first = jnp.clip(first, 0, num_keys)
    end = jnp.clip(ends[seq] - (cu_seqlens_q[seq + 1] - 1 - rows), first, last)
    start = jnp.where(real, first, 0)
    return start, jnp.where(real & (end > first), end, start)


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None):
    """Static shapes and dtypes (values: `validate_attention_metadata`)."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v must be [T, H, D], [S, H, D], [S, H, Dv]; got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if k.shape[1:] != q.shape[1:] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"k must be [S, H={q.shape[1]}, D={q.shape[2]}] and v [S, H, Dv] "
                         f"with the same S; got k {k.shape}, v {v.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.ndim != 1 or cu.shape[0] < 2 or cu.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [N + 1] with N >= 1, got "
                             f"{cu.dtype}{list(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {list(cu_seqlens_q.shape)} and cu_seqlens_k "
                         f"{list(cu_seqlens_k.shape)} must both be [N + 1]")
    if seqused_k is not None and (seqused_k.dtype != jnp.int32
                                  or seqused_k.shape != (cu_seqlens_q.shape[0] - 1,)):
        raise ValueError(f"seqused_k must be int32 [N = {cu_seqlens_q.shape[0] - 1}], got "
                         f"{seqused_k.dtype}{list(seqused_k.shape)}")


def validate_attention_metadata(cu_seqlens_q, cu_seqlens_k, num_queries: int,
                                num_keys: int, seqused_k=None) -> None:
    """Host-side check of the metadata's values; ValueError naming the bad sequence."""
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    for name, cu, bound in (("cu_seqlens_q", cu_q, num_queries),
                            ("cu_seqlens_k", cu_k, num_keys)):
        if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > bound:
            raise ValueError(f"{name}={cu.tolist()} must start at 0, not decrease and end "
                             f"at most at {bound}")
    keys = np.diff(cu_k)
    if seqused_k is not None:
        used = np.asarray(seqused_k)
        wide = np.flatnonzero((used < 0) | (used > keys))
        if wide.size:
            n = int(wide[0])
            raise ValueError(f"seqused_k[{n}]={int(used[n])} is not within sequence {n}'s "
                             f"region of {int(keys[n])} key rows")
        keys = used
    short = np.flatnonzero(keys < np.diff(cu_q))
    if short.size:
        n = int(short[0])
        raise ValueError(f"sequence {n} has {int(cu_q[n + 1] - cu_q[n])} queries but only "
                         f"{int(keys[n])} keys (keys = prefix + the queries' own)")


@functools.partial(jax.jit, static_argnames=("scale",))
def attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, *, scale: float):
    """jax.numpy `prefill_attention` (fp32 softmax), `REFERENCE_QUERY_BLOCK` queries at a
    time so the [H, block, S] scores stay bounded."""
    num_queries, num_keys = q.shape[0], k.shape[0]
    start, end = key_ranges(cu_seqlens_q, cu_seqlens_k, num_queries, num_keys, seqused_k)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    cols = jnp.arange(num_keys, dtype=jnp.int32)

    def attend(q, start, end):  # [B, H, D], [B], [B]
        scores = jnp.einsum("thd,shd->hts", q, k, precision=precision,
                            preferred_element_type=jnp.float32) * scale
        visible = (cols[None] >= start[:, None]) & (cols[None] < end[:, None])  # [B, S]
        scores = jnp.where(visible[None], scores, -jnp.inf)
        peak = jnp.max(scores, axis=-1, keepdims=True)
        weights = jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0))
        total = jnp.sum(weights, axis=-1, keepdims=True)
        lse = jnp.where(total > 0, peak + jnp.log(jnp.where(total > 0, total, 1)), -jnp.inf)
        probs = (weights / jnp.where(total > 0, total, 1)).astype(v.dtype)
        out = jnp.einsum("hts,shv->thv", probs, v, precision=precision,
                         preferred_element_type=jnp.float32)
        return out.astype(q.dtype), lse[..., 0].T

    block = REFERENCE_QUERY_BLOCK
    if num_queries <= block:
        return attend(q, start, end)
    pad = -num_queries % block

    def blocks(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(x.shape[0] // block, block, *x.shape[1:])

    out, lse = lax.map(lambda args: attend(*args), (blocks(q), blocks(start), blocks(end)))
    return (out.reshape(-1, *out.shape[2:])[:num_queries],
            lse.reshape(-1, lse.shape[-1])[:num_queries])


def prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, *,
                      scale: float | None = None, implementation: str | None = None,
                      interpret: bool | None = None, config=None):
    """Causal attention of packed spans over their own prefix and themselves.

    Args:
      q: [T, H, D]; k: [S, H, D]; v: [S, H, Dv]; one float dtype (bf16 on a GPU; fp32
        selects IEEE fp32 matmuls).
      cu_seqlens_q, cu_seqlens_k: int32 [N + 1]; seqused_k: int32 [N] or None (see the
        module docstring).
      scale: score scale, default D ** -0.5.
      implementation: one of `IMPLEMENTATIONS`; None: `default_implementation` for the
        device, N and the dtype.
      interpret: Pallas interpret mode (default: on the CPU); "pallas" only.
      config: a `attention_pallas.FlashConfig` override; "pallas" only.
    Returns:
      o [T, H, Dv] in q's dtype (zero on rows without keys) and lse fp32 [T, H] (-inf there).
    """
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)
    implementation = implementation or default_implementation(
        num_sequences=cu_seqlens_q.shape[0] - 1, dtype=q.dtype)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if implementation == "reference":
        return attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                   scale=scale)
    if implementation == "cudnn":
        return attention_cudnn(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, scale=scale)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    config = config or select_flash_config(head_qk=q.shape[-1], head_v=v.shape[-1],
                                           operand_bytes=q.dtype.itemsize)
    start, end = key_ranges(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], seqused_k)
    return flash_attention_pallas(q, k, v, start, end, scale=scale, config=config,
                                  interpret=bool(interpret))
