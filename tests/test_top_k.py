"""`select_top_k` selects exactly lax.top_k's set (ties to the lower index) without a sort."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.top_k import order_keys, row_cumsums, select_top_k


def random_scores(rng, rows, num, kind):
    x = rng.standard_normal((rows, num)).astype(np.float32)
    if kind == "ties":
        x = np.floor(x * 1.5)  # a handful of values: long runs of equal scores
    elif kind == "masked":  # as the indexer: invisible keys at -inf, rows with few visible
        x[rng.random((rows, num)) < rng.random((rows, 1))] = -np.inf
    elif kind == "zeros":  # relu'd scores: exact zeros of both signs, some -inf
        x = np.where(rng.random((rows, num)) < 0.5, np.float32(0), x)
        x[rng.random((rows, num)) < 0.2] *= -0.0
        x[rng.random((rows, num)) < 0.2] = -np.inf
    return x


@pytest.mark.parametrize("kind", ["normal", "ties", "masked", "zeros"])
@pytest.mark.parametrize("num, k", [(1, 1), (37, 5), (37, 37), (300, 64), (300, 299)])
def test_the_set_is_lax_top_k_s(rng, kind, num, k):
    scores = random_scores(rng, 6, num, kind)
    got = np.asarray(jax.jit(select_top_k, static_argnums=1)(jnp.asarray(scores), k))
    _, expected = jax.lax.top_k(jnp.asarray(scores + np.float32(0)), k)  # -0.0 as +0.0
    assert got.shape == (6, k) and got.dtype == np.int32
    for row, want, score in zip(got, np.asarray(expected), scores):
        assert len(set(row)) == k
        assert set(row.tolist()) == set(want.tolist())
        values = score[row] + np.float32(0)
        num_above = int((values > values.min()).sum())
        assert (values[:num_above] > values.min()).all(), "the keys above the k-th first"
        assert (np.diff(row[:num_above]) > 0).all() and (np.diff(row[num_above:]) > 0).all()
        finite = np.isfinite(values)
        assert finite[:int(finite.sum())].all(), "finite selections before -inf ones"


def test_order_keys_keep_the_order_of_the_scores():
    values = np.array([-np.inf, -3e38, -1.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 3e38, np.inf],
                      np.float32)
    keys = np.asarray(order_keys(jnp.asarray(values))).astype(np.int64)
    assert (np.diff(keys[:4]) > 0).all() and keys[4] == keys[5]
    assert (np.diff(keys[5:]) > 0).all() and keys[3] < keys[4]


def test_row_cumsums_are_exact_across_blocks(rng):
    draw = rng.random((3, 1000))
    first, second = draw < 0.45, draw > 0.5  # disjoint; full blocks of either
    first[0, :300], second[1, 200:700] = True, True
    second[0, :300], first[1, 200:700] = False, False
    got = row_cumsums(jnp.asarray(first), jnp.asarray(second))
    for flags, counts in zip((first, second), got):
        np.testing.assert_array_equal(counts, np.cumsum(flags, axis=1))


@pytest.mark.parametrize("k, shape, match", [(0, (2, 5), "k=0"), (6, (2, 5), "k=6"),
                                             (1, (5,), "shape")])
def test_bad_arguments_are_refused(k, shape, match):
    with pytest.raises(ValueError, match=match):
        select_top_k(jnp.zeros(shape), k)
