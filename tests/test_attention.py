"""`prefill_attention` against a float64 per-sequence oracle.

`AttentionCases` holds the cases every implementation runs; `TestReference` runs the
jax.numpy reference, `TestPallasInterpret` the Pallas kernel in interpret mode on the CPU,
`TestPallasGpu` and `TestCudnnGpu` the compiled kernels (marker `gpu`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import (
    INVARIANT_KEY_ALIGN,
    default_implementation,
    key_ranges,
    prefill_attention,
    validate_attention_metadata,
)
from pallas_kernels.attention_pallas import TUNING, FlashConfig, block_schedule, head_pieces

HEAD_SHAPES = {"glm-like": (64, 64), "kimi-like": (48, 32)}  # (qk, v): small MLA shapes


def make_inputs(rng, lens, prefixes, *, gaps=None, heads=2, head_qk=64, head_v=64, pad_q=3,
                pad_k=5, dtype=jnp.float32):
    """Packed spans of `lens` queries continuing `prefixes` cached keys; `pad_q` padding
    query rows and `pad_k` key rows no sequence owns (large values: reading one shows).
    `gaps`: unused rows after each sequence's keys, in its region (`seqused_k` given)."""
    lens, prefixes = np.asarray(lens), np.asarray(prefixes)
    used = lens + prefixes
    regions = used if gaps is None else used + np.asarray(gaps)
    cu_q = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(regions)]).astype(np.int32)
    num_q, num_k = int(cu_q[-1]) + pad_q, int(cu_k[-1]) + pad_k
    q = rng.standard_normal((num_q, heads, head_qk))
    k = rng.standard_normal((num_k, heads, head_qk))
    v = rng.standard_normal((num_k, heads, head_v))
    unused = np.ones(num_k, bool)
    for start, n in zip(cu_k[:-1], used):
        unused[start:start + n] = False
    k[unused] *= 100
    v[unused] *= 100
    inputs = dict(q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype),
                  cu_seqlens_q=jnp.asarray(cu_q), cu_seqlens_k=jnp.asarray(cu_k))
    if gaps is not None:
        inputs["seqused_k"] = jnp.asarray(used, jnp.int32)
    return inputs


def oracle(inputs, scale):
    """float64 loops: query i of sequence n sees its prefix and its span's rows up to i."""
    q, k, v = (np.asarray(inputs[n], np.float64) for n in ("q", "k", "v"))
    cu_q, cu_k = np.asarray(inputs["cu_seqlens_q"]), np.asarray(inputs["cu_seqlens_k"])
    used = np.asarray(inputs.get("seqused_k", np.diff(cu_k)))
    out = np.zeros((q.shape[0], q.shape[1], v.shape[-1]))
    lse = np.full(q.shape[:2], -np.inf)
    for n in range(len(cu_q) - 1):
        len_q = cu_q[n + 1] - cu_q[n]
        prefix = used[n] - len_q
        for i in range(len_q):
            keys = slice(cu_k[n], cu_k[n] + prefix + i + 1)
            scores = np.einsum("hd,shd->hs", q[cu_q[n] + i], k[keys]) * scale
            peak = scores.max(-1, keepdims=True)
            w = np.exp(scores - peak)
            out[cu_q[n] + i] = np.einsum("hs,shv->hv", w / w.sum(-1, keepdims=True), v[keys])
            lse[cu_q[n] + i] = peak[:, 0] + np.log(w.sum(-1))
    return out, lse


