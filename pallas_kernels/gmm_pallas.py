"""The grouped GEMM as one Pallas kernel lowered through Triton.

Rows of the lhs are sorted by group (expert). The launch is a list of work items, each up
to `block_m` consecutive rows of ONE group, tiled from the group's first row (not from a
global row grid): a group of n rows is cdiv(n, block_m) items with at most one short item,
its last. A global grid cut every group twice on average, so at kimi-linear-48b's 8K
prefill (65,536 rows over 256 experts) its items ran 1.49x the useful rows through the
tensor cores; group-local items run 1.24x, and 1.12x with `GmmConfig.half_tiles` (an item of
at most block_m / 2 rows runs a tile of that height). The list is built inside jit from
`group_sizes` (`work_schedule`) and has a STATIC length

    cdiv(M, block_m) + min(E, M)

(each non-empty group adds at most one item beyond its rows / block_m; the rows past
sum(group_sizes) form one extra "padding" group whose items store zeros), so one compiled
kernel serves every routing and the cost scales with the rows, not with E: items past the
real count exit at once.

Grid: one axis of work items x n tiles, swizzled (`GmmConfig.swizzle` work items share a
window across all n tiles) so a group's [K, block_n] weight slab and a tile's rows stay in
L2 while in use. Each program runs the k loop (fori_loop over block_k slices) into an fp32
accumulator.

Fusions, each a static switch:
  gather:  lhs is x [T, K] and `row_tokens` [M] names the token of each sorted row, so the
           sorted copies [M, K] are never materialised;
  swiglu:  two weight stacks (gate, up) into two accumulators, SwiGLU (with its clamp
           limit) in the epilogue, h written directly;
  combine: the epilogue scales row r by `row_scale[r]` (the router's combine weight) and
           stores it at row `row_dest[r]` (the copy's place in token-major order).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gmm_tuning import GmmConfig
from pallas_kernels.tiles import exp_function, iota


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """Static description of what the kernel computes beyond lhs @ rhs."""

    gather: bool = False
    swiglu: bool = False
    limit: float | None = None
    combine: bool = False


def num_work_items(rows: int, num_groups: int, block_m: int) -> int:
    """The static bound on work items: cdiv(M, block_m) + min(E, M) (see module doc)."""
    return pl.cdiv(rows, block_m) + min(num_groups, rows)


def work_schedule(group_sizes, *, rows: int, block_m: int):
    """int32 [W] arrays (group, first row, end row) of each work item, W static.

    Item j of group g holds rows [start_g + j block_m, min(start_g + (j + 1) block_m,
    end_g)). Group E is the padding group (rows sum(group_sizes)..rows); items past the
    real count are empty (first row == end row). Group sizes are clipped so rows never
    exceed `rows`.
    """
    num_groups = group_sizes.shape[0]
    sizes = jnp.concatenate([group_sizes.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    ends = jnp.minimum(jnp.cumsum(sizes), rows)
    ends = ends.at[-1].set(rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    tiles_end = jnp.cumsum(tiles)
    w = jnp.arange(num_work_items(rows, num_groups, block_m), dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tiles_end, w, side="right", method="compare_all"),
                        num_groups)
    group = group.astype(jnp.int32)
    lo = starts[group] + (w - (tiles_end[group] - tiles[group])) * block_m
    hi = jnp.minimum(ends[group], lo + block_m)
    hi = jnp.where(w < tiles_end[-1], hi, lo)
    return group, lo.astype(jnp.int32), hi.astype(jnp.int32)


def issued_rows(group_sizes, config: GmmConfig) -> int:
    """Rows the tensor cores run for `group_sizes` (host ints) under `config`: the sum of
    the items' tile heights. Divided by sum(group_sizes), the MMA work per useful row."""
    issued, half = 0, config.half_m
    for size in map(int, group_sizes):
        full, tail = divmod(size, config.block_m)
        issued += full * config.block_m
        if tail:
            issued += half if half and tail <= half else config.block_m
    return issued


