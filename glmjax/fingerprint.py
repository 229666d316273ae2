"""A fingerprint of a model's weights and config: saved prefill states are resumed only
under the weights that made them (`glmjax.prefill --load-states`).

Every parameter is checksummed whole, on the device where it lives (one fused pass over
its bytes, nothing copied to the host but 8 bytes per tensor). `tensor_checksum` reads the
tensor's bits as uint32 words u_i and returns two sums

    c_k = sum_i u_i * w_k(i)  (mod 2^32),  k = 0, 1,

where w_k(i) is an odd pseudo-random weight hashed from the element's position (every
axis index). Changing one element changes u_j, so c_k moves by (u_j' - u_j) w_k(j) mod
2^32, which is never 0: w_k(j) is odd, hence invertible mod 2^32, and 0 < |u_j' - u_j| <
2^32. A single changed element is therefore always detected, in any tensor, at any
position (the old fingerprint read 16 values per tensor and missed every expert but the
first). Several changed elements cancel in both sums with probability about 2^-64, and
moving values between positions changes the weights they are multiplied by.

`model_fingerprint` hashes (sha256) each parameter's path, shape, dtype and checksums, and
the model config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model import ModelState, merge

_U32 = jnp.uint32
# Constants of MurmurHash3's 32-bit finaliser, a cheap full-avalanche mix.
_MIX_1, _MIX_2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_GOLDEN = np.uint32(0x9E3779B9)
_SECOND_LANE = np.uint32(0x5BD1E995)


def _mix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * _MIX_1
    h = h ^ (h >> 13)
    h = h * _MIX_2
    return h ^ (h >> 16)


def _bits(x: jax.Array) -> jax.Array:
    """The tensor's bits as uint32 words: 1- and 2-byte elements widened, 8-byte elements
    split into two words (a trailing axis of 2)."""
    if x.dtype == jnp.bool_:
        return x.astype(_U32)
    width = x.dtype.itemsize
    if width >= 4:
        return jax.lax.bitcast_convert_type(x, _U32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[width]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(_U32)


def tensor_checksum(x: jax.Array) -> jax.Array:
    """uint32 [2]: the two position-weighted sums of the module docstring, for any shape
    and dtype (a scalar included)."""
    words = _bits(x)
    position = jnp.zeros(words.shape, _U32)
    for axis in range(words.ndim):
        index = jax.lax.broadcasted_iota(_U32, words.shape, axis)
        # Per axis, not a flat index: a flat uint32 index would wrap past 2^32 elements.
        position = _mix32(position * _GOLDEN + index + np.uint32(axis + 1))
    first = position | np.uint32(1)
    second = _mix32(position ^ _SECOND_LANE) | np.uint32(1)
    return jnp.stack([jnp.sum(words * first, dtype=_U32), jnp.sum(words * second, dtype=_U32)])


# One compile per (shape, dtype): a model repeats few, and a changed leaf recompiles alone.
_checksum = jax.jit(tensor_checksum)


def model_fingerprint(model_state: ModelState, config: ModelConfig) -> str:
    """sha256 hex digest over every parameter (path order: path, shape, dtype, checksums)
    and ``config``."""
    params = jax.tree_util.tree_flatten_with_path(nnx.state(merge(model_state), nnx.Param))[0]
    sums = jax.device_get([_checksum(leaf) for _, leaf in params])  # uint32 [2] each
    digest = hashlib.sha256()
    digest.update(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode())
    for (path, leaf), checksum in zip(params, sums, strict=True):
        digest.update(f"{jax.tree_util.keystr(path)} {leaf.shape} {leaf.dtype}".encode())
        digest.update(np.asarray(checksum).astype("<u4").tobytes())
    return digest.hexdigest()