class AttentionCases:
    """Shared cases; subclasses set IMPLEMENTATION, CONFIG and DTYPES."""

    IMPLEMENTATION: str
    CONFIG: FlashConfig | None = None
    DTYPE = jnp.float32
    TOLERANCE = 1e-5

    def run(self, inputs, **kwargs):
        return prefill_attention(**inputs, implementation=self.IMPLEMENTATION,
                                 config=self.CONFIG, **kwargs)

    def check(self, rng, lens, prefixes, shape="glm-like", **kwargs):
        head_qk, head_v = HEAD_SHAPES[shape] if isinstance(shape, str) else shape
        inputs = make_inputs(rng, lens, prefixes, head_qk=head_qk, head_v=head_v,
                             dtype=self.DTYPE, **kwargs)
        validate_attention_metadata(inputs["cu_seqlens_q"], inputs["cu_seqlens_k"],
                                    inputs["q"].shape[0], inputs["k"].shape[0],
                                    inputs.get("seqused_k"))
        out, lse = self.run(inputs)
        assert out.dtype == inputs["q"].dtype and lse.dtype == jnp.float32
        expected_out, expected_lse = oracle(inputs, head_qk ** -0.5)
        out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
        assert np.isfinite(out).all(), "output has inf or NaN"
        np.testing.assert_allclose(out, expected_out, rtol=self.TOLERANCE,
                                   atol=self.TOLERANCE)
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(expected_lse))
        finite = np.isfinite(expected_lse)
        np.testing.assert_allclose(lse[finite], expected_lse[finite], rtol=self.TOLERANCE,
                                   atol=self.TOLERANCE)
        end = int(inputs["cu_seqlens_q"][-1])
        assert not out[end:].any(), "padding rows must be zero"

    @pytest.mark.parametrize("shape", sorted(HEAD_SHAPES))
    @pytest.mark.parametrize("lens", [[1], [70]])
    def test_one_span_without_prefix(self, rng, shape, lens):
        self.check(rng, lens, [0], shape)

    @pytest.mark.parametrize("prefix", [1, 21, 64])
    def test_one_span_after_a_prefix(self, rng, prefix):
        self.check(rng, [23], [prefix], "kimi-like")

    @pytest.mark.parametrize("shape", sorted(HEAD_SHAPES))
    def test_packed_spans_with_prefixes_and_padding(self, rng, shape):
        self.check(rng, [5, 1, 0, 33, 17, 1], [0, 12, 9, 16, 3, 40], shape, pad_q=20)

    def test_one_token_spans(self, rng):
        self.check(rng, [1, 1, 1, 1], [0, 31, 1, 16])

    def test_unused_rows_after_each_sequences_keys(self, rng):
        self.check(rng, [5, 1, 0, 33], [0, 12, 9, 16], "kimi-like", gaps=[11, 0, 7, 3])

    def test_no_padding_rows(self, rng):
        self.check(rng, [16, 32], [16, 0], pad_q=0, pad_k=0)

    def test_new_lengths_do_not_retrace(self, rng):
        traces = []

        @jax.jit
        def attend(inputs):
            traces.append(1)
            return self.run(inputs)

        for lens, prefixes in (([10, 20], [3, 0]), ([29, 1], [0, 2])):
            inputs = make_inputs(rng, lens, prefixes, dtype=self.DTYPE, pad_q=10 + 30 - sum(lens),
                                 pad_k=5 + 33 - sum(lens) - sum(prefixes))
            jax.block_until_ready(attend(inputs))
        assert len(traces) == 1


class TestReference(AttentionCases):
    IMPLEMENTATION = "reference"


class BatchInvariance:
    """The kernel's promise (module docstring of pallas_kernels.attention): a sequence
    whose region starts at a multiple of INVARIANT_KEY_ALIGN gets the same bits alone as
    after another sequence, sharing query blocks with it."""

    def test_rows_do_not_depend_on_the_rest_of_the_batch(self, rng):
        alone = make_inputs(rng, [40], [70], gaps=[0], dtype=self.DTYPE, pad_q=0, pad_k=0)
        other = make_inputs(rng, [23], [50], gaps=[INVARIANT_KEY_ALIGN - 73], dtype=self.DTYPE,
                            pad_q=0, pad_k=0)
        packed = {name: jnp.concatenate([other[name], alone[name]])
                  for name in ("q", "k", "v", "seqused_k")}
        packed.update(cu_seqlens_q=jnp.array([0, 23, 63], jnp.int32),
                      cu_seqlens_k=jnp.array([0, INVARIANT_KEY_ALIGN, INVARIANT_KEY_ALIGN + 110],
                                             jnp.int32))
        out, lse = self.run(alone)
        packed_out, packed_lse = self.run(packed)
        np.testing.assert_array_equal(np.asarray(packed_out[23:], np.float32),
                                      np.asarray(out, np.float32))
        np.testing.assert_array_equal(packed_lse[23:], lse)


