"""The model on a (tp, dcp) device mesh (DESIGN section 5): the mesh, putting arrays on it
and the jitted steps over it.

    mesh = make_mesh(tp=4, dcp=2)                 # 4 devices as (tpo=2, dcp=2)
    plan = ShardingPlan(config, mesh, interleave=1)
    steps = plan.steps()                          # or single_device_steps(config)
    model_state = steps.place(nnx.split(model))
    caches = steps.init_caches(num_state_slots, num_kv_blocks)
    out = steps.prefill(model_state, caches, batch)   # caches donated, as on one device

Which mesh axis each parameter, activation, state pool and cache is split over (tensor
parallelism over both axes, the MLA latent cache by token over "dcp") is
`glmjax.sharding_specs`; the plan turns those PartitionSpecs into the NamedShardings of
the jitted steps.

Explicit collectives (shard_map) are used where the pattern matters: the KDA scan runs per
device on its own heads (a Pallas kernel must see the per-device head count), and MLA
writes, gathers and attends to the latent cache per dcp rank (see `glmjax.layers.mla`).
Everything else is left to XLA's partitioner through the NamedShardings of the jitted steps.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from glmjax.caches import Caches, copy_kv_blocks, copy_state_slots
from glmjax.config import ModelConfig
from glmjax.layers.paged_cache import DCPLayout
from glmjax.mixed import mixed
from glmjax.model import (
    DecodeOutput,
    HybridModel,
    ModelState,
    PrefillOutput,
    decode,
    decode_pinned,
    decode_step,
    prefill,
    prefill_step,
    pure_state,
)
from glmjax.sharding_specs import AXES, DCP_AXIS, SPECS, Specs, cache_specs, param_spec
from glmjax.xla_options import STEP_OPTIONS

SUPPORTED_DCP = (1, 2, 4)


def make_mesh(tp: int, dcp: int = 1, devices=None) -> Mesh:
    """`tp` devices (the first of `devices`, default ``jax.devices()``) as a
    ``(tp // dcp, dcp)`` mesh with axes ``("tpo", "dcp")``.

    Raises:
      ValueError: naming tp or dcp when dcp is not 1, 2 or 4, does not divide tp, or there
        are fewer than tp devices.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got tp={tp!r}")
    if isinstance(dcp, bool) or dcp not in SUPPORTED_DCP:
        raise ValueError(f"dcp must be one of {SUPPORTED_DCP}, got dcp={dcp!r}")
    if tp % dcp:
        raise ValueError(f"dcp={dcp} must divide tp={tp}")
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) < tp:
        platform = devices[0].platform if devices else "none"
        raise ValueError(
            f"tp={tp} needs {tp} devices; JAX has {len(devices)} ({platform}). On a CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tp} before JAX starts")
    return Mesh(np.asarray(devices[:tp]).reshape(tp // dcp, dcp), AXES)


def put(tree, shardings):
    """``jax.device_put(tree, shardings)`` (`shardings` one per leaf, or one for all).
    Over several processes (``glmjax.distributed``) each process puts its own devices'
    slices of its host copy, which must be the same in every process (as weights drawn
    from the same seed, files read on every host, or step metadata announced by process 0
    are): ``jax.device_put`` would check that with a collective of every array, compiled
    per shape, at every step."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def one(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)



def host_copy(tree):
    """`tree` with every array whole on the host (NumPy). Arrays other processes hold
    shards of are gathered from them (``process_allgather``, a collective: every process
    must call this with the same tree)."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)

def request_cpu_devices(count: int) -> None:
    """Ask JAX for `count` host (CPU) devices, so that a mesh can be tried on a CPU. Only
    takes effect before JAX starts its backends (else `make_mesh` reports the shortfall);
    harmless on a GPU machine, where the CPU devices go unused."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    if jax.config.jax_num_cpu_devices >= count:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # backends already started: their device count stands
        pass


def device_bytes(tree) -> dict[Any, int]:
    """Bytes each device holds of the arrays in `tree` (its addressable shards)."""
    held: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


class ModelSteps(NamedTuple):
    """What a serving loop runs: the jitted steps (caches donated, as `glmjax.model.prefill`
    and friends) and how to place the parameters and make the caches they expect."""

    prefill: Callable  # (model_state, caches, batch, *, return_logprobs=False) -> PrefillOutput
    decode: Callable  # (model_state, caches, batch) -> DecodeOutput
    copy_state_slots: Callable  # (caches, sources, destinations) -> (caches, status)
    copy_kv_blocks: Callable  # (caches, sources, destinations) -> caches
    init_caches: Callable[[int, int], Caches]  # (num_state_slots, num_kv_blocks) -> Caches
    place: Callable[[ModelState], ModelState]  # put the parameters where the steps want them
    mesh: Mesh | None  # None: JAX's default device (dcp emulated, see serving.engine)
    layout: DCPLayout  # where the MLA latent cache keeps each token (DCPLayout() on one device)
    # (model_state, caches, prefill batch, decode batch) -> MixedOutput: both in one forward
    # (`glmjax.mixed`); None where there is none (a mesh, for now).
    mixed: Callable | None = None
    # (model_state, caches, batch, DecodeBuffers) -> DecodeOutput: decode writing its
    # outputs into donated buffers (`glmjax.model.decode_pinned`, `serving.pinned`); None
    # where the engine calls `decode` (a mesh, for now).
    decode_pinned: Callable | None = None

    @property
    def dcp(self) -> int | None:
        """The mesh's dcp ranks; None on one device."""
        return None if self.mesh is None else self.mesh.shape[DCP_AXIS]


def single_device_steps(config: ModelConfig) -> ModelSteps:
    """The steps of `glmjax.model` on JAX's default device; the engine's decode steps call
    `decode_pinned` (`serving.pinned`)."""
    return ModelSteps(prefill, decode, copy_state_slots, copy_kv_blocks,
                      lambda slots, blocks: Caches.init(config, slots, blocks),
                      pure_state, None, DCPLayout(), mixed, decode_pinned)


@dataclasses.dataclass(frozen=True, eq=False)
class MeshStep:
    """A model step jitted over a mesh, called as `glmjax.model`'s jitted steps are: its
    last argument, the batch (host arrays), is replicated over the mesh first. `jitted`
    maps ``return_logprobs`` to the jitted function (one entry, False, for decode);
    `lower` lowers for an ahead-of-time compile, as `jax.jit`'s does."""

    jitted: dict[bool, Callable]
    replicated: NamedSharding

    def _step(self, return_logprobs: bool) -> Callable:
        if return_logprobs not in self.jitted:
            raise ValueError(f"{self.__name__} has no return_logprobs={return_logprobs} variant")
        return self.jitted[return_logprobs]

    def __call__(self, model_state, caches, batch, *, return_logprobs=False):
        return self._step(return_logprobs)(model_state, caches, put(batch, self.replicated))

    def lower(self, model_state, caches, batch, *, return_logprobs=False):
        return self._step(return_logprobs).lower(model_state, caches,
                                                 put(batch, self.replicated))

    @property
    def __name__(self) -> str:
        """The jitted function's name, as compile logs report it."""
        return self.jitted[False].__name__


@dataclasses.dataclass(frozen=True, eq=False)
class MeshCopy:
    """A cache copy jitted over a mesh, called as `glmjax.caches`' copies are: its
    (sources, destinations) pairs (host int32 arrays) are replicated first; `lower` lowers
    for an ahead-of-time compile (`serving.precompile`), as `jax.jit`'s does."""

    jitted: Callable
    replicated: NamedSharding

    def __call__(self, caches, sources, destinations):
        return self.jitted(caches, *put((sources, destinations), self.replicated))

    def lower(self, caches, sources, destinations):
        return self.jitted.lower(caches, *put((sources, destinations), self.replicated))


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """How `config`'s model runs on `mesh` (from `make_mesh`): the specs, the DCP layout of
    the MLA latent cache (`interleave` tokens per run, dividing ``kv_block_size / dcp``)
    and the jitted steps. The layers read `mesh`, `specs`, `layout` and `dcp_axis`.

    Raises:
      ValueError: if tp does not divide a head count or width the specs split, or the
        interleave does not tile the KV block.
    """

    config: ModelConfig
    mesh: Mesh
    interleave: int = 1
    specs: Specs = SPECS

    def __post_init__(self):
        if self.mesh.axis_names != AXES:
            raise ValueError(f"mesh axes must be {AXES}, got {self.mesh.axis_names}")
        c, tp = self.config, self.tp
        split = {"kda_num_heads": c.kda_num_heads, "mla_num_heads": c.mla_num_heads,
                 "moe_intermediate_size": c.moe_intermediate_size,
                 "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size}
        for name, size in split.items():
            if size % tp:
                raise ValueError(f"tp={tp} must divide {name}={size}")
        self.layout.check_block(c.kv_block_size)

    @property
    def tp(self) -> int:
        return self.mesh.size

    @property
    def dcp(self) -> int:
        return self.mesh.shape[DCP_AXIS]

    @property
    def dcp_axis(self) -> str:
        return DCP_AXIS

    @property
    def layout(self) -> DCPLayout:
        return DCPLayout(self.dcp, self.interleave)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def constrain(self, x: jax.Array, spec: P) -> jax.Array:
        """Inside the jitted steps: pin `x` to `spec` on the mesh."""
        return jax.lax.with_sharding_constraint(x, self.sharding(spec))

    def param_shardings(self, params: nnx.State):
        """`params` (``nnx.split(model)[1]``) with every array replaced by its sharding."""
        def sharding(path, leaf):
            spec = param_spec(path, self.specs)
            for dim, axes in enumerate(spec):
                if axes is not None and leaf.shape[dim] % self.tp:
                    raise ValueError(f"parameter {jax.tree_util.keystr(path)} of shape "
                                     f"{leaf.shape}: dim {dim} does not split over tp={self.tp}")
            return self.sharding(spec)

        return jax.tree_util.tree_map_with_path(sharding, params)

    def cache_shardings(self, caches: Caches) -> Caches:
        return jax.tree.map(self.sharding, cache_specs(caches, self.specs))

    def place(self, model_state: ModelState) -> ModelState:
        """``nnx.split(model)`` with its parameters sharded over the mesh, as
        ``glmjax.model.pure_state`` (dicts of arrays). Abstract parameters
        (``jax.ShapeDtypeStruct``, for ahead-of-time compiles) get their shardings attached
        instead."""
        graphdef, params = model_state
        shardings = self.param_shardings(params)
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            return pure_state((graphdef, jax.tree.map(lambda x, s: x.update(sharding=s),
                                                      params, shardings)))
        return pure_state((graphdef, put(params, shardings)))

    def init_caches(self, num_state_slots: int, num_kv_blocks: int) -> Caches:
        """Zeroed caches, made in place on the mesh (no device holds them whole)."""
        def make():
            return Caches.init(self.config, num_state_slots, num_kv_blocks)

        return jax.jit(make, out_shardings=self.cache_shardings(jax.eval_shape(make)))()

    def steps(self) -> ModelSteps:
        """The model's steps jitted over the mesh: in and out shardings from the specs,
        caches donated. Batches may be host arrays; they are replicated."""
        graphdef, params = nnx.split(nnx.eval_shape(lambda: HybridModel(self.config,
                                                                         nnx.Rngs(0))))
        state_sh = pure_state((graphdef, self.param_shardings(params)))
        rep = self.sharding(self.specs.replicated)
        shapes = jax.eval_shape(lambda: Caches.init(self.config, 1, 1))
        caches_sh = self.cache_shardings(shapes)

        def prefill_on_mesh(state, caches, batch, *, return_logprobs):
            return prefill_step(state, caches, batch, return_logprobs=return_logprobs,
                                plan=self)

        def decode_on_mesh(state, caches, batch):
            return decode_step(state, caches, batch, plan=self)

        jitted_prefill = {
            logprobs: jax.jit(
                functools.partial(prefill_on_mesh, return_logprobs=logprobs),
                in_shardings=(state_sh, caches_sh, rep),
                out_shardings=PrefillOutput(rep, caches_sh, rep, rep if logprobs else None),
                donate_argnums=1, compiler_options=STEP_OPTIONS)
            for logprobs in (False, True)}
        jitted_decode = jax.jit(decode_on_mesh, in_shardings=(state_sh, caches_sh, rep),
                                out_shardings=DecodeOutput(rep, caches_sh, rep),
                                donate_argnums=1, compiler_options=STEP_OPTIONS)
        jitted_copy_slots = jax.jit(copy_state_slots, in_shardings=(caches_sh, rep, rep),
                                    out_shardings=(caches_sh, rep), donate_argnums=0)
        jitted_copy_blocks = jax.jit(copy_kv_blocks, in_shardings=(caches_sh, rep, rep),
                                     out_shardings=caches_sh, donate_argnums=0)

        run_prefill = MeshStep(jitted_prefill, rep)
        run_decode = MeshStep({False: jitted_decode}, rep)

        return ModelSteps(run_prefill, run_decode, MeshCopy(jitted_copy_slots, rep),
                          MeshCopy(jitted_copy_blocks, rep), self.init_caches, self.place,
                          self.mesh, self.layout)
