"""Routed experts of a MoE layer as grouped GEMMs over the token copies sorted by expert.

    h_r = swiglu(x_{t(r)} W_gate[e(r)], x_{t(r)} W_up[e(r)])      copy r of token t(r)
    y_t = sum_{r of t} w_r * h_r W_down[e(r)]                      w_r: combine weight

The copies are sorted by expert (stable), so each expert's rows are contiguous and
`grouped_matmul`'s contract holds. Every implementation (`pallas_kernels.gmm`) computes the
same thing; on "pallas" the glue can move into the kernel's epilogues, each fusion a
separate switch so it can be measured alone (bench.moe):

  "gather":  the gate/up kernel reads x [T, D] through the row -> token index instead of a
             materialised [T * k, D] sorted copy;
  "swiglu":  gate and up in one kernel (two accumulators), SwiGLU in its epilogue;
  "combine": the down kernel scales each row by its combine weight and stores it in
             token-major order, so only a sum over the k copies remains.

With every fusion on and at most PER_ROW_COPIES copies (a decode step of a row or two),
the copies are not sorted at all: each is its own work item naming its expert
(`gmm_pallas`'s `row_groups`). The sort, the group sizes and the sorted schedule are a dozen
small launches (~20 us a layer on the H200 at one row); with top-8 of 256 experts two
copies rarely share an expert, so sorting would save no weight reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import (
    check_operands,
    grouped_matmul,
    pallas_config,
    resolve,
    resolve_interpret,
)
from pallas_kernels.gmm_pallas import Epilogue, gmm_pallas

FUSIONS = ("gather", "swiglu", "combine")
PER_ROW_COPIES = 16  # most token copies (tokens x top-k) the unsorted per-row schedule takes
# What the Pallas path fuses by default; the lead trims it after measuring on the H200.
DEFAULT_FUSIONS = FUSIONS


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None) -> jax.Array:
    """``silu(gate) * up``; with a limit, gate is clamped above at `limit` and up to
    [-limit, limit] first (the DeepSeek / GLM "swiglu_limit" form)."""
    if limit is not None:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def sort_by_expert(experts: jax.Array, num_experts: int):
    """experts int32 [T, k] -> (order [T*k]: copy index of each sorted row, group_sizes
    int32 [E]). Sorted row r is copy order[r] = token order[r] // k, slot order[r] % k."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, group_sizes


def _check(x, weights, experts, w_gate, w_up, w_down, fusions):
    if x.ndim != 2 or experts.ndim != 2 or experts.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, D] and experts [T, k], got {x.shape}, {experts.shape}")
    if weights.shape != experts.shape:
        raise ValueError(f"weights must match experts' shape {experts.shape}, got "
                         f"{weights.shape}")
    if w_gate.shape != w_up.shape or w_down.shape != (w_gate.shape[0], w_gate.shape[2],
                                                      w_gate.shape[1]):
        raise ValueError(f"w_gate / w_up must be [E, D, I] and w_down [E, I, D], got "
                         f"{w_gate.shape}, {w_up.shape}, {w_down.shape}")
    unknown = set(fusions) - set(FUSIONS)
    if unknown:
        raise ValueError(f"fusions must be a subset of {FUSIONS}, got {sorted(unknown)}")