class TestPallasInterpret(AttentionCases, BatchInvariance):
    """Small blocks so the cases cross several query and key blocks."""

    IMPLEMENTATION = "pallas"
    CONFIG = FlashConfig(block_q=16, block_k=16)


class GpuCases(AttentionCases):
    """The shared cases in bf16 on a GPU, plus the presets' head dims."""

    DTYPE = jnp.bfloat16
    TOLERANCE = 2e-2

    @pytest.mark.parametrize("head_qk, head_v", [(192, 128), (256, 256)])
    def test_real_head_dims(self, rng, head_qk, head_v):
        self.check(rng, [300, 1, 700, 129], [0, 512, 1000, 7], (head_qk, head_v), heads=4)


@pytest.mark.gpu
class TestPallasGpu(GpuCases, BatchInvariance):
    IMPLEMENTATION = "pallas"


@pytest.mark.gpu
class TestCudnnGpu(GpuCases):
    IMPLEMENTATION = "cudnn"


def test_every_key_block_divides_the_invariant_alignment():
    for table in TUNING.values():
        for config in table.values():
            assert INVARIANT_KEY_ALIGN % config.block_k == 0, config


def test_key_ranges_match_the_contract():
    cu_q = jnp.array([0, 2, 2, 5], jnp.int32)
    cu_k = jnp.array([0, 4, 7, 10], jnp.int32)  # prefixes 2, 3 (no queries), 0
    start, end = key_ranges(cu_q, cu_k, 7, 12)
    np.testing.assert_array_equal(start, [0, 0, 7, 7, 7, 0, 0])
    np.testing.assert_array_equal(end, [3, 4, 8, 9, 10, 0, 0])


def test_schedule_visits_every_visible_pair_and_skips_the_rest(rng):
    """Random packed batches: [lo, hi) covers every row's range, unmasked blocks are whole
    for every row of their query block, and a batch of spans aligned to the blocks visits
    the blocks its sequences need, not the rectangle."""
    block_q = block_k = 16
    num_q, num_k = 320, 640  # fixed shapes: one compile for every random batch
    ranges = jax.jit(key_ranges, static_argnums=(2, 3))
    schedule_of = jax.jit(lambda s, e: block_schedule(s, e, block_q=block_q, block_k=block_k))
    for _ in range(50):
        lens = rng.integers(0, 60, size=5)
        prefixes = rng.integers(0, 60, size=5)
        lens[rng.integers(5):] = 0  # 1 to 5 real sequences
        cu_q = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
        cu_k = jnp.asarray(np.concatenate([[0], np.cumsum(lens + prefixes)]), jnp.int32)
        start, end = ranges(cu_q, cu_k, num_q, num_k)
        start, end = np.asarray(start)[:, None], np.asarray(end)[:, None]
        schedule = np.asarray(schedule_of(start, end))
        for qb, (lo, a, b, hi) in enumerate(schedule):
            assert lo <= a <= b <= hi
            rows = slice(qb * block_q, (qb + 1) * block_q)
            s, e = start[rows, 0], end[rows, 0]
            has = e > s
            if has.any():
                assert lo * block_k <= s[has].min() and hi * block_k >= e[has].max()
            assert b == a or (has.all() and a * block_k >= s.max() and b * block_k <= e.min())
    lens = [64] * 8  # 8 spans of 4 blocks each: 8 x (1 + 2 + 3 + 4) key blocks
    inputs = make_inputs(rng, lens, [0] * 8, heads=1, head_qk=16, head_v=16, pad_q=0)
    start, end = key_ranges(inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], 512, 517)
    schedule = np.asarray(block_schedule(start[:, None], end[:, None], block_q=block_q,
                                         block_k=block_k))
    assert (schedule[:, 3] - schedule[:, 0]).sum() == 8 * 10
    assert (schedule[:, 2] - schedule[:, 1]).sum() == 8 * 6  # the diagonal blocks masked


