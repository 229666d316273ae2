"""`sparse_attention` against the dense masked DSA attention in float64.

Each case builds what the MLA prefill builds: packed sequences continuing cached prefixes,
index scores (often tied), each query's top-k of its causally visible keys by
`select_top_k` (checked to be exactly the oracle's stable-argsort set), then attention over
only those keys, compared with dense attention over every key under the selection mask.
`SparseCases` holds the cases; `TestReference` runs the jax.numpy reference,
`TestPallasInterpret` the Pallas kernel in interpret mode on the CPU, `TestPallasGpu` the
compiled kernel (marker `gpu`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.sparse_attention_pallas import SparseConfig
from pallas_kernels.top_k import select_top_k

SHAPES = {"glm-like": (64, 0), "kimi-like": (64, 32)}  # (kv_lora, rope)
NUM_Q, NUM_K = 64, 96  # every CPU case padded to these (one compile per k and shape)
top_k_jit = jax.jit(select_top_k, static_argnums=1)


def packed_visibility(lens, prefixes, num_q, num_k):
    """bool [num_q, num_k]: query i of sequence n sees its prefix and its span up to
    itself; rows and columns past the packed sequences are padding."""
    lens, prefixes = np.asarray(lens), np.asarray(prefixes)
    cu_q = np.concatenate([[0], np.cumsum(lens)])
    cu_k = np.concatenate([[0], np.cumsum(lens + prefixes)])
    assert cu_q[-1] <= num_q and cu_k[-1] <= num_k
    visible = np.zeros((num_q, num_k), bool)
    for n, (length, prefix) in enumerate(zip(lens, prefixes)):
        for i in range(length):
            visible[cu_q[n] + i, cu_k[n]:cu_k[n] + prefix + i + 1] = True
    return visible


def make_case(rng, lens, prefixes, top_k, *, heads, shape, levels, num_q, num_k, dtype):
    """Inputs, the selection (int32 [T, k], -1: none) and the oracle's selection mask."""
    kv_lora, rope = shape
    visible = packed_visibility(lens, prefixes, num_q, num_k)
    scores = rng.integers(0, levels, size=visible.shape).astype(np.float32)
    masked = np.where(visible, scores, -np.inf)
    k = min(top_k, num_k)
    top = np.asarray(top_k_jit(jnp.asarray(masked), k))
    indices = np.where(np.take_along_axis(visible, top, axis=1), top, -1).astype(np.int32)
    selected = np.zeros_like(visible)
    for t in range(num_q):  # the oracle: stable argsort, then only the visible ones
        chosen = np.argsort(-masked[t], kind="stable")[:k]
        selected[t, chosen[visible[t, chosen]]] = True
        assert set(indices[t][indices[t] >= 0].tolist()) == set(np.flatnonzero(selected[t]))
    q = rng.standard_normal((num_q, heads, kv_lora + rope))
    latent = rng.standard_normal((num_k, kv_lora + rope))
    latent[visible.any(axis=0) == 0] *= 100  # keys no query sees: reading one shows
    return (jnp.asarray(q, dtype), jnp.asarray(latent, dtype), jnp.asarray(indices)), selected


def dense_masked_oracle(q, latent, selected, kv_lora, scale):
    """float64: every query against every key, masked to its selection."""
    q, latent = np.asarray(q, np.float64), np.asarray(latent, np.float64)
    scores = np.einsum("thl,sl->ths", q, latent) * scale
    scores = np.where(selected[:, None], scores, -np.inf)
    peak = np.max(scores, axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(peak), peak, 0))
    total = weights.sum(-1, keepdims=True)
    out = np.einsum("ths,sc->thc", weights / np.where(total > 0, total, 1),
                    latent[:, :kv_lora])
    lse = np.where(total > 0, peak + np.log(np.where(total > 0, total, 1)), -np.inf)
    return out, lse[..., 0]


