"""Checkpointing KDA prefill scan and the KDA decode step: Pallas GPU kernels and jax.numpy /
NumPy oracles."""

from pallas_kernels.kda import kda_prefill
from pallas_kernels.kda_decode import kda_decode
from pallas_kernels.reference import kda_chunked_reference, kda_recurrent_reference
from pallas_kernels.validation import validate_checkpoint_metadata

__all__ = [
    "kda_chunked_reference",
    "kda_decode",
    "kda_prefill",
    "kda_recurrent_reference",
    "validate_checkpoint_metadata",
]
