"""The Pallas KDA checkpointing scan against the fp64 recurrence and the chunked oracle.

`KdaKernelCases` holds the cases; `TestKdaKernelGpu` compiles them for the GPU (marker
`gpu`) and `TestKdaKernelInterpret` runs the same cases in Pallas interpret mode on the CPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda_chunked_reference, kda_prefill, kda_recurrent_reference
from pallas_kernels.kda_chunks import chunk_slots
from pallas_kernels.kda_pallas import kda_prefill_pallas
from pallas_kernels.tuning import KernelConfig, device_spec, select_config

OUTPUT_NAMES = ("o", "final_states", "snapshots")


# Compiling the kernel dominates a case on the CPU (~10 s in interpret mode; running it
# takes ~1 s), and it compiles once per shape: lengths and offsets are runtime values, the
# number of rows and of sequences are not. So cases pad to few shapes, as the engine pads
# its steps: rows to a multiple of 512 plus 5 (never whole chunks), packed batches to
# PACKED_SEQS sequences with empty ones after theirs (themselves a case the kernel must
# pass: no rows, the initial state out, no snapshots).
PACKED_SEQS = 5


def bucket_rows(rows: int) -> int:
    """The rows of a batch of at least `rows`, padded to a bucket (see PACKED_SEQS)."""
    return -(-(rows - 5) // 512) * 512 + 5


def make_inputs(
    rng,
    lens,
    *,
    heads=2,
    head_k=32,
    head_v=32,
    padding=5,
    capacity=4,
    min_decay=-5.0,
    dtype=jnp.float32,
    offsets=None,
):
    """A packed batch: sequences of `lens` tokens, at least `padding` spare rows after them
    (`bucket_rows`); more than one sequence: empty ones after them up to PACKED_SEQS."""
    if len(lens) > 1:
        extra = max(PACKED_SEQS - len(lens), 0)
        lens = [*lens, *[0] * extra]
        if offsets is not None:
            offsets = [*offsets, *[[-1] * capacity] * extra]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    num_tokens = bucket_rows(int(cu[-1]) + padding)

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    arrays = dict(
        q=unit((num_tokens, heads, head_k)),
        k=unit((num_tokens, heads, head_k)),
        v=rng.standard_normal((num_tokens, heads, head_v)),
        g=rng.uniform(min_decay, 0.0, (num_tokens, heads, head_k)),
        beta=rng.uniform(0.02, 0.98, (num_tokens, heads)),
    )
    arrays = {name: jnp.asarray(x, dtype) for name, x in arrays.items()}
    if offsets is None:
        offsets = awkward_offsets(rng, lens, capacity)
    return dict(
        **arrays,
        cu_seqlens=jnp.asarray(cu),
        initial_states=jnp.asarray(
            0.5 * rng.standard_normal((len(lens), heads, head_k, head_v)), jnp.float32
        ),
        checkpoint_offsets=jnp.asarray(np.asarray(offsets, np.int32)),
    )


def awkward_offsets(rng, lens, capacity):
    """Per sequence: 1, the length, chunk boundaries and one either side, repeats, -1."""
    rows = []
    for length in lens:
        if length == 0:
            rows.append([-1] * capacity)
            continue
        picks = {1, length}
        for boundary in (64, 128, 192):
            picks.update(p for p in (boundary - 1, boundary, boundary + 1) if 1 <= p <= length)
        picks = sorted(picks)
        row = list(rng.choice(picks, size=capacity, replace=True))
        if capacity > 1:
            row[rng.integers(capacity)] = -1
        rows.append(row)
    return rows


def boundary_offsets(length, segments, capacity=4, chunk=64):
    """Offset rows that put snapshots on both sides of every segment boundary of a
    sequence of `length` tokens (segments of ceil(chunks / segments) chunks; see
    `kda_segments.segment_chunks`), plus 1 and the length: as many rows as it takes."""
    chunks = -(-length // chunk)
    span = max(-(-chunks // segments), 1) * chunk
    picks = {1, length}
    for boundary in range(span, length, span):
        picks.update((boundary - 1, boundary, boundary + 1))
    picks = sorted(p for p in picks if 1 <= p <= length)
    picks += [-1] * (-len(picks) % capacity)
    return [picks[i:i + capacity] for i in range(0, len(picks), capacity)]


def segment_batch(rng, lens, segments, **kwargs):
    """`make_inputs` with each sequence repeated until its boundary offsets are covered."""
    rows, all_lens = [], []
    for length in lens:
        for row in boundary_offsets(length, segments) if length else [[-1] * 4]:
            rows.append(row)
            all_lens.append(length)
    return make_inputs(rng, all_lens, offsets=rows, **kwargs)


def relative_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)


def assert_outputs_close(outputs, expected, tolerance=1e-6):
    """Each of o, final states and snapshots within `tolerance` (relative) of another
    config's: the same products, summed or rounded in another order."""
    for name, a, b in zip(OUTPUT_NAMES, outputs, expected, strict=True):
        assert relative_error(a, b) < tolerance, name


