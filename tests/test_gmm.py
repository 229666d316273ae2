"""The grouped GEMM (`pallas_kernels.gmm`) and the routed experts built on it
(`pallas_kernels.moe_experts`) against float64 NumPy oracles.

`GmmCases` holds the cases; `TestGmmInterpret` runs them in Pallas interpret mode on the
CPU with small tiles (so tiles span groups and groups span tiles), `TestGmmGpu` compiles
them for the GPU with the device's tiling (marker `gpu`) and adds the real shapes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.config import ModelConfig
from pallas_kernels import moe_experts
from pallas_kernels.gmm import grouped_matmul, pallas_config
from pallas_kernels.gmm_pallas import (
    Epilogue,
    gmm_pallas,
    issued_rows,
    num_work_items,
    work_schedule,
)
from pallas_kernels.gmm_tuning import GmmConfig, estimate_shared_memory, select_gmm_config
from pallas_kernels.moe_shapes import MOE_SHAPES
from pallas_kernels.tuning import GB10, H200

# name -> (rows M, group sizes or (E, rows routed) for a random routing)
CASES = {
    "empty-groups": (70, [10, 0, 33, 0, 12]),  # 15 padding rows
    "one-expert": (48, [0, 0, 48, 0]),
    "off-tile": (80, [17, 5, 40, 18]),
    "e1": (33, [33]),
    "e16": (96, (16, 96)),
    "e256": (64, (256, 60)),  # 4 padding rows
    "e288": (72, (288, 72)),
}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
PLAIN = Epilogue()


def group_sizes_for(rng, spec):
    if isinstance(spec, tuple):
        experts, routed = spec
        return np.bincount(rng.integers(0, experts, routed), minlength=experts).astype(np.int32)
    return np.asarray(spec, np.int32)


def gmm_oracle(lhs, rhs, sizes):
    """float64 per-group loop; rows past sum(sizes) are zero."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for group, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size] @ rhs[group]
        start += size
    return out


def swiglu_oracle(gate, up, limit):
    if limit is not None:
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return gate / (1 + np.exp(-gate)) * up


def assert_close(actual, expected, dtype):
    actual = np.asarray(actual, np.float64)
    if dtype == jnp.float32:
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-4)
    else:  # bf16 output: one rounding of each element, relative to the output's scale
        np.testing.assert_allclose(actual, expected, rtol=2e-2,
                                   atol=2e-2 * np.abs(expected).max())


