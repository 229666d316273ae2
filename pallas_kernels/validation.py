"""Host-side checks of the packed-batch metadata that ``kda_prefill`` takes (DESIGN.md s. 3)."""

import numpy as np

CAPACITIES = (1, 2, 4)


def validate_checkpoint_metadata(cu_seqlens, checkpoint_offsets, *, num_tokens) -> None:
    """Raise ``ValueError`` naming the offending row and value if the metadata is invalid.

    Args:
      cu_seqlens: int32 ``[N + 1]``, ``cu_seqlens[0] == 0``, non-decreasing,
        ``cu_seqlens[N] <= num_tokens``.
      checkpoint_offsets: int32 ``[N, capacity]`` with capacity in {1, 2, 4}; each entry is
        -1 (inactive slot) or a token count 1..len_n of sequence n.
      num_tokens: T, the number of packed rows (padding included).

    Accepts NumPy or JAX arrays (concrete values only: this runs on the host, before jit).
    """
    cu_seqlens = np.asarray(cu_seqlens)
    offsets = np.asarray(checkpoint_offsets)
    for name, array in (("cu_seqlens", cu_seqlens), ("checkpoint_offsets", offsets)):
        if array.dtype != np.int32:
            raise ValueError(f"{name} must be int32, got {array.dtype}")

    if cu_seqlens.ndim != 1 or cu_seqlens.size == 0:
        raise ValueError(f"cu_seqlens must have shape [N + 1], got {cu_seqlens.shape}")
    if cu_seqlens[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {cu_seqlens[0]}")
    lengths = np.diff(cu_seqlens.astype(np.int64))
    decreasing = np.flatnonzero(lengths < 0)
    if decreasing.size:
        n = decreasing[0]
        raise ValueError(
            f"cu_seqlens must be non-decreasing: cu_seqlens[{n + 1}] = {cu_seqlens[n + 1]} "
            f"< cu_seqlens[{n}] = {cu_seqlens[n]}"
        )
    if cu_seqlens[-1] > num_tokens:
        raise ValueError(f"cu_seqlens[-1] = {cu_seqlens[-1]} exceeds num_tokens = {num_tokens}")

    num_seqs = cu_seqlens.size - 1
    if offsets.ndim != 2 or offsets.shape[0] != num_seqs:
        raise ValueError(
            f"checkpoint_offsets must have shape [N, capacity] with N = {num_seqs}, "
            f"got {offsets.shape}"
        )
    if offsets.shape[1] not in CAPACITIES:
        raise ValueError(
            f"checkpoint_offsets capacity must be one of {CAPACITIES}, got {offsets.shape[1]}"
        )
    bad = np.argwhere((offsets != -1) & ((offsets < 1) | (offsets > lengths[:, None])))
    if bad.size:
        n, c = bad[0]
        offset = offsets[n, c]
        where = f"checkpoint_offsets row {n}, slot {c}: offset {offset}"
        if offset == 0:
            raise ValueError(f"{where}: offsets count tokens from 1 (-1 marks an inactive slot)")
        if offset < 0:
            raise ValueError(f"{where} is negative; only -1 marks an inactive slot")
        raise ValueError(f"{where} is past the length {lengths[n]} of sequence {n}")
