"""`pallas_kernels.mla_decode` (absorbed MLA decode attention over paged latents) against a
float64 NumPy oracle: the Pallas kernel in interpret mode on the CPU and compiled on a GPU
(marker `gpu`), and the jax.numpy path, on the same cases: missing blocks, inactive rows,
a DSA mask, no rope part, head counts off the 16-row tile, splits that end mid-block."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_decode import mla_decode
from pallas_kernels.mla_decode_pallas import SPLIT_POSITIONS, DecodeTiling, select_tiling

# name -> (heads, kv_lora, rope, block size, blocks per sequence, masked, tiling or None)
CASES = {
    "kimi-like": (20, 64, 16, 32, 4, False, DecodeTiling(split=48, block_t=16)),
    "glm-like-masked": (16, 64, 0, 16, 5, True, DecodeTiling(split=32, block_t=16)),
    "one-split-per-step": (3, 32, 16, 32, 3, False, DecodeTiling(split=32, block_t=32)),
    "default-tiling": (17, 32, 0, 32, 4, True, None),
}


def make_case(rng, heads, kv_lora, rope, block_size, blocks, masked, dtype):
    rows, num_blocks = 4, 4 * blocks + 2
    q = rng.normal(size=(rows, heads, kv_lora))
    q_pe = rng.normal(size=(rows, heads, rope)) if rope else None
    pages = rng.normal(size=(num_blocks, block_size, kv_lora + rope))
    table = rng.permutation(num_blocks)[: rows * blocks].reshape(rows, blocks)
    table[0, 1] = -1  # a missing block inside a sequence: reads as zeros
    table[3] = -1  # an inactive row
    width = blocks * block_size
    lens = np.array([width - 1, width // 2 + 3, 0, -1])  # full, mid-block, one key, none
    mask = rng.random((rows, width)) < 0.6 if masked else None
    cast = lambda x: None if x is None else np.asarray(jnp.asarray(x, dtype), np.float64)  # noqa: E731
    return cast(q), cast(q_pe), cast(pages), table.astype(np.int32), lens.astype(np.int32), mask


def oracle(q, q_pe, pages, table, lens, mask, scale):
    rows, heads, kv_lora = q.shape
    block_size = pages.shape[1]
    out, lse = np.zeros((rows, heads, kv_lora)), np.full((rows, heads), -np.inf)
    for n in range(rows):
        keys = [t for t in range(lens[n] + 1) if mask is None or mask[n, t]]
        if not keys:
            continue
        latent = np.stack([pages[table[n, t // block_size], t % block_size]
                           if table[n, t // block_size] >= 0 else np.zeros(pages.shape[-1])
                           for t in keys])
        scores = q[n] @ latent[:, :kv_lora].T
        if q_pe is not None:
            scores += q_pe[n] @ latent[:, kv_lora:].T
        scores *= scale
        peak = scores.max(-1, keepdims=True)
        weights = np.exp(scores - peak)
        out[n] = weights @ latent[:, :kv_lora] / weights.sum(-1, keepdims=True)
        lse[n] = peak[:, 0] + np.log(weights.sum(-1))
    return out, lse


class MlaDecodeCases:
    IMPLEMENTATION: str
    INTERPRET: bool = False

    def check(self, rng, case, dtype=jnp.float32, tol=2e-5):
        heads, kv_lora, rope, block_size, blocks, masked, tiling = CASES[case]
        q, q_pe, pages, table, lens, mask = make_case(rng, heads, kv_lora, rope, block_size,
                                                      blocks, masked, dtype)
        scale = kv_lora ** -0.5
        as_dtype = lambda x: None if x is None else jnp.asarray(x, dtype)  # noqa: E731
        out, lse = mla_decode(as_dtype(q), as_dtype(q_pe), as_dtype(pages), jnp.asarray(table),
                              jnp.asarray(lens), None if mask is None else jnp.asarray(mask),
                              scale=scale, implementation=self.IMPLEMENTATION,
                              interpret=self.INTERPRET,
                              tiling=tiling if self.IMPLEMENTATION == "pallas" else None)
        assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
        want_out, want_lse = oracle(q, q_pe, pages, table, lens, mask, scale)
        np.testing.assert_allclose(np.asarray(out), want_out, rtol=tol, atol=tol)
        finite = np.isfinite(want_lse)
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
        np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], rtol=tol, atol=tol)
        assert not np.asarray(out)[3].any()  # the inactive row

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_fp32(self, rng, case):
        self.check(rng, case)

    def test_bf16(self, rng):
        # bf16 latents and queries; the kernel rounds the unnormalised weights to bf16.
        self.check(rng, "kimi-like", jnp.bfloat16, tol=2e-2)


@pytest.mark.gpu
class TestMlaDecodeGpu(MlaDecodeCases):
    IMPLEMENTATION = "pallas"

    @pytest.mark.parametrize("heads, rope, masked", [(32, 64, False), (64, 0, True)],
                             ids=["kimi", "glm"])
    def test_real_shapes_bf16(self, rng, heads, rope, masked):
        """kimi-linear-48b's and glm5.3-flash's heads, kv_lora 512, blocks of 512 tokens,
        with the runtime's tiling."""
        CASES["real"] = (heads, 512, rope, 512, 4, masked, None)
        try:
            self.check(rng, "real", jnp.bfloat16, tol=2e-2)
        finally:
            del CASES["real"]


