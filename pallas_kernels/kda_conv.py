"""`kda_conv`: the KDA layer's short convolution over a packed prefill, with its SiLU and the
L2 norms of q and k, from the input projection's output to the scan's q, k and v.

    y[t, c] = silu(sum_j w[c, j] x[t - (W - 1) + j, c])       j = 0 .. W - 1, oldest first
    q, k, v = split(y, 3) per head;  q, k <- q / sqrt(|q|^2 + eps), per head and row

where a tap before its sequence's first token reads the sequence's conv history (the W - 1
inputs before it, oldest first) and padding rows give zeros. Every sum runs in fp32 in that
order and y is rounded to x's dtype before the norms, as the layer's decode step does.

Two implementations behind one signature: jax.numpy (`conv_silu` then the norms: XLA's
fusions, also the path on a mesh, where the channels are sharded) and a Pallas kernel
(`kda_conv_pallas`: one launch per part, reading each projection output as it is; one
program per block of rows and head, every row through the same code, history included).
In the H200 profile of kimi-linear-48b's 8K prefill step
(`bench/results/model_prefill_kimi_27L256E_8192_skip_temp_2026-12-02e.json`) the glue
directly in the KDA layer's scope, XLA's conv fusion most of it, took 8.3 ms (415 us a
layer) and the q / k norms 1.3 ms, where reading x and writing q, k, v is ~400 MB a layer:
~0.1 ms at the H200's bandwidth. The kernel took 5.3 ms there (264 us a layer; its tilings
not yet swept: `python -m bench.kda_conv --sweep`) and the q | k | v concatenation it then
read 1.9 ms more (`model_prefill_kimi_27L256E_8192_2026-12-05.json`): it now takes the three
projection outputs as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import resolve_interpret
from pallas_kernels.kda_conv_pallas import ConvShape, ConvTiling, kda_conv_pallas
from pallas_kernels.packing import sequence_rows

IMPLEMENTATIONS = ("pallas", "xla")
L2_EPS = 1e-6  # fla's l2norm
DEFAULT_TILING = ConvTiling()


def history_rows(history: jax.Array, dtype) -> jax.Array:
    """[N, C, W - 1] -> [N (W - 1), C] in dtype: row n (W - 1) + i is input i (oldest first)
    before sequence n."""
    num_seqs, channels, hist = history.shape
    return history.transpose(0, 2, 1).reshape(num_seqs * hist, channels).astype(dtype)


def history_buffer(x: jax.Array, history: jax.Array) -> jax.Array:
    """The N histories' rows, then x's: [N (W - 1) + T, C] in x's dtype (`buffer_rows`)."""
    return jnp.concatenate([history_rows(history, x.dtype), x])


def buffer_rows(cu_seqlens: jax.Array, hist: int, seq: jax.Array, rel: jax.Array
                ) -> jax.Array:
    """The `history_buffer` row of position `rel` of sequence `seq` (negative: inside its
    history of `hist` rows); int32 arrays broadcast together."""
    num_seqs = cu_seqlens.shape[0] - 1
    return jnp.where(rel >= 0, num_seqs * hist + cu_seqlens[seq] + rel, seq * hist + rel + hist)


