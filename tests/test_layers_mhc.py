"""mHC hyper-connections against a per-token float64 loop; Sinkhorn and init properties."""

import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_layers_oracles import f64, mhc_oracle, random_module

from glmjax.layers.mhc import HyperConnection, collapse_streams, expand_streams

mhc_module = sys.modules["glmjax.layers.mhc"]
HIDDEN, STREAMS = 32, 4


@nnx.jit
def read_write(hc, streams, sublayer_weight):
    """One hyper-connection around the sublayer F(u) = tanh(u W)."""
    x, mixing = hc.read(streams)
    return x, hc.write(streams, jnp.tanh(x @ sublayer_weight), mixing)


def make(rng=None) -> HyperConnection:
    def factory():
        return HyperConnection(HIDDEN, STREAMS, sinkhorn_iters=20, eps=1e-5, rngs=nnx.Rngs(0))

    return factory() if rng is None else random_module(factory, rng)


def test_read_write_matches_per_token_loop(rng):
    hc = make(rng)
    streams = rng.normal(size=(7, STREAMS, HIDDEN)).astype(np.float32)
    weight = rng.normal(size=(HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)
    _, out = read_write(hc, jnp.asarray(streams), jnp.asarray(weight, jnp.float32))
    params = {
        "phi": f64(hc.phi),
        "alpha": f64(hc.alpha),
        "b_pre": f64(hc.b_pre),
        "b_post": f64(hc.b_post),
        "b_res": f64(hc.b_res),
    }
    expected = mhc_oracle(params, f64(streams), lambda u: np.tanh(u @ weight), iters=20, eps=1e-5)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_static_init_is_a_plain_residual_on_equal_streams(rng):
    """With alpha = 0 (the default biases, no dynamic part) and expanded streams, for any
    sublayer F: collapse(write(read)) == x + F(x)."""
    hc = make()
    hc.alpha[...] = jnp.zeros(3)
    x = jnp.asarray(rng.normal(size=(7, HIDDEN)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(HIDDEN, HIDDEN)) / np.sqrt(HIDDEN), jnp.float32)
    h, out = read_write(hc, expand_streams(x, STREAMS), weight)
    np.testing.assert_allclose(h, x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        collapse_streams(out), x + jnp.tanh(x @ weight), rtol=1e-5, atol=1e-5
    )


def test_a_token_does_not_depend_on_the_tokens_beside_it(rng, monkeypatch):
    """Batch invariance (MTP's verify): each token's read and write are bit for bit the same
    alone and among 9, on the one-GPU path (the weight stream, in interpret mode here); at
    1024 wide the CPU's own product (`jnp.dot`) differs with the token count."""
    monkeypatch.setattr(mhc_module, "on_one_gpu", lambda: True)
    hidden = 1024
    hc = random_module(lambda: HyperConnection(hidden, STREAMS, sinkhorn_iters=20, eps=1e-5,
                                               rngs=nnx.Rngs(0)), rng)
    streams = jnp.asarray(rng.normal(size=(9, STREAMS, hidden)), jnp.float32)

    @nnx.jit
    def around_tanh(hc, streams):  # a sublayer with no product of its own
        x, mixing = hc.read(streams)
        return x, hc.write(streams, jnp.tanh(x), mixing)

    x, out = around_tanh(hc, streams)
    for t in (0, 4, 8):
        x_t, out_t = around_tanh(hc, streams[t:t + 1])
        np.testing.assert_array_equal(np.asarray(x_t)[0], np.asarray(x)[t])
        np.testing.assert_array_equal(np.asarray(out_t)[0], np.asarray(out)[t])
