"""Hugging Face safetensors checkpoints in, orbax checkpoints of converted parameters out.

    model = load_safetensors("/ckpt/Kimi-Linear-48B-A3B-Instruct", config, family="kimi")
    save_params("/ckpt/converted", model)       # sharded arrays are written as they lie
    model = restore_params("/ckpt/converted", config, sharding=param_sharding)

A safetensors checkpoint is a folder of ``*.safetensors`` files, with or without the
``model.safetensors.index.json`` that maps tensor names to files; tensors keep their
upstream names (the two namings, ``"kimi"`` and ``"glm"``, and every transform are in
`glmjax.weight_names`). Loading checks the whole checkpoint before reading any tensor: one
`ValueError` lists every missing, unexpected and mis-shaped tensor. Each parameter is cast
to the dtype the model declares for it (``config.param_dtype``, or fp32 where the layer
keeps fp32: A_log, dt_bias, the mHC maps, the router bias).

`sharding` places parameters as they are created: one `jax.sharding.Sharding` for all, or a
function of the dotted parameter path (``"layers.0.mixer.q_proj.kernel"``) and shape.
A model with scanned layer groups (``config.scan_layers``, `glmjax.layer_scan`) is read
per layer and its groups' parameters stacked after (``"layer_groups.0...."``, [G, ...]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors import safe_open

from glmjax.config import ModelConfig
from glmjax.layer_scan import layer_plan, stack_params, unstack_params
from glmjax.model import HybridModel
from glmjax.weight_names import (
    Family,
    Rule,
    Shape,
    family_named,
    ignored_names,
    shape_matches,
    upstream_rules,
)

INDEX_FILE = "model.safetensors.index.json"

ParamSharding = jax.sharding.Sharding | Callable[[str, Shape], jax.sharding.Sharding] | None


def _abstract_model(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """GraphDef and parameter state (ShapeDtypeStruct leaves) of `config`'s model."""
    return nnx.split(nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0))), nnx.Param)


def _flat(state: nnx.State) -> dict[str, tuple[tuple, Any]]:
    """Dotted parameter path -> (state key path, leaf)."""
    return {".".join(map(str, path)): (path, variable.get_value())
            for path, variable in nnx.to_flat_state(state)}


def _with_leaves(state: nnx.State, leaves: dict[tuple, Any]) -> nnx.State:
    """`state` with the leaf at each key path replaced."""
    pure = nnx.to_pure_dict(state)
    for path, leaf in leaves.items():
        node = pure
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = leaf
    nnx.replace_by_pure_dict(state, pure)
    return state


def _resolve(sharding: ParamSharding, name: str, shape: Shape) -> jax.sharding.Sharding:
    if sharding is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    return sharding(name, shape)


def _checked_rules(config: ModelConfig, family: Family, params) -> list[Rule]:
    """`family`'s rules for `config`, checked to cover each model parameter exactly once."""
    rules = upstream_rules(config, family)
    covered = [name for rule in rules for name in rule.params]
    uncovered = sorted(set(params) - set(covered))
    if uncovered:
        raise ValueError(f"the {family.name!r} naming has no upstream tensor for these "
                         f"parameters of config {config.name!r}: {', '.join(uncovered)}")
    unknown = sorted(set(covered) - set(params))
    twice = sorted({name for name in covered if covered.count(name) > 1})
    if unknown or twice:  # a bug in glmjax.weight_names, not in a checkpoint
        raise ValueError(f"the {family.name!r} naming maps onto parameters the model lacks "
                         f"{unknown} or maps twice {twice}")
    return rules


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the ``.safetensors`` file holding it.

    Reads the index when the folder has one (its files must exist), else every
    ``*.safetensors`` file in the folder (a name in two files is an error).
    """
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.exists():
        files = {name: folder / file
                 for name, file in json.loads(index.read_text())["weight_map"].items()}
        absent = sorted({file.name for file in files.values() if not file.exists()})
        if absent:
            raise ValueError(f"{index} names files that do not exist: {', '.join(absent)}")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors files in {folder}")
    files, repeated = {}, []
    for shard in shards:
        with safe_open(shard, framework="np") as handle:
            for name in handle.keys():
                if name in files:
                    repeated.append(f"{name} ({files[name].name}, {shard.name})")
                files[name] = shard
    if repeated:
        raise ValueError(f"tensors stored in two files of {folder}: {', '.join(repeated)}")
    return files


class _Shards:
    """Open handles on a checkpoint's files; tensors read lazily, one at a time."""

    def __init__(self, files: dict[str, Path], stack: contextlib.ExitStack):
        handles = {file: stack.enter_context(safe_open(file, framework="np"))
                   for file in sorted(set(files.values()))}
        keys = {file: set(handle.keys()) for file, handle in handles.items()}
        self._handle = {name: handles[file] for name, file in files.items()
                        if name in keys[file]}
        # An index entry whose file lacks the tensor counts as missing.
        self.shapes = {name: tuple(handle.get_slice(name).get_shape())
                       for name, handle in self._handle.items()}

    def read(self, name: str) -> np.ndarray:
        return self._handle[name].get_tensor(name)