def conv_silu(x: jax.Array, weight: jax.Array, cu_seqlens: jax.Array,
              history: jax.Array) -> jax.Array:
    """The convolution and SiLU alone, jax.numpy: y [T, C] in x's dtype (zero on padding
    rows). x [T, C]; weight [C, W]; cu_seqlens int32 [N + 1]; history [N, C, W - 1]."""
    num_tokens, hist = x.shape[0], weight.shape[1] - 1

    def conv(taps):
        acc = jnp.zeros(taps[0].shape, jnp.float32)
        for j, tap in enumerate(taps):
            acc = acc + tap.astype(jnp.float32) * weight[:, j].astype(jnp.float32)
        return jax.nn.silu(acc)

    # Every row as if its window lay inside its own sequence: static shifts of x, one
    # elementwise pass. Gathering each tap's row instead (the history for a window reaching
    # before the sequence) made XLA write the fp32 sum apart from the SiLU: 0.5 + 0.2 ms a
    # layer at 8K tokens, 12,288 channels on the H200.
    valid = jnp.arange(num_tokens) < cu_seqlens[-1]
    padded = jnp.pad(x, ((hist, 0), (0, 0)))
    y = jnp.where(valid[:, None], conv([padded[j:j + num_tokens] for j in range(hist + 1)]), 0)
    y = y.astype(x.dtype)
    # Then the first W - 1 rows of each sequence again, their windows read through the
    # history: N (W - 1) rows gathered, computed and scattered in place.
    buf = history_buffer(x, history)
    seqs = jnp.arange(history.shape[0], dtype=jnp.int32)[:, None]
    first = jnp.arange(hist, dtype=jnp.int32)  # [W - 1] positions in the sequence
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    taps = [jnp.take(buf, buffer_rows(cu_seqlens, hist, seqs, first - hist + j), axis=0,
                     mode="clip") for j in range(hist + 1)]  # each [N, W - 1, C]
    target = jnp.where(first < lengths[:, None], cu_seqlens[:-1, None] + first, num_tokens)
    return y.at[target].set(conv(taps).astype(x.dtype), mode="drop")


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    """``x / sqrt(sum(x**2, -1) + eps)`` (fla's ``l2norm``), fp32 math, x's dtype out (the
    model's L2 norm of KDA queries and keys, `glmjax.layers.norms` too)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def kda_conv_reference(x, weight, history, cu_seqlens, *, heads: int, l2_eps: float):
    """The jax.numpy path (see `kda_conv`)."""
    y = conv_silu(x, weight, cu_seqlens, history)
    shape = (x.shape[0], heads, x.shape[1] // (3 * heads))
    q, k, v = (part.reshape(shape) for part in jnp.split(y, 3, axis=-1))
    return l2_normalize(q, l2_eps), l2_normalize(k, l2_eps), v


def kda_conv(parts: Sequence[jax.Array], weight: jax.Array, history: jax.Array,
             cu_seqlens: jax.Array, *, heads: int, l2_eps: float = L2_EPS,
             implementation: str = "xla", interpret: bool | None = None,
             tiling: ConvTiling = DEFAULT_TILING) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The scan's q, k, v from the input projections' q, k and v.

    Args:
      parts: the q, k, v projection outputs, each [T, H K] packed rows (bf16 or fp32, one
        dtype), head-major: the conv's channels are their concatenation, in that order.
      weight: [3 H K, W] depthwise taps (fp32 or the inputs' dtype), W >= 1.
      history: [N, 3 H K, W - 1], the W - 1 inputs before each sequence, oldest first.
      cu_seqlens: int32 [N + 1], non-decreasing from 0 (rows past cu_seqlens[N] padding).
      heads: H. l2_eps: the L2 norms' epsilon.
      implementation: "xla" (jax.numpy) or "pallas" (interpret mode by default on the CPU).
      tiling: the kernel's rows a program and warps.

    Returns q, k, v [T, H, K] in the inputs' dtype: q and k L2-normalized per head; zero on
    padding rows.
    """
    if len(parts) != 3 or any(x.ndim != 2 or x.shape != parts[0].shape or x.dtype != parts[0].dtype
                              for x in parts):
        raise ValueError(f"parts must be q, k, v of one shape [T, H K] and dtype, got "
                         f"{[(x.shape, str(x.dtype)) for x in parts]}")
    num_tokens, width = parts[0].shape
    if weight.ndim != 2 or weight.shape[0] != 3 * width:
        raise ValueError(f"weight must be [3 H K = {3 * width}, W], got {weight.shape}")
    channels, taps = weight.shape
    if width % heads:
        raise ValueError(f"parts' {width} channels are not heads {heads} x a head dim")
    if history.shape[1:] != (channels, taps - 1) or cu_seqlens.shape != (history.shape[0] + 1,):
        raise ValueError(f"history must be [N, {channels}, {taps - 1}] and cu_seqlens [N + 1], "
                         f"got {history.shape}, {cu_seqlens.shape}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if implementation == "xla":
        return kda_conv_reference(jnp.concatenate(parts, axis=-1), weight, history, cu_seqlens,
                                  heads=heads, l2_eps=l2_eps)
    seq, pos = sequence_rows(cu_seqlens, num_tokens)
    shape = ConvShape(heads=heads, dim=width // heads, width=taps, num_seqs=history.shape[0],
                      l2_eps=float(l2_eps), tiling=tiling)
    q, k, v = kda_conv_pallas(tuple(parts), weight.T.astype(jnp.float32),
                              history_rows(history, parts[0].dtype), cu_seqlens, seq, pos,
                              shape=shape, interpret=resolve_interpret(interpret))
    out = (num_tokens, heads, shape.dim)
    return q.reshape(out), k.reshape(out), v.reshape(out)