def _kernel(*refs, config: GmmConfig, epilogue: Epilogue, num_work: int, num_n: int,
            num_groups: int, precision, copies_per_token: int | None, interpret: bool):
    """One work item x one n tile: acc = sum_k lhs[rows, k] @ rhs[group, k, cols].

    copies_per_token set: the per-row schedule (`gmm_pallas`'s `row_groups`), the only
    schedule operand is the rows' groups and the rest follows from the row index."""
    refs = list(refs)
    out_ref = refs.pop()
    per_row = copies_per_token is not None
    schedule = [refs.pop(0) for _ in range(1 if per_row else 3)]
    row_tokens_ref = refs.pop(0) if epilogue.gather and not per_row else None
    scale_ref = refs.pop(0) if epilogue.combine else None
    dest_ref = refs.pop(0) if epilogue.combine and not per_row else None
    lhs_ref, *rhs_refs = refs
    bn, bk = config.block_n, config.block_k

    # Swizzle: `config.swizzle` consecutive work items take every n tile in turn.
    pid = pl.program_id(0)
    window = config.swizzle * num_n
    first = (pid // window) * config.swizzle
    width = jnp.minimum(num_work - first, config.swizzle)
    w = first + (pid % window) % width
    n = (pid % window) // width

    if per_row:  # work item w is row w; an id out of range makes it the padding group's
        group = schedule[0][w]
        group = jnp.where((group >= 0) & (group < num_groups), group, num_groups)
        lo, hi = w, w + 1
    else:
        group, lo, hi = (ref[w] for ref in schedule)
    cols = pl.ds(n * bn, bn)
    # Gathered rows and scattered stores index with two broadcast int arrays ([R, 1] rows,
    # [1, C] columns): Pallas interpret mode cannot mix an int array with a slice.
    col_ids = (n * bn + iota((bn,), 0))[None, :]

    def item(height: int):
        """The item's rows [lo, hi) as a tile of `height` rows from lo (hi - lo <= height)."""
        rows = pl.ds(lo, height)
        row_ids = lo + iota((height,), 0)
        valid_1d = row_ids < hi
        valid = valid_1d[:, None]

        def store(value):
            if epilogue.combine:
                # Masked-off lanes point past the end, out of bounds: interpret mode's
                # masked scatter writes every in-bounds lane (the old value where masked),
                # so a real row there could undo a valid write.
                dest = (jnp.where(valid_1d, row_ids, out_ref.shape[0]) if per_row else
                        plgpu.load(dest_ref.at[rows], mask=valid_1d, other=out_ref.shape[0]))
                target = out_ref.at[dest[:, None], col_ids]
            else:
                target = out_ref.at[rows, cols]
            plgpu.store(target, value.astype(out_ref.dtype), mask=valid)

        @pl.when(group < num_groups)
        def _():
            if epilogue.gather and per_row:
                tokens = jnp.where(valid_1d, row_ids // copies_per_token, 0)[:, None]
            elif epilogue.gather:
                tokens = plgpu.load(row_tokens_ref.at[rows], mask=valid_1d, other=0)[:, None]

            def body(i, accs):
                ks = pl.ds(i * bk, bk)
                at = (lhs_ref.at[tokens, (i * bk + iota((bk,), 0))[None, :]]
                      if epilogue.gather else lhs_ref.at[rows, ks])
                a = plgpu.load(at, mask=valid, other=0)
                return tuple(acc + jnp.dot(a, rhs[group, ks, cols], precision=precision,
                                           preferred_element_type=jnp.float32)
                             for acc, rhs in zip(accs, rhs_refs))

            zero = jnp.zeros((height, bn), jnp.float32)
            accs = lax.fori_loop(0, lhs_ref.shape[1] // bk, body, (zero,) * len(rhs_refs))
            out = accs[0]
            if epilogue.swiglu:
                gate, up = accs
                if epilogue.limit is not None:
                    gate = jnp.minimum(gate, epilogue.limit)
                    up = jnp.clip(up, -epilogue.limit, epilogue.limit)
                # SiLU as gate / (1 + exp(-gate)): in base 2 for bf16 operands (9 SASS
                # instructions an element where gate * sigmoid(gate) took 19, sm_90, pip
                # Triton; the exp is one MUFU, `tiles.exp2_ftz`).
                exp = exp_function(lhs_ref.dtype == jnp.float32, interpret=interpret)
                out = gate / (1 + exp(-gate)) * up
            if epilogue.combine:
                scale = plgpu.load(scale_ref.at[rows], mask=valid_1d, other=0)
                out = out * scale[:, None]
            store(out)

        @pl.when(group == num_groups)
        def _():
            store(jnp.zeros((height, bn), jnp.float32))

    half = config.half_m
    if half is None:
        pl.when(hi > lo)(lambda: item(config.block_m))
    else:
        pl.when((hi > lo) & (hi - lo <= half))(lambda: item(half))
        pl.when(hi - lo > half)(lambda: item(config.block_m))


@functools.partial(jax.jit, static_argnames=("config", "epilogue", "interpret",
                                             "copies_per_token"))
def gmm_pallas(lhs, rhs, group_sizes, *, row_tokens=None, row_scale=None, row_dest=None,
               row_groups=None, copies_per_token: int = 1, config: GmmConfig,
               epilogue: Epilogue, interpret: bool):
    """The kernel (arguments already validated by `pallas_kernels.gmm`).

    Args:
      lhs: [M, K] rows sorted by group, or x [T, K] with `row_tokens` int32 [M] (gather).
      rhs: tuple of one [E, K, N] weight stack, or (gate, up) for the swiglu epilogue.
      group_sizes: int32 [E]; rows past their sum come out zero.
      row_scale: fp32 [M] and row_dest int32 [M] (a permutation of 0..M-1) for combine.
      row_groups: int32 [M] instead of group_sizes, row_tokens and row_dest: the per-row
        schedule, for a few rows (a decode step's copies), where building the sorted
        schedule costs more launches than sharing a group's weight between rows saves.
        Row r, in any order, is its own work item of group row_groups[r] (an id outside
        0..E-1 gives a zero row); under gather it is token r // copies_per_token of x;
        under combine it stays row r. Nothing but row_groups is computed outside the
        kernel.

    Returns [M, N] in lhs.dtype (row r at row_dest[r] under combine).
    """
    per_row = row_groups is not None
    rows = (row_groups.shape[0] if per_row else
            row_tokens.shape[0] if epilogue.gather else lhs.shape[0])
    num_groups, _, n = rhs[0].shape
    if rows == 0:
        return jnp.zeros((0, n), lhs.dtype)
    # An item's tile may reach past its group and past row M: every load and store is
    # masked to the item's rows (on the GPU and in interpret mode), so nothing is padded.
    if per_row:
        schedule = [row_groups.astype(jnp.int32)]
    else:
        schedule = work_schedule(group_sizes, rows=rows, block_m=config.block_m)
    extras = []
    if epilogue.gather and not per_row:
        extras.append(row_tokens.astype(jnp.int32))
    if epilogue.combine:
        extras.append(row_scale.astype(jnp.float32))
        if not per_row:
            extras.append(row_dest.astype(jnp.int32))
    num_work = rows if per_row else schedule[0].shape[0]
    num_n = n // config.block_n
    precision = (lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else lax.Precision.DEFAULT)
    call = pl.pallas_call(
        functools.partial(_kernel, config=config, epilogue=epilogue, num_work=num_work,
                          num_n=num_n, num_groups=num_groups, precision=precision,
                          copies_per_token=copies_per_token if per_row else None,
                          interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((rows, n), lhs.dtype),
        grid=(num_work * num_n,),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="_".join(["gmm"] + [part for part in ("gather", "swiglu", "combine")
                                 if getattr(epilogue, part)]),
    )
    return call(*schedule, *extras, lhs, *rhs)
