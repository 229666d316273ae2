"""Pallas GPU kernels and their jax.numpy / NumPy oracles: the checkpointing KDA prefill
scan and the MLA prefill attention."""

from pallas_kernels.attention import prefill_attention, validate_attention_metadata
from pallas_kernels.kda import kda_prefill
from pallas_kernels.reference import kda_chunked_reference, kda_recurrent_reference
from pallas_kernels.validation import validate_checkpoint_metadata

__all__ = [
    "kda_chunked_reference",
    "kda_prefill",
    "kda_recurrent_reference",
    "prefill_attention",
    "validate_attention_metadata",
    "validate_checkpoint_metadata",
]
