"""`kda_decode` (one token per row on a state pool, in place) against the fp64 recurrence.

`KdaDecodeCases` holds the cases; `TestKdaDecodeGpu` compiles the Pallas kernel for the GPU
(marker `gpu`), `TestKdaDecodeInterpret` runs it in Pallas interpret mode on the CPU and
`TestKdaDecodeReference` runs the jax.numpy path, all on the same cases. Every slot no
real row names is poisoned with NaN, and so are the padding rows' inputs: a read of the
wrong slot or a write of a padding row shows up as a NaN or a changed bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda_recurrent_reference
from pallas_kernels.kda_decode import kda_decode
from pallas_kernels.kda_decode_pallas import kda_decode_pallas
from pallas_kernels.tuning import DecodeConfig

INPUT_NAMES = ("q", "k", "v", "g", "beta")


def unit(rng, shape):
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_step(rng, rows, *, heads=2, head_k=32, head_v=32, min_decay=-5.0, fixed_decay=None,
              dtype=jnp.float32):
    """Random inputs of one step, [rows, ...], as float64 NumPy rounded to `dtype`; decays
    uniform in [min_decay, 0), or all `fixed_decay`."""
    arrays = dict(
        q=unit(rng, (rows, heads, head_k)),
        k=unit(rng, (rows, heads, head_k)),
        v=rng.standard_normal((rows, heads, head_v)),
        g=(rng.uniform(min_decay, 0.0, (rows, heads, head_k)) if fixed_decay is None
           else np.full((rows, heads, head_k), fixed_decay)),
        beta=rng.uniform(0.02, 0.98, (rows, heads)),
    )
    return {n: np.asarray(jnp.asarray(x, dtype), np.float64) for n, x in arrays.items()}


def make_pool(rng, num_slots, slots, *, heads=2, head_k=32, head_v=32):
    """fp32 [S, H, K, V]: random states in `slots`, NaN everywhere else."""
    pool = np.full((num_slots, heads, head_k, head_v), np.nan, np.float32)
    for s in slots:
        if s >= 0:
            pool[s] = 0.5 * rng.standard_normal((heads, head_k, head_v))
    return pool


def poison_padding(step, slots):
    """NaN inputs on padding rows: they must reach neither the pool nor a real row."""
    padding = np.asarray(slots) < 0
    for x in step.values():
        x[padding] = np.nan
    return step


def recurrence(steps, slots, pool):
    """fp64 oracle: row n of every step continues the state in slot slots[n].

    steps: list of step dicts (rows in the same order each step). Returns the outputs
    [steps, rows, H, V] and the final states [rows, H, K, V] of the real rows."""
    real = np.flatnonzero(np.asarray(slots) >= 0)
    count = len(steps)

    def packed(name):  # [steps, rows, ...] -> sequence-major [rows * steps, ...]
        x = np.stack([s[name][real] for s in steps], axis=1)
        return x.reshape(-1, *x.shape[2:])

    cu = np.arange(len(real) + 1, dtype=np.int32) * count
    o, final, _ = kda_recurrent_reference(
        *(packed(n) for n in INPUT_NAMES),
        cu,
        pool[np.asarray(slots)[real]],
        np.full((len(real), 1), -1, np.int32),
    )
    return o.reshape(len(real), count, *o.shape[1:]).swapaxes(0, 1), final


def relative_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)


def assert_bits_equal(actual, expected):
    np.testing.assert_array_equal(
        np.asarray(actual, np.float32).view(np.uint32), np.asarray(expected).view(np.uint32)
    )


def pool_copies(backend):
    """Lines of the optimised HLO of a donated decode step (16 rows on a [256, 4, 128, 128]
    pool) that copy the pool: none when the step updates it in place (interpret mode's
    emulation copies, so it is not checked)."""
    rows = jax.ShapeDtypeStruct((16, 4, 128), jnp.bfloat16)
    args = (rows, rows, rows, jax.ShapeDtypeStruct((16, 4, 128), jnp.float32),
            jax.ShapeDtypeStruct((16, 4), jnp.float32), jax.ShapeDtypeStruct((16,), jnp.int32),
            jax.ShapeDtypeStruct((256, 4, 128, 128), jnp.float32))
    step = jax.jit(lambda *a: kda_decode(*a, backend=backend), donate_argnums=6)
    hlo = step.lower(*args).compile().as_text()
    return [line for line in hlo.splitlines() if "f32[256,4,128,128]" in line and " copy(" in line]


class KdaDecodeCases:
    """Shared cases; subclasses set BACKEND and INTERPRET."""

    BACKEND: str
    INTERPRET: bool = False

    def decode(self, step, slots, pool, dtype=jnp.float32, **kwargs):
        inputs = [jnp.asarray(step[n], dtype if n != "g" else jnp.float32) for n in INPUT_NAMES]
        return kda_decode(
            *inputs,
            jnp.asarray(slots, jnp.int32),
            jnp.asarray(pool),
            backend=self.BACKEND,
            interpret=self.INTERPRET,
            **kwargs,
        )

    def check_steps(self, rng, slots, *, num_slots=8, num_steps=1, shuffle=False,
                    dtype=jnp.float32, o_tol=1e-5, state_tol=1e-5, **shape):
        """`num_steps` decode steps (rows permuted between steps when `shuffle`) against
        the recurrence: outputs, the rows' slots, and every other slot bit for bit."""
        slots = np.asarray(slots, np.int32)
        pool0 = make_pool(rng, num_slots, slots, **{k: v for k, v in shape.items()
                                                    if k not in ("min_decay", "fixed_decay")})
        steps = [poison_padding(make_step(rng, len(slots), dtype=dtype, **shape), slots)
                 for _ in range(num_steps)]
        want_o, want_final = recurrence(steps, slots, pool0)
        pool, real = jnp.asarray(pool0), np.flatnonzero(slots >= 0)
        for i, step in enumerate(steps):
            order = rng.permutation(len(slots)) if shuffle else np.arange(len(slots))
            o, pool = self.decode({n: x[order] for n, x in step.items()}, slots[order], pool,
                                  dtype=dtype)
            assert o.dtype == dtype
            o = np.asarray(o, np.float64)[np.argsort(order)]
            assert np.isfinite(o[real]).all()
            err = relative_error(o[real], want_o[i])
            assert err < o_tol, f"step {i}: o relative error {err:.2e}"
            assert not o[slots < 0].any(), "padding rows must output zeros"
        pool = np.asarray(pool)
        err = relative_error(pool[slots[real]], want_final)
        assert err < state_tol, f"states: relative error {err:.2e}"
        others = np.setdiff1d(np.arange(num_slots), slots)
        assert_bits_equal(pool[others], pool0[others])
        return pool

    @pytest.mark.parametrize("slots", [[3], [5, -1, 0, 7, 2, -1], [-1, -1]])
    def test_one_step(self, rng, slots):
        self.check_steps(rng, slots)

    def test_chained_steps_with_rows_reordered(self, rng):
        self.check_steps(rng, [6, -1, 1, 4], num_steps=5, shuffle=True)

    def test_wide_heads_and_unequal_dims(self, rng):
        self.check_steps(rng, [0, -1, 2], heads=3, head_k=16, head_v=64, num_slots=3)

    def test_decay_at_the_lower_bound_and_beyond(self, rng):
        """g = -5 (GLM's bound) for several steps, and g = -40 (any decay): exp(g) only
        shrinks the state, so nothing overflows."""
        self.check_steps(rng, [1, 2], num_steps=3, fixed_decay=-5.0)
        self.check_steps(rng, [1, 2], min_decay=-40.0)

    def test_bf16_inputs(self, rng):
        # The math is fp32 on bf16-rounded inputs: states stay exact, outputs round to bf16.
        self.check_steps(rng, [4, -1, 0], num_steps=2, dtype=jnp.bfloat16, o_tol=5e-3)

    @pytest.mark.parametrize(
        "slots", [[2, 5, 2], [2, 8, 1], [2, -2, 1]], ids=["duplicate", "past-end", "below-1"]
    )
    def test_invalid_slots_refuse_the_whole_step(self, rng, slots):
        pool0 = make_pool(rng, 8, [1, 2, 5])
        o, pool = self.decode(make_step(rng, 3), slots, pool0)
        assert_bits_equal(pool, pool0)
        assert not np.asarray(o).any()


