"""Which mesh axis each array of the model is split over (DESIGN section 5): the
PartitionSpec of every parameter, activation, state pool and cache on the ``(tpo, dcp)``
mesh of `glmjax.sharding`, named once (`Specs`) and looked up by parameter path
(`param_spec`) or cache (`cache_specs`).

Tensor parallelism runs over both mesh axes together (``TP = ("tpo", "dcp")``): KDA and MLA
heads, the MLP and MoE intermediate, the vocabulary, and the KDA state pools by head. Token
activations are replicated. Decode context parallelism splits the MLA latent cache by
token over "dcp" (`glmjax.layers.paged_cache.DCPLayout`), so it is replicated only over
"tpo" and its bytes per device shrink by dcp; the DSA index-key cache stays replicated.

| kind | arrays | spec |
| --- | --- | --- |
| column-parallel kernel [in, out] | q/k/v/f_b/g_b/b projections, q_b_proj, kv_b_proj, gate/up, lm_head | (None, TP) |
| row-parallel kernel [in, out] | o_proj, down_proj | (TP, None) |
| vocabulary rows [V, D] | embed_tokens | (TP, None) |
| per head / per channel | KDA A_log, dt_bias | (TP,) |
| conv taps [C, W] | KDA conv | (TP, None) |
| experts [E, D, I] / [E, I, D] | w_gate, w_up / w_down | (None, None, TP) / (None, TP, None) |
| everything else | norms, mHC, router, q_a / kv_a / f_a / g_a, DSA indexer, eh_proj | replicated |
| scanned group parameters (`glmjax.layer_scan`) | [G, ...] | (None, *their spec) |
| token activations [T, ...] | residual stream, batch metadata, logits | replicated |
| head activations [T, H, ...] | KDA q, k, v, g, o; MLA absorbed queries | (None, TP, None) |
| KDA recurrent pool / states [S, H, K, V] | | (None, TP, None, None) |
| KDA conv pool [S, C, W - 1] | | (None, TP, None) |
| MLA latent cache [B, P * dcp, L] | | (None, "dcp", None) |
| DSA index keys [B, P * dcp, d] | | replicated |
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from glmjax.caches import Caches
from glmjax.layer_scan import GROUPS
from glmjax.layers.paged_cache import MLACache
from glmjax.state_pool import StatePool

AXES = ("tpo", "dcp")
DCP_AXIS = "dcp"
TP = AXES  # tensor parallelism spans both axes


@dataclasses.dataclass(frozen=True)
class Specs:
    """The PartitionSpec of every kind of array (see the module's table), named once."""

    replicated: P = P()
    # Parameters; kernels are [in, out].
    column: P = P(None, TP)
    row: P = P(TP, None)
    vocab_rows: P = P(TP, None)
    per_head: P = P(TP)
    conv_weight: P = P(TP, None)
    expert_column: P = P(None, None, TP)
    expert_row: P = P(None, TP, None)
    # Activations.
    tokens: P = P()
    heads: P = P(None, TP, None)
    head_scalars: P = P(None, TP)
    # States and caches.
    kda_states: P = P(None, TP, None, None)
    kda_snapshots: P = P(None, None, TP, None, None)
    conv_states: P = P(None, TP, None)
    mla_latent: P = P(None, DCP_AXIS, None)
    mla_index_keys: P = P()


SPECS = Specs()

# The module or parameter name at the end of a parameter's path -> its `Specs` field.
# Names not listed are replicated (the DSA indexer's `wq_b` and `weights_proj` among them:
# every rank computes the same top-k selection).
PARAM_SPECS = {
    "embed_tokens": "vocab_rows",
    "lm_head": "column",
    # KDA
    "q_proj": "column",
    "k_proj": "column",
    "v_proj": "column",
    "f_b_proj": "column",
    "g_b_proj": "column",
    "b_proj": "column",
    "A_log": "per_head",
    "dt_bias": "per_head",
    "conv": "conv_weight",
    "o_proj": "row",
    # MLA
    "q_b_proj": "column",
    "kv_b_proj": "column",
    # MLP, shared experts, routed experts
    "gate_proj": "column",
    "up_proj": "column",
    "down_proj": "row",
    "w_gate": "expert_column",
    "w_up": "expert_column",
    "w_down": "expert_row",
}


def param_spec(path: tuple, specs: Specs = SPECS) -> P:
    """The PartitionSpec of the parameter at `path` (a JAX key path into ``nnx.State``).
    A scanned group's parameters (`glmjax.layer_scan`) gain a leading, unsplit layer axis."""
    names = [str(getattr(key, "key", getattr(key, "name", ""))) for key in path]
    spec = specs.replicated
    for name in reversed(names):
        if name in PARAM_SPECS:
            spec = getattr(specs, PARAM_SPECS[name])
            break
    return P(None, *spec) if GROUPS in names else spec


def cache_specs(caches: Caches, specs: Specs = SPECS) -> Caches:
    """`caches` with every array replaced by its PartitionSpec."""
    def mla(c: MLACache) -> MLACache:
        return MLACache(specs.mla_latent, None if c.index_keys is None else specs.mla_index_keys)

    return Caches(tuple(StatePool(specs.kda_states, specs.conv_states) for _ in caches.kda),
                  tuple(map(mla, caches.mla)), tuple(map(mla, caches.mtp)))
