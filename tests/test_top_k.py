"""`select_top_k` selects exactly lax.top_k's set (ties to the lower index) without a sort:
the jax.numpy reference, the Pallas kernel in interpret mode (resident and streamed rows)
and on a GPU (marker `gpu`), one case list."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.top_k import order_keys, row_cumsums, select_top_k
from pallas_kernels.top_k_pallas import NEG_INF_KEY, TopKConfig, signed_order_keys

KINDS = ("normal", "ties", "masked", "zeros", "few")
# (S, k): one key; S not a power of two; k == S; several tiles, S not a multiple of one.
CASES = [(1, 1), (37, 5), (37, 37), (300, 64), (300, 299)]


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
    elif kind == "few":  # causal rows: a prefix of 0..S keys visible, often fewer than k
        x[np.arange(num)[None] >= rng.integers(0, num + 1, (rows, 1))] = -np.inf
    return x


def mixed_scores(rng, rows_per_kind, num):
    """Rows of every kind in one [R, S] array (one compile per case), plus a row without
    any visible key."""
    return np.concatenate([random_scores(rng, rows_per_kind, num, kind) for kind in KINDS]
                          + [np.full((1, num), -np.inf, np.float32)])


def check_selection(scores, got, k):
    """got int32 [R, k] is lax.top_k's set, listed as the keys above the k-th largest
    score in ascending index, then the ones equal to it in ascending index."""
    scores = np.asarray(scores) + np.float32(0)  # -0.0 as +0.0
    got = np.asarray(got)
    assert got.shape == (scores.shape[0], k) and got.dtype == np.int32
    _, expected = jax.lax.top_k(jnp.asarray(scores), k)
    np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(np.asarray(expected), axis=1))
    values = np.take_along_axis(scores, got, axis=1)
    above = values > values.min(axis=1, keepdims=True)
    assert (np.diff(above.astype(int), axis=1) <= 0).all(), "the keys above the k-th first"
    same_group = above[:, 1:] == above[:, :-1]
    assert (np.diff(got, axis=1)[same_group] > 0).all(), "ascending index in each group"
    finite = np.isfinite(values)
    assert (np.diff(finite.astype(int), axis=1) <= 0).all(), "finite selections first"


class TopKCases:
    IMPLEMENTATION: str
    CONFIG: TopKConfig | None = None
    INTERPRET: bool | None = None  # None: interpret on the CPU only
    ROWS_PER_KIND = 3

    def select(self, scores, k, lengths=None):
        fn = jax.jit(lambda s, n: select_top_k(s, k, lengths=n,
                                               implementation=self.IMPLEMENTATION,
                                               interpret=self.INTERPRET, config=self.CONFIG))
        return fn(jnp.asarray(scores), None if lengths is None else jnp.asarray(lengths))

    @pytest.mark.parametrize("num, k", CASES)
    def test_the_set_is_lax_top_k_s(self, rng, num, k):
        scores = mixed_scores(rng, self.ROWS_PER_KIND, num)
        check_selection(scores, self.select(scores, k), k)

    @pytest.mark.parametrize("num, k", [(37, 5), (300, 64)])
    def test_keys_past_the_lengths_rank_as_minus_inf(self, rng, num, k):
        """Finite scores past each row's length are ignored: causal rows of every length
        (0, below k, S, beyond S: clipped), over every kind of scores."""
        scores = mixed_scores(rng, self.ROWS_PER_KIND, num)
        scores = np.where(np.isinf(scores), np.float32(5), scores)[::-1].copy()
        lengths = rng.integers(0, num + 1, scores.shape[0]).astype(np.int32)
        lengths[:4] = 0, min(k, num) - 1, num, num + 7
        got = self.select(scores, k, lengths)
        visible = np.arange(num)[None] < lengths[:, None]
        check_selection(np.where(visible, scores, -np.inf), got, k)


class TestReference(TopKCases):
    IMPLEMENTATION = "reference"


class TestPallasInterpret(TopKCases):
    """Tiles of 64: S = 300 is 8 compaction tiles of a 512-key resident row."""

    IMPLEMENTATION = "pallas"
    CONFIG = TopKConfig(tile=64)
    INTERPRET = True  # on a GPU too: the tiny tiles are for the interpreter


class TestPallasStreamedInterpret(TopKCases):
    """Rows longer than 128 keys streamed 64 at a time (S = 300: 5 tiles, the last partial),
    2 and 4 bits a search step."""

    IMPLEMENTATION = "pallas"
    CONFIG = TopKConfig(tile=64, resident=128)
    INTERPRET = True

    # The shorter cases fit 128 keys: TestPallasInterpret's resident path again.
    @pytest.mark.parametrize("num, k", [(300, 64), (300, 299)])
    def test_the_set_is_lax_top_k_s(self, rng, num, k):
        super().test_the_set_is_lax_top_k_s(rng, num, k)

    @pytest.mark.parametrize("num, k", [(300, 64)])
    def test_keys_past_the_lengths_rank_as_minus_inf(self, rng, num, k):
        super().test_keys_past_the_lengths_rank_as_minus_inf(rng, num, k)

    def test_four_bit_steps(self, rng):
        scores = mixed_scores(rng, 2, 300)
        config = TopKConfig(tile=64, resident=128, streamed_digit_bits=4)
        got = select_top_k(jnp.asarray(scores), 70, implementation="pallas", interpret=True,
                           config=config)
        check_selection(scores, got, 70)


@pytest.mark.gpu
class TestPallasGpu(TopKCases):
    IMPLEMENTATION = "pallas"
    ROWS_PER_KIND = 40

    @pytest.mark.parametrize("num", [8192, 32768, 65536])
    @pytest.mark.parametrize("given_lengths", [False, True])
    def test_real_shape(self, rng, num, given_lengths):
        """glm5.3-flash's top-k 2048 over a causal block of 1024 queries: the tuning
        table's config, rows in registers up to 32K (in the register tile their lengths
        pick, as the indexer passes them), streamed at 64K."""
        rows = 1024
        scores = rng.standard_normal((rows, num)).astype(np.float32)
        scores[rows // 2:] = np.floor(scores[rows // 2:] * 4)  # ties across the k-th
        lengths = np.linspace(1, num, rows).astype(np.int32)
        scores = np.where(np.arange(num)[None] < lengths[:, None], scores, -np.inf)
        got = self.select(scores, 2048, lengths if given_lengths else None)
        check_selection(scores, got, 2048)


@pytest.mark.gpu
class TestPallasStreamedGpu(TopKCases):
    IMPLEMENTATION = "pallas"
    CONFIG = TopKConfig(tile=64, resident=128)
    ROWS_PER_KIND = 40


def test_order_keys_keep_the_order_of_the_scores():
    values = np.array([-np.inf, -3e38, -1.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 3e38, np.inf],
                      np.float32)
    for keys in (np.asarray(order_keys(jnp.asarray(values))).astype(np.int64),
                 np.asarray(signed_order_keys(jnp.asarray(values))).astype(np.int64)):
        assert (np.diff(keys[:4]) > 0).all() and keys[4] == keys[5]
        assert (np.diff(keys[5:]) > 0).all() and keys[3] < keys[4]
    assert np.asarray(signed_order_keys(jnp.asarray(values)))[0] == NEG_INF_KEY > -(1 << 31)


def test_row_cumsums_are_exact_across_blocks(rng):
    draw = rng.random((3, 1000))
    first, second = draw < 0.45, draw > 0.5  # disjoint; full blocks of either
    first[0, :300], second[1, 200:700] = True, True
    second[0, :300], first[1, 200:700] = False, False
    got = row_cumsums(jnp.asarray(first), jnp.asarray(second))
    for flags, counts in zip((first, second), got):
        np.testing.assert_array_equal(counts, np.cumsum(flags, axis=1))


@pytest.mark.parametrize("k, shape, impl, match", [
    (0, (2, 5), None, "k=0"), (6, (2, 5), None, "k=6"), (1, (5,), None, "shape"),
    (1, (2, 5), "sort", "implementation")])
def test_bad_arguments_are_refused(k, shape, impl, match):
    with pytest.raises(ValueError, match=match):
        select_top_k(jnp.zeros(shape), k, implementation=impl)


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="lengths must be int32"):
        select_top_k(jnp.zeros((2, 5)), 1, lengths=jnp.zeros((3,), jnp.int32))


@pytest.mark.parametrize("changes, match", [({"tile": 48}, "tile=48"),
                                             ({"tile": 1 << 16}, "tile=65536"),
                                             ({"resident": 8}, "resident=8"),
                                             ({"streamed_digit_bits": 3}, "bits=3")])
def test_bad_configs_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        TopKConfig(**changes)
