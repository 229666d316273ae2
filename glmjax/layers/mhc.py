"""mHC: manifold-constrained hyper-connections (DeepSeek), n residual streams per token.

The residual is n streams X = [x_1 .. x_n] ([T, n, D]). Around a sublayer F (attention or
feed-forward, with its own pre-norm), per token:

    u      = rmsnorm(flatten(X))                         # [n * D], no learned scale
    p      = u @ phi                                     # [2n + n^2], one fused projection
    H_pre  = sigmoid(alpha_pre  * p[:n]     + b_pre)     # [n]     read map, in (0, 1)
    H_post = 2 * sigmoid(alpha_post * p[n:2n] + b_post)  # [n]     write map, in (0, 2)
    H_res  = sinkhorn(alpha_res * p[2n:] + b_res)        # [n, n]  doubly stochastic
    X'     = H_res X + H_post^T F(H_pre X)

``sinkhorn`` (`pallas_kernels.sinkhorn`: one Pallas launch on one GPU, where XLA's loop was
five launches an iteration) exponentiates and then alternately normalises rows and columns
(rows first), `iters` times, so columns sum to 1 exactly and rows to within the
iteration's error. The model copies the embedding into every stream at the start and
collapses the streams by their mean at the end. The init (alpha = 0.01, b_pre =
logit(1/n), b_post = 0, b_res = 0) starts near a plain pre-norm residual: with alpha = 0
and equal streams, it is exactly x + F(x).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.layers.norms import rms_normalize
from glmjax.layers.projection import on_one_gpu
from pallas_kernels.sinkhorn import sinkhorn
from pallas_kernels.stream_matmul import STREAM_ROWS, stream_matmul


class Mixing(NamedTuple):
    """The per-token maps of one hyper-connection, fp32."""

    post: jax.Array  # [T, n]
    res: jax.Array  # [T, n, n]; res[t, i, j] weighs stream j into stream i


def fused_projection(u: jax.Array, phi: jax.Array) -> jax.Array:
    """u fp32 [T, n D] @ phi fp32 [n D, 2n + n^2], IEEE fp32. On one GPU, for at most
    STREAM_ROWS tokens (a decode step), the weight stream (phi's columns padded to a
    multiple of 16), whose sums do not depend on the token count; XLA's product otherwise
    (its order may change with T: a decode row must not change with the rows beside it)."""
    if not (on_one_gpu() and 1 <= u.shape[0] <= STREAM_ROWS and u.shape[1] % 16 == 0):
        return jnp.dot(u, phi, precision=jax.lax.Precision.HIGHEST)
    width = phi.shape[1]
    padded = jnp.pad(phi, ((0, 0), (0, -width % 16)))
    return stream_matmul(u, (padded,))[0][:, :width]


def weighted_sum(weights: jax.Array, streams: jax.Array) -> jax.Array:
    """sum_j weights[..., j] * streams[..., j, :] in fp32, j = 0 .. n - 1 in order:
    weights [T, ..., n] fp32, streams [T, ..., n, D] -> [T, ..., D]. Written as n
    elementwise multiply-adds rather than an einsum, which XLA may lower to a batched
    matmul whose summation order changes with T (on the H200 a row of 64 tokens' write
    differed from the same token alone)."""
    acc = weights[..., 0, None] * streams[..., 0, :].astype(jnp.float32)
    for j in range(1, weights.shape[-1]):
        acc = acc + weights[..., j, None] * streams[..., j, :].astype(jnp.float32)
    return acc


def expand_streams(x: jax.Array, num_streams: int) -> jax.Array:
    """[T, D] -> [T, n, D]: every stream starts as the embedding."""
    return jnp.broadcast_to(x[:, None], (x.shape[0], num_streams, x.shape[1]))


def collapse_streams(streams: jax.Array) -> jax.Array:
    """[T, n, D] -> [T, D]: mean over streams."""
    return jnp.mean(streams.astype(jnp.float32), axis=1).astype(streams.dtype)


class HyperConnection(nnx.Module):
    """The mHC wrapper of one sublayer: `read` before it, `write` after it."""

    def __init__(self, hidden_size: int, num_streams: int, *, sinkhorn_iters: int,
                 eps: float, rngs: nnx.Rngs):
        n = num_streams
        self.num_streams, self.sinkhorn_iters, self.eps = n, sinkhorn_iters, eps
        self.phi = nnx.Param(jax.random.normal(rngs.params(), (n * hidden_size, 2 * n + n * n),
                                               jnp.float32) * (n * hidden_size) ** -0.5)
        self.alpha = nnx.Param(jnp.full((3,), 0.01, jnp.float32))  # pre, post, res
        self.b_pre = nnx.Param(jnp.full((n,), -math.log(n - 1), jnp.float32))
        self.b_post = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.b_res = nnx.Param(jnp.zeros((n, n), jnp.float32))

    def read(self, streams: jax.Array) -> tuple[jax.Array, Mixing]:
        """streams [T, n, D] -> sublayer input [T, D] (streams' dtype) and the write maps."""
        with jax.named_scope("mhc_read"):
            tokens, n = streams.shape[:2]
            u = rms_normalize(streams.reshape(tokens, -1), self.eps)
            p = fused_projection(u, self.phi[...])
            alpha = self.alpha[...]
            pre = jax.nn.sigmoid(alpha[0] * p[:, :n] + self.b_pre[...])
            post = 2 * jax.nn.sigmoid(alpha[1] * p[:, n:2 * n] + self.b_post[...])
            kernel = on_one_gpu() and not n & (n - 1)  # the kernel's tiles: n a power of 2
            res = sinkhorn(alpha[2] * p[:, 2 * n:].reshape(tokens, n, n) + self.b_res[...],
                           self.sinkhorn_iters, implementation="pallas" if kernel else "xla")
            x = weighted_sum(pre, streams)
            return x.astype(streams.dtype), Mixing(post, res)

    def write(self, streams: jax.Array, y: jax.Array, mixing: Mixing) -> jax.Array:
        """X' = H_res X + H_post^T y; streams [T, n, D], y [T, D] -> [T, n, D]."""
        with jax.named_scope("mhc_write"):
            mixed = weighted_sum(mixing.res, streams[:, None])  # [T, n, D]
            out = mixed + mixing.post[..., None] * y.astype(jnp.float32)[:, None]
            return out.astype(streams.dtype)
