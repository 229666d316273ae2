"""Upstream Hugging Face tensor names of both model families, mapped onto `HybridModel`.

Every upstream tensor belongs to one *entry*: a group of upstream names, the model
parameters they become, and the transform between them. Names are relative to a layer
prefix: ``model.layers.{i}.`` upstream, ``layers.{i}.`` in the model; the MTP layer k is
upstream layer ``num_layers + k`` (the DeepSeek-V3 / GLM convention) and ``mtp.{k}.`` in
the model, its decoder block under ``mtp.{k}.block.``.

Transforms: ``linear`` transposes torch's ``[out, in]`` Linear weight into an NNX kernel
``[in, out]``; ``copy`` keeps the tensor; ``heads`` reshapes (any size-1 axes are accepted
on load); ``conv`` concatenates the q, k and v depthwise convs ``[C, 1, W]`` into the
model's one conv ``[3C, W]`` (glmjax/layers/kda.py fuses them); ``experts`` transposes
each expert's ``[out, in]`` weight and stacks them into the grouped ``[E, in, out]`` tensor
of `MoE`; ``hc_base`` splits one ``[2n + n^2]`` bias into ``b_pre [n]``, ``b_post [n]``,
``b_res [n, n]`` (row-major).

Shared by both families (upstream -> model, transform):

| upstream | model | transform |
| --- | --- | --- |
| model.embed_tokens.weight | embed_tokens.embedding | copy |
| model.norm.weight | norm.weight | copy |
| lm_head.weight (absent when tied) | lm_head.kernel | linear |
| input_layernorm.weight, post_attention_layernorm.weight | same names | copy |
| KDA self_attn.{q,k,v,f_a,f_b,g_a,g_b,b,o}_proj.weight | mixer.*_proj.kernel | linear |
| KDA self_attn.{q,k,v}_conv1d.weight | mixer.conv.weight | conv |
| KDA self_attn.A_log | mixer.A_log | heads |
| KDA self_attn.dt_bias, self_attn.o_norm.weight | mixer.dt_bias, mixer.o_norm.weight | copy |
| MLA self_attn.q_proj.weight (no q LoRA) | mixer.q_proj.kernel | linear |
| MLA self_attn.q_a_proj / q_b_proj .weight | mixer.q_a_proj / q_b_proj .kernel | linear |
| MLA self_attn.q_a_layernorm / kv_a_layernorm .weight | same under mixer. | copy |
| MLA self_attn.kv_a_proj_with_mqa / kv_b_proj / o_proj .weight | same under mixer. | linear |
| dense mlp.{gate,up,down}_proj.weight | mlp.*_proj.kernel | linear |

kv_b_proj stays one tensor: the model reads it per head as ``[nope | v]``, upstream's layout.

Kimi-Linear (moonshotai/Kimi-Linear-48B-A3B; names as its safetensors index has them):

| upstream | model | transform |
| --- | --- | --- |
| self_attn.A_log, written [1, 1, H, 1] | mixer.A_log [H] | heads |
| block_sparse_moe.gate.weight | mlp.router.kernel | linear |
| block_sparse_moe.gate.e_score_correction_bias | mlp.e_score_correction_bias | copy |
| block_sparse_moe.experts.{e}.w1 / w3 / w2 .weight | mlp.w_gate / w_up / w_down | experts |
| block_sparse_moe.shared_experts.{gate,up,down}_proj.weight | mlp.shared_experts.* | linear |

GLM-5.3-Flash. No checkpoint of this hybrid is public, so these names are our choice: the
GLM-5 / DeepSeek-V3.2 names for MLA, the DSA indexer, MoE and MTP; Kimi's KDA names under
``self_attn.`` (KDA has no GLM precedent); DeepSeek-V4's ``hc_{attn,ffn}_{fn,base,scale}``
for mHC. The model's mHC mixing order (pre, post, res) is DeepSeek-V4's.

| upstream | model | transform |
| --- | --- | --- |
| self_attn.A_log, written [H] | mixer.A_log | heads |
| self_attn.indexer.{wq_b,wk,weights_proj}.weight | mixer.indexer.*.kernel | linear |
| self_attn.indexer.k_norm.weight / .bias | mixer.indexer.k_norm.scale / .bias | copy |
| mlp.gate.weight | mlp.router.kernel | linear |
| mlp.gate.e_score_correction_bias | mlp.e_score_correction_bias | copy |
| mlp.experts.{e}.gate_proj / up_proj / down_proj .weight | mlp.w_gate / w_up / w_down | experts |
| mlp.shared_experts.{gate,up,down}_proj.weight | mlp.shared_experts.* | linear |
| hc_attn_fn / hc_ffn_fn [2n + n^2, n * D] | mixer_residual.phi / mlp_residual.phi | linear |
| hc_attn_base / hc_ffn_base | {mixer,mlp}_residual.b_pre, b_post, b_res | hc_base |
| hc_attn_scale / hc_ffn_scale [3] | {mixer,mlp}_residual.alpha | copy |
| MTP eh_proj.weight | mtp.{k}.eh_proj.kernel | linear |
| MTP enorm / hnorm / shared_head.norm .weight | mtp.{k}.enorm / hnorm / shared_head_norm | copy |
| MTP embed_tokens.weight, shared_head.head.weight | none: the MTP uses the main model's | ignored |

The MTP layer's decoder block (MLA + indexer, MoE, mHC) uses the per-layer names above under
its own layer prefix. The Kimi family has no names for mHC, the DSA indexer or MTP: loading
a config that uses them with it fails, naming the parameters left without an upstream name.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from glmjax.config import ModelConfig

Shape = tuple[int, ...]


class Transform(Protocol):
    """Maps the upstream tensors of one entry to its model parameters, and back.

    `loose_singletons`: an upstream tensor may differ from the expected shape by size-1 axes.
    """

    loose_singletons: bool

    def upstream_shapes(self, param_shapes: list[Shape]) -> list[Shape]: ...

    def to_model(self, tensors: list[np.ndarray], param_shapes: list[Shape]
                 ) -> list[np.ndarray]: ...

    def to_upstream(self, params: list[np.ndarray]) -> list[np.ndarray]: ...


def _squeezed(shape: Shape) -> Shape:
    return tuple(d for d in shape if d != 1)


class Copy:
    loose_singletons = False

    def upstream_shapes(self, param_shapes):
        return list(param_shapes)

    def to_model(self, tensors, param_shapes):
        return list(tensors)

    def to_upstream(self, params):
        return list(params)


class Linear:
    """torch Linear weight [out, in] <-> NNX kernel [in, out]."""

    loose_singletons = False

    def upstream_shapes(self, param_shapes):
        return [shape[::-1] for shape in param_shapes]

    def to_model(self, tensors, param_shapes):
        return [t.T for t in tensors]

    def to_upstream(self, params):
        return [p.T for p in params]


@dataclasses.dataclass(frozen=True)
class Heads:
    """A per-head vector written with extra size-1 axes: `axes_before` and `axes_after`."""

    axes_before: int = 0
    axes_after: int = 0
    loose_singletons = True

    def upstream_shapes(self, param_shapes):
        return [(1,) * self.axes_before + shape + (1,) * self.axes_after
                for shape in param_shapes]

    def to_model(self, tensors, param_shapes):
        return [t.reshape(shape) for t, shape in zip(tensors, param_shapes)]

    def to_upstream(self, params):
        return [p.reshape(shape) for p, shape in
                zip(params, self.upstream_shapes([p.shape for p in params]))]


class Conv:
    """q, k, v depthwise conv weights [C, 1, W] <-> the fused conv [3C, W]."""

    loose_singletons = True

    def upstream_shapes(self, param_shapes):
        (channels, width), = param_shapes
        return [(channels // 3, 1, width)] * 3

    def to_model(self, tensors, param_shapes):
        (shape,) = param_shapes
        return [np.concatenate([t.reshape(shape[0] // 3, shape[1]) for t in tensors])]

    def to_upstream(self, params):
        (param,) = params
        return [part[:, None, :] for part in np.split(param, 3)]


class Experts:
    """One torch Linear weight [out, in] per expert <-> the grouped kernel [E, in, out]."""

    loose_singletons = False

    def upstream_shapes(self, param_shapes):
        (experts, d_in, d_out), = param_shapes
        return [(d_out, d_in)] * experts

    def to_model(self, tensors, param_shapes):
        return [np.stack([t.T for t in tensors])]

    def to_upstream(self, params):
        (param,) = params
        return [expert.T for expert in param]


class HCBase:
    """The flat mHC bias [2n + n^2] <-> b_pre [n], b_post [n], b_res [n, n]."""

    loose_singletons = False

    def upstream_shapes(self, param_shapes):
        return [(sum(int(np.prod(shape)) for shape in param_shapes),)]

    def to_model(self, tensors, param_shapes):
        (flat,) = tensors
        sizes = np.cumsum([int(np.prod(shape)) for shape in param_shapes])[:-1]
        return [part.reshape(shape) for part, shape in zip(np.split(flat, sizes), param_shapes)]

    def to_upstream(self, params):
        return [np.concatenate([p.reshape(-1) for p in params])]


COPY, LINEAR, CONV, EXPERTS, HC_BASE = Copy(), Linear(), Conv(), Experts(), HCBase()


def shape_matches(transform: Transform, got: Shape, want: Shape) -> bool:
    """Whether an upstream tensor of shape `got` can stand where `want` is expected."""
    if tuple(got) == tuple(want):
        return True
    return transform.loose_singletons and _squeezed(got) == _squeezed(want)


@dataclasses.dataclass(frozen=True)
class Entry:
    """Upstream name suffixes -> model path suffixes; ``{e}`` repeats once per expert."""

    upstream: tuple[str, ...]
    model: tuple[str, ...]
    transform: Transform


def _names(names: str | list[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def _entry(upstream, model, transform=LINEAR) -> Entry:
    return Entry(_names(upstream), _names(model), transform)


def _linears(upstream_dir: str, model_dir: str, names: str) -> tuple[Entry, ...]:
    return tuple(_entry(f"{upstream_dir}{n}.weight", f"{model_dir}{n}.kernel")
                 for n in names.split())


NORMS = (_entry("input_layernorm.weight", "input_layernorm.weight", COPY),
         _entry("post_attention_layernorm.weight", "post_attention_layernorm.weight", COPY))

KDA = (
    *_linears("self_attn.", "mixer.", "q_proj k_proj v_proj f_a_proj f_b_proj b_proj "
              "g_a_proj g_b_proj o_proj"),
    _entry([f"self_attn.{x}_conv1d.weight" for x in "qkv"], "mixer.conv.weight", CONV),
    _entry("self_attn.dt_bias", "mixer.dt_bias", COPY),
    _entry("self_attn.o_norm.weight", "mixer.o_norm.weight", COPY),
)  # A_log: per family

MLA = (
    *_linears("self_attn.", "mixer.", "kv_a_proj_with_mqa kv_b_proj o_proj"),
    _entry("self_attn.kv_a_layernorm.weight", "mixer.kv_a_layernorm.weight", COPY),
)
MLA_Q = _linears("self_attn.", "mixer.", "q_proj")
MLA_Q_LORA = (*_linears("self_attn.", "mixer.", "q_a_proj q_b_proj"),
              _entry("self_attn.q_a_layernorm.weight", "mixer.q_a_layernorm.weight", COPY))

DENSE_MLP = _linears("mlp.", "mlp.", "gate_proj up_proj down_proj")


def _moe(prefix: str, gate: str, up: str, down: str) -> tuple[Entry, ...]:
    return (
        _entry(f"{prefix}gate.weight", "mlp.router.kernel"),
        _entry(f"{prefix}gate.e_score_correction_bias", "mlp.e_score_correction_bias", COPY),
        _entry(f"{prefix}experts.{{e}}.{gate}.weight", "mlp.w_gate", EXPERTS),
        _entry(f"{prefix}experts.{{e}}.{up}.weight", "mlp.w_up", EXPERTS),
        _entry(f"{prefix}experts.{{e}}.{down}.weight", "mlp.w_down", EXPERTS),
        *_linears(f"{prefix}shared_experts.", "mlp.shared_experts.",
                  "gate_proj up_proj down_proj"),
    )


def _mhc(upstream: str, model: str) -> tuple[Entry, ...]:
    return (_entry(f"hc_{upstream}_fn", f"{model}.phi"),
            _entry(f"hc_{upstream}_base", [f"{model}.b_pre", f"{model}.b_post", f"{model}.b_res"],
                   HC_BASE),
            _entry(f"hc_{upstream}_scale", f"{model}.alpha", COPY))


DSA_INDEXER = (
    *_linears("self_attn.indexer.", "mixer.indexer.", "wq_b wk weights_proj"),
    _entry("self_attn.indexer.k_norm.weight", "mixer.indexer.k_norm.scale", COPY),
    _entry("self_attn.indexer.k_norm.bias", "mixer.indexer.k_norm.bias", COPY),
)

MTP_HEAD = (
    _entry("eh_proj.weight", "eh_proj.kernel"),
    _entry("enorm.weight", "enorm.weight", COPY),
    _entry("hnorm.weight", "hnorm.weight", COPY),
    _entry("shared_head.norm.weight", "shared_head_norm.weight", COPY),
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One upstream naming; an empty table means the family has no names for that part."""

    name: str
    a_log: Entry
    moe: tuple[Entry, ...]
    mhc: tuple[Entry, ...]
    dsa_indexer: tuple[Entry, ...]
    mtp_head: tuple[Entry, ...]
    mtp_ignored: tuple[str, ...]  # upstream MTP tensors accepted but not loaded


