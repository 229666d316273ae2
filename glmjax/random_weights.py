"""Seeded random weights: the embedded default of the server and the offline prefill, and
the weights of the benchmarks (throughput does not depend on the values)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model import HybridModel


def random_model(config: ModelConfig, seed: int) -> HybridModel:
    """`HybridModel` with parameters normal * 0.02 and norm gains 1, drawn on the host with
    NumPy: no init op is compiled (on a CPU that takes longer than the draw itself)."""
    model = nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed)
    leaves = []
    for path, leaf in paths_leaves:
        if "norm" in jax.tree_util.keystr(path):
            value = np.ones(leaf.shape, np.float32)
        else:
            value = 0.02 * rng.standard_normal(leaf.shape, np.float32)
        leaves.append(jnp.asarray(value, leaf.dtype))
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))
    return model
