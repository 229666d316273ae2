"""glmjax.alternating: two executables of one step called in turn, each compiled ahead of
time by one `lower(...).compile()`, results those of the plain jitted step."""

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.alternating import Alternating
from serving.compiles import CompileLog


def step(state, x):
    """A donated state updated in place and a result, as the model's decode step."""
    return state + x.sum(), jnp.tanh(x) * state[0]


def test_calls_alternate_and_match_the_plain_step(rng):
    in_turn = Alternating(step, donate_argnums=0)
    plain = jax.jit(step)
    state = jnp.asarray(rng.standard_normal(3), jnp.float32)
    expected = state
    for call in range(5):
        x = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
        expected, out_plain = plain(expected, x)
        state, out = in_turn(state, x)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(out_plain))
        np.testing.assert_array_equal(np.asarray(state), np.asarray(expected))
        # the copy that ran last is the one the next call skips
        sizes = [copy._cache_size() for copy in in_turn.copies]
        assert sizes == ([1, 0] if call == 0 else [1, 1]), (call, sizes)
    assert in_turn.__name__ == "step"


def test_lowering_compiles_both_copies_ahead_of_their_calls(rng):
    in_turn = Alternating(step, donate_argnums=0)
    state = jnp.zeros(3, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
    with CompileLog() as log:
        in_turn.lower(state, x).compile()
    assert log.count == 2, log.by_function()
    with CompileLog() as log:
        for _ in range(4):
            state, _ = in_turn(state, x)
    assert log.count == 0, log.by_function()