KIMI = Family(
    name="kimi",
    a_log=_entry("self_attn.A_log", "mixer.A_log", Heads(axes_before=2, axes_after=1)),
    moe=_moe("block_sparse_moe.", gate="w1", up="w3", down="w2"),
    mhc=(), dsa_indexer=(), mtp_head=(), mtp_ignored=())

GLM = Family(
    name="glm",
    a_log=_entry("self_attn.A_log", "mixer.A_log", Heads()),
    moe=_moe("mlp.", gate="gate_proj", up="up_proj", down="down_proj"),
    mhc=(*_mhc("attn", "mixer_residual"), *_mhc("ffn", "mlp_residual")),
    dsa_indexer=DSA_INDEXER,
    mtp_head=MTP_HEAD,
    mtp_ignored=("embed_tokens.weight", "shared_head.head.weight"))

FAMILIES = {family.name: family for family in (KIMI, GLM)}


@dataclasses.dataclass(frozen=True)
class Rule:
    """Full upstream names -> dotted model parameter paths (``layers.0.mixer.q_proj.kernel``)."""

    upstream: tuple[str, ...]
    params: tuple[str, ...]
    transform: Transform


def family_named(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown weight family {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def _rules(entries, upstream_prefix: str, model_prefix: str, num_experts: int) -> list[Rule]:
    rules = []
    for entry in entries:
        upstream = tuple(upstream_prefix + name.format(e=e)
                         for name in entry.upstream
                         for e in (range(num_experts) if "{e}" in name else [None]))
        rules.append(Rule(upstream, tuple(model_prefix + p for p in entry.model),
                          entry.transform))
    return rules


def _block_entries(config: ModelConfig, family: Family, kind: str, dense_mlp: bool):
    if kind == "kda":
        mixer = (*KDA, family.a_log)
    else:
        mixer = (*MLA, *(MLA_Q if config.q_lora_rank is None else MLA_Q_LORA),
                 *(family.dsa_indexer if config.dsa_top_k is not None else ()))
    mhc = family.mhc if config.mhc_streams is not None else ()
    return (*NORMS, *mixer, *(DENSE_MLP if dense_mlp else family.moe), *mhc)


def upstream_rules(config: ModelConfig, family: Family) -> list[Rule]:
    """Every upstream tensor of `config` in `family`'s naming, grouped by model parameter."""
    experts = config.num_experts
    rules = _rules([_entry("model.embed_tokens.weight", "embed_tokens.embedding", COPY),
                    _entry("model.norm.weight", "norm.weight", COPY)], "", "", experts)
    if not config.tie_word_embeddings:
        rules += _rules([_entry("lm_head.weight", "lm_head.kernel")], "", "", experts)
    for i, kind in enumerate(config.layer_types):
        entries = _block_entries(config, family, kind, i < config.first_dense_layers)
        rules += _rules(entries, f"model.layers.{i}.", f"layers.{i}.", experts)
    for k in range(config.num_mtp_layers):
        upstream = f"model.layers.{config.num_layers + k}."
        rules += _rules(_block_entries(config, family, "mla", False), upstream,
                        f"mtp.{k}.block.", experts)
        rules += _rules(family.mtp_head, upstream, f"mtp.{k}.", experts)
    return rules


def ignored_names(config: ModelConfig, family: Family) -> set[str]:
    """Upstream tensors a checkpoint may hold that the model does not load."""
    names = {f"model.layers.{config.num_layers + k}.{name}"
             for k in range(config.num_mtp_layers) for name in family.mtp_ignored}
    if config.tie_word_embeddings:
        names.add("lm_head.weight")
    return names