class SparseCases:
    """Shared cases; subclasses set IMPLEMENTATION, CONFIG, DTYPE, HEADS and TOLERANCE."""

    IMPLEMENTATION: str
    CONFIG: SparseConfig | None = None
    INTERPRET: bool | None = None  # None: interpret on the CPU only
    DTYPE = jnp.float32
    HEADS = 4
    TOLERANCE = 1e-5

    def check(self, rng, lens, prefixes, top_k, shape="glm-like", *, levels=1000,
              num_q=NUM_Q, num_k=NUM_K, heads=None):
        shape = SHAPES[shape] if isinstance(shape, str) else shape
        (q, latent, indices), selected = make_case(
            rng, lens, prefixes, top_k, heads=heads or self.HEADS, shape=shape, levels=levels,
            num_q=num_q, num_k=num_k, dtype=self.DTYPE)
        scale = sum(shape) ** -0.5
        out, lse = sparse_attention(q, latent, indices, kv_lora=shape[0], scale=scale,
                                    implementation=self.IMPLEMENTATION, config=self.CONFIG,
                                    interpret=self.INTERPRET)
        assert out.dtype == q.dtype and lse.dtype == jnp.float32
        assert out.shape == (*q.shape[:2], shape[0]) and lse.shape == q.shape[:2]
        expected_out, expected_lse = dense_masked_oracle(q, latent, selected, shape[0], scale)
        out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
        assert np.isfinite(out).all(), "output has inf or NaN"
        np.testing.assert_allclose(out, expected_out, rtol=self.TOLERANCE, atol=self.TOLERANCE)
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(expected_lse))
        finite = np.isfinite(expected_lse)
        np.testing.assert_allclose(lse[finite], expected_lse[finite], rtol=self.TOLERANCE,
                                   atol=self.TOLERANCE)
        assert not out[~selected.any(axis=1)].any(), "rows without keys must be zero"

    @pytest.mark.parametrize("shape", sorted(SHAPES))
    def test_one_span(self, rng, shape):
        self.check(rng, [40], [0], 8, shape)

    def test_top_k_larger_than_the_visible_keys(self, rng):
        self.check(rng, [6, 3], [2, 0], 32)

    @pytest.mark.parametrize("shape", sorted(SHAPES))
    def test_packed_spans_with_prefixes_and_padding(self, rng, shape):
        self.check(rng, [5, 1, 0, 33, 17], [0, 12, 9, 16, 3], 8, shape)

    def test_ties(self, rng):
        """Two score levels: most of each row's selection is decided by the tie rule."""
        self.check(rng, [30, 9], [11, 4], 8, levels=2)

    def test_out_of_range_entries_select_nothing(self, rng):
        (q, latent, indices), _ = make_case(
            rng, [50], [0], 8, heads=self.HEADS, shape=SHAPES["glm-like"], levels=1000,
            num_q=NUM_Q, num_k=NUM_K, dtype=self.DTYPE)
        noisy = jnp.concatenate([jnp.full((NUM_Q, 3), -7, jnp.int32), indices,
                                 jnp.full((NUM_Q, 2), NUM_K, jnp.int32)], axis=1)
        run = [sparse_attention(q, latent, i, kv_lora=64, scale=0.125,
                                implementation=self.IMPLEMENTATION, config=self.CONFIG,
                                interpret=self.INTERPRET)
               for i in (indices, noisy)]
        for a, b in zip(*run):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                       rtol=self.TOLERANCE, atol=self.TOLERANCE)


class TestReference(SparseCases):
    IMPLEMENTATION = "reference"


class TestPallasInterpret(SparseCases):
    """Small key blocks so the cases cross several of them, and two head blocks."""

    IMPLEMENTATION = "pallas"
    CONFIG = SparseConfig(block_h=2, block_k=8)
    INTERPRET = True  # on a GPU too: the tiny tiles are for the interpreter


@pytest.mark.gpu
class TestPallasGpu(SparseCases):
    IMPLEMENTATION = "pallas"
    DTYPE = jnp.bfloat16
    HEADS = 16
    TOLERANCE = 2e-2

    def test_heads_padded_to_the_head_block(self, rng):
        self.check(rng, [30, 9], [11, 4], 8, heads=4)

    @pytest.mark.parametrize("shape", [(512, 0), (512, 64)])
    def test_real_shapes(self, rng, shape):
        """glm5.3-flash's latent (and one with a rope part) at its 64 heads, the tuning
        table's tiling, top-k 256 of up to ~1.3K keys."""
        self.check(rng, [300, 1, 700, 129], [0, 512, 100, 7], 256, shape, heads=64,
                   num_q=1200, num_k=1800)


def test_bad_arguments_are_refused():
    q, latent = jnp.zeros((4, 2, 64)), jnp.zeros((9, 64))
    indices = jnp.zeros((4, 3), jnp.int32)
    with pytest.raises(ValueError, match="implementation"):
        sparse_attention(q, latent, indices, kv_lora=64, scale=1.0, implementation="dense")
    with pytest.raises(ValueError, match="int32"):
        sparse_attention(q, latent, indices.astype(jnp.int16), kv_lora=64, scale=1.0)
    with pytest.raises(ValueError, match="latent must be"):
        sparse_attention(q, latent[:, :32], indices, kv_lora=32, scale=1.0)
    with pytest.raises(ValueError, match="kv_lora=65"):
        sparse_attention(q, latent, indices, kv_lora=65, scale=1.0)
