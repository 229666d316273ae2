"""`index_scores` against a float64 oracle: packed causal ranges (padding rows without keys,
tiles no row sees), reference / Pallas interpret / Pallas on a GPU (marker `gpu`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.index_scores import index_scores
from pallas_kernels.index_scores_pallas import IndexConfig

NUM_ROWS, NUM_KEYS = 70, 150  # every CPU case padded to these: one compile per class


def packed_ranges(lens, prefixes, num_rows):
    """Each query's key range in the packed layout (prefix, then the span), [0, 0) on
    padding rows."""
    start, end = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32)
    row = key = 0
    for length, prefix in zip(lens, prefixes):
        for i in range(length):
            start[row + i], end[row + i] = key, key + prefix + i + 1
        row, key = row + length, key + prefix + length
    return start, end


def oracle(q, w, k, start, end):
    q, w, k = (np.asarray(x, np.float64) for x in (q, w, k))
    scores = np.einsum("rh,rhs->rs", w, np.maximum(np.einsum("rhd,sd->rhs", q, k), 0))
    cols = np.arange(k.shape[0])[None]
    return np.where((cols >= start[:, None]) & (cols < end[:, None]), scores, -np.inf)


class IndexCases:
    IMPLEMENTATION: str
    CONFIG: IndexConfig | None = None
    INTERPRET: bool | None = None  # None: interpret on the CPU only
    DTYPE = jnp.float32
    TOLERANCE = 1e-5
    HEADS, DIM = 3, 32

    def check(self, rng, lens, prefixes, *, num_rows=NUM_ROWS, num_keys=NUM_KEYS, heads=None,
              dim=None):
        heads, dim = heads or self.HEADS, dim or self.DIM
        start, end = packed_ranges(lens, prefixes, num_rows)
        assert end.max() <= num_keys
        q = jnp.asarray(rng.standard_normal((num_rows, heads, dim)), self.DTYPE)
        w = jnp.asarray(rng.standard_normal((num_rows, heads)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((num_keys, dim)), self.DTYPE)
        out = index_scores(q, w, k, jnp.asarray(start), jnp.asarray(end),
                           implementation=self.IMPLEMENTATION, config=self.CONFIG,
                           interpret=self.INTERPRET)
        assert out.shape == (num_rows, num_keys) and out.dtype == jnp.float32
        expected = oracle(q, w, k, start, end)
        out = np.asarray(out, np.float64)
        np.testing.assert_array_equal(np.isinf(out), np.isinf(expected))
        seen = np.isfinite(expected)
        scale = np.abs(expected[seen]).max()
        np.testing.assert_allclose(out[seen], expected[seen], rtol=self.TOLERANCE,
                                   atol=self.TOLERANCE * scale)

    def test_one_span(self, rng):
        self.check(rng, [60], [0])

    def test_packed_spans_with_prefixes_and_padding(self, rng):
        """Tiles above a span's diagonal and past the last key are seen by no row."""
        self.check(rng, [5, 1, 0, 33, 17], [0, 12, 9, 16, 3])

    def test_rows_reaching_the_last_key(self, rng):
        self.check(rng, [20, 50], [70, 10])


class TestReference(IndexCases):
    IMPLEMENTATION = "reference"


class TestPallasInterpret(IndexCases):
    """16 x 32 tiles: several row and key blocks, skipped tiles among them."""

    IMPLEMENTATION = "pallas"
    CONFIG = IndexConfig(block_r=16, block_s=32)
    INTERPRET = True  # on a GPU too: the tiny tiles are for the interpreter


@pytest.mark.gpu
class TestPallasGpu(IndexCases):
    IMPLEMENTATION = "pallas"
    DTYPE = jnp.bfloat16
    TOLERANCE = 2e-2
    HEADS, DIM = 4, 32

    def test_real_shape(self, rng):
        """glm5.3-flash's indexer (32 heads of 128) on 1024 queries, the tuning table's
        tiling."""
        self.check(rng, [700, 300, 24], [0, 2000, 9], num_rows=1024, num_keys=3100,
                   heads=32, dim=128)


def test_bad_arguments_are_refused():
    q, w, k = jnp.zeros((4, 2, 32)), jnp.zeros((4, 2)), jnp.zeros((9, 32))
    ranges = jnp.zeros((4,), jnp.int32), jnp.ones((4,), jnp.int32)
    with pytest.raises(ValueError, match="implementation"):
        index_scores(q, w, k, *ranges, implementation="dense")
    with pytest.raises(ValueError, match="keys must be"):
        index_scores(q, w, k[:, :16], *ranges)
    with pytest.raises(ValueError, match="key_end must be int32"):
        index_scores(q, w, k, ranges[0], ranges[1][:3])
    with pytest.raises(ValueError, match="power of two"):
        index_scores(jnp.zeros((4, 2, 48)), w, jnp.zeros((9, 48)), *ranges,
                     implementation="pallas")