def routed_experts(x, weights, experts, w_gate, w_up, w_down, *, limit: float | None,
                   implementation: str | None = None, fusions: tuple[str, ...] | None = None,
                   interpret: bool | None = None, out_dtype=None,
                   active_experts: int | None = None):
    """The weighted sum of each token's top-k experts.

    Args:
      x: [T, D] activations (bf16 or fp32); weights: fp32 [T, k] combine weights;
      experts: int32 [T, k] expert ids; w_gate, w_up: [E, D, I]; w_down: [E, I, D]
        (cast to x.dtype).
      limit: the SwiGLU clamp (None: none).
      implementation: one of `pallas_kernels.gmm.IMPLEMENTATIONS`, None from the device.
      fusions: subset of FUSIONS for the "pallas" implementation (None: DEFAULT_FUSIONS);
        ignored by the others, which run the same glue in jax.numpy.
      out_dtype: of the result (None: x.dtype); the sum over a token's copies is fp32.
      active_experts: how many of the E experts ids can name (None: E), when the weights
        stack several layers' experts: the Pallas tiling is chosen for that many groups.

    Returns [T, D] in out_dtype.
    """
    out_dtype = out_dtype or x.dtype
    fusions = DEFAULT_FUSIONS if fusions is None else tuple(fusions)
    _check(x, weights, experts, w_gate, w_up, w_down, fusions)
    implementation = resolve(implementation)
    if implementation != "pallas":
        fusions = ()
    tokens, top_k = experts.shape
    w_gate, w_up, w_down = (w.astype(x.dtype) for w in (w_gate, w_up, w_down))
    interpret = resolve_interpret(interpret)
    if set(fusions) == set(FUSIONS) and tokens * top_k <= PER_ROW_COPIES:
        return _per_row(x, weights, experts, w_gate, w_up, w_down, limit=limit,
                        interpret=interpret, out_dtype=out_dtype, active_experts=active_experts)
    order, group_sizes = sort_by_expert(experts, w_gate.shape[0])
    row_tokens = order // top_k

    def gemm(lhs, rhs):
        config = (pallas_config(lhs.shape[0], rhs, active_groups=active_experts)
                  if implementation == "pallas" else None)
        return grouped_matmul(lhs, rhs, group_sizes, implementation=implementation,
                              interpret=interpret, config=config)

    gather = "gather" in fusions
    xs = x if gather else x[row_tokens]  # [T, D] or [T * k, D] sorted by expert
    if "swiglu" in fusions or gather:
        h = _pallas(xs, (w_gate, w_up) if "swiglu" in fusions else (w_gate,), group_sizes,
                    rows=tokens * top_k, interpret=interpret, row_tokens=row_tokens,
                    epilogue=Epilogue(gather=gather, swiglu="swiglu" in fusions, limit=limit),
                    active_groups=active_experts)
        if "swiglu" not in fusions:
            up = _pallas(xs, (w_up,), group_sizes, rows=tokens * top_k, interpret=interpret,
                         row_tokens=row_tokens, epilogue=Epilogue(gather=gather),
                         active_groups=active_experts)
            h = swiglu(h, up, limit)
    else:
        h = swiglu(gemm(xs, w_gate), gemm(xs, w_up), limit)

    if "combine" in fusions:
        ys = _pallas(h, (w_down,), group_sizes, rows=tokens * top_k, interpret=interpret,
                     row_scale=weights.reshape(-1)[order], row_dest=order,
                     epilogue=Epilogue(combine=True), active_groups=active_experts)
        ys = ys.reshape(tokens, top_k, -1).astype(jnp.float32)
        return jnp.sum(ys, axis=1).astype(out_dtype)
    ys = gemm(h, w_down)
    ys = jnp.zeros_like(ys).at[order].set(ys).reshape(tokens, top_k, -1)  # unsort
    return jnp.einsum("tk,tkd->td", weights, ys.astype(jnp.float32)).astype(out_dtype)


def _per_row(x, weights, experts, w_gate, w_up, w_down, *, limit, interpret, out_dtype,
             active_experts):
    """Every fusion, the copies unsorted: copy r = t * k + j is row r, of expert
    experts[t, j] (module doc)."""
    tokens, top_k = experts.shape
    common = dict(rows=tokens * top_k, interpret=interpret,
                  row_groups=experts.reshape(-1).astype(jnp.int32), copies_per_token=top_k,
                  active_groups=active_experts)
    sizes = jnp.zeros((w_gate.shape[0],), jnp.int32)  # unused by the per-row schedule
    h = _pallas(x, (w_gate, w_up), sizes,
                epilogue=Epilogue(gather=True, swiglu=True, limit=limit), **common)
    ys = _pallas(h, (w_down,), sizes, row_scale=weights.reshape(-1).astype(jnp.float32),
                 epilogue=Epilogue(combine=True), **common)
    ys = ys.reshape(tokens, top_k, -1).astype(jnp.float32)
    return jnp.sum(ys, axis=1).astype(out_dtype)


def _pallas(lhs, rhs, group_sizes, *, rows, interpret, epilogue, row_tokens=None,
            row_scale=None, row_dest=None, row_groups=None, copies_per_token=1,
            active_groups=None):
    """One Pallas grouped GEMM with `epilogue` (`pallas_kernels.gmm_pallas`)."""
    for stack in rhs:
        check_operands(lhs, stack, group_sizes)
    config = pallas_config(rows, rhs[0], num_rhs=len(rhs), active_groups=active_groups)
    return gmm_pallas(lhs, rhs, group_sizes, config=config, epilogue=epilogue,
                      interpret=interpret,
                      row_tokens=row_tokens if epilogue.gather else None,
                      row_scale=row_scale, row_dest=row_dest, row_groups=row_groups,
                      copies_per_token=copies_per_token)
