"""`glmjax.layers.projection`: the layer's dispatch between XLA's product and the weight
stream (`pallas_kernels.stream_matmul`, tested in `test_stream_matmul.py`), and
`project_together` (the streaming projections of one input in one launch) against each
projection's own XLA product; the stream route is forced on the CPU (interpret mode) and
taken for real on a GPU (marker `gpu`)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers.projection import (
    Projection,
    default_implementation,
    project_together,
    projection,
)
from pallas_kernels.partials import ordered_sum
from pallas_kernels.stream_matmul import STREAM_ROWS

# The module (glmjax.layers re-exports the `projection` function under its name).
projection_module = sys.modules["glmjax.layers.projection"]


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
    assert default_implementation(0, 32, 48) == "xla"
    assert default_implementation(STREAM_ROWS + 1, 32, 48) == "xla"
    assert default_implementation(1, 30, 48) == "xla"
    # cuBLAS would stream it as fast, but its sums' order changes with the rows.
    assert default_implementation(1, 4096, 8192) == ("stream" if on_gpu else "xla")


def check_together(rng, lead):
    """Three projections of one input, one of them in fp32 output (it streams with the
    others, its sums kept in fp32), against the float64 product."""
    config = ModelConfig.preset("tiny")
    rngs = nnx.Rngs(int(rng.integers(1 << 30)))
    layers = (projection(config, 32, 48, rngs=rngs), projection(config, 32, 16, rngs=rngs),
              projection(config, 32, 64, rngs=rngs, out_dtype=jnp.float32))
    x = jnp.asarray(rng.standard_normal((*lead, 32)), config.dtype)
    outs = project_together(x, layers)
    rows = int(np.prod(lead))
    assert layers[2].streams(rows) == layers[0].streams(rows)
    for out, layer in zip(outs, layers):
        expected = np.asarray(x, np.float64) @ np.asarray(layer.kernel[...], np.float64)
        assert out.shape == (*lead, layer.out_features)
        assert out.dtype == (layer.preferred_element_type or config.dtype)
        tol = 1e-5 if jax.default_backend() == "cpu" else 2e-3  # TF32 products on a GPU
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("lead", [(1,), (2, 3)])
def test_project_together_forced_stream(rng, monkeypatch, lead):
    """The CPU forced onto the stream route: interpret mode runs the same launch."""
    monkeypatch.setattr(projection_module, "default_implementation",
                        lambda rows, d_in, d_out: "stream")
    calls = []
    real = projection_module.stream_matmul
    monkeypatch.setattr(projection_module, "stream_matmul",
                        lambda x, weights, **kw: calls.append(len(weights)) or real(x, weights,
                                                                                     **kw))
    check_together(rng, lead)
    assert calls == [3]  # the three projections, one launch


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(1,), (2, 3), (STREAM_ROWS,)])
def test_project_together_gpu(rng, lead):
    check_together(rng, lead)


def test_partials_come_back_unsummed_where_they_stream(rng, monkeypatch):
    """`partials`: an fp32 projection's partial sums [S, ..., d_out] from the launch, whose
    ordered sum is the product without `partials`; on XLA's route the product."""
    config = ModelConfig.preset("tiny")
    rngs = nnx.Rngs(int(rng.integers(1 << 30)))
    layers = (projection(config, 32, 48, rngs=rngs),
              projection(config, 32, 16, rngs=rngs, out_dtype=jnp.float32))
    x = jnp.asarray(rng.standard_normal((2, 3, 32)), config.dtype)
    _, logits = project_together(x, layers, partials=(layers[1],))
    assert logits.shape == (2, 3, 16)  # nothing streams on the CPU
    monkeypatch.setattr(projection_module, "default_implementation",
                        lambda rows, d_in, d_out: "stream")
    streamed, partials = project_together(x, layers, partials=(layers[1],))
    whole = project_together(x, layers)
    assert partials.ndim == 4 and partials.shape[1:] == (2, 3, 16)
    np.testing.assert_array_equal(np.asarray(ordered_sum(partials)), np.asarray(whole[1]))
    np.testing.assert_array_equal(np.asarray(streamed), np.asarray(whole[0]))
