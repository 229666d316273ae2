"""Checkpointing KDA prefill scan: Pallas GPU kernel and jax.numpy / NumPy oracles."""

from pallas_kernels.kda import kda_prefill
from pallas_kernels.reference import kda_chunked_reference, kda_recurrent_reference
from pallas_kernels.validation import validate_checkpoint_metadata

__all__ = [
    "kda_chunked_reference",
    "kda_prefill",
    "kda_recurrent_reference",
    "validate_checkpoint_metadata",
]