class GmmCases:
    INTERPRET: bool
    CONFIG: GmmConfig | None  # None: the device's tiling
    K, N = 32, 64

    def random(self, rng, shape, dtype):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    def pallas(self, lhs, rhs, sizes, epilogue=PLAIN, half_tiles=True, **extras):
        rows = extras["row_tokens"].shape[0] if epilogue.gather else lhs.shape[0]
        config = pallas_config(rows, rhs[0], num_rhs=len(rhs), config=self.CONFIG)
        config = dataclasses.replace(config, half_tiles=half_tiles)
        return gmm_pallas(lhs, tuple(rhs), jnp.asarray(sizes), config=config,
                          epilogue=epilogue, interpret=self.INTERPRET, **extras)

    @pytest.mark.parametrize("dtype", sorted(DTYPES))
    @pytest.mark.parametrize("case", sorted(CASES))
    def test_grouped_matmul(self, rng, case, dtype):
        rows, spec = CASES[case]
        sizes = group_sizes_for(rng, spec)
        lhs = self.random(rng, (rows, self.K), DTYPES[dtype])
        rhs = self.random(rng, (len(sizes), self.K, self.N), DTYPES[dtype])
        out = self.pallas(lhs, (rhs,), sizes)
        assert out.shape == (rows, self.N) and out.dtype == lhs.dtype
        assert_close(out, gmm_oracle(lhs, rhs, sizes), DTYPES[dtype])

    @pytest.mark.parametrize("case", ["empty-groups", "off-tile"])
    def test_whole_tiles(self, rng, case):
        """`half_tiles=False`: every item runs a block_m tile, short ones masked."""
        rows, spec = CASES[case]
        sizes = group_sizes_for(rng, spec)
        lhs = self.random(rng, (rows, self.K), jnp.float32)
        rhs = self.random(rng, (len(sizes), self.K, self.N), jnp.float32)
        out = self.pallas(lhs, (rhs,), sizes, half_tiles=False)
        assert_close(out, gmm_oracle(lhs, rhs, sizes), jnp.float32)

    @pytest.mark.parametrize("limit", [None, 1.5])
    @pytest.mark.parametrize("case", ["empty-groups", "e16", "e288"])
    def test_gather_swiglu(self, rng, case, limit):
        rows, spec = CASES[case]
        sizes = group_sizes_for(rng, spec)
        tokens = rows // 2 + 1
        row_tokens = rng.integers(0, tokens, rows).astype(np.int32)
        x = self.random(rng, (tokens, self.K), jnp.float32)
        gate, up = (self.random(rng, (len(sizes), self.K, self.N), jnp.float32)
                    for _ in range(2))
        epilogue = Epilogue(gather=True, swiglu=True, limit=limit)
        out = self.pallas(x, (gate, up), sizes, epilogue, row_tokens=jnp.asarray(row_tokens))
        xs = np.asarray(x, np.float64)[row_tokens]
        g, u = gmm_oracle(xs, gate, sizes), gmm_oracle(xs, up, sizes)
        expected = swiglu_oracle(g, u, limit)
        # SwiGLU multiplies the two fp32 dots, so each one's rounding comes out scaled by
        # the other factor (unclamped: up to |gate| ~ 20 here): bound each dot's error by
        # K u sum_k |x_k w_k| (u = 2^-24) and carry it through the derivatives.
        bound = [self.K * 2.0 ** -24 * gmm_oracle(np.abs(xs), np.abs(w), sizes)
                 for w in (gate, up)]
        sig = 1 / (1 + np.exp(-g))
        carried = (np.abs(sig * (1 + g * (1 - sig)) * u) * bound[0]
                   + np.abs(g * sig) * bound[1])
        np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - expected),
                                     carried + 1e-5 * np.abs(expected) + 1e-6)

    @pytest.mark.parametrize("case", ["off-tile", "e256"])
    def test_combine(self, rng, case):
        rows, spec = CASES[case]
        sizes = group_sizes_for(rng, spec)
        lhs = self.random(rng, (rows, self.K), jnp.float32)
        rhs = self.random(rng, (len(sizes), self.K, self.N), jnp.float32)
        scale = rng.uniform(0.1, 2.0, rows).astype(np.float32)
        dest = rng.permutation(rows).astype(np.int32)
        out = self.pallas(lhs, (rhs,), sizes, Epilogue(combine=True),
                          row_scale=jnp.asarray(scale), row_dest=jnp.asarray(dest))
        expected = np.zeros((rows, self.N))
        expected[dest] = gmm_oracle(lhs, rhs, sizes) * scale[:, None]
        assert_close(out, expected, jnp.float32)

    @pytest.mark.parametrize("rows", [1, 5, 16, 40])
    def test_row_schedule(self, rng, rows):
        """Rows in any order, each naming its group (repeats included): one work item each;
        a group id out of range (-1, 6) gives a zero row."""
        groups = rng.integers(0, 6, rows).astype(np.int32)
        groups[-1] = groups[0]  # a group twice, not adjacent
        if rows > 2:
            groups[1], groups[2] = -1, 6
        lhs = self.random(rng, (rows, self.K), jnp.float32)
        rhs = self.random(rng, (6, self.K, self.N), jnp.float32)
        out = self.pallas(lhs, (rhs,), np.zeros(6, np.int32), row_groups=jnp.asarray(groups))
        expected = np.stack([np.asarray(lhs[r], np.float64) @ np.asarray(rhs[g], np.float64)
                             if 0 <= g < 6 else np.zeros(self.N) for r, g in enumerate(groups)])
        assert_close(out, expected, jnp.float32)

    # No fusion and all fusions run in the MoE layer's tests; the per-row schedule (every
    # fusion, at most PER_ROW_COPIES copies) here with 1 and 2 tokens.
    @pytest.mark.parametrize("tokens, top_k, fusions", [
        (23, 3, ("gather",)), (23, 3, ("swiglu",)), (1, 8, moe_experts.FUSIONS),
        (2, 8, moe_experts.FUSIONS)], ids=["gather", "swiglu", "per-row-1", "per-row-2"])
    def test_routed_experts(self, rng, monkeypatch, tokens, top_k, fusions):
        experts, hidden, inter = 16, self.K, self.N
        if tokens * top_k <= moe_experts.PER_ROW_COPIES and fusions == moe_experts.FUSIONS:
            monkeypatch.setattr(moe_experts, "sort_by_expert", None)  # the per-row path
        x = self.random(rng, (tokens, hidden), jnp.float32) * 3
        ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
        weights = jnp.asarray(rng.uniform(0, 1, (tokens, top_k)), jnp.float32)
        w_gate, w_up = (self.random(rng, (experts, hidden, inter), jnp.float32)
                        for _ in range(2))
        w_down = self.random(rng, (experts, inter, hidden), jnp.float32)
        args = (x, weights, jnp.asarray(ids, jnp.int32), w_gate, w_up, w_down)
        out = moe_experts.routed_experts(*args, limit=4.0, implementation="pallas",
                                         fusions=fusions, interpret=self.INTERPRET)
        f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
        expected = np.zeros((tokens, hidden))
        for t in range(tokens):
            for slot, e in enumerate(ids[t]):
                h = swiglu_oracle(f64(x[t]) @ f64(w_gate[e]), f64(x[t]) @ f64(w_up[e]), 4.0)
                expected[t] += f64(weights[t, slot]) * (h @ f64(w_down[e]))
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-3 * np.abs(expected).max())

    def test_one_compile_for_every_routing(self, rng):
        """The routing (group sizes) is data: new routings reuse the compiled kernel."""
        lhs = self.random(rng, (64, self.K), jnp.bfloat16)
        rhs = self.random(rng, (16, self.K, self.N), jnp.bfloat16)

        def call(lhs, rhs, sizes):
            return grouped_matmul(lhs, rhs, sizes, implementation="pallas",
                                  interpret=self.INTERPRET, config=self.CONFIG)

        routings = [[64] + [0] * 15, [0] * 15 + [64], [4] * 16, [0, 0, 30, 1] + [0] * 12]
        # A process's first Pallas call imports JAX modules that add a config value to the
        # tracing context, which retraces everything once: make it before counting.
        call(lhs, rhs, jnp.asarray(routings[0], jnp.int32))
        run = jax.jit(call)
        for sizes in routings:
            sizes = np.asarray(sizes, np.int32)
            assert_close(run(lhs, rhs, jnp.asarray(sizes)), gmm_oracle(lhs, rhs, sizes),
                         jnp.bfloat16)
        assert run._cache_size() == 1