def test_head_pieces():
    assert head_pieces(192) == ((0, 128), (128, 64))
    assert head_pieces(256) == ((0, 256),)
    assert head_pieces(48) == ((0, 32), (32, 16))
    with pytest.raises(ValueError, match="head dim 40"):
        head_pieces(40)


@pytest.mark.parametrize(
    "cu_q, cu_k, used, match",
    [([0, 3, 2], [0, 3, 5], None, "cu_seqlens_q"),
     ([0, 3, 5], [0, 2, 9], None, "sequence 0 has 3"),
     ([0, 3, 5], [0, 4, 30], None, "cu_seqlens_k"),
     ([0, 3, 5], [0, 4, 9], [4, 6], r"seqused_k\[1\]=6"),
     ([0, 3, 5], [0, 4, 9], [2, 5], "sequence 0 has 3 queries but only 2")],
)
def test_metadata_validation_names_the_bad_value(cu_q, cu_k, used, match):
    with pytest.raises(ValueError, match=match):
        validate_attention_metadata(np.array(cu_q), np.array(cu_k), 8, 20,
                                    None if used is None else np.array(used))


def test_shape_and_implementation_errors(rng):
    inputs = make_inputs(rng, [4], [2])
    with pytest.raises(ValueError, match="implementation"):
        prefill_attention(**inputs, implementation="flash")
    inputs["v"] = inputs["v"][:-1]
    with pytest.raises(ValueError, match="same S"):
        prefill_attention(**inputs)


def test_cudnn_path_lowers_for_cuda_on_any_host(monkeypatch):
    """The cuDNN path traced and lowered for CUDA here (the backend's device checks faked
    as an H200 with cuDNN 9.10): one causal call over the spans' own tokens and one
    padding-masked call over their prefixes, at kimi's head dims (v padded to 192)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    from pallas_kernels.attention_cudnn import attention_cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: False)
    shape = jax.ShapeDtypeStruct
    args = (shape((100, 4, 192), jnp.bfloat16), shape((300, 4, 192), jnp.bfloat16),
            shape((300, 4, 128), jnp.bfloat16), shape((5,), jnp.int32),
            shape((5,), jnp.int32))
    traced = jax.jit(lambda *a: attention_cudnn(*a, scale=0.1)).trace(*args)
    out, lse = traced.out_info
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((100, 4, 128), jnp.bfloat16,
                                                           (100, 4), jnp.float32)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__cudnn$fmhaSoftmax") == 2
    assert "PADDING_CAUSAL" in text and "\\22PADDING\\22" in text


def test_default_implementation_by_device_batch_and_dtype():
    class Gpu:  # what default_implementation reads of a jax.Device
        platform = "gpu"

        def __init__(self, capability):
            self.compute_capability = capability

    h200, gb10 = Gpu("9.0"), Gpu("12.1")
    assert default_implementation(h200, num_sequences=1) == "cudnn"
    assert default_implementation(h200, num_sequences=8) == "pallas"
    assert default_implementation(h200, num_sequences=1, dtype=jnp.float32) == "pallas"
    assert default_implementation(gb10, num_sequences=1) == "pallas"
    assert default_implementation(jax.devices("cpu")[0], num_sequences=1) == "reference"
