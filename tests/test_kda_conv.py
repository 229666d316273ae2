"""`pallas_kernels.kda_conv` against a float64 per-sequence loop (`conv_oracle`, then the L2
norms): the Pallas kernel in interpret mode on the CPU and compiled on a GPU (marker `gpu`),
and the jax.numpy path, on the same cases: empty, one-token and two-token sequences (windows
that reach into the history), cold and warm histories, padding rows, row counts that are
not a multiple of the kernel's row block, kernel width 1, bf16; and a continuation that
equals the whole span bit for bit (a ladder step against a coalesced one)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_layers_oracles import conv_oracle, cu_seqlens_of, random_lengths

from pallas_kernels.kda_conv import kda_conv

# A case's call as one compiled program, as the model calls the op: op by op, the
# jax.numpy path compiled ~20 small programs a case (about 1.5 s of CI's time each).
kda_conv_jit = jax.jit(kda_conv, static_argnames=("heads", "implementation", "interpret"))

# name -> (rows, sequences, heads, head dim, width, dtype, cold history)
CASES = {
    "short-seqs": (37, 5, 2, 16, 4, "float32", False),
    "cold": (37, 5, 2, 16, 4, "float32", True),
    "two-row-blocks": (130, 3, 1, 32, 4, "float32", False),
    "one-seq-padded": (70, 1, 2, 16, 4, "float32", False),
    "width-1": (21, 3, 1, 16, 1, "float32", False),
    "width-2": (21, 4, 1, 16, 2, "float32", False),
    "bf16": (75, 4, 2, 32, 4, "bfloat16", False),
}
TOLERANCE = {"float32": dict(rtol=2e-5, atol=2e-6), "bfloat16": dict(rtol=2e-2, atol=2e-2)}


def make(rng, rows, seqs, heads, dim, width, dtype, cold):
    lengths = ([rows - 5] if seqs == 1 else
               random_lengths(rng, seqs, rows - 3, include=(0, 1, 2)[:seqs]))
    channels = 3 * heads * dim
    x = rng.normal(size=(rows, channels)).astype(np.float32)
    weight = rng.normal(size=(channels, width)).astype(np.float32)
    history = np.zeros((seqs, channels, width - 1), np.float32)
    if not cold:
        history[:] = rng.normal(size=history.shape)
    # The kernel reads its inputs in their dtype: the oracle reads the same rounded values.
    x, history = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (x, history))
    return x, weight, history, cu_seqlens_of(lengths)


def oracle(x, weight, history, cu, heads):
    offsets = np.full((history.shape[0], 1), -1, np.int32)
    y = conv_oracle(x, weight, cu, history, offsets)[0]
    q, k, v = (part.reshape(len(x), heads, -1) for part in np.split(y, 3, axis=-1))
    q, k = (p / np.sqrt(np.sum(p * p, -1, keepdims=True) + 1e-6) for p in (q, k))
    return q, k, v


class ConvCases:
    IMPLEMENTATION: str
    INTERPRET: bool = False

    def run(self, x, weight, history, cu, heads, dtype="float32"):
        """x [T, 3 H K]: its q, k, v thirds are the op's three inputs."""
        parts = [jnp.asarray(part, dtype) for part in np.split(x, 3, axis=-1)]
        return kda_conv_jit(parts, jnp.asarray(weight), jnp.asarray(history, dtype),
                            jnp.asarray(cu), heads=heads, implementation=self.IMPLEMENTATION,
                            interpret=self.INTERPRET)

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_random(self, rng, case):
        rows, seqs, heads, dim, width, dtype, cold = CASES[case]
        x, weight, history, cu = make(rng, *CASES[case])
        got = self.run(x, weight, history, cu, heads, dtype)
        for name, a, b in zip("qkv", got, oracle(x, weight, history, cu, heads)):
            assert a.shape == (rows, heads, dim) and a.dtype == jnp.dtype(dtype), name
            np.testing.assert_allclose(np.asarray(a, np.float32), b, err_msg=name,
                                       **TOLERANCE[dtype])
        padding = np.arange(rows) >= cu[-1]
        assert padding.any() and all(not np.asarray(a)[padding].any() for a in got)

    def test_a_continuation_equals_the_whole_span(self, rng):
        """The last rows of one sequence, run as a continuation with the inputs before them
        as its history, are bit for bit the whole span's rows (every W - 1 split point)."""
        heads, dim, width, length = 2, 16, 4, 50
        x, weight, _, _ = make(rng, length, 1, heads, dim, width, "bfloat16", True)
        zero = np.zeros((1, x.shape[1], width - 1), np.float32)
        whole = self.run(x, weight, zero, [0, length], heads, "bfloat16")
        for split in (1, 2, 3, 17):
            history = np.concatenate([np.zeros((width - 1, x.shape[1]), np.float32),
                                      x[:split]])[-(width - 1):].T[None]
            tail = self.run(x[split:], weight, history, [0, length - split], heads, "bfloat16")
            for a, b in zip(tail, whole):
                np.testing.assert_array_equal(np.asarray(a, np.float32),
                                              np.asarray(b[split:], np.float32))


@pytest.mark.gpu
class TestConvGpu(ConvCases):
    IMPLEMENTATION = "pallas"


class TestConvInterpret(ConvCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = True


class TestConvXla(ConvCases):
    IMPLEMENTATION = "xla"


@pytest.mark.parametrize("change, message", [
    (dict(parts=[jnp.zeros((8, 32))] * 2), "parts must be q, k, v"),
    (dict(parts=[jnp.zeros((8, 32))] * 2 + [jnp.zeros((8, 16))]), "parts must be q, k, v"),
    (dict(parts=[jnp.zeros((8, 32))] * 2 + [jnp.zeros((8, 32), jnp.bfloat16)]),
     "parts must be q, k, v"),
    (dict(parts=[jnp.zeros((32,))] * 3), "parts must be q, k, v"),
    (dict(weight=jnp.zeros((12, 4))), r"weight must be \[3 H K = 96, W\]"),
    (dict(heads=5), "32 channels are not heads 5"),
    (dict(history=jnp.zeros((2, 96, 2))), r"history must be \[N, 96, 3\]"),
    (dict(cu_seqlens=jnp.zeros((2,), jnp.int32)), r"cu_seqlens \[N \+ 1\]"),
    (dict(implementation="triton"), "implementation must be one of"),
])
def test_bad_arguments_name_the_value(change, message):
    args = dict(parts=[jnp.zeros((8, 32))] * 3, weight=jnp.zeros((96, 4)),
                history=jnp.zeros((2, 96, 3)), cu_seqlens=jnp.zeros((3,), jnp.int32), heads=2)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        kda_conv(**args)