class PallasDecodeCases(KdaDecodeCases):
    """Cases of the kernel alone."""

    BACKEND = "pallas"

    def test_new_slots_do_not_recompile(self, rng):
        pool = jnp.asarray(make_pool(rng, 8, range(8)))
        step = make_step(rng, 3)
        # Twice: interpret mode's first call imports a module that adds a value to JAX's
        # trace context (jax 0.11.2), so its second call traces once more.
        for _ in range(2):
            _, pool = self.decode(step, [1, 2, 3], pool)
        size = kda_decode_pallas._cache_size()
        for slots in ([7, -1, 0], [-1, -1, -1], [0, 1, 1]):
            _, pool = self.decode(step, slots, pool)
        assert kda_decode_pallas._cache_size() == size


@pytest.mark.gpu
class TestKdaDecodeGpu(PallasDecodeCases):
    INTERPRET = False

    @pytest.mark.parametrize("rows", [1, 64])
    def test_real_shapes_bf16(self, rng, rows):
        """glm5.3-flash's 64 heads x 128 on a 256-slot pool, half the rows padding."""
        slots = rng.permutation(256)[:rows].astype(np.int32)
        slots[1::2] = -1
        self.check_steps(rng, slots, num_slots=256, num_steps=2, heads=64, head_k=128,
                         head_v=128, dtype=jnp.bfloat16, o_tol=5e-3)

    def test_value_blocks(self, rng):
        for block_v in (16, 32, 64):
            slots = np.array([5, -1, 0], np.int32)
            pool0 = make_pool(rng, 8, slots, head_v=64)
            step = make_step(rng, 3, head_v=64)
            o, pool = self.decode(step, slots, pool0, config=DecodeConfig(block_v=block_v))
            want_o, want = recurrence([step], slots, pool0)
            assert relative_error(np.asarray(pool)[[5, 0]], want) < 1e-5, block_v
            assert relative_error(np.asarray(o)[[0, 2]], want_o[0]) < 1e-5, block_v

    def test_compiled_step_copies_no_pool(self):
        assert not pool_copies("pallas")


class TestKdaDecodeInterpret(PallasDecodeCases):
    INTERPRET = True


class TestKdaDecodeReference(KdaDecodeCases):
    BACKEND = "reference"

    def test_compiled_step_copies_no_pool(self):
        assert not pool_copies("reference")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(state_slots=jnp.zeros((3,), jnp.float32)), "state_slots must be int32"),
        (dict(state_slots=jnp.zeros((2,), jnp.int32)), r"state_slots must have shape \(3,\)"),
        (dict(beta=jnp.zeros((3, 3))), r"beta must have shape \(3, 2\)"),
        (dict(states=jnp.zeros((4, 2, 32, 32), jnp.bfloat16)), "float32 pool"),
        (dict(states=jnp.zeros((4, 2, 16, 32), jnp.float32)), r"pool \[S >= 1, 2, 32, 32\]"),
    ],
)
def test_bad_arguments_name_the_value(rng, change, message):
    step = {n: jnp.asarray(x, jnp.float32) for n, x in make_step(rng, 3).items()}
    args = dict(**step, state_slots=jnp.zeros((3,), jnp.int32),
                states=jnp.zeros((4, 2, 32, 32), jnp.float32))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        kda_decode(**args)
