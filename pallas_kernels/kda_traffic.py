"""Bytes the KDA prefill kernel moves per token and head, by source count (issue 20).

Each pass's reads and writes of per-row tensors, every tensor counted once per pass (the
value-block programs of one head that load the same W or Kg tile share it through L2:
`kda_chunks.scan_grid` dispatches them together; before it, a launch of more than one
wave read it once a value block), on the fast path: bf16 q, k, v, beta and matmul
operands (T and W's right-hand side beta k exp(G) among them), fp32 g (see
`pallas_kernels.kda_prep`).
Per-chunk tensors (G_last, the entry states) count 1/C of their size per token;
per-sequence ones (states, snapshots, segment transitions) are left out: they do not grow
with the tokens. GB10's 273 GB/s turns the total into the time a bandwidth-bound kernel
cannot beat there. `tuning.select_segments` uses the scan's share; `bench.kda_kernel`
prints it all.
"""

from __future__ import annotations

from pallas_kernels.kda_prep import SUB_CHUNK
from pallas_kernels.tuning import KernelConfig

GB10_BANDWIDTH = 273e9  # bytes/s, DGX Spark's LPDDR5X
BF16, FP32 = 2, 4


def bytes_per_token_head(config: KernelConfig, head_k: int, head_v: int) -> dict[str, float]:
    """Bytes per token and head of each pass, the same on both gate paths; the segment
    transitions (`scan_segments` P > 1) read W, U, Kg and G_last of the first P - 1
    segments, (P - 1) / P of the tokens."""
    k, v, c = head_k, head_v, config.chunk_size
    inputs = 2 * BF16 * k + FP32 * k + BF16  # q, k, g, beta
    diagonal_blocks = (BF16 + FP32) * SUB_CHUNK  # Aqk's (operand dtype) and T's (fp32)
    # Qg, Kg, beta k exp(G); G_last. G itself is stored only in the chunks that hold a
    # snapshot (at most 4 a sequence), which the scan reads.
    gates = 3 * BF16 * k + FP32 * k / c
    passes = {"inverse": inputs + diagonal_blocks}  # the diagonal blocks from the inputs
    passes["prep"] = inputs + diagonal_blocks + 2 * BF16 * c + gates  # Aqk, T out
    w_u_inputs = BF16 * (k + v) + BF16 + BF16 * c  # beta k exp(G), v, beta, T
    if config.scan_forms_w_u:  # the scan reads the W/U pass's inputs instead of W and U
        recurrence_reads = w_u_inputs + BF16 * k + FP32 * k / c  # and Kg, G_last
    else:
        passes["w_u"] = w_u_inputs + BF16 * (k + v)  # W, U out
        recurrence_reads = BF16 * (2 * k + v) + FP32 * k / c  # W, Kg, U, G_last
    segments = config.scan_segments
    if segments > 1:
        passes["transition"] = recurrence_reads * (segments - 1) / segments
    if config.fuse_output:  # Qg and Aqk in; o out (no fill before: the scan zeroes padding)
        passes["scan"] = recurrence_reads + BF16 * (k + c) + BF16 * v
        return passes
    passes["scan"] = recurrence_reads + BF16 * k * v / c + BF16 * v  # entry states, Vnew
    # Qg, Aqk, entry states, Vnew in; o out, after XLA zero-fills it.
    passes["output"] = BF16 * (k + c + k * v / c + v) + 2 * BF16 * v
    return passes


def traffic_summary(config: KernelConfig, head_k: int, head_v: int, *, tokens: int,
                    heads: int) -> dict:
    """Per-pass and total bytes per token-head, and the GB10 time they imply."""
    passes = bytes_per_token_head(config, head_k, head_v)
    total = sum(passes.values())
    return dict(bytes_per_token_head=passes, total_bytes_per_token_head=total,
                gb10_ms_at_273GBs=total * tokens * heads / GB10_BANDWIDTH * 1e3)
