"""`pallas_kernels.moe_routing.route_top_k` against a float64 NumPy oracle: the Pallas kernel
in interpret mode on the CPU and compiled on a GPU (marker `gpu`), and the jax.numpy path,
on the same cases: both presets' expert counts, counts and k that are not powers of two,
ties (the lower id first), a bias that decides the choice alone, saturated scores; the
logits as the weight stream's partial sums."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_routing import route_top_k
from pallas_kernels.partials import ordered_sum

# name -> (tokens, experts, top_k)
CASES = {
    "kimi": (3, 256, 8),
    "glm": (2, 288, 8),
    "k-3-of-16": (5, 16, 3),
    "k-1-of-7": (4, 7, 1),
    "all-of-6": (2, 6, 6),
    "decode-64-rows": (64, 256, 8),
}


def oracle(logits, bias, top_k, scaling):
    """Stable descending sort of s + bias (ties: the lower id first), in float64."""
    scores = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    choice = scores + np.asarray(bias, np.float64)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    picked = np.take_along_axis(scores, ids, -1)
    return picked / (picked.sum(-1, keepdims=True) + 1e-20) * scaling, ids


def make(rng, tokens, experts, *, spread=2.0):
    logits = rng.normal(size=(tokens, experts)) * spread
    bias = rng.normal(size=experts) * 0.1
    return logits.astype(np.float32), bias.astype(np.float32)


class RoutingCases:
    IMPLEMENTATION: str
    INTERPRET: bool = False

    def route(self, logits, bias, top_k, scaling=2.5):
        return route_top_k(jnp.asarray(logits), jnp.asarray(bias), top_k=top_k, scaling=scaling,
                           implementation=self.IMPLEMENTATION, interpret=self.INTERPRET)

    def check(self, logits, bias, top_k, scaling=2.5):
        weights, ids = self.route(logits, bias, top_k, scaling)
        assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32
        want_weights, want_ids = oracle(logits, bias, top_k, scaling)
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=2e-6, atol=1e-7)

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_random(self, rng, case):
        tokens, experts, top_k = CASES[case]
        self.check(*make(rng, tokens, experts), top_k)

    def test_ties_take_the_lower_id(self, rng):
        logits, bias = make(rng, 3, 40)
        bias[:] = 0
        logits[0, [3, 9, 17, 30]] = 4.0  # four equal leaders, k = 3
        logits[1, :] = 1.0  # every score equal
        logits[2, [39, 0]] = 6.0  # equal at both ends
        self.check(logits, bias, 3)

    def test_bias_decides_the_choice_only(self, rng):
        logits, bias = make(rng, 4, 32)
        bias[:] = 0
        bias[[5, 20]] = 100.0  # forces experts 5 and 20 whatever their scores
        weights, ids = self.route(logits, bias, 2)
        np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), [[5, 20]] * 4)
        self.check(logits, bias, 2)

    @pytest.mark.parametrize("splits", [1, 3, 20], ids=lambda s: f"splits{s}")
    def test_partial_sums(self, rng, splits):
        """The logits as fp32 partial sums (20: two of `ordered_sum`'s groups): the choice
        and weights of their ordered sum, bit for bit."""
        _, bias = make(rng, 3, 40)
        partials = (rng.normal(size=(splits, 3, 40)) * 2.0).astype(np.float32)
        weights, ids = route_top_k(jnp.asarray(partials), jnp.asarray(bias), top_k=5,
                                   scaling=2.5, implementation=self.IMPLEMENTATION,
                                   interpret=self.INTERPRET, partial_sums=True)
        logits = np.asarray(ordered_sum(jnp.asarray(partials)))
        summed = self.route(logits, bias, 5)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(summed[1]))
        np.testing.assert_array_equal(np.asarray(weights), np.asarray(summed[0]))
        self.check(logits, bias, 5)

    def test_saturated_scores(self, rng):
        # Large logits: sigmoid rounds to 1 for many experts, so the bias breaks the ties.
        self.check(*make(rng, 3, 64, spread=40.0), 8)

    def test_nan_scores_rank_last_and_ids_stay_in_range(self, rng):
        """A NaN score ranks below every number (XLA's top-k on the CPU); every id names a
        real expert, once, even on an all-NaN row (a padding row's NaN input), so no
        consumer of the ids sees an expert past E."""
        logits, bias = make(rng, 3, 24)
        logits[0, [1, 7, 20]] = np.nan  # the finite leaders are chosen, weights finite
        logits[1, :] = np.nan
        logits[2, :] = np.nan
        logits[2, [4, 9]] = 1.0  # two numbers, then the lowest NaN ids
        weights, ids = (np.asarray(a) for a in self.route(logits, bias, 5))
        assert ((ids >= 0) & (ids < 24)).all(), ids
        assert all(len(set(row)) == 5 for row in ids), ids
        finite = np.where(np.isnan(logits), -np.inf, logits)
        want_weights, want_ids = oracle(finite, bias, 5, 2.5)
        np.testing.assert_array_equal(ids[0], want_ids[0])
        np.testing.assert_allclose(weights[0], want_weights[0], rtol=2e-6, atol=1e-7)
        np.testing.assert_array_equal(ids[1], [0, 1, 2, 3, 4])
        np.testing.assert_array_equal(ids[2, :2], [4, 9] if bias[4] >= bias[9] else [9, 4])
        np.testing.assert_array_equal(ids[2, 2:], [0, 1, 2])
        assert np.isnan(weights[1:]).all(), "a NaN score chosen makes the row's weights NaN"


@pytest.mark.gpu
class TestRoutingGpu(RoutingCases):
    IMPLEMENTATION = "pallas"


class TestRoutingInterpret(RoutingCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = True


class TestRoutingXla(RoutingCases):
    IMPLEMENTATION = "xla"


@pytest.mark.parametrize("change, message", [
    (dict(logits=jnp.zeros((4,))), r"logits must be \[T, E\]"),
    (dict(bias=jnp.zeros((5,))), r"bias \[E\]"),
    (dict(top_k=0), "top_k must be in 1..8"),
    (dict(top_k=9), "top_k must be in 1..8"),
    (dict(implementation="sort"), "implementation must be one of"),
    (dict(partial_sums=True), r"logits must be \[S, T, E\]"),
    (dict(logits=jnp.zeros((3, 2, 8), jnp.bfloat16), partial_sums=True),
     "partial sums must be float32"),
])
def test_bad_arguments_name_the_value(change, message):
    args = dict(logits=jnp.zeros((2, 8)), bias=jnp.zeros((8,)), top_k=2, scaling=1.0)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        route_top_k(**args)
