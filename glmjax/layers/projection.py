"""The projection every layer uses: a bias-free linear map in the config's dtypes.

A product of a few rows (a decode step) is a stream of the weight: XLA's GPU compiler rewrites
one whose operands hold under 10M elements (every 2304 x 4096 projection of kimi-linear-48b)
into a broadcast multiply written to memory as a [K, N] temporary and a column reduction of
it, three passes over the weight's size where one would do. On the H200 those reductions
took 4.1 of the 6.7 ms of device time of a batch-1 kimi-linear-48b decode step, against
0.7 ms to read every dense weight once (`bench/results/decode_kimi_b1_trace.json.gz`). So
on one GPU such a product of few rows runs as our grouped GEMM with one group
(`pallas_kernels.gmm`, tiled as a weight stream by `gmm_tuning.stream_config`). On a mesh
XLA's product stays: a Pallas call there would need its own partitioning.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from pallas_kernels.gmm import grouped_matmul
from pallas_kernels.gmm_tuning import STREAM_ROWS

# XLA's GPU compiler turns a product into a reduction when its operands hold fewer elements
# than this (`IsMatrixMultiplicationTooSmallForRewriting`'s threshold in its algebraic
# simplifier); larger ones go to cuBLAS or its Triton GEMMs, which stream well.
XLA_REDUCTION_THRESHOLD = 10_000_000


def default_implementation(rows: int, d_in: int, d_out: int) -> str:
    """"stream" for a product XLA would turn into a reduction, of at most STREAM_ROWS rows,
    on a process with one device, a GPU, in widths the kernel tiles (multiples of 16);
    "xla" otherwise."""
    devices = jax.devices()
    if (len(devices) == 1 and devices[0].platform == "gpu" and rows <= STREAM_ROWS
            and rows * d_in + d_in * d_out < XLA_REDUCTION_THRESHOLD
            and d_in % 16 == 0 and d_out % 16 == 0):
        return "stream"
    return "xla"


def stream_matmul(x: jax.Array, kernel: jax.Array, *, interpret: bool | None = None
                  ) -> jax.Array:
    """x [..., K] @ kernel [K, N] -> [..., N] in x.dtype, accumulated in fp32, as the grouped
    GEMM with one group (interpret mode on the CPU unless `interpret` says otherwise)."""
    rows = math.prod(x.shape[:-1])
    out = grouped_matmul(x.reshape(rows, x.shape[-1]), kernel[None],
                         jnp.full((1,), rows, jnp.int32), implementation="pallas",
                         interpret=interpret)
    return out.reshape(*x.shape[:-1], kernel.shape[-1])


class Projection(nnx.Linear):
    """`nnx.Linear` without bias ([..., d_in] -> [..., d_out], kernel [d_in, d_out]: torch's
    weight transposed) whose few-row products on one GPU stream the weight (module doc)."""

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        rows = math.prod(inputs.shape[:-1])
        if (self.preferred_element_type is not None or out_sharding is not None
                or default_implementation(rows, self.in_features, self.out_features) == "xla"):
            return super().__call__(inputs, out_sharding)
        x, kernel = inputs.astype(self.dtype), self.kernel[...].astype(self.dtype)
        return stream_matmul(x, kernel)


def projection(config: ModelConfig, d_in: int, d_out: int, *, rngs: nnx.Rngs,
               out_dtype=None) -> Projection:
    """[..., d_in] -> [..., d_out] in `out_dtype` (default: the config's dtype; the matmul
    accumulates in fp32 either way); kernel [d_in, d_out] (torch's weight transposed)."""
    return Projection(d_in, d_out, use_bias=False, dtype=config.dtype,
                      param_dtype=config.param_dtype, preferred_element_type=out_dtype,
                      rngs=rngs)