class TestGmmInterpret(GmmCases):
    INTERPRET = True
    CONFIG = GmmConfig(block_m=32, block_n=32, block_k=16, num_warps=4, num_stages=1, swizzle=3)


@pytest.mark.gpu
class TestGmmGpu(GmmCases):
    INTERPRET = False
    CONFIG = None
    K, N = 256, 512

    @pytest.mark.parametrize("fusions", [(), moe_experts.FUSIONS], ids=["plain", "all"])
    @pytest.mark.parametrize("shape", MOE_SHAPES, ids=[s.preset for s in MOE_SHAPES])
    def test_real_shapes(self, rng, shape, fusions):
        """512 tokens at the preset's real widths and expert count against ragged_dot."""
        tokens = 512
        x = self.random(rng, (tokens, shape.hidden), jnp.bfloat16)
        ids = np.argsort(rng.random((tokens, shape.experts)), axis=1)[:, :shape.top_k]
        weights = jnp.asarray(rng.uniform(0, 1, (tokens, shape.top_k)), jnp.float32)
        # Weights drawn on the device: at 288 experts they are 7 GB of bf16.
        keys = jax.random.split(jax.random.key(int(rng.integers(1 << 31))), 3)
        up_shape = (shape.experts, shape.hidden, shape.inter)
        w_gate, w_up = (jax.random.normal(key, up_shape, jnp.bfloat16) * shape.hidden ** -0.5
                        for key in keys[:2])
        w_down = (jax.random.normal(keys[2], (shape.experts, shape.inter, shape.hidden),
                                    jnp.bfloat16) * shape.inter ** -0.5)
        args = (x, weights, jnp.asarray(ids, jnp.int32), w_gate, w_up, w_down)
        out = moe_experts.routed_experts(*args, limit=shape.swiglu_limit,
                                         implementation="pallas", fusions=fusions)
        expected = moe_experts.routed_experts(*args, limit=shape.swiglu_limit,
                                              implementation="ragged_dot")
        error = (np.linalg.norm(np.asarray(out, np.float64) - np.asarray(expected, np.float64))
                 / np.linalg.norm(np.asarray(expected, np.float64)))
        assert error < 2e-2


