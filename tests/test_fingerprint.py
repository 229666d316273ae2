"""glmjax.fingerprint: every single-element change of a tensor changes its checksum (any
dtype, any position), and the model fingerprint notices a change deep in the weights (an
element of the last expert, an embedding row other than the first), in shapes or dtypes,
or in the config, while identical weights give identical fingerprints."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.fingerprint import model_fingerprint, tensor_checksum
from glmjax.prefill import random_model_state

CONFIG = ModelConfig.preset("tiny")
checksum = jax.jit(tensor_checksum)


@pytest.fixture(scope="module")
def model_state():
    return random_model_state(CONFIG, 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.int8, jnp.bool_])
def test_every_single_element_change_changes_the_checksum(dtype):
    rng = np.random.default_rng(0)
    shape = (3, 5, 7)
    if dtype == jnp.bool_:
        x = jnp.asarray(rng.integers(0, 2, shape).astype(bool))
    else:
        x = jnp.asarray(rng.standard_normal(shape) * 50).astype(dtype)
    base = np.asarray(checksum(x))
    for index in np.ndindex(shape):
        if dtype == jnp.bool_:
            changed = x.at[index].set(~x[index])
        elif jnp.issubdtype(dtype, jnp.floating):
            changed = x.at[index].set(jnp.nextafter(x[index], jnp.asarray(jnp.inf, dtype)))
        else:
            changed = x.at[index].add(1)
        assert (np.asarray(checksum(changed)) != base).all(), (dtype, index)


def test_checksum_depends_on_position():
    x = jnp.arange(24, dtype=jnp.float32).reshape(4, 6)
    swapped = x.at[0, 0].set(x[3, 5]).at[3, 5].set(x[0, 0])
    assert (np.asarray(checksum(x)) != np.asarray(checksum(swapped))).any()
    assert (np.asarray(checksum(x)) != np.asarray(checksum(x.reshape(6, 4)))).any()


def _nudged(model_state, path: tuple, index: tuple):
    """`model_state` with the parameter at `path` one ulp larger at `index`."""
    graph, state = model_state
    flat = dict(nnx.to_flat_state(state))
    value = flat[path].get_value()
    one_ulp_up = jnp.nextafter(value[index], jnp.asarray(jnp.inf, value.dtype))
    flat[path] = flat[path].replace(value.at[index].set(one_ulp_up))
    return graph, nnx.from_flat_state(flat)


def test_fingerprint_sees_deep_changes(model_state):
    base = model_fingerprint(model_state, CONFIG)
    assert model_fingerprint(random_model_state(CONFIG, 0), CONFIG) == base
    assert model_fingerprint(random_model_state(CONFIG, 1), CONFIG) != base

    last_layer = CONFIG.num_layers - 1
    experts = CONFIG.num_experts
    changes = {
        "last expert of the last layer": (
            ("layers", last_layer, "mlp", "w_down"),
            (experts - 1, 7, 9),
        ),
        "last expert of the MTP block": (("mtp", 0, "block", "mlp", "w_up"), (experts - 1, 0, 0)),
        "embedding row 5": (("embed_tokens", "embedding"), (5, 0)),
        "last embedding row": (("embed_tokens", "embedding"), (CONFIG.vocab_size - 1, 255)),
    }
    for what, (path, index) in changes.items():
        assert model_fingerprint(_nudged(model_state, path, index), CONFIG) != base, what
    assert model_fingerprint(model_state, CONFIG) == base  # the nudges made copies

    other_config = dataclasses.replace(CONFIG, kv_block_size=CONFIG.kv_block_size * 2)
    assert model_fingerprint(model_state, other_config) != base


def test_fingerprint_sees_dtype_and_shape(model_state):
    graph, state = model_state
    flat = dict(nnx.to_flat_state(state))
    path = ("layers", 0, "input_layernorm", "weight")
    value = flat[path].get_value()
    base = model_fingerprint(model_state, CONFIG)
    # Same bits, other dtype: the checksums agree, the fingerprint must not.
    as_int = jax.lax.bitcast_convert_type(value, jnp.int32)
    flat[path] = flat[path].replace(as_int)
    assert model_fingerprint((graph, nnx.from_flat_state(flat)), CONFIG) != base
