"""`pallas_kernels.sinkhorn.sinkhorn` against a float64 NumPy oracle: the Pallas kernel in
interpret mode on the CPU and compiled on a GPU (marker `gpu`), and the jax.numpy path, on
the same cases: token counts that are not a multiple of the kernel's block (one token, a
decode step's), 2 / 4 / 8 streams, no iteration and many, logits large enough that exp
spans most of the fp32 range."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_layers_oracles import sinkhorn_oracle

from pallas_kernels.sinkhorn import sinkhorn
from pallas_kernels.sinkhorn_pallas import BLOCK_TOKENS

# name -> (tokens, streams, iterations, logit spread)
CASES = {
    "glm-prefill": (2 * BLOCK_TOKENS + 13, 4, 20, 2.0),
    "decode-row": (1, 4, 20, 2.0),
    "two-streams": (BLOCK_TOKENS, 2, 20, 2.0),
    "eight-streams": (9, 8, 20, 2.0),
    "exp-only": (5, 4, 0, 2.0),
    "one-iteration": (5, 4, 1, 2.0),
    "wide-logits": (7, 4, 20, 10.0),  # exp down to ~e^-60, still normal fp32
}


class SinkhornCases:
    IMPLEMENTATION: str
    INTERPRET: bool = False

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_against_the_oracle(self, rng, case):
        tokens, n, iters, spread = CASES[case]
        logits = (rng.normal(size=(tokens, n, n)) * spread).astype(np.float32)
        m = sinkhorn(jnp.asarray(logits), iters, implementation=self.IMPLEMENTATION,
                     interpret=self.INTERPRET)
        assert m.shape == logits.shape and m.dtype == jnp.float32
        # The oracle without the max subtraction: the same matrix up to rounding.
        want = [sinkhorn_oracle(lg - lg.max(), iters) for lg in logits.astype(np.float64)]
        np.testing.assert_allclose(np.asarray(m), want, rtol=2e-5, atol=1e-30)
        if iters:
            np.testing.assert_allclose(np.asarray(m).sum(-2), 1, atol=1e-6)

    def test_a_token_does_not_depend_on_the_tokens_beside_it(self, rng):
        """Bit for bit alone and among others (MTP's verify runs more rows than decode)."""
        logits = jnp.asarray(rng.normal(size=(BLOCK_TOKENS + 3, 4, 4)), jnp.float32)
        run = lambda x: np.asarray(sinkhorn(x, 20, implementation=self.IMPLEMENTATION,  # noqa: E731
                                            interpret=self.INTERPRET))
        together = run(logits)
        for t in (0, BLOCK_TOKENS + 2):
            np.testing.assert_array_equal(run(logits[t:t + 1])[0], together[t])


@pytest.mark.gpu
class TestSinkhornGpu(SinkhornCases):
    IMPLEMENTATION = "pallas"


class TestSinkhornInterpret(SinkhornCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = True


class TestSinkhornXla(SinkhornCases):
    IMPLEMENTATION = "xla"


@pytest.mark.parametrize("logits, kwargs, message", [
    (jnp.zeros((3, 4)), {}, r"fp32 \[T, n, n\]"),
    (jnp.zeros((3, 4, 2)), {}, r"fp32 \[T, n, n\]"),
    (jnp.zeros((3, 4, 4), jnp.bfloat16), {}, r"fp32 \[T, n, n\]"),
    (jnp.zeros((3, 4, 4)), {"iters": -1}, "iters must be >= 0"),
    (jnp.zeros((3, 4, 4)), {"implementation": "cuda"}, "implementation must be one of"),
    (jnp.zeros((3, 3, 3)), {"implementation": "pallas"}, "n a power of two, got n = 3"),
])
def test_bad_arguments_name_the_value(logits, kwargs, message):
    kwargs = {"iters": 20} | kwargs
    with pytest.raises(ValueError, match=message):
        sinkhorn(logits, **kwargs)