@pytest.mark.parametrize("sizes", [[0, 0, 0], [5, 0, 200, 3, 0, 1], [128, 128], [1] * 40,
                                   [65, 64, 63, 129]])
@pytest.mark.parametrize("block_m", [16, 64])
def test_schedule_covers_each_row_once(sizes, block_m):
    """Every row lies in exactly one non-empty work item, of the group owning it (the
    padding group E past the sizes' sum); items are tiled from their group's first row, so
    a group of n rows takes cdiv(n, block_m) items; the count stays inside the static
    bound."""
    sizes = np.asarray(sizes, np.int32)
    rows = -(-(int(sizes.sum()) + 7) // block_m) * block_m
    schedule = jax.jit(work_schedule, static_argnames=("rows", "block_m"))
    group, lo, hi = map(np.asarray, schedule(jnp.asarray(sizes), rows=rows, block_m=block_m))
    assert group.shape == (num_work_items(rows, len(sizes), block_m),)
    owners = np.concatenate([sizes, [rows - sizes.sum()]])
    owner = np.repeat(np.arange(len(owners)), owners)
    covered = np.zeros(rows, int)
    for g, a, b in zip(group, lo, hi):
        if b > a:
            assert b - a <= block_m and (owner[a:b] == g).all()
            covered[a:b] += 1
    np.testing.assert_array_equal(covered, 1)
    items = np.bincount(group[hi > lo], minlength=len(owners))
    np.testing.assert_array_equal(items, -(-owners // block_m))


@pytest.mark.parametrize("half_tiles", [False, True])
def test_issued_rows(half_tiles):
    """The MMA rows the schedule runs: whole tiles, a short last item at half height."""
    config = GmmConfig(block_m=64, half_tiles=half_tiles)
    sizes = [0, 1, 32, 33, 64, 65, 128, 150]
    expected = [0, 64, 64, 64, 64, 128, 128, 192] if not half_tiles else [
        0, 32, 32, 64, 64, 96, 128, 160]
    assert issued_rows(sizes, config) == sum(expected)
    assert issued_rows([5, 9], GmmConfig(block_m=16)) == 32  # half of 16 is below a dot


@pytest.mark.parametrize("spec", [GB10, H200], ids=["gb10", "h200"])
@pytest.mark.parametrize("shape", MOE_SHAPES, ids=[s.preset for s in MOE_SHAPES])
def test_configs_fit_and_divide(spec, shape):
    for tokens in (16, 512, 8192):
        for k, n, num_rhs in ((shape.hidden, shape.inter, 2), (shape.inter, shape.hidden, 1)):
            config = select_gmm_config(spec, rows=tokens * shape.top_k, k=k, n=n,
                                       num_groups=shape.experts, num_rhs=num_rhs)
            assert k % config.block_k == 0 and n % config.block_n == 0
            assert estimate_shared_memory(config, num_rhs=num_rhs) <= spec.smem_per_block


def test_shapes_match_presets():
    for shape in MOE_SHAPES:
        config = ModelConfig.preset(shape.preset)
        assert dataclasses.astuple(shape)[1:] == (
            config.hidden_size, config.moe_intermediate_size, config.num_experts,
            config.num_experts_per_token, config.swiglu_limit)


def test_rejects_bad_operands():
    lhs, rhs = jnp.zeros((8, 32)), jnp.zeros((2, 32, 16))
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(lhs, rhs, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="rhs"):
        grouped_matmul(lhs, jnp.zeros((2, 16, 16)), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="implementation"):
        grouped_matmul(lhs, rhs, jnp.zeros((2,), jnp.int32), implementation="cublas")
    with pytest.raises(ValueError, match="fusions"):
        moe_experts.routed_experts(jnp.zeros((4, 32)), jnp.zeros((4, 1)),
                                   jnp.zeros((4, 1), jnp.int32), rhs, rhs,
                                   jnp.zeros((2, 16, 32)), limit=None, fusions=("scatter",))