def _check_tensors(path, family: Family, rules: list[Rule], params, found: dict[str, Shape],
                   ignored: set[str]) -> None:
    """Raise one ValueError listing every missing, unexpected and mis-shaped tensor."""
    expected = {}
    for rule in rules:
        shapes = rule.transform.upstream_shapes([params[name][1].shape for name in rule.params])
        for name, shape in zip(rule.upstream, shapes, strict=True):
            expected[name] = (shape, rule.transform)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected) - ignored)
    misshaped = [f"{name} {found[name]} (expected {shape})"
                 for name, (shape, transform) in sorted(expected.items())
                 if name in found and not shape_matches(transform, found[name], shape)]
    problems = [f"{label} ({len(names)}): {', '.join(names)}"
                for label, names in (("missing", missing), ("unexpected", unexpected),
                                     ("wrong shape", misshaped)) if names]
    if problems:
        raise ValueError(f"checkpoint {path} does not fit the {family.name!r} naming of this "
                         "model:\n  " + "\n  ".join(problems))


def load_safetensors(path: str | Path, config: ModelConfig, *, family: str,
                     sharding: ParamSharding = None) -> HybridModel:
    """A `HybridModel` of `config` with every parameter read from the checkpoint at `path`.

    Args:
      path: folder of ``*.safetensors`` files (optionally with ``model.safetensors.index.json``).
      config: the model the checkpoint holds.
      family: the upstream naming, ``"kimi"`` or ``"glm"`` (see `glmjax.weight_names`).
      sharding: where each parameter goes (see the module docstring); default: device 0.
    Raises:
      ValueError: the naming cannot express `config`, or tensors are missing, unexpected or
        mis-shaped (all of them named).
    """
    if layer_plan(config).num_groups:  # read per layer, then stacked
        unrolled = load_safetensors(path, dataclasses.replace(config, scan_layers=False),
                                    family=family, sharding=sharding)
        return _scanned(unrolled, config, sharding)
    naming = family_named(family)
    graphdef, state = _abstract_model(config)
    params = _flat(state)
    rules = _checked_rules(config, naming, params)
    with contextlib.ExitStack() as stack:
        shards = _Shards(checkpoint_files(path), stack)
        _check_tensors(path, naming, rules, params, shards.shapes, ignored_names(config, naming))
        leaves = {}
        for rule in rules:
            abstract = [params[name][1] for name in rule.params]
            arrays = rule.transform.to_model([shards.read(name) for name in rule.upstream],
                                             [leaf.shape for leaf in abstract])
            for name, array, leaf in zip(rule.params, arrays, abstract, strict=True):
                leaves[params[name][0]] = jax.device_put(
                    np.asarray(array).astype(leaf.dtype),
                    _resolve(sharding, name, leaf.shape))
    return nnx.merge(graphdef, _with_leaves(state, leaves))


def _scanned(unrolled: HybridModel, config: ModelConfig, sharding: ParamSharding
             ) -> HybridModel:
    """`unrolled`'s parameters as `config`'s scanned model (`glmjax.layer_scan`); each
    stacked leaf is placed by `sharding` under its scanned name, and its per-layer arrays
    are freed as it is made, so the device holds at most one stacked leaf more than the
    model."""
    def stack(name, leaves):
        shape = (len(leaves), *leaves[0].shape)
        stacked = jax.device_put(jnp.stack(leaves), _resolve(sharding, name, shape))
        for leaf in leaves:
            leaf.delete()
        return stacked

    graphdef, state = _abstract_model(config)
    nnx.replace_by_pure_dict(state, stack_params(
        nnx.to_pure_dict(nnx.state(unrolled, nnx.Param)), config, stack))
    return nnx.merge(graphdef, state)


def _unrolled(model: HybridModel) -> HybridModel:
    """A scanned model's parameters as those of the unrolled model (copies)."""
    config = model.config
    graphdef, state = _abstract_model(dataclasses.replace(config, scan_layers=False))
    nnx.replace_by_pure_dict(state, unstack_params(
        nnx.to_pure_dict(nnx.state(model, nnx.Param)), config))
    return nnx.merge(graphdef, state)


def upstream_tensors(model: HybridModel, family: str) -> dict[str, np.ndarray]:
    """The inverse of `load_safetensors`: upstream name -> tensor, in the parameters' dtypes
    (host copies; for writing checkpoints and for tests)."""
    naming = family_named(family)
    if layer_plan(model.config).num_groups:
        model = _unrolled(model)
    params = _flat(nnx.state(model, nnx.Param))
    tensors = {}
    for rule in _checked_rules(model.config, naming, params):
        values = rule.transform.to_upstream([np.asarray(params[name][1])
                                             for name in rule.params])
        tensors.update(zip(rule.upstream, map(np.ascontiguousarray, values), strict=True))
    return tensors


def save_params(path: str | Path, model: HybridModel) -> None:
    """Write the model's parameters, sharded or not, as an orbax checkpoint in the new
    directory `path`."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(Path(path).absolute(), nnx.state(model, nnx.Param))


def restore_params(path: str | Path, config: ModelConfig, *,
                   sharding: ParamSharding = None) -> HybridModel:
    """The model `save_params` wrote at `path`, restored into the abstract model of `config`
    (`nnx.eval_shape`: no parameter is initialised) with each array placed by `sharding`."""
    graphdef, state = _abstract_model(config)
    target = {key: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                        sharding=_resolve(sharding, name, leaf.shape))
              for name, (key, leaf) in _flat(state).items()}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(Path(path).absolute(), _with_leaves(state, target))
    return nnx.merge(graphdef, restored)
