"""`pallas_kernels.stream_matmul`: several weights of one few-row input in one launch, split
along K, against a float64 NumPy oracle; in interpret mode on the CPU and compiled on a GPU
(marker `gpu`, the same cases plus the real decode launches); the tiling rule; bad input."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.partials import ordered_sum
from pallas_kernels.stream_matmul import (
    MIN_BLOCK_K,
    MIN_BLOCK_N,
    PARTIAL_SHARE,
    PROGRAMS_PER_SM,
    STREAM_ROWS,
    estimate_shared_memory,
    max_stream_splits,
    padded_rows,
    select_config,
    select_tiling,
    stream_matmul,
)
from pallas_kernels.stream_matmul_pallas import StreamConfig, StreamTiling
from pallas_kernels.tuning import GB10, H200

# name -> (rows, K, the N of each weight): one row, rows that are not a power of two, one
# tile of rows, the most rows; K and N off the default tiles (48, 80, 112, 160).
CASES = {
    "one-row": (1, 48, (80,)),
    "rows-3-three-weights": (3, 32, (16, 48, 160)),
    "rows-16-two-weights": (16, 64, (48, 32)),
    "rows-40": (40, 96, (32, 64)),
    "rows-max": (STREAM_ROWS, 16, (112,)),
}
# kimi-linear-48b's decode launches: the KDA layer's input projections (q, k, v, f_a, g_a,
# beta), its o projection, a shared expert's gate + up and its down.
REAL = {
    "kimi-kda-in": (2304, ((4096,) * 3 + (128, 128, 32))),
    "kimi-kda-o": (4096, (2304,)),
    "kimi-shared-gate-up": (2304, (1024, 1024)),
    "kimi-shared-down": (1024, (2304,)),
}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def check(rng, rows, k, widths, dtype, interpret, config=None, out_dtypes=None):
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    weights = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype) for n in widths]
    outs = stream_matmul(x, weights, interpret=interpret, config=config, out_dtypes=out_dtypes)
    assert len(outs) == len(weights)
    for out, w, out_dtype in zip(outs, weights, out_dtypes or (dtype,) * len(weights)):
        assert out.shape == (rows, w.shape[1]) and out.dtype == out_dtype
        expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        if out_dtype == jnp.float32:  # fp32 sums of exact (fp32 or bf16 x bf16) products
            np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-5,
                                       atol=1e-5)
        else:  # one bf16 rounding of each output
            np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-2,
                                       atol=1e-2 * np.abs(expected).max())


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_interpret(rng, case, dtype):
    check(rng, *CASES[case], DTYPES[dtype], interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_gpu(rng, case, dtype):
    check(rng, *CASES[case], DTYPES[dtype], interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 16, STREAM_ROWS])
@pytest.mark.parametrize("launch", sorted(REAL))
def test_stream_real_launches_gpu(rng, launch, rows):
    check(rng, rows, *REAL[launch], jnp.bfloat16, interpret=False)


# bf16 operands, some products kept in fp32 (the MoE router's logits beside the shared
# expert's gate and up); the last shape is kimi's launch.
FP32_OUT = {
    "small": (3, 64, (48, 32, 16), (jnp.float32, jnp.bfloat16, jnp.float32)),
    "kimi-shared-router": (1, 2304, (1024, 1024, 256), (jnp.bfloat16,) * 2 + (jnp.float32,)),
}


@pytest.mark.parametrize("case", ["small"])
def test_fp32_outputs_interpret(rng, case):
    rows, k, widths, out_dtypes = FP32_OUT[case]
    check(rng, rows, k, widths, jnp.bfloat16, interpret=True, out_dtypes=out_dtypes)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(FP32_OUT))
def test_fp32_outputs_gpu(rng, case):
    rows, k, widths, out_dtypes = FP32_OUT[case]
    check(rng, rows, k, widths, jnp.bfloat16, interpret=False, out_dtypes=out_dtypes)


def test_kept_partials_add_up_to_the_products_interpret(rng):
    """`keep_partials`: fp32 products come back as their partial sums (four splits, two, and
    one for the reference), whose ordered sum is the product the launch returns."""
    config = StreamConfig((StreamTiling(block_n=16, block_k=16, splits=4),
                           StreamTiling(block_n=32, block_k=32, splits=1),
                           StreamTiling(block_n=16, block_k=16, splits=2)))
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    weights = [jnp.asarray(rng.standard_normal((64, n)) / 8, jnp.bfloat16) for n in (48, 32, 16)]
    out_dtypes = (jnp.float32, jnp.bfloat16, jnp.float32)
    whole = stream_matmul(x, weights, out_dtypes=out_dtypes, config=config, interpret=True)
    kept = stream_matmul(x, weights, out_dtypes=out_dtypes, config=config, interpret=True,
                         keep_partials=(0, 2))
    assert kept[0].shape == (4, 3, 48) and kept[2].shape == (2, 3, 16)
    for i in (0, 2):
        np.testing.assert_array_equal(np.asarray(ordered_sum(kept[i])), np.asarray(whole[i]))
    np.testing.assert_array_equal(np.asarray(kept[1]), np.asarray(whole[1]))
    reference = stream_matmul(x, weights, out_dtypes=out_dtypes, implementation="xla",
                              keep_partials=(0,))
    assert reference[0].shape == (1, 3, 48)
    np.testing.assert_allclose(np.asarray(reference[0][0]), np.asarray(whole[0]), rtol=1e-5,
                               atol=1e-5)


def test_explicit_tiling_interpret(rng):
    """A tiling given by hand: one split per k step, one column tile, two warps."""
    config = StreamConfig((StreamTiling(block_n=16, block_k=16, splits=4),
                           StreamTiling(block_n=32, block_k=32, splits=1)), num_warps=2,
                          num_stages=2)
    check(rng, 2, 64, (48, 64), jnp.float32, interpret=True, config=config)


@pytest.mark.parametrize("spec", [H200, GB10], ids=["h200", "gb10"])
@pytest.mark.parametrize("shape", [(2304, 4096), (4096, 2304), (2304, 128), (2304, 32),
                                   (128, 4096), (2304, 576), (48, 80)])
def test_tiling_rule(spec, shape):
    """The tiles divide the weight; the launch fills the device where the weight allows;
    the fp32 partials of STREAM_ROWS rows stay within their share of the weight's bytes (or
    there is one split); every row count gets this tiling, in stages that fit shared
    memory."""
    k, n = shape
    tiling = select_tiling(spec, k, n)
    assert n % tiling.block_n == 0 and k % (tiling.splits * tiling.block_k) == 0
    partial_bytes = tiling.splits * STREAM_ROWS * n * 4
    assert tiling.splits == 1 or partial_bytes <= PARTIAL_SHARE * k * n * 2
    if tiling.programs(n) < PROGRAMS_PER_SM * spec.num_sms:  # short only at the limits
        assert tiling.block_n <= MIN_BLOCK_N or n % (tiling.block_n // 2)
        assert tiling.block_k <= MIN_BLOCK_K
        assert tiling.splits == max(s for s in range(1, max_stream_splits(k) + 1)
                                    if (k // tiling.block_k) % s == 0)
    for rows in (1, 5, 16, STREAM_ROWS):
        for operand_bytes in (2, 4):  # bf16, fp32
            config = select_config(spec, rows, [shape], operand_bytes=operand_bytes)
            assert config.tilings == (tiling,)
            assert estimate_shared_memory(tiling, padded_rows(rows), config.num_stages,
                                          operand_bytes=operand_bytes) <= spec.smem_per_block


def check_rows_invariant(rng, k, widths, dtype, interpret, config=None):
    """Each row of a launch of STREAM_ROWS rows equals, bit for bit, the same row launched
    with fewer rows beside it (within one row tile and across tiles of 16, 32 and 64)."""
    x = jnp.asarray(rng.standard_normal((STREAM_ROWS, k)), dtype)
    weights = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype) for n in widths]
    full = stream_matmul(x, weights, interpret=interpret, config=config)
    for rows in (1, 3, 16, 17, 33):
        part = stream_matmul(x[:rows], weights, interpret=interpret, config=config)
        for a, b in zip(part, full):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:rows])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_row_does_not_depend_on_the_rows_beside_it_interpret(rng, dtype):
    """Batch invariance (MTP's verify runs N + 1 rows per sequence where plain decoding runs
    one): one tiling for every row count, K splits added in a fixed order. Tiles of 16
    columns, because the CPU's own dot of a [16, bk] tile differs from a [64, bk] one at
    wider tiles: interpret mode cannot speak for the tensor cores, the `gpu` case below
    does, at the default tiling."""
    config = StreamConfig((StreamTiling(block_n=16, block_k=64, splits=4),
                           StreamTiling(block_n=16, block_k=16, splits=16)))
    check_rows_invariant(rng, 1024, (64, 48), DTYPES[dtype], interpret=True, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", sorted(REAL))
def test_a_row_does_not_depend_on_the_rows_beside_it_gpu(rng, launch):
    check_rows_invariant(rng, *REAL[launch], jnp.bfloat16, interpret=False)


@pytest.mark.parametrize("rows, k, widths, message", [
    (0, 32, (16,), "rows"),
    (STREAM_ROWS + 1, 32, (16,), "rows"),
    (2, 30, (16,), "multiples of 16"),
    (2, 32, (24,), "multiples of 16"),
])
def test_bad_shapes(rows, k, widths, message):
    x = jnp.zeros((rows, k), jnp.float32)
    with pytest.raises(ValueError, match=message):
        stream_matmul(x, [jnp.zeros((k, n), jnp.float32) for n in widths])


def test_bad_operands():
    x = jnp.zeros((2, 32), jnp.float32)
    with pytest.raises(ValueError, match="at least one weight"):
        stream_matmul(x, [])
    with pytest.raises(ValueError, match="K=32"):
        stream_matmul(x, [jnp.zeros((48, 16), jnp.float32)])
    with pytest.raises(ValueError, match="bfloat16"):
        stream_matmul(x, [jnp.zeros((32, 16), jnp.bfloat16)])
    with pytest.raises(ValueError, match="implementation"):
        stream_matmul(x, [jnp.zeros((32, 16), jnp.float32)], implementation="cublas")
    with pytest.raises(ValueError, match="1 tilings for 2 weights"):
        stream_matmul(x, [jnp.zeros((32, 16), jnp.float32)] * 2,
                      config=StreamConfig((StreamTiling(16, 16, 1),)))
    with pytest.raises(ValueError, match="out_dtypes has 2 entries for 1 weights"):
        stream_matmul(x, [jnp.zeros((32, 16), jnp.float32)],
                      out_dtypes=(jnp.float32, jnp.float32))
    with pytest.raises(ValueError, match=r"out_dtypes\[0\] must be x's dtype or float32"):
        stream_matmul(x, [jnp.zeros((32, 16), jnp.float32)], out_dtypes=(jnp.int32,))
    with pytest.raises(ValueError, match="keep_partials names product 1"):
        stream_matmul(x, [jnp.zeros((32, 16), jnp.float32)], keep_partials=(1,))
    with pytest.raises(ValueError, match="keep_partials names product 0"):
        stream_matmul(x.astype(jnp.bfloat16), [jnp.zeros((32, 16), jnp.bfloat16)],
                      keep_partials=(0,))
    with pytest.raises(ValueError, match="does not divide"):
        stream_matmul(x, [jnp.zeros((32, 16), jnp.float32)],
                      config=StreamConfig((StreamTiling(16, 16, 3),)))


def test_xla_implementation_is_the_reference(rng):
    x = jnp.asarray(rng.standard_normal((3, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
    (out,) = stream_matmul(x, [w], implementation="xla")
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               np.asarray(x, np.float64) @ np.asarray(w, np.float64),
                               rtol=1e-5, atol=1e-5)
