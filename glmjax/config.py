"""Model configuration: one frozen dataclass and the presets of DESIGN.md section 4.

Numbers DESIGN.md does not give are taken from the upstream Hugging Face configs where they
exist (Kimi-Linear-48B-A3B-Instruct) and from the nearest GLM release otherwise; each such
choice is commented where it is set.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

LayerType = Literal["kda", "mla"]
KDAGate = Literal["softplus", "sigmoid_bound"]
KDABackend = Literal["pallas", "reference"]
MoEBackend = Literal["ragged_dot", "pallas", "tokamax"]
MLAAttention = Literal["reference", "pallas", "cudnn"]

KDA_GATES = ("softplus", "sigmoid_bound")
KDA_BACKENDS = ("pallas", "reference")
MOE_BACKENDS = ("ragged_dot", "pallas", "tokamax")  # pallas_kernels.gmm.IMPLEMENTATIONS
MLA_ATTENTIONS = ("reference", "pallas", "cudnn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a hybrid KDA / MLA model.

    Layer kinds are derived, not stored: layer i (0-based) is MLA when
    ``(i + 1) % full_attn_interval == 0`` or when it is the last layer and
    ``full_attn_last`` is set; every other layer is KDA. See `layer_types`.
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    full_attn_interval: int
    full_attn_last: bool
    rms_norm_eps: float

    # KDA (linear attention).
    kda_num_heads: int
    kda_head_dim: int  # K == V
    kda_gate: KDAGate
    kda_gate_bound: float  # lower bound of g for "sigmoid_bound"; unused by "softplus"
    conv_kernel: int

    # MLA (full attention, no positional rotation).
    mla_num_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    # DSA indexer: None disables it (dense MLA).
    dsa_top_k: int | None
    dsa_num_heads: int
    dsa_head_dim: int

    # Feed-forward: dense SwiGLU for the first layers, MoE after.
    intermediate_size: int
    first_dense_layers: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float | None

    # Residual: mHC streams (None = plain residual) and MTP heads.
    mhc_streams: int | None
    mhc_sinkhorn_iters: int
    num_mtp_layers: int

    tie_word_embeddings: bool = False
    kv_block_size: int = 512  # tokens per physical MLA cache block (DESIGN section 6, P)
    kda_backend: KDABackend | None = None  # None: "pallas" on a GPU, "reference" elsewhere
    # Routed experts' grouped GEMM; None: pallas_kernels.gmm.default_implementation (the
    # device's: "ragged_dot" on the CPU, "pallas" on a GPU).
    moe_backend: MoEBackend | None = None
    # MLA prefill attention implementation (pallas_kernels.attention); None: by device.
    mla_attention: MLAAttention | None = None
    # Batch-invariant prefill: a sequence's results do not depend on what else its step
    # holds, so the ladder and a coalesced span (and any packing) give the same bits on a
    # GPU. MLA attends with our flash kernel over keys packed at multiples of its key
    # blocks; XLA's GEMMs must run without split-K as well, a process-wide XLA flag
    # (`glmjax.xla_options.batch_invariant_gemms`, which the server's --batch-invariant
    # sets). On the CPU the reference ops make no such promise.
    batch_invariant: bool = False
    # Prefill runs the longest run of whole repeated layer groups (full_attn_interval
    # layers: 3 KDA + 1 MLA) as one `jax.lax.scan` over parameters stacked per group
    # position, so a deep model's prefill compiles one group, not every layer
    # (`glmjax.layer_scan`). Changes the parameter tree (`HybridModel.layer_groups`).
    scan_layers: bool = False
    dtype: Any = jnp.bfloat16  # activations and caches
    param_dtype: Any = jnp.bfloat16

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "num_layers", "full_attn_interval",
                    "kda_num_heads", "kda_head_dim", "conv_kernel", "mla_num_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
                    "num_experts", "num_experts_per_token", "moe_intermediate_size",
                    "mhc_sinkhorn_iters", "kv_block_size")
        for field in positive:
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.kda_gate not in KDA_GATES:
            raise ValueError(f"kda_gate must be one of {KDA_GATES}, got {self.kda_gate!r}")
        if self.kda_backend not in (None, *KDA_BACKENDS):
            raise ValueError(f"kda_backend must be None or one of {KDA_BACKENDS}, "
                             f"got {self.kda_backend!r}")
        if self.moe_backend not in (None, *MOE_BACKENDS):
            raise ValueError(f"moe_backend must be None or one of {MOE_BACKENDS}, "
                             f"got {self.moe_backend!r}")
        if self.mla_attention not in (None, *MLA_ATTENTIONS):
            raise ValueError(f"mla_attention must be None or one of {MLA_ATTENTIONS}, "
                             f"got {self.mla_attention!r}")
        if self.batch_invariant and self.mla_attention == "cudnn":
            raise ValueError("batch_invariant needs mla_attention 'pallas' or None: cuDNN's "
                             "attention depends on how a sequence's keys are split")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(f"num_experts_per_token={self.num_experts_per_token} exceeds "
                             f"num_experts={self.num_experts}")
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ValueError(f"first_dense_layers={self.first_dense_layers} not in "
                             f"[0, num_layers={self.num_layers}]")
        if self.dsa_top_k is not None and self.q_lora_rank is None:
            raise ValueError("the DSA indexer reads the query latent: it needs q_lora_rank")
        if self.mhc_streams is not None and self.mhc_streams < 2:
            raise ValueError(f"mhc_streams must be None or >= 2, got {self.mhc_streams}")

    @property
    def layer_types(self) -> tuple[LayerType, ...]:
        """Mixer of each layer, ``"kda"`` or ``"mla"``, in order."""
        return tuple(
            "mla" if (i + 1) % self.full_attn_interval == 0
            or (self.full_attn_last and i == self.num_layers - 1) else "kda"
            for i in range(self.num_layers))

    @property
    def conv_channels(self) -> int:
        """Channels of the KDA short convolution: q, k and v side by side."""
        return 3 * self.kda_num_heads * self.kda_head_dim

    def resolved_kda_backend(self) -> KDABackend:
        """`kda_backend`, or the default for the platform JAX runs on (DESIGN section 4)."""
        if self.kda_backend is not None:
            return self.kda_backend
        return "pallas" if jax.default_backend() == "gpu" else "reference"

    def replace_depth(self, num_layers: int, num_experts: int | None = None) -> ModelConfig:
        """The same widths with fewer layers (and optionally fewer experts), for benchmarks.

        The KDA / MLA interleave follows the same rule, so 4 layers give 3 KDA + 1 MLA. The
        dense prefix keeps its length while at least one MoE layer remains.
        """
        num_experts = self.num_experts if num_experts is None else num_experts
        return dataclasses.replace(
            self,
            name=f"{self.name}-L{num_layers}-E{num_experts}",
            num_layers=num_layers,
            first_dense_layers=min(self.first_dense_layers, max(num_layers - 1, 0)),
            num_experts=num_experts,
            num_experts_per_token=min(self.num_experts_per_token, num_experts),
        )

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """The config called `name`: one of ``PRESETS``."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]()

    @classmethod
    def tiny(cls) -> ModelConfig:
        """CPU test model; GLM-flavoured (bounded gate, clamp, mHC, MTP), fp32."""
        return cls(
            name="tiny", vocab_size=1024, hidden_size=256, num_layers=4,
            full_attn_interval=4, full_attn_last=False, rms_norm_eps=1e-5,
            kda_num_heads=4, kda_head_dim=64, kda_gate="sigmoid_bound", kda_gate_bound=-5.0,
            conv_kernel=4,
            mla_num_heads=4, kv_lora_rank=64, q_lora_rank=128, qk_nope_head_dim=64,
            qk_rope_head_dim=0, v_head_dim=64,
            dsa_top_k=None, dsa_num_heads=4, dsa_head_dim=32,
            # Not in DESIGN: 2x hidden dense, 0.5x hidden per expert.
            intermediate_size=512, first_dense_layers=1, num_experts=4,
            num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=128,
            routed_scaling_factor=2.5, swiglu_limit=10.0,
            mhc_streams=4, mhc_sinkhorn_iters=20, num_mtp_layers=1,
            dtype=jnp.float32, param_dtype=jnp.float32,
        )

    @classmethod
    def kimi_linear_48b(cls) -> ModelConfig:
        """Kimi-Linear-48B-A3B: 27 layers, MLA at 1-based 4, 8, ..., 24 and 27."""
        return cls(
            name="kimi-linear-48b", vocab_size=163840, hidden_size=2304, num_layers=27,
            full_attn_interval=4, full_attn_last=True,
            rms_norm_eps=1e-5,  # upstream config.json
            kda_num_heads=32, kda_head_dim=128, kda_gate="softplus", kda_gate_bound=-5.0,
            conv_kernel=4,
            mla_num_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128,
            dsa_top_k=None, dsa_num_heads=64, dsa_head_dim=128,
            intermediate_size=9216,  # upstream dense first layer
            first_dense_layers=1, num_experts=256, num_experts_per_token=8,
            num_shared_experts=1, moe_intermediate_size=1024,
            routed_scaling_factor=2.446,  # upstream config.json
            swiglu_limit=None,
            mhc_streams=None, mhc_sinkhorn_iters=20, num_mtp_layers=0,
        )

    @classmethod
    def glm53_flash(cls) -> ModelConfig:
        """GLM-5.3-Flash: 45 layers, (3 KDA + 1 MLA) x 11 then 1 KDA."""
        return cls(
            name="glm5.3-flash",
            vocab_size=154880,  # GLM-4.7 / GLM-5 tokenizer
            hidden_size=4096, num_layers=45, full_attn_interval=4, full_attn_last=False,
            rms_norm_eps=1e-5,  # every GLM-4.x / GLM-5 config
            kda_num_heads=64, kda_head_dim=128, kda_gate="sigmoid_bound", kda_gate_bound=-5.0,
            conv_kernel=4,
            mla_num_heads=64, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=256,
            qk_rope_head_dim=0, v_head_dim=256,
            dsa_top_k=2048,
            dsa_num_heads=32, dsa_head_dim=128,  # GLM-5's indexer
            intermediate_size=10944,  # GLM-4.5-Air, the GLM with the same hidden size
            first_dense_layers=3, num_experts=288, num_experts_per_token=8,
            num_shared_experts=1, moe_intermediate_size=2048,
            routed_scaling_factor=2.5,  # every GLM-4.x / GLM-5 MoE
            swiglu_limit=10.0,
            mhc_streams=4, mhc_sinkhorn_iters=20, num_mtp_layers=1,
        )


PRESETS = {
    "tiny": ModelConfig.tiny,
    "kimi-linear-48b": ModelConfig.kimi_linear_48b,
    "glm5.3-flash": ModelConfig.glm53_flash,
}
