"""``validate_checkpoint_metadata``: valid metadata passes, each bad case names row and value."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import validate_checkpoint_metadata

CU_SEQLENS = [0, 700, 700, 764]  # lengths 700, 0, 64
OFFSETS = [[1, 700, 700, -1], [-1, -1, -1, -1], [64, 33, -1, 1]]


def validate(
    cu_seqlens=CU_SEQLENS,
    offsets=OFFSETS,
    *,
    num_tokens=800,
    cu_dtype=np.int32,
    offsets_dtype=np.int32,
):
    return validate_checkpoint_metadata(
        np.asarray(cu_seqlens, cu_dtype),
        np.asarray(offsets, offsets_dtype),
        num_tokens=num_tokens,
    )


@pytest.mark.parametrize("capacity", [1, 2, 4])
def test_valid_metadata_passes(capacity):
    assert validate(offsets=[row[:capacity] for row in OFFSETS]) is None
    assert validate(num_tokens=764) is None


def test_accepts_jax_arrays():
    cu_seqlens = jnp.asarray(CU_SEQLENS, jnp.int32)
    offsets = jnp.asarray(OFFSETS, jnp.int32)
    assert validate_checkpoint_metadata(cu_seqlens, offsets, num_tokens=764) is None


BAD = {
    "cu-dtype": (dict(cu_dtype=np.int64), "cu_seqlens must be int32, got int64"),
    "offsets-dtype": (
        dict(offsets_dtype=np.float32),
        "checkpoint_offsets must be int32, got float32",
    ),
    "cu-2d": (dict(cu_seqlens=[CU_SEQLENS]), "shape [N + 1], got (1, 4)"),
    "cu-empty": (dict(cu_seqlens=[], offsets=np.zeros((0, 1))), "shape [N + 1], got (0,)"),
    "cu-start": (dict(cu_seqlens=[5, 700, 700, 764]), "cu_seqlens[0] must be 0, got 5"),
    "cu-decreasing": (
        dict(cu_seqlens=[0, 700, 699, 764]),
        "cu_seqlens[2] = 699 < cu_seqlens[1] = 700",
    ),
    "cu-past-tokens": (dict(num_tokens=763), "cu_seqlens[-1] = 764 exceeds num_tokens = 763"),
    "offsets-1d": (dict(offsets=[1, 2, 3]), "got (3,)"),
    "offsets-rows": (dict(offsets=OFFSETS[:2]), "N = 3, got (2, 4)"),
    "capacity-3": (dict(offsets=[row[:3] for row in OFFSETS]), "one of (1, 2, 4), got 3"),
    "offset-zero": (
        dict(offsets=[[1, 700, 700, -1], [-1] * 4, [64, 0, -1, 1]]),
        "row 2, slot 1: offset 0:",
    ),
    "offset-below-minus-one": (
        dict(offsets=[[1, 700, -2, -1], [-1] * 4, [64, 33, -1, 1]]),
        "row 0, slot 2: offset -2 is negative",
    ),
    "offset-past-length": (
        dict(offsets=[[1, 700, 700, -1], [-1] * 4, [65, 33, -1, 1]]),
        "row 2, slot 0: offset 65 is past the length 64 of sequence 2",
    ),
    "offset-in-empty-sequence": (
        dict(offsets=[[1, 700, 700, -1], [-1, 1, -1, -1], [64, 33, -1, 1]]),
        "row 1, slot 1: offset 1 is past the length 0 of sequence 1",
    ),
}


@pytest.mark.parametrize("kwargs, message", BAD.values(), ids=BAD.keys())
def test_bad_metadata_raises(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(**kwargs)