def assert_outputs_equal(outputs, expected):
    """o, final states and snapshots bit for bit equal to another config's (a change of
    when loads are issued, not of what is computed)."""
    for name, a, b in zip(OUTPUT_NAMES, outputs, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


class KdaKernelCases:
    """Shared cases; subclasses set INTERPRET."""

    INTERPRET: bool

    def run_kernel(self, inputs, **kwargs):
        return kda_prefill(**inputs, backend="pallas", interpret=self.INTERPRET, **kwargs)

    def check_against_recurrence(self, inputs, tolerance, **kwargs):
        outputs = self.run_kernel(inputs, **kwargs)
        oracle = kda_recurrent_reference(
            *(
                np.asarray(inputs[n], np.float64) if inputs[n].dtype == jnp.bfloat16 else inputs[n]
                for n in ("q", "k", "v", "g", "beta")
            ),
            inputs["cu_seqlens"],
            inputs["initial_states"],
            inputs["checkpoint_offsets"],
        )
        for name, out, ref in zip(OUTPUT_NAMES, outputs, oracle, strict=True):
            out = np.asarray(out, np.float64)
            assert np.isfinite(out).all(), f"{name} has inf or NaN"
            err = relative_error(out, ref)
            assert err < tolerance, f"{name}: relative error {err:.2e} >= {tolerance:.0e}"
        return outputs

    @pytest.mark.parametrize("lens", [[1], [63], [64], [65], [200], [500]])
    def test_single_sequence_lengths(self, rng, lens):
        self.check_against_recurrence(make_inputs(rng, lens), 1e-5)

    @pytest.mark.parametrize("lens", [[1, 63, 64], [65, 0, 200, 3, 129], [0, 130]])
    def test_packed_sequences_with_padding(self, rng, lens):
        inputs = make_inputs(rng, lens, padding=70)
        o, _, _ = self.check_against_recurrence(inputs, 1e-5)
        end = int(inputs["cu_seqlens"][-1])
        assert not np.asarray(o[end:]).any(), "padding rows must be zero"

    @pytest.mark.parametrize("capacity", [1, 2, 4])
    def test_capacities(self, rng, capacity):
        self.check_against_recurrence(make_inputs(rng, [150, 77], capacity=capacity), 1e-5)

    def test_repeated_and_inactive_offsets(self, rng):
        offsets = [[64, 64, -1, 130], [-1, -1, -1, -1], [1, 1, 1, 1]]
        inputs = make_inputs(rng, [130, 20, 5], offsets=offsets)
        _, _, snapshots = self.check_against_recurrence(inputs, 1e-5)
        snapshots = np.asarray(snapshots)
        np.testing.assert_array_equal(snapshots[0, 0], snapshots[0, 1])
        assert not snapshots[0, 2].any() and not snapshots[1].any()

    def test_several_snapshots_in_one_chunk(self, rng):
        """Every slot's offset inside the same chunk, out of order (the scan stores them in
        one branch of that chunk, a loop over the slots), and a chunk holding none."""
        offsets = [[40, 5, 64, 1], [70, 127, 100, 65]]
        inputs = make_inputs(rng, [100, 130], offsets=offsets)
        _, _, snapshots = self.check_against_recurrence(inputs, 1e-5)
        for n in range(2):  # each slot its own state, not another slot's
            assert len({np.asarray(snapshots)[n, c].tobytes() for c in range(4)}) == 4

    def test_strong_decay_stays_finite(self, rng):
        inputs = make_inputs(rng, [300], min_decay=-5.0)
        inputs["g"] = jnp.full_like(inputs["g"], -5.0)
        self.check_against_recurrence(inputs, 1e-5)

    def test_matches_chunked_oracle(self, rng):
        """In the first packed case's shape: one compile for both (K = V = 64:
        `test_bf16_inputs`; two value blocks: `test_scan_prefetch`)."""
        inputs = make_inputs(rng, [190, 1, 66])
        outputs = self.run_kernel(inputs)
        oracle = kda_chunked_reference(**inputs)
        for name, out, ref in zip(OUTPUT_NAMES, outputs, oracle, strict=True):
            assert relative_error(out, ref) < 1e-5, name

    @pytest.mark.parametrize("dtype", ["fp32", "bf16"])
    def test_any_decay_wide_spreads_by_keys(self, rng, dtype):
        """Any decay beyond the products' range: decays to -60 a token in one head of the
        first sequence, so most of its sub-chunks are summed key by key; a -60 on the
        first row of some sub-chunks (no pair of its own block decays by it: the
        products keep it) and on other rows or in one column (that sub-chunk goes key by
        key), over 16-column key slices."""
        dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
        inputs = make_inputs(rng, [150, 1, 64, 33], padding=7, min_decay=-0.3, dtype=dtype)
        g = np.array(inputs["g"], np.float32)
        g[:60, 0] *= 200.0                     # head 0 of the first sequence: down to -60
        g[16::32, 1, :16] = -60.0              # first rows of every other sub-chunk
        g[90:95, 1, 16:] = -60.0               # inside a sub-chunk: it goes by keys
        g[230:240, :, 5] = -45.0               # one column: those sub-chunks by keys
        inputs["g"] = jnp.asarray(g, dtype)
        config = KernelConfig(block_v=32, inverse_block_k=16)
        tolerance = 1e-5 if dtype == jnp.float32 else 5e-3
        self.check_against_recurrence(inputs, tolerance, config=config)

    def test_any_decay_at_the_products_range(self, rng):
        """Decays around -5.25 a token (8 rows: the products' limit of 42): on both sides
        of the check, every slice; exact within fp32 either way."""
        inputs = make_inputs(rng, [200, 77], padding=3)
        inputs["g"] = jnp.asarray(rng.uniform(-5.4, -5.1, inputs["g"].shape), jnp.float32)
        self.check_against_recurrence(inputs, 1e-5)

    def test_key_slices_narrower_than_k(self, rng):
        """The inverse and prep kernels over several key slices (16 of K = 32 columns),
        decays at the bound (the bounded path: the inverse kernel slices only there; the
        prep kernel is the same on both paths)."""
        config = KernelConfig(block_v=32, prep_block_k=16, inverse_block_k=16)
        inputs = make_inputs(rng, [1, 150, 64], padding=7, min_decay=-5.0)
        inputs["g"] = inputs["g"].at[150:].set(-5.0)
        self.check_against_recurrence(inputs, 1e-5, config=config, gate_lower_bound=-5.0)

    @pytest.mark.extended  # on the CPU `make test-extended` (~15 s of CI's cores): the
    # bounded path in bf16 runs in `test_bounded_gate_path` and the `gpu` cases
    def test_key_slices_narrower_than_k_bf16(self, rng):
        config = KernelConfig(block_v=32, prep_block_k=16, inverse_block_k=16)
        inputs = make_inputs(rng, [97, 31], dtype=jnp.bfloat16)
        self.check_against_recurrence(inputs, 5e-3, config=config, gate_lower_bound=-5.0)

    @pytest.mark.extended  # on the CPU `make test-extended`: no config picks 32-row chunks
    def test_chunk_size_32(self, rng):
        self.check_against_recurrence(make_inputs(rng, [100, 33]), 1e-5, chunk_size=32)

    def test_bf16_inputs(self, rng):
        inputs = make_inputs(rng, [257, 64, 31], head_k=64, head_v=64, dtype=jnp.bfloat16)
        o, _, _ = self.check_against_recurrence(inputs, 5e-3)
        assert o.dtype == jnp.bfloat16

    def test_resuming_from_a_chunk_end_snapshot_is_bit_exact(self, rng):
        """A snapshot at a chunk's last row (a sequence's end included) is the state the
        pass carries on with: a span resumed from it (a prefix hit) gives the cold pass's
        outputs, snapshots and final state bit for bit, in bf16 (where a snapshot formed
        apart rounds otherwise). `test_bf16_inputs`' shape: no compile of its own."""
        offsets = [[100, 128, 192, -1], [64, -1, -1, -1], [31, 1, -1, -1]]
        cold = make_inputs(rng, [257, 64, 31], head_k=64, head_v=64, dtype=jnp.bfloat16,
                           offsets=offsets)
        o, final, snapshots = self.check_against_recurrence(cold, 5e-3)
        for n in (1, 2):  # offsets at the sequence's end
            np.testing.assert_array_equal(np.asarray(snapshots[n, 0]), np.asarray(final[n]))
        # sequence 0 again from its snapshot at 128, alone in a batch of the same shape
        cut, rows = 128, 257 - 128
        resumed = {name: jnp.zeros_like(x).at[:rows].set(x[cut:cut + rows])
                   for name, x in cold.items() if name in ("q", "k", "v", "g", "beta")}
        o_resumed, final_resumed, snapshots_resumed = self.run_kernel(dict(
            resumed, cu_seqlens=jnp.asarray([0] + [rows] * PACKED_SEQS, jnp.int32),
            initial_states=jnp.zeros_like(cold["initial_states"]).at[0].set(snapshots[0, 1]),
            checkpoint_offsets=jnp.full_like(cold["checkpoint_offsets"], -1).at[0, 0].set(
                192 - cut)))
        np.testing.assert_array_equal(np.asarray(o_resumed[:rows]), np.asarray(o[cut:257]))
        np.testing.assert_array_equal(np.asarray(final_resumed[0]), np.asarray(final[0]))
        np.testing.assert_array_equal(np.asarray(snapshots_resumed[0, 0]),
                                      np.asarray(snapshots[0, 2]))

    @pytest.mark.parametrize("lens", [[1, 63, 64], [65, 0, 200, 3, 129], [300, 1]])
    def test_bounded_gate_path(self, rng, lens):
        """gate_lower_bound=-5: diagonal blocks on the tensor cores, decays at the bound
        (every one of them in the last case); bf16 too on the five-sequence case (others
        have bf16 on this path: `test_key_slices_narrower_than_k`, `test_pipelined_loads`);
        one compiled shape (`PACKED_SEQS`)."""
        inputs = make_inputs(rng, lens, padding=20, min_decay=-5.0)
        if lens == [300, 1]:
            inputs["g"] = jnp.full_like(inputs["g"], -5.0)
        self.check_against_recurrence(inputs, 1e-5, gate_lower_bound=-5.0)
        if len(lens) > 3:
            inputs = make_inputs(rng, lens, dtype=jnp.bfloat16)
            self.check_against_recurrence(inputs, 5e-3, gate_lower_bound=-5.0)

    @pytest.mark.parametrize(("segments", "lens", "bound"), [
        (3, [581, 0, 1, 130], None),     # 10 chunks: 4 + 4 + 2; 130: fewer chunks than segments
        (4, [700, 65, 64], -5.0),        # 11 chunks: 3 + 3 + 3 + 2; 65: an empty last segment
        # two segments, both sequences split: `make test-extended` (~15 s of CI's cores)
        pytest.param(2, [129, 200], -5.0, marks=pytest.mark.extended),
    ])
    def test_segment_parallel_scan(self, rng, segments, lens, bound):
        """Segments forced: snapshots either side of every segment boundary, initial
        states, packed sequences of awkward lengths, both gate paths. Decays are weak, so
        each segment's entry state matters (at -5 per token it is forgotten in a chunk)."""
        config = KernelConfig(block_v=32, scan_segments=segments)
        inputs = segment_batch(rng, lens, segments, heads=1, head_k=32, head_v=32, padding=9,
                               min_decay=-0.02)
        o, _, _ = self.check_against_recurrence(inputs, 1e-5, config=config,
                                                gate_lower_bound=bound)
        end = int(inputs["cu_seqlens"][-1])
        assert not np.asarray(o[end:]).any(), "padding rows must be zero"

    def test_segment_parallel_scan_bf16(self, rng):
        inputs = segment_batch(rng, [650, 3], 3, heads=1, head_k=32, head_v=32, dtype=jnp.bfloat16,
                               min_decay=-0.02)
        # GLM's bounded gate (TP4's few heads); the any-decay path's segments are checked
        # in fp32 above.
        o, _, _ = self.check_against_recurrence(
            inputs, 5e-3, config=KernelConfig(block_v=32, scan_segments=3),
            gate_lower_bound=-5.0)
        assert o.dtype == jnp.bfloat16

    # The runtime's pick fuses the output (every case on the default config runs it, bf16,
    # both gate paths and two value blocks among them); this case sets it against the
    # output pass on the segment-parallel scan, in the first segment case's shape and
    # config (which compiles the output pass's side).
    @pytest.mark.parametrize(("segments", "lens", "bound", "dtype"), [
        (3, [581, 0, 1, 130], None, "fp32"),
    ])
    def test_output_fused_into_the_scan(self, rng, segments, lens, bound, dtype):
        """`fuse_output`: the scan writes O chunk by chunk (no entry states, no Vnew
        stored); the same tolerances as the three passes, padding rows zero, and O close
        to the output pass's from the same inputs."""
        dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
        make = functools.partial(segment_batch, rng, lens, segments) if segments > 1 else \
            functools.partial(make_inputs, rng, lens)
        inputs = make(heads=1, head_k=32, head_v=32, padding=9, dtype=dtype, min_decay=-0.02)
        tolerance = 1e-5 if dtype == jnp.float32 else 5e-3
        config = KernelConfig(block_v=32, scan_segments=segments)
        fused = dataclasses.replace(config, fuse_output=True)
        o, final, snapshots = self.check_against_recurrence(inputs, tolerance, config=fused,
                                                            gate_lower_bound=bound)
        end = int(inputs["cu_seqlens"][-1])
        assert not np.asarray(o[end:]).any(), "padding rows must be zero"
        o_passes, final_passes, snapshots_passes = self.run_kernel(
            inputs, config=config, gate_lower_bound=bound)
        assert relative_error(o, o_passes) < tolerance / 10
        np.testing.assert_array_equal(np.asarray(final), np.asarray(final_passes))
        np.testing.assert_array_equal(np.asarray(snapshots), np.asarray(snapshots_passes))

    # The runtime's pick (W / U formed in the scan, the output fused) runs in every case on
    # the default config, the bounded gate and bf16 among them; this case sets it against
    # the W / U pass (on the CPU in `make test-extended`, ~30 s of CI's busy cores: the W / U
    # pass runs in every explicit-config case).
    @pytest.mark.extended
    @pytest.mark.parametrize(("lens", "bound", "dtype", "fuse_output"), [
        ([65, 0, 200, 3, 129], None, "fp32", True),
    ])
    def test_scan_forms_w_u(self, rng, lens, bound, dtype, fuse_output):
        """`form_w_u_in_scan` (the runtime's pick, so every case on the default config
        runs it too): the scan forms each chunk's W and U from T, beta k exp(G), v and
        beta (no W/U pass), with the output fused in or the output pass after; the
        recurrence's tolerances, padding rows zero, and in fp32 the W/U pass's results to
        within fp32 rounding (the same products, summed in another order)."""
        dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
        inputs = make_inputs(rng, lens, heads=2, head_k=32, head_v=64, padding=70, dtype=dtype,
                             min_decay=-0.5)
        tolerance = 1e-5 if dtype == jnp.float32 else 5e-3
        config = KernelConfig(block_v=32, fuse_output=fuse_output)
        formed = dataclasses.replace(config, form_w_u_in_scan=True)
        assert formed.scan_forms_w_u
        outputs = self.check_against_recurrence(inputs, tolerance, config=formed,
                                                gate_lower_bound=bound)
        end = int(inputs["cu_seqlens"][-1])
        assert not np.asarray(outputs[0][end:]).any(), "padding rows must be zero"
        if dtype == jnp.float32:
            passes = self.run_kernel(inputs, config=config, gate_lower_bound=bound)
            assert_outputs_close(outputs, passes)

    # The runtime's pick on sm_90 (so on the default config here) prefetches; this case
    # sets it against the loads issued in each chunk, on both scans (the segment scan's
    # side without prefetch is `test_output_fused_into_the_scan`'s: one compile fewer).
    @pytest.mark.parametrize(("segments", "lens", "shape", "bound"), [
        # W / U formed in the scan: beta v carried too, for each of two value blocks (on the
        # CPU in `make test-extended`, ~30 s of CI's cores: every default-config case runs
        # the prefetch, which the runtime picks on sm_90)
        pytest.param(1, [581, 0, 1, 130], dict(heads=2, head_v=64, min_decay=-0.5), -5.0,
                     marks=pytest.mark.extended),
        # the segment scan (W / U read): no beta v; empty segments
        (3, [581, 0, 1, 130], dict(heads=1, head_v=32, min_decay=-0.02), None),
    ], ids=["plain-scan", "segment-scan"])
    def test_scan_prefetch(self, rng, segments, lens, shape, bound):
        """`scan_prefetch`: G_last's row and beta v loaded a chunk ahead change when the
        loads are issued, not what is computed: the recurrence's tolerance, and the same
        bits as without them."""
        make = functools.partial(segment_batch, rng, lens, segments) if segments > 1 else \
            functools.partial(make_inputs, rng, lens)
        inputs = make(head_k=32, padding=9, **shape)
        config = KernelConfig(block_v=32, scan_segments=segments, fuse_output=True,
                              form_w_u_in_scan=segments == 1)
        ahead = dataclasses.replace(config, scan_prefetch=True)
        outputs = self.check_against_recurrence(inputs, 1e-5, config=ahead,
                                                gate_lower_bound=bound)
        plain = self.run_kernel(inputs, config=config, gate_lower_bound=bound)
        assert_outputs_equal(outputs, plain)

    def test_new_lengths_and_offsets_do_not_retrace(self, rng):
        """Three batches of one shape, other lengths and offsets: one compiled kernel (none
        new where an earlier case compiled this shape)."""
        cache_before = kda_prefill_pallas._cache_size()
        for lens, padding in (([100, 60], 40), ([30, 170], 0), ([1, 199], 0)):
            inputs = make_inputs(rng, lens, padding=padding)
            jax.block_until_ready(kda_prefill(**inputs, backend="pallas",
                                              interpret=self.INTERPRET))
        assert kda_prefill_pallas._cache_size() <= cache_before + 1


@pytest.mark.gpu
class TestKdaKernelGpu(KdaKernelCases):
    INTERPRET = False

    def test_real_head_dims_bf16(self, rng):
        inputs = make_inputs(
            rng, [3000, 1000, 95], heads=4, head_k=128, head_v=128, dtype=jnp.bfloat16
        )
        self.check_against_recurrence(inputs, 5e-3)
        self.check_against_recurrence(inputs, 5e-3, gate_lower_bound=-5.0)

    def test_runtime_picks_segment_parallel_scan(self, rng):
        """One long sequence, few heads: the default config splits the scan (checked here
        against the rule), and the result holds at the real head dims."""
        config = select_config(device_spec(), num_seqs=1, num_heads=4, head_k=128,
                               head_v=128, num_tokens=bucket_rows(8192))
        assert config.scan_segments > 1
        offsets = boundary_offsets(8192, config.scan_segments)[:1]
        inputs = make_inputs(rng, [8192], heads=4, head_k=128, head_v=128, padding=0,
                             dtype=jnp.bfloat16, min_decay=-0.02, offsets=offsets)
        self.check_against_recurrence(inputs, 5e-3, gate_lower_bound=-5.0)

    @pytest.mark.parametrize(("bound", "segments"), [(-5.0, 1), (None, 1), (-5.0, 3)])
    def test_pipelined_loads(self, rng, bound, segments):
        """`prep_num_stages` / `inverse_num_stages` 2, and with segments
        `segment_num_stages` 2: Triton's pipeliner stages the loops' loads an iteration
        ahead (cp.async; interpret mode has no pipeliner, so this case is GPU only). Four
        key slices a prep program; the recurrence's tolerance, and the same bits as one
        stage."""
        make = functools.partial(segment_batch, rng, [330, 0, 1, 130], segments) \
            if segments > 1 else functools.partial(make_inputs, rng, [1, 150, 64])
        inputs = make(heads=2, head_k=64, head_v=64, padding=7, dtype=jnp.bfloat16,
                      min_decay=-5.0)
        config = KernelConfig(block_v=32, prep_block_k=16, inverse_block_k=16,
                              scan_segments=segments)
        staged = dataclasses.replace(config, prep_num_stages=2, inverse_num_stages=2,
                                     segment_num_stages=2)
        outputs = self.check_against_recurrence(inputs, 5e-3, config=staged,
                                                gate_lower_bound=bound)
        plain = self.run_kernel(inputs, config=config, gate_lower_bound=bound)
        assert_outputs_equal(outputs, plain)


class TestKdaKernelInterpret(KdaKernelCases):
    INTERPRET = True


@pytest.mark.parametrize("bound", [-5.5, 0.0, 1.0])
def test_gate_lower_bound_out_of_range(rng, bound):
    inputs = make_inputs(rng, [10])
    with pytest.raises(ValueError, match=f"gate_lower_bound.*{bound}"):
        kda_prefill(**inputs, gate_lower_bound=bound)


def test_config_rejects_mismatched_blocks(rng):
    inputs = make_inputs(rng, [10], head_k=32, head_v=32)
    with pytest.raises(ValueError, match="value block"):
        kda_prefill(**inputs, config=KernelConfig(block_v=64))
    with pytest.raises(ValueError, match="K=32 .* prep_block_k=24"):  # 8 columns lost
        kda_prefill(**inputs, config=KernelConfig(block_v=32, prep_block_k=24))
    with pytest.raises(ValueError, match="K=32 .* inverse_block_k=24"):
        kda_prefill(**inputs, config=KernelConfig(block_v=32, inverse_block_k=24))


@pytest.mark.parametrize("segments", [0, 17])
def test_config_rejects_segment_counts(rng, segments):
    inputs = make_inputs(rng, [10])
    with pytest.raises(ValueError, match=f"scan_segments.*got {segments}"):
        kda_prefill(**inputs, config=KernelConfig(block_v=32, scan_segments=segments))


def test_chunk_slots_mark_the_slots_holding_a_snapshot():
    """The prep pass stores G only in these slots, the only ones the scan reads it in:
    offsets on chunk edges, at a sequence's end, and inactive ones (0, -1, past the end)."""
    cu = jnp.array([0, 100, 164, 300], jnp.int32)  # lengths 100, 64, 136: slots 0-1, 2, 3-5
    offsets = jnp.array([[1, 64, 65, 0], [64, -1, 200, 0], [136, 1, 0, 0]], jnp.int32)
    slots = chunk_slots(cu, 300, 64, offsets)
    np.testing.assert_array_equal(slots.snapshot, [1, 1, 1, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(chunk_slots(cu, 300, 64).snapshot, [1] * 8)


def test_segments_keep_the_w_u_pass():
    """With scan segments the transitions read W and U: the scan does not form them."""
    assert not KernelConfig(form_w_u_in_scan=True, scan_segments=3).scan_forms_w_u
    assert KernelConfig(form_w_u_in_scan=True).scan_forms_w_u
