"""The projection every layer uses: a bias-free linear map in the config's dtypes.

A product of a few rows (a decode step) is a stream of the weight: XLA's GPU compiler rewrites
one whose operands hold under 10M elements (every 2304 x 4096 projection of kimi-linear-48b)
into a broadcast multiply written to memory as a [K, N] temporary and a column reduction of
it, three passes over the weight's size where one would do. On the H200 those reductions
took 4.1 of the 6.7 ms of device time of a batch-1 kimi-linear-48b decode step, against
0.7 ms to read every dense weight once (`bench/results/decode_kimi_b1_trace.json.gz`). So
on one GPU such a product of few rows runs as `pallas_kernels.stream_matmul`, whose launch
is cut along K as well as N so it fills the GPU; `project_together` puts every projection of
one input (a KDA layer's six) into one launch. Larger weights (the LM head, a dense MLP)
stream too: cuBLAS would read them as fast, but picks its algorithm, and so the order of
its sums, from the rows, and MTP's verify step runs N + 1 rows per sequence where plain
decoding runs one (the stream's sums do not depend on the rows: `stream_matmul`'s batch
invariance). On a mesh XLA's product stays: a Pallas call there would need its own
partitioning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from pallas_kernels.stream_matmul import STREAM_ROWS, stream_matmul


def on_one_gpu() -> bool:
    """Whether the process has one device, a GPU: where our Pallas kernels replace XLA's ops
    without a partitioning of their own."""
    devices = jax.devices()
    return len(devices) == 1 and devices[0].platform == "gpu"


def default_implementation(rows: int, d_in: int, d_out: int) -> str:
    """"stream" for a product of at most STREAM_ROWS rows on a process with one device, a
    GPU, in widths the kernel tiles (multiples of 16); "xla" otherwise."""
    if (on_one_gpu() and 1 <= rows <= STREAM_ROWS
            and d_in % 16 == 0 and d_out % 16 == 0):
        return "stream"
    return "xla"


class Projection(nnx.Linear):
    """`nnx.Linear` without bias ([..., d_in] -> [..., d_out], kernel [d_in, d_out]: torch's
    weight transposed) whose few-row products on one GPU stream the weight (module doc)."""

    def streams(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs as the weight stream (its output in the
        compute dtype, or in fp32 when `preferred_element_type` asks for it)."""
        return (self.preferred_element_type in (None, jnp.float32)
                and default_implementation(rows, self.in_features, self.out_features) == "stream")

    @property
    def out_dtype(self):
        """The dtype of this projection's output."""
        return jnp.dtype(self.preferred_element_type or self.dtype)

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        if out_sharding is not None or not self.streams(math.prod(inputs.shape[:-1])):
            return super().__call__(inputs, out_sharding)
        return project_together(inputs, (self,))[0]


def project_together(inputs: jax.Array, projections: Sequence[Projection], *,
                     partials: Sequence[Projection] = ()) -> tuple[jax.Array, ...]:
    """Every projection of one input [..., d_in] -> a tuple of [..., d_out_i]: those that
    stream (`Projection.streams`) in one `stream_matmul` launch, the rest as XLA products.
    A projection of `partials` (fp32 output) that streams comes as its fp32 partial sums
    [S, ..., d_out] for its consumer to add (`pallas_kernels.partials.ordered_sum`: the
    same bits), one launch fewer."""
    rows = math.prod(inputs.shape[:-1])
    streamed = [p for p in projections if p.streams(rows)]
    outputs = {}
    if streamed:
        dtype = streamed[0].dtype  # one launch, one operand dtype
        if any(p.dtype != dtype for p in streamed):
            raise ValueError(f"project_together needs one dtype, got "
                             f"{sorted({str(p.dtype) for p in streamed})}")
        x = inputs.reshape(rows, inputs.shape[-1]).astype(dtype)
        kept = tuple(i for i, p in enumerate(streamed) if any(p is q for q in partials))
        products = stream_matmul(x, tuple(p.kernel[...].astype(dtype) for p in streamed),
                                 out_dtypes=tuple(p.out_dtype for p in streamed),
                                 keep_partials=kept)
        outputs = {id(p): y.reshape(*y.shape[:-2], *inputs.shape[:-1], y.shape[-1])
                   for p, y in zip(streamed, products)}
    return tuple(outputs[id(p)] if id(p) in outputs else p(inputs) for p in projections)


def projection(config: ModelConfig, d_in: int, d_out: int, *, rngs: nnx.Rngs,
               out_dtype=None) -> Projection:
    """[..., d_in] -> [..., d_out] in `out_dtype` (default: the config's dtype; the matmul
    accumulates in fp32 either way); kernel [d_in, d_out] (torch's weight transposed)."""
    return Projection(d_in, d_out, use_bias=False, dtype=config.dtype,
                      param_dtype=config.param_dtype, preferred_element_type=out_dtype,
                      rngs=rngs)
