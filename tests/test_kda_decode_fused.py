"""`kda_decode_fused` (a KDA layer's decode step between its projections, both pools updated
in place) against a float64 NumPy oracle written from the layer's equations.

`FusedCases` holds the cases; `TestFusedGpu` compiles the Pallas kernel (marker `gpu`),
`TestFusedInterpret` runs it in Pallas interpret mode on the CPU and `TestFusedReference`
runs the jax.numpy path, all on the same cases. Slots no real row names hold NaN and so do
the padding rows' inputs: a stray read or a padding row's write shows as a NaN or a
changed bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda_decode_fused import (
    DecodeLayerGates,
    DecodeLayerWeights,
    kda_decode_fused,
)

# A step as one compiled program, as the model calls it: op by op, the jax.numpy path
# compiled a few dozen small programs a case.
kda_decode_fused_jit = jax.jit(kda_decode_fused,
                               static_argnames=("gates", "backend", "interpret", "num_warps"))


def softplus(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def make_weights(rng, heads, dim, width):
    hk = heads * dim
    return DecodeLayerWeights(
        conv=rng.uniform(-0.5, 0.5, (3 * hk, width)),
        f_b=rng.normal(size=(dim, hk)) / np.sqrt(dim),
        dt_bias=rng.normal(size=hk),
        a_log=np.log(rng.uniform(1, 16, heads)),
        g_b=rng.normal(size=(dim, hk)) / np.sqrt(dim),
        norm=rng.uniform(0.5, 1.5, dim))


def make_step(rng, rows, heads, dim, slots):
    step = dict(qkv=rng.normal(size=(rows, 3 * heads * dim)), f_a=rng.normal(size=(rows, dim)),
                g_a=rng.normal(size=(rows, dim)), beta=rng.uniform(0.02, 0.98, (rows, heads)))
    padding = np.asarray(slots) < 0
    for x in step.values():
        x[padding] = np.nan
    return step


def make_pools(rng, num_slots, slots, heads, dim, width):
    recurrent = np.full((num_slots, heads, dim, dim), np.nan)
    conv = np.full((num_slots, 3 * heads * dim, width - 1), np.nan)
    for s in slots:
        if s >= 0:
            recurrent[s] = 0.3 * rng.normal(size=(heads, dim, dim))
            conv[s] = rng.normal(size=(3 * heads * dim, width - 1))
    return recurrent, conv


def oracle(step, weights, slots, recurrent, conv, gates):
    """float64: each real row's output [H K] and its slot's new states, from the equations."""
    recurrent, conv = recurrent.copy(), conv.copy()
    _, heads, dim, _ = recurrent.shape
    out = np.zeros((len(slots), heads * dim))
    for n, s in enumerate(slots):
        if s < 0:
            continue
        window = np.concatenate([conv[s], step["qkv"][n][:, None]], axis=1)
        y = (window * weights.conv).sum(1)
        q, k, v = (y * sigmoid(y)).reshape(3, heads, dim)
        q, k = (x / np.sqrt((x * x).sum(-1, keepdims=True) + gates.l2_eps) for x in (q, k))
        f = (step["f_a"][n] @ weights.f_b + weights.dt_bias).reshape(heads, dim)
        a = np.exp(weights.a_log)[:, None]
        g = -a * softplus(f) if gates.gate == "softplus" else gates.gate_bound * sigmoid(a * f)
        state = np.exp(g)[..., None] * recurrent[s]
        error = v - np.einsum("hk,hkv->hv", k, state)
        state += (step["beta"][n][:, None] * k)[..., None] * error[:, None, :]
        o = dim ** -0.5 * np.einsum("hk,hkv->hv", q, state)
        gate = (step["g_a"][n] @ weights.g_b).reshape(heads, dim)
        o = o / np.sqrt((o * o).mean(-1, keepdims=True) + gates.norm_eps)
        out[n] = (o * weights.norm * sigmoid(gate)).reshape(-1)
        recurrent[s], conv[s] = state, window[:, 1:]
    return out, recurrent, conv


def relative_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)


def assert_bits_equal(actual, expected):
    np.testing.assert_array_equal(np.asarray(actual).view(np.uint8),
                                  np.asarray(expected).view(np.uint8))


GATES = {"softplus": DecodeLayerGates("softplus", 0.0, 1e-5),
         "sigmoid_bound": DecodeLayerGates("sigmoid_bound", -5.0, 1e-5)}


class FusedCases:
    """Shared cases; subclasses set BACKEND and INTERPRET."""

    BACKEND: str
    INTERPRET: bool = False

    def run(self, step, weights, slots, pools, gates, dtype):
        cast = {n: jnp.asarray(x, jnp.float32 if n == "beta" else dtype) for n, x in step.items()}
        w = DecodeLayerWeights(*(jnp.asarray(x, jnp.float32 if n in ("dt_bias", "a_log")
                                             else dtype)
                                 for n, x in zip(DecodeLayerWeights._fields, weights)))
        inputs = jnp.concatenate([cast["qkv"], cast["f_a"], cast["g_a"]], axis=-1)
        return kda_decode_fused_jit(inputs, cast["beta"], w, jnp.asarray(slots, jnp.int32),
                                    *pools, gates=gates, backend=self.BACKEND,
                                    interpret=self.INTERPRET)

    def check(self, rng, slots, *, heads=2, dim=32, width=4, num_slots=8, steps=1,
              gate="sigmoid_bound", dtype=jnp.float32, tol=2e-5):
        """`steps` steps (rows permuted between them) against the oracle: outputs, the rows'
        slots, and every other slot bit for bit."""
        slots = np.asarray(slots, np.int32)
        gates = GATES[gate]
        weights = make_weights(rng, heads, dim, width)
        # The oracle starts from what the kernel sees: inputs rounded to `dtype`.
        weights = DecodeLayerWeights(*(x if n in ("dt_bias", "a_log")
                                       else np.asarray(jnp.asarray(x, dtype), np.float64)
                                       for n, x in zip(DecodeLayerWeights._fields, weights)))
        recurrent0, conv0 = make_pools(rng, num_slots, slots, heads, dim, width)
        conv0 = np.asarray(jnp.asarray(conv0, dtype), np.float64)
        pools = (jnp.asarray(recurrent0, jnp.float32), jnp.asarray(conv0, dtype))
        want_rec, want_conv = recurrent0.astype(np.float32).astype(np.float64), conv0
        real = slots >= 0
        for _ in range(steps):
            order = rng.permutation(len(slots))
            step = make_step(rng, len(slots), heads, dim, slots)
            step = {n: (x if n == "beta" else np.asarray(jnp.asarray(x, dtype), np.float64))
                    for n, x in step.items()}
            want, want_rec, want_conv = oracle(step, weights, slots, want_rec, want_conv, gates)
            out, *pools = self.run({n: x[order] for n, x in step.items()}, weights,
                                   slots[order], pools, gates, dtype)
            assert out.dtype == dtype
            out = np.asarray(out, np.float64)[np.argsort(order)]
            assert np.isfinite(out[real]).all()
            assert not out[~real].any(), "padding rows must output zeros"
            err = relative_error(out[real], want[real])
            assert err < tol, f"out: relative error {err:.2e}"
        recurrent, conv = (np.asarray(p, np.float64) for p in pools)
        for got, expected in ((recurrent, want_rec), (conv, want_conv)):
            err = relative_error(got[slots[real]], expected[slots[real]])
            assert err < tol, f"pool: relative error {err:.2e}"
        others = np.setdiff1d(np.arange(num_slots), slots)
        assert_bits_equal(np.asarray(pools[0])[others], recurrent0.astype(np.float32)[others])
        assert_bits_equal(np.asarray(pools[1])[others], np.asarray(jnp.asarray(conv0, dtype))[others])

    @pytest.mark.parametrize("gate, slots", [
        ("sigmoid_bound", [3]), ("softplus", [5, -1, 0, 7, 2, -1]),
        ("sigmoid_bound", [5, -1, 0, 7, 2, -1]), ("softplus", [-1, -1])])
    def test_one_step(self, rng, slots, gate):
        self.check(rng, slots, gate=gate)

    def test_chained_steps_with_rows_reordered(self, rng):
        self.check(rng, [6, -1, 1, 4], steps=3)

    @pytest.mark.parametrize("heads, dim, width", [(1, 64, 2), (3, 32, 3)])
    def test_shapes(self, rng, heads, dim, width):
        self.check(rng, [0, -1, 2], heads=heads, dim=dim, width=width, num_slots=3)

    def test_bf16(self, rng):
        # bf16 activations, weights and conv pool (fp32 math, rounded where the layer
        # rounds): the output within bf16's rounding of the oracle.
        self.check(rng, [4, -1, 0], steps=2, dtype=jnp.bfloat16, tol=2e-2)

    @pytest.mark.parametrize("slots", [[2, 5, 2], [2, 8, 1], [2, -2, 1]],
                             ids=["duplicate", "past-end", "below-1"])
    def test_invalid_slots_refuse_the_whole_call(self, rng, slots):
        heads, dim, width = 2, 32, 4
        recurrent, conv = (jnp.asarray(p, jnp.float32)
                           for p in make_pools(rng, 8, [1, 2, 5], heads, dim, width))
        out, got_rec, got_conv = self.run(make_step(rng, 3, heads, dim, [0, 0, 0]),
                                          make_weights(rng, heads, dim, width), slots,
                                          (recurrent, conv), GATES["softplus"], jnp.float32)
        assert_bits_equal(got_rec, recurrent)
        assert_bits_equal(got_conv, conv)
        assert not np.asarray(out).any()


@pytest.mark.gpu
class TestFusedGpu(FusedCases):
    BACKEND = "pallas"

    @pytest.mark.parametrize("heads", [32, 64])
    @pytest.mark.parametrize("rows", [1, 64])
    def test_real_shapes_bf16(self, rng, heads, rows):
        """kimi-linear-48b's 32 and glm5.3-flash's 64 heads x 128 on a 256-slot pool, half
        the rows padding."""
        slots = rng.permutation(256)[:rows].astype(np.int32)
        slots[1::2] = -1
        self.check(rng, slots, heads=heads, dim=128, num_slots=256, steps=2,
                   dtype=jnp.bfloat16, tol=2e-2)

    def test_compiled_step_copies_no_pool(self):
        """Donated pools are updated in place: the optimised HLO copies neither."""
        heads, dim, rows, slots = 4, 128, 16, 256
        shape = jax.ShapeDtypeStruct
        bf16, hk = jnp.bfloat16, heads * dim
        weights = DecodeLayerWeights(shape((3 * hk, 4), bf16), shape((dim, hk), bf16),
                                     shape((hk,), jnp.float32), shape((heads,), jnp.float32),
                                     shape((dim, hk), bf16), shape((dim,), bf16))
        args = (shape((rows, 3 * hk + 2 * dim), bf16), shape((rows, heads), jnp.float32),
                weights, shape((rows,), jnp.int32), shape((slots, heads, dim, dim), jnp.float32),
                shape((slots, 3 * hk, 3), bf16))
        step = jax.jit(lambda *a: kda_decode_fused(*a, gates=GATES["softplus"]),
                       donate_argnums=(4, 5))
        hlo = step.lower(*args).compile().as_text()
        assert not [line for line in hlo.splitlines()
                    if (f"f32[{slots},{heads}" in line or f"bf16[{slots},{3 * hk}" in line)
                    and " copy(" in line]


class TestFusedInterpret(FusedCases):
    BACKEND = "pallas"
    INTERPRET = True


class TestFusedReference(FusedCases):
    BACKEND = "reference"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(state_slots=jnp.zeros((3,), jnp.float32)), "state_slots must be int32"),
        (dict(beta=jnp.zeros((3, 3))), r"beta must have shape \(3, 2\)"),
        (dict(inputs=jnp.zeros((3, 100))), r"inputs must have shape \(3, 256\)"),
        (dict(conv=jnp.zeros((8, 192, 2))), r"conv pool must have shape \(8, 192, 3\)"),
        (dict(recurrent=jnp.zeros((8, 2, 32, 32), jnp.bfloat16)), "fp32 pool"),
        (dict(gates=DecodeLayerGates("relu", 0.0, 1e-5)), "gate must be one of"),
    ],
)
def test_bad_arguments_name_the_value(rng, change, message):
    heads, dim, width = 2, 32, 4
    step = {n: jnp.asarray(x, jnp.float32)
            for n, x in make_step(rng, 3, heads, dim, [0, 1, 2]).items()}
    weights = DecodeLayerWeights(*(jnp.asarray(x, jnp.float32)
                                   for x in make_weights(rng, heads, dim, width)))
    inputs = jnp.concatenate([step["qkv"], step["f_a"], step["g_a"]], axis=-1)
    args = dict(inputs=inputs, beta=step["beta"], weights=weights,
                state_slots=jnp.zeros((3,), jnp.int32),
                recurrent=jnp.zeros((8, heads, dim, dim), jnp.float32),
                conv=jnp.zeros((8, 3 * heads * dim, width - 1), jnp.float32),
                gates=GATES["softplus"])
    args.update(change)
    with pytest.raises(ValueError, match=message):
        kda_decode_fused(**args)
