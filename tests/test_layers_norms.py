"""RMSNorm, gated RMSNorm and L2 norm against NumPy float64."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_layers_oracles import f64, random_module, rms_norm, sigmoid, silu

from glmjax.layers.norms import GatedRMSNorm, RMSNorm, l2_normalize


def test_rms_norm(rng):
    norm = random_module(lambda: RMSNorm(48, eps=1e-5), rng)
    x = rng.normal(size=(7, 3, 48)).astype(np.float32) * 3
    np.testing.assert_allclose(
        norm(jnp.asarray(x)), rms_norm(f64(x), f64(norm.weight), 1e-5), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("activation, act", [("sigmoid", sigmoid), ("silu", silu)])
def test_gated_rms_norm(rng, activation, act):
    norm = random_module(lambda: GatedRMSNorm(64, eps=1e-6, activation=activation), rng)
    x, gate = rng.normal(size=(2, 5, 4, 64)).astype(np.float32)
    expected = rms_norm(f64(x), f64(norm.weight), 1e-6) * act(f64(gate))
    np.testing.assert_allclose(
        norm(jnp.asarray(x), jnp.asarray(gate)), expected, rtol=1e-5, atol=1e-6
    )


def test_gated_rms_norm_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        GatedRMSNorm(8, eps=1e-6, activation="relu")


def test_l2_normalize(rng):
    x = rng.normal(size=(6, 4, 32)).astype(np.float32)
    x[0, 0] = 0  # eps keeps the zero vector finite
    expected = f64(x) / np.sqrt(np.sum(f64(x) ** 2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(l2_normalize(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-7)


def test_norms_keep_input_dtype(rng):
    x = jnp.asarray(rng.normal(size=(3, 16)), jnp.bfloat16)
    assert RMSNorm(16, eps=1e-5)(x).dtype == jnp.bfloat16
    assert GatedRMSNorm(16, eps=1e-5)(x, x).dtype == jnp.bfloat16
    assert l2_normalize(x).dtype == jnp.bfloat16
