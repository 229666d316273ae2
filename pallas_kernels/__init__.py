"""Pallas kernels and their jax.numpy / NumPy oracles: the checkpointing KDA prefill scan,
the KDA decode step, the MoE grouped GEMM and the MLA prefill attention."""

# Pallas's interpret mode imports its fuser during the first trace, and that import
# registers a config value jit keys include: a program first traced before it compiled
# twice (on the CPU a whole model, once a process). Imported here, it is registered first.
import jax.experimental.pallas.fuser  # noqa: F401

from pallas_kernels.attention import prefill_attention, validate_attention_metadata
from pallas_kernels.gmm import grouped_matmul
from pallas_kernels.kda import kda_prefill
from pallas_kernels.kda_decode import kda_decode
from pallas_kernels.moe_experts import routed_experts
from pallas_kernels.reference import kda_chunked_reference, kda_recurrent_reference
from pallas_kernels.validation import validate_checkpoint_metadata

__all__ = [
    "grouped_matmul",
    "kda_chunked_reference",
    "kda_decode",
    "kda_prefill",
    "kda_recurrent_reference",
    "prefill_attention",
    "routed_experts",
    "validate_attention_metadata",
    "validate_checkpoint_metadata",
]
