"""`prefill_attention` through cuDNN flash attention (sm_90 and later), for the H200.

What jax 0.11.2 offers: `jax.nn.dot_product_attention(implementation="cudnn")` takes one
sequence length per batch row (`query_seq_lengths`, `key_value_seq_lengths`) and a causal
flag, with v's head dim equal to qk's; it cannot express packed spans. Its backend,
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, also takes packed
segments (`q_offsets` / `kv_offsets` with per-segment lengths, Hopper and later) and
returns the softmax statistics (`return_residual`). Its masks are NO_MASK, PADDING, CAUSAL
and PADDING_CAUSAL (`MaskType`): a causal mask aligned top-left, with no bottom-right
variant, so "query i of a span sees its prefix and itself" is not one call when the
prefix is not empty. It is two calls merged by their log-sum-exp:

- own tokens: segment n = the span's queries against its own last len_q keys, causal
  (query and key segments of equal length, where top-left and bottom-right agree);
- prefix: the same queries against the prefix keys, padding mask only; run only when
  some span has a prefix.

v is zero-padded to qk's head dim (the padded columns are dropped from the output): the
backend's different-v-dim path needs cuDNN >= 9.10, which the H200 image is not known to
have. Statistics of a packed call are laid out [segments, H, T]; this module reads row i
of segment s at [s, h, i] (relative to the segment start), and the GPU test in
tests/test_attention.py checks that against the reference LSE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.cudnn.fused_attention_stablehlo import MaskType
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_sdpa

from pallas_kernels.packing import key_ends, sequence_rows


def _segments(offsets, lengths):
    """[1, max(N, 2) + 1] offsets and [1, max(N, 2)] lengths, segments of length 0 dropped
    (-1), plus each sequence's index among the kept segments and whether it was kept.

    jax takes the offsets as packed segments only when there are at least two per batch
    row (`get_max_seg_per_batch(q_offsets) > 1`); with one it passes them to cuDNN
    unconverted, which then reads keys from row 0 instead of the segment's offset. So a
    single sequence gets an empty second segment.
    """
    if lengths.shape[0] < 2:
        lengths = jnp.pad(lengths, (0, 2 - lengths.shape[0]))
        offsets = jnp.pad(offsets, (0, 2 - offsets.shape[0]))
    keep = lengths > 0
    lengths = jnp.where(keep, lengths, -1).astype(jnp.int32)
    offsets = jnp.where(keep, offsets, -1).astype(jnp.int32)
    offsets = jnp.concatenate([offsets, jnp.full((1,), -1, jnp.int32)])
    return offsets[None], lengths[None], jnp.cumsum(keep) - 1, keep


def _packed_call(q, k, v, q_start, q_len, k_start, k_len, seq, row_in_seq, *, scale, causal):
    """One cuDNN call over packed segments: q rows [q_start, +q_len) of each sequence
    against k rows [k_start, +k_len). Returns o fp32 [T, H, Dqk] (zero on rows outside a
    kept segment) and lse fp32 [T, H] (-inf there)."""
    keep_both = (q_len > 0) & (k_len > 0)
    q_off, q_lens, rank, _ = _segments(q_start, jnp.where(keep_both, q_len, 0))
    k_off, k_lens, _, _ = _segments(k_start, jnp.where(keep_both, k_len, 0))
    out, stats = cudnn_sdpa(
        q[None], k[None], v[None], q_seqlen=q_lens, kv_seqlen=k_lens, q_offsets=q_off,
        kv_offsets=k_off, scale=scale,
        mask_type=MaskType.PADDING_CAUSAL if causal else MaskType.PADDING,
        return_residual=True)
    num_queries = q.shape[0]
    rows = jnp.arange(num_queries, dtype=jnp.int32)
    inside = (keep_both[seq] & (rows >= q_start[seq]) & (rows < q_start[seq] + q_len[seq]))
    lse = stats[rank[seq], :, jnp.clip(row_in_seq, 0, num_queries - 1)]  # [T, H]
    lse = jnp.where(inside[:, None], lse.astype(jnp.float32), -jnp.inf)
    out = jnp.where(inside[:, None, None], out[0].astype(jnp.float32), 0)
    return out, lse


def _merge(a, b):
    """Exact attention over two disjoint key sets from each set's (o fp32, lse)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = jnp.logaddexp(lse_a, lse_b)
    finite = jnp.isfinite(lse)
    safe = jnp.where(finite, lse, 0)
    weight_a = jnp.where(finite, jnp.exp(lse_a - safe), 0)[..., None]
    weight_b = jnp.where(finite, jnp.exp(lse_b - safe), 0)[..., None]
    return out_a * weight_a + out_b * weight_b, lse


def attention_cudnn(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, *, scale: float):
    """cuDNN `prefill_attention` (bf16 or fp16 operands; arguments as that function)."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"cuDNN attention takes bf16 or fp16 operands, got {q.dtype}")
    num_queries, head_qk, head_v = q.shape[0], q.shape[-1], v.shape[-1]
    if head_v < head_qk:
        v = jnp.pad(v, [(0, 0), (0, 0), (0, head_qk - head_v)])
    len_q = jnp.diff(cu_seqlens_q)
    prefix = jnp.maximum(key_ends(cu_seqlens_k, seqused_k) - cu_seqlens_k[:-1] - len_q, 0)
    seq, row_in_seq = sequence_rows(cu_seqlens_q, num_queries)
    q_start = cu_seqlens_q[:-1]
    own = _packed_call(q, k, v, q_start, len_q, cu_seqlens_k[:-1] + prefix, len_q, seq,
                       row_in_seq, scale=scale, causal=True)

    def with_prefix():
        return _merge(own, _packed_call(q, k, v, q_start, len_q, cu_seqlens_k[:-1], prefix,
                                        seq, row_in_seq, scale=scale, causal=False))

    out, lse = lax.cond(jnp.any((prefix > 0) & (len_q > 0)), with_prefix, lambda: own)
    return out[..., :head_v].astype(q.dtype), lse


def cudnn_available() -> bool:
    """Whether this process can run `attention_cudnn` (a CUDA GPU of sm_90 or later)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and int(str(device.compute_capability).split(".")[0]) >= 9