class TestMlaDecodeInterpret(MlaDecodeCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = True


class TestMlaDecodeXla(MlaDecodeCases):
    IMPLEMENTATION = "xla"


def test_one_tiling_for_every_batch():
    """Splits of a fixed number of positions, steps of 32 (16 in blocks of 16)."""
    assert select_tiling(512) == DecodeTiling(split=SPLIT_POSITIONS, block_t=32)
    assert select_tiling(16) == DecodeTiling(split=SPLIT_POSITIONS, block_t=16)
    with pytest.raises(ValueError, match="multiple of 16"):
        select_tiling(24)


def check_sequences_invariant(rng, tiling, interpret, heads=20, kv_lora=32, rope=16,
                              dtype=jnp.float32):
    """Batch invariance (MTP's verify runs N + 1 rows per sequence where plain decoding
    runs one): each sequence's output and LSE in a batch of 8 equal, bit for bit, the same
    sequence alone, and alone in a table twice as wide (more splits past its end)."""
    block_size, blocks, rows = 16, 24, 8
    q = rng.normal(size=(rows, heads, kv_lora))
    q_pe = rng.normal(size=(rows, heads, rope))
    pages = rng.normal(size=(rows * blocks, block_size, kv_lora + rope))
    table = rng.permutation(rows * blocks).reshape(rows, blocks).astype(np.int32)
    lens = rng.integers(0, blocks * block_size, rows).astype(np.int32)
    lens[0] = blocks * block_size - 1
    as_dtype = lambda x: jnp.asarray(x, dtype)  # noqa: E731

    def run(index, width_blocks):
        wide = np.full((len(index), width_blocks), -1, np.int32)
        wide[:, :blocks] = table[index]
        return mla_decode(as_dtype(q[index]), as_dtype(q_pe[index]), as_dtype(pages),
                          jnp.asarray(wide), jnp.asarray(lens[index]), scale=0.125,
                          implementation="pallas", interpret=interpret, tiling=tiling)

    batch_out, batch_lse = run(np.arange(rows), blocks)
    for n in (0, 5):
        for width_blocks in (blocks, 2 * blocks):
            out, lse = run(np.array([n]), width_blocks)
            np.testing.assert_array_equal(np.asarray(out)[0], np.asarray(batch_out)[n])
            np.testing.assert_array_equal(np.asarray(lse)[0], np.asarray(batch_lse)[n])


def test_a_sequence_does_not_depend_on_the_batch_interpret(rng):
    """Splits of 16 positions: 24 and 48 of them, past the merge's group of 16."""
    check_sequences_invariant(rng, DecodeTiling(split=16, block_t=16), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [16, SPLIT_POSITIONS])
def test_a_sequence_does_not_depend_on_the_batch_gpu(rng, split):
    check_sequences_invariant(rng, DecodeTiling(split=split, block_t=16), interpret=False,
                              heads=32, kv_lora=512, rope=64, dtype=jnp.bfloat16)


@pytest.mark.parametrize("change, message", [
    (dict(q_abs=jnp.zeros((2, 4))), r"q_abs must be \[N, H, C\]"),
    (dict(q_pe=jnp.zeros((2, 3, 16))), r"q_pe must be \[2, 4, R\]"),
    (dict(pages=jnp.zeros((6, 16, 40))), r"pages must be \[B, P, 48\]"),
    (dict(block_table=jnp.zeros((2, 3), jnp.float32)), "block_table must be int32"),
    (dict(context_lens=jnp.zeros((3,), jnp.int32)), r"context_lens must be int32 \[2\]"),
    (dict(mask=jnp.zeros((2, 10), bool)), r"mask must be bool \[2, 48\]"),
    (dict(implementation="cudnn"), "implementation must be one of"),
])
def test_bad_arguments_name_the_value(change, message):
    args = dict(q_abs=jnp.zeros((2, 4, 32)), q_pe=jnp.zeros((2, 4, 16)),
                pages=jnp.zeros((6, 16, 48)), block_table=jnp.zeros((2, 3), jnp.int32),
                context_lens=jnp.zeros((2,), jnp.int32), mask=None, scale=1.0)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        mla_decode(**args)
