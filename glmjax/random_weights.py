"""Seeded random weights: the embedded default of the server and the offline prefill, and
the weights of the benchmarks (throughput does not depend on the values)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model import HybridModel


def random_model(config: ModelConfig, seed: int) -> HybridModel:
    """`HybridModel` with parameters normal * 0.02 and norm gains 1.

    On a CPU they are drawn on the host with NumPy: no init op is compiled (on a CPU that
    takes longer than the draw itself). On an accelerator they are drawn on the device
    (one small program per distinct shape): NumPy draws ~0.4 GB/s, so a 30-50 B-parameter
    model took minutes on the host. The two backends draw different values from a seed.
    """
    model = nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    on_host = jax.default_backend() == "cpu"
    rng, key = np.random.default_rng(seed), jax.random.key(seed)
    leaves = []
    for index, (path, leaf) in enumerate(paths_leaves):
        if "norm" in jax.tree_util.keystr(path):
            leaves.append(jnp.ones(leaf.shape, leaf.dtype))
        elif on_host:
            leaves.append(jnp.asarray(0.02 * rng.standard_normal(leaf.shape, np.float32),
                                      leaf.dtype))
        else:
            leaves.append(_normal(jax.random.fold_in(key, index), leaf.shape, leaf.dtype))
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))
    return model


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
