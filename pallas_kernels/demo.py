"""Kernel demo: one packed prefill that retains checkpoints, checked against the fp64 oracle.

Run with ``python -m pallas_kernels.demo [--backend pallas|reference]``. The default follows
the KDA layer: the Pallas kernel on a GPU, the jax.numpy oracle on the CPU (where the kernel
would run in the much slower interpret mode).
"""

import argparse

import jax
import numpy as np

from pallas_kernels import kda_prefill, kda_recurrent_reference, validate_checkpoint_metadata

LENGTHS = (700, 64, 1300)
PADDING_ROWS = 48
HEADS = 4
DIM = 64  # K = V
# Capacity 4; -1 slots are inactive. Offsets need not be chunk-aligned, repeats are allowed.
CHECKPOINT_OFFSETS = ((256, 700, 1, -1), (-1, 64, -1, 33), (512, 1024, 1299, 1300))


def make_batch(rng):
    """Random packed batch: q, k, g ``[T, H, K]``, v ``[T, H, V]``, beta ``[T, H]`` fp32,
    cu_seqlens int32 ``[N + 1]``, zero initial states fp32 ``[N, H, K, V]`` and
    checkpoint_offsets int32 ``[N, 4]``."""
    num_tokens = sum(LENGTHS) + PADDING_ROWS

    def unit_rows():
        x = rng.standard_normal((num_tokens, HEADS, DIM))
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    return dict(
        q=unit_rows(),
        k=unit_rows(),
        v=rng.standard_normal((num_tokens, HEADS, DIM)).astype(np.float32),
        g=rng.uniform(-1.0, 0.0, (num_tokens, HEADS, DIM)).astype(np.float32),
        beta=rng.uniform(0.0, 1.0, (num_tokens, HEADS)).astype(np.float32),
        cu_seqlens=np.cumsum((0, *LENGTHS), dtype=np.int32),
        initial_states=np.zeros((len(LENGTHS), HEADS, DIM, DIM), np.float32),
        checkpoint_offsets=np.array(CHECKPOINT_OFFSETS, np.int32),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "pallas" if jax.default_backend() == "gpu" else "reference"
    parser.add_argument("--backend", choices=("pallas", "reference"), default=default)
    backend = parser.parse_args().backend
    batch = make_batch(np.random.default_rng(0))
    validate_checkpoint_metadata(
        batch["cu_seqlens"], batch["checkpoint_offsets"], num_tokens=len(batch["q"])
    )

    o, final_states, snapshots = jax.block_until_ready(kda_prefill(**batch, backend=backend))
    o_ref, final_ref, snapshots_ref = kda_recurrent_reference(**batch)

    print(
        f"kda_prefill(backend={backend!r}) on {jax.default_backend()}: {len(LENGTHS)} sequences, "
        f"{len(batch['q'])} rows, H={HEADS}, K=V={DIM}"
    )
    print(f"o: max |diff| vs fp64 recurrence {np.abs(np.asarray(o) - o_ref).max():.2e}")
    for n, length in enumerate(LENGTHS):
        final_diff = np.abs(np.asarray(final_states[n]) - final_ref[n]).max()
        print(f"sequence {n} ({length} tokens): final state max |diff| {final_diff:.2e}")
        for slot, offset in enumerate(CHECKPOINT_OFFSETS[n]):
            diff = np.abs(np.asarray(snapshots[n, slot]) - snapshots_ref[n, slot]).max()
            where = "inactive" if offset == -1 else f"retained at {offset:>4}"
            print(f"  slot {slot} {where}: max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
