"""`kda_prefill`: the public entry point of the checkpointing scan (DESIGN section 3)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.kda_pallas import kda_prefill_pallas
from pallas_kernels.kda_prep import SUB_CHUNK
from pallas_kernels.reference import kda_chunked_reference
from pallas_kernels.tuning import MAX_SEGMENTS, KernelConfig, device_spec, select_config

BACKENDS = ("pallas", "reference")
CAPACITIES = (1, 2, 4)
# Bounded-gate fast path: 16 tokens at this decay keep exp(+-8 |bound|) far inside fp32.
MIN_GATE_LOWER_BOUND = -5.0


def _check_shapes(q, k, v, g, beta, cu_seqlens, initial_states, checkpoint_offsets):
    """Static shape and dtype checks; values are checked by validate_checkpoint_metadata."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, K], got shape {q.shape}")
    num_tokens, num_heads, head_k = q.shape
    head_v = v.shape[-1]
    expected = {
        "k": (k, (num_tokens, num_heads, head_k)),
        "g": (g, (num_tokens, num_heads, head_k)),
        "v": (v, (num_tokens, num_heads, head_v)),
        "beta": (beta, (num_tokens, num_heads)),
    }
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype != jnp.int32:
        raise ValueError(f"cu_seqlens must be int32 [N + 1] with N >= 1, got "
                         f"{cu_seqlens.dtype}{list(cu_seqlens.shape)}")
    num_seqs = cu_seqlens.shape[0] - 1
    if checkpoint_offsets.ndim != 2 or checkpoint_offsets.shape[0] != num_seqs:
        raise ValueError(f"checkpoint_offsets must be [N={num_seqs}, capacity], got "
                         f"{list(checkpoint_offsets.shape)}")
    if checkpoint_offsets.shape[1] not in CAPACITIES:
        raise ValueError(f"checkpoint capacity must be one of {CAPACITIES}, got "
                         f"{checkpoint_offsets.shape[1]}")
    if checkpoint_offsets.dtype != jnp.int32:
        raise ValueError(f"checkpoint_offsets must be int32, got {checkpoint_offsets.dtype}")
    state_shape = (num_seqs, num_heads, head_k, head_v)
    if tuple(initial_states.shape) != state_shape or initial_states.dtype != jnp.float32:
        raise ValueError(f"initial_states must be float32 {list(state_shape)}, got "
                         f"{initial_states.dtype}{list(initial_states.shape)}")


def kda_prefill(q, k, v, g, beta, cu_seqlens, initial_states, checkpoint_offsets, *,
                scale=None, chunk_size=64, backend="pallas", interpret=None,
                gate_lower_bound: float | None = None, config: KernelConfig | None = None):
    """Chunked KDA over a packed batch, retaining up to four state snapshots per sequence.

    Args:
      q, k: [T, H, K] (L2-normalised by the caller); v: [T, H, V]; g: [T, H, K] log-decay
        (<= 0); beta: [T, H] in (0, 1). Any float dtype; fp32 inputs select IEEE fp32
        matmuls, narrower inputs tf32 matmuls with fp32 accumulation.
      cu_seqlens: int32 [N + 1]; sequence n is rows cu_seqlens[n]:cu_seqlens[n + 1].
      initial_states: fp32 [N, H, K, V].
      checkpoint_offsets: int32 [N, capacity], capacity in {1, 2, 4}; entry c is a token
        count from the start of its sequence (1..len), -1 for an inactive slot.
      scale: output scale, default K ** -0.5.
      backend: "pallas" (the kernel; interpret mode by default on CPU) or "reference"
        (the jax.numpy chunked oracle).
      gate_lower_bound: None for any decay, or a bound b in [-5, 0) the caller guarantees
        (g >= b everywhere, e.g. GLM's b * sigmoid(...) gate): the kernel then forms the
        diagonal 16 x 16 blocks of the in-chunk matrices on the tensor cores instead of
        elementwise. The reference backend ignores it (it is exact for any decay).
      config: tiling override; by default picked from the device by `select_config`
        (which also decides whether the scan runs segment-parallel: `scan_segments`).

    Returns:
      o [T, H, V] in v.dtype (zero on padding rows), final_states fp32 [N, H, K, V],
      snapshots fp32 [N, capacity, H, K, V] (zeros for inactive slots).
    """
    _check_shapes(q, k, v, g, beta, cu_seqlens, initial_states, checkpoint_offsets)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if chunk_size % SUB_CHUNK or not SUB_CHUNK <= chunk_size <= 128:
        raise ValueError(f"chunk_size must be a multiple of {SUB_CHUNK} in [16, 128], "
                         f"got {chunk_size}")
    _, num_heads, head_k = q.shape
    head_v = v.shape[-1]
    for name, dim in (("K", head_k), ("V", head_v)):
        if dim < 16 or dim & (dim - 1):
            raise ValueError(f"head dim {name}={dim} must be a power of two >= 16")
    scale = float(head_k ** -0.5 if scale is None else scale)
    if gate_lower_bound is not None:
        gate_lower_bound = float(gate_lower_bound)
        if not MIN_GATE_LOWER_BOUND <= gate_lower_bound < 0:
            raise ValueError(f"gate_lower_bound must be None or in [{MIN_GATE_LOWER_BOUND}, 0), "
                             f"got {gate_lower_bound}")
    if backend == "reference":
        return kda_chunked_reference(q, k, v, g, beta, cu_seqlens, initial_states,
                                     checkpoint_offsets, scale=scale, chunk_size=chunk_size)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    exact = all(x.dtype == jnp.float32 for x in (q, k, v, g, beta))
    if config is None:
        config = select_config(device_spec(), num_seqs=cu_seqlens.shape[0] - 1,
                               num_heads=num_heads, head_k=head_k, head_v=head_v,
                               operand_bytes=4 if exact else 2, num_tokens=q.shape[0])
    config = dataclasses.replace(config, chunk_size=chunk_size)
    if head_v % config.block_v:
        raise ValueError(f"head dim V={head_v} must be a multiple of the kernel's value "
                         f"block {config.block_v}")
    if not 1 <= config.scan_segments <= MAX_SEGMENTS:
        raise ValueError(f"scan_segments must be in [1, {MAX_SEGMENTS}], got "
                         f"{config.scan_segments}")
    for name in ("prep_block_k", "inverse_block_k"):
        if head_k % min(getattr(config, name), head_k):
            raise ValueError(f"head dim K={head_k} must be a multiple of the prep pass's "
                             f"key slice {name}={getattr(config, name)}")
    return kda_prefill_pallas(q, k, v, g, beta, cu_seqlens, initial_states, checkpoint_offsets,
                              scale=scale, bounded_gates=gate_lower_bound is not None,
                              config=config, interpret=bool(interpret), exact=exact)
