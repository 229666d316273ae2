"""The memory floor of one decode step: the bytes it must move at least, and the time
those take at the H200's HBM bandwidth.

A decode step of B rows (one new token each; row b attends over `contexts[b]` cached
positions, its own included) must at least
- read every weight the step uses once: every parameter of the model except the MTP head
  (not run), the routed experts and the token embedding, of which it reads B rows;
- read the routed experts the step's routing touches: each MoE layer reads the distinct
  experts its B rows chose. With top-k routing over E experts, uniform and independent
  rows (a router of random weights routes so), the expected count is
      E_touched(B) = E (1 - (1 - k / E) ** B)
  (an expert is missed by one row with probability (E - k) / E);
- read and write back each row's KDA state and conv history in every KDA layer;
- read each row's cached MLA latents (and DSA index keys) over its context and write its
  new token's, in every MLA layer.
In bytes:
    weights  = P_dense + B D s_embed
    experts  = L_moe E_touched(B) S_expert
    states   = 2 B L_kda S_slot
    kv       = L_mla S_token sum_b (contexts[b] + 1)
with P_dense the bytes of the parameters above, D the hidden size, s_embed the
embedding's bytes per value, S_expert the bytes of one routed expert (its gate, up and
down matrices), S_slot the bytes of one state slot of one KDA layer (recurrent state and
conv history), S_token the bytes of one cached token of one MLA layer. Activations and
logits (B D and B x vocab values) are left out: under 1% at the real shapes.

All sizes are read from the model's and the caches' abstract shapes, so the formula follows
any preset, cut or dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
from flax import nnx

from bench.kda_decode import H200_BANDWIDTH
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.model import HybridModel

ROUTED_EXPERTS = ("w_gate", "w_up", "w_down")  # the MoE layer's stacked expert weights [E, ...]


class DecodeSizes(NamedTuple):
    """The per-model sizes of the floor formula (bytes)."""

    dense_bytes: int  # P_dense: every parameter read whole by a step
    embed_row_bytes: int  # D s_embed
    expert_bytes: int  # S_expert
    moe_layers: int  # L_moe
    slot_bytes: int  # S_slot, per KDA layer
    kda_layers: int  # L_kda
    token_bytes: int  # S_token, per MLA layer
    mla_layers: int  # L_mla


def decode_sizes(config: ModelConfig) -> DecodeSizes:
    """The sizes of `config`'s model and caches, from their abstract shapes."""
    params = nnx.state(nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0))), nnx.Param)
    dense = experts = embed = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(key, "key", getattr(key, "idx", key))) for key in path]
        size = math.prod(leaf.shape) * leaf.dtype.itemsize
        if names[0] == "mtp":
            continue
        if names[0] == "embed_tokens":
            embed = leaf.dtype.itemsize * config.hidden_size
        elif any(name in ROUTED_EXPERTS for name in names):
            experts += size
        else:
            dense += size
    moe_layers = config.num_layers - config.first_dense_layers
    caches = jax.eval_shape(lambda: Caches.init(config, num_state_slots=1, num_kv_blocks=1))

    def nbytes(tree) -> int:
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    return DecodeSizes(
        dense_bytes=dense, embed_row_bytes=embed,
        expert_bytes=experts // max(moe_layers * config.num_experts, 1), moe_layers=moe_layers,
        slot_bytes=nbytes(caches.kda[0]) if caches.kda else 0, kda_layers=len(caches.kda),
        token_bytes=nbytes(caches.mla[0]) // config.kv_block_size if caches.mla else 0,
        mla_layers=len(caches.mla),
    )  # fmt: skip


def expected_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts `rows` uniform, independent top-`top_k` choices touch."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def decode_step_bytes(config: ModelConfig, sizes: DecodeSizes,
                      contexts: Sequence[int]) -> dict[str, float]:
    """The floor's bytes of one decode step whose rows attend over `contexts` positions,
    by term (the module docstring's formula) and in total.

    Raises:
      ValueError: no rows, or a context below 1.
    """
    if not contexts or min(contexts) < 1:
        raise ValueError(f"contexts {list(contexts)[:8]}: need at least one row, each >= 1")
    rows = len(contexts)
    touched = expected_experts(config.num_experts, config.num_experts_per_token, rows)
    terms = dict(
        weights=sizes.dense_bytes + rows * sizes.embed_row_bytes,
        experts=sizes.moe_layers * touched * sizes.expert_bytes,
        states=2 * rows * sizes.kda_layers * sizes.slot_bytes,
        kv=sizes.mla_layers * sizes.token_bytes * sum(c + 1 for c in contexts),
    )
    return terms | {"total": sum(terms.values()), "experts_touched_per_layer": touched}


def floor_seconds(total_bytes: float, bandwidth: float = H200_BANDWIDTH) -> float:
    """The time `total_bytes` take at `bandwidth` (bytes/s; the H200's 4.8 TB/s)."""
    return total_bytes / bandwidth
