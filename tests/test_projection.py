"""`glmjax.layers.projection`: the weight-stream product of few rows (the grouped GEMM with one
group) against a float64 NumPy oracle, in interpret mode on the CPU and compiled on a GPU
(marker `gpu`, with the real decode shapes), and the layer's dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers.projection import Projection, default_implementation, projection, stream_matmul
from pallas_kernels.gmm_tuning import STREAM_ROWS

# name -> (leading shape of x, K, N): one row, a few rows over two leading axes, tile-sized
# and the most rows the stream takes; K and N off the default tiles.
CASES = {
    "one-row": ((1,), 48, 80),
    "rows-2x3": ((2, 3), 32, 16),
    "rows-16": ((16,), 64, 48),
    "rows-max": ((STREAM_ROWS,), 16, 112),
}
# The real decode projections of kimi-linear-48b (q/k/v, o, a shared expert's down).
REAL = {"kimi-qkv": (2304, 4096), "kimi-o": (4096, 2304), "kimi-shared-down": (1024, 2304)}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def check(rng, lead, k, n, dtype, interpret):
    x = jnp.asarray(rng.standard_normal((*lead, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    out = stream_matmul(x, w, interpret=interpret)
    assert out.shape == (*lead, n) and out.dtype == dtype
    expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if dtype == jnp.float32:  # GPU: tensor-core products round operands to TF32
        tol = 1e-5 if interpret else 2e-3
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=tol, atol=tol)
    else:  # one bf16 rounding of each output
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-2,
                                   atol=1e-2 * np.abs(expected).max())


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_interpret(rng, case, dtype):
    check(rng, *CASES[case], DTYPES[dtype], interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_gpu(rng, case, dtype):
    check(rng, *CASES[case], DTYPES[dtype], interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, STREAM_ROWS])
@pytest.mark.parametrize("shape", sorted(REAL))
def test_stream_real_shapes_gpu(rng, shape, rows):
    check(rng, (rows,), *REAL[shape], jnp.bfloat16, interpret=False)


def test_layer_dispatch_and_output(rng):
    """The CPU takes XLA's product (the stream is for one GPU); the layer equals x @ kernel
    either way, and the stream is only a choice for few rows and tileable widths."""
    config = ModelConfig.preset("tiny")
    layer = projection(config, 32, 48, rngs=nnx.Rngs(0))
    assert isinstance(layer, Projection)
    x = jnp.asarray(rng.standard_normal((3, 32)), config.dtype)
    expected = np.asarray(x, np.float64) @ np.asarray(layer.kernel[...], np.float64)
    np.testing.assert_allclose(np.asarray(layer(x), np.float64), expected, rtol=1e-5, atol=1e-5)
    on_gpu = len(jax.devices()) == 1 and jax.devices()[0].platform == "gpu"
    assert default_implementation(1, 32, 48) == ("stream" if on_gpu else "xla")
    assert default_implementation(STREAM_ROWS + 1, 32, 48) == "xla"
    assert default_implementation(1, 30, 48) == "xla"
    assert default_implementation(1, 4096, 8192) == "xla"  # cuBLAS's: not a reduction
