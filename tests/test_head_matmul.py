"""`pallas_kernels.head_matmul` (each head's rows against its slice of one shared [C, H, W]
weight: MLA's absorb and expand) against a float64 NumPy oracle: the Pallas kernel in
interpret mode on the CPU and compiled on a GPU (marker `gpu`), and the jax.numpy path, on
the same cases (one row, rows off the tiles and past one row tile, head counts and widths
off the 64-wide tiles, slices at an offset); batch invariance; bad arguments."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.head_matmul import head_matmul
from pallas_kernels.head_matmul_pallas import HeadTiling, select_tiling

# name -> (rows, heads, C, W, transposed, offset, K (absorb) or width (expand))
CASES = {
    "absorb-one-row": (1, 3, 48, 80, True, 32, 48),
    "absorb-rows-70": (70, 2, 64, 96, True, 0, 32),
    "expand-rows-3": (3, 5, 80, 64, False, 16, 48),
    "expand-rows-17": (17, 2, 128, 96, False, 32, 64),
}
REAL = {  # kimi-linear-48b's and glm5.3-flash's kv_b_proj: C 512, nope + v per head
    "kimi-absorb": (32, 256, True, 0, 128),
    "kimi-expand": (32, 256, False, 128, 128),
    "glm-absorb": (64, 448, True, 0, 192),
    "glm-expand": (64, 448, False, 192, 256),
}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def make(rng, rows, heads, c, w_width, transposed, k_or_width, dtype):
    k = k_or_width if transposed else c
    x = jnp.asarray(rng.standard_normal((rows, heads, k)), dtype)
    w = jnp.asarray(rng.standard_normal((c, heads, w_width)) / np.sqrt(k), dtype)
    return x, w


def check(rng, case, dtype, implementation, interpret=None):
    rows, heads, c, w_width, transposed, offset, k_or_width = case
    x, w = make(rng, rows, heads, c, w_width, transposed, k_or_width, dtype)
    width = None if transposed else k_or_width
    out = head_matmul(x, w, transposed=transposed, offset=offset, width=width,
                      implementation=implementation, interpret=interpret)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    if transposed:
        expected = np.einsum("nhd,chd->nhc", x64, w64[..., offset:offset + k_or_width])
    else:
        expected = np.einsum("nhc,chj->nhj", x64, w64[..., offset:offset + k_or_width])
    assert out.dtype == jnp.float32 and out.shape == expected.shape
    tol = 1e-5 if dtype == jnp.float32 else 2e-3  # bf16 products are exact, sums fp32
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_cases(rng, case, dtype, implementation):
    check(rng, CASES[case], DTYPES[dtype], implementation, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_gpu(rng, case, dtype):
    check(rng, CASES[case], DTYPES[dtype], "pallas", interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64, 80])
@pytest.mark.parametrize("shape", sorted(REAL))
def test_real_shapes_gpu(rng, shape, rows):
    heads, w_width, transposed, offset, k_or_width = REAL[shape]
    check(rng, (rows, heads, 512, w_width, transposed, offset, k_or_width), jnp.bfloat16,
          "pallas", interpret=False)


def check_rows_invariant(rng, case, dtype, interpret, tiling=None):
    """Each row of 80 equals, bit for bit, the same row with fewer rows beside it (one row
    tile of 16, 32 or 64 rows, or two tiles)."""
    _, heads, c, w_width, transposed, offset, k_or_width = case
    x, w = make(rng, 80, heads, c, w_width, transposed, k_or_width, dtype)
    kwargs = dict(transposed=transposed, offset=offset, tiling=tiling, interpret=interpret,
                  width=None if transposed else k_or_width)
    full = np.asarray(head_matmul(x, w, **kwargs))
    for rows in (1, 5, 17, 33, 64):
        np.testing.assert_array_equal(np.asarray(head_matmul(x[:rows], w, **kwargs)),
                                      full[:rows])


@pytest.mark.parametrize("case", ["absorb-rows-70", "expand-rows-17"])
def test_a_row_does_not_depend_on_the_rows_beside_it_interpret(rng, case):
    """Output tiles of 16 columns: the CPU's own dot of wider tiles changes with the tile's
    rows, so interpret mode cannot speak for the tensor cores; the `gpu` case does."""
    check_rows_invariant(rng, CASES[case], jnp.float32, True, HeadTiling(block_n=16,
                                                                          block_k=16))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(REAL))
def test_a_row_does_not_depend_on_the_rows_beside_it_gpu(rng, shape):
    heads, w_width, transposed, offset, k_or_width = REAL[shape]
    check_rows_invariant(rng, (0, heads, 512, w_width, transposed, offset, k_or_width),
                         jnp.bfloat16, False)


def test_tiling_comes_from_the_shapes():
    assert select_tiling(512, 128) == HeadTiling(block_n=64, block_k=64)
    assert select_tiling(48, 80) == HeadTiling(block_n=16, block_k=16)
    assert select_tiling(96, 32) == HeadTiling(block_n=32, block_k=32)


@pytest.mark.parametrize("x_shape, w_shape, kwargs, message", [
    ((2, 3, 16), (32, 3), dict(transposed=True), r"w \[C, H, W\]"),
    ((2, 3, 16), (32, 4, 16), dict(transposed=True), "3 heads, w 4"),
    ((2, 3, 16), (32, 3, 24), dict(transposed=True, offset=16), "offset 16 \\+ 16"),
    ((2, 3, 16), (32, 3, 48), dict(transposed=False, width=16), "must be w's first 32"),
    ((2, 3, 32), (32, 3, 48), dict(transposed=False, offset=40, width=16), r"\[40, 40 \+ 16\)"),
    ((2, 3, 24), (32, 3, 48), dict(transposed=True), "multiples of 16"),
    ((2, 3, 16), (32, 3, 48), dict(transposed=True, implementation="cublas"), "implementation"),
])
def test_bad_arguments_name_the_value(x_shape, w_shape, kwargs, message):
    with pytest.raises(ValueError, match=message):
        head_matmul(jnp.zeros(x_shape), jnp.zeros(w_shape), **kwargs)


def test_dtypes_must_match():
    with pytest.raises(ValueError, match="bfloat16"):
        head_matmul(jnp.zeros((2, 3, 16), jnp.bfloat16), jnp.zeros((32, 3, 48)), transposed=True)
