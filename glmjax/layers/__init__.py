"""Layers of the hybrid model, one concept per module."""

from glmjax.layers.block import DecoderBlock, PlainResidual
from glmjax.layers.conv import ConvResult, ShortConvolution, causal_conv1d
from glmjax.layers.dsa_indexer import DSAIndexer
from glmjax.layers.kda import KDA, KDAResult, KDAState
from glmjax.layers.mhc import HyperConnection, collapse_streams, expand_streams, sinkhorn
from glmjax.layers.mla import MLA
from glmjax.layers.moe import MLP, MoE, swiglu
from glmjax.layers.mtp import MTP
from glmjax.layers.norms import GatedRMSNorm, RMSNorm, l2_normalize, rms_normalize
from glmjax.layers.packing import PackedBatch, sequence_ids
from glmjax.layers.paged_cache import MLACache, read_paged, write_paged
from glmjax.layers.projection import projection

__all__ = [
    "ConvResult", "DSAIndexer", "DecoderBlock", "GatedRMSNorm", "HyperConnection", "KDA",
    "KDAResult", "KDAState", "MLA", "MLACache", "MLP", "MTP", "MoE", "PackedBatch",
    "PlainResidual", "RMSNorm", "ShortConvolution", "causal_conv1d", "collapse_streams",
    "expand_streams", "l2_normalize", "projection", "read_paged", "rms_normalize",
    "sequence_ids", "sinkhorn", "swiglu", "write_paged",
]
