"""The retained states of `glmjax.prefill`: their host form, the orbax checkpoint they are
saved as, and the caches a resumed run starts from.

States are kept on the host in a layout that does not depend on the mesh: the KDA states
whole (every head), the MLA latent blocks in token order (``DCPLayout.block_rows`` undone).
On a mesh the caches are gathered from every device, and from every process when others
hold shards (`glmjax.sharding.host_copy`: a collective, so every process takes part).
A run resumes under the same weights, config and block size (the fingerprint covers the
config, whose KV block is ``--block-size * --dcp`` tokens).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.layers.paged_cache import DCPLayout, MLACache
from glmjax.sharding import ShardingPlan, host_copy, put

# /2: the fingerprint covers whole tensors and the config (`glmjax.fingerprint`).
FORMAT = "glmjax-offline-prefill-states/2"
RUNNING_SLOT = 0  # checkpoint c of a span goes to slot 1 + c


class SavedStates(NamedTuple):
    """Host copies of retained states: R positions, every KDA layer, plus the MLA latents."""

    positions: tuple[int, ...]  # ascending; state r holds the state after positions[r] tokens
    recurrent: list[np.ndarray]  # per KDA layer, fp32 [R, H, K, V]
    conv: list[np.ndarray]  # per KDA layer, [R, C, W - 1]
    mla: list[dict[str, np.ndarray]]  # per MLA layer, "latent" [M, P, D] (+ "index_keys")
    prefix_sha256: tuple[str, ...]  # per position, `prefix_hash(prompt, p)`
    prompt_sha256: str  # prefix_hash of the whole prompt
    prompt_len: int
    block_size: int
    fingerprint: str  # `model_fingerprint` of the weights and config behind the states


def prefix_hash(tokens: np.ndarray, length: int) -> str:
    """sha256 of the first `length` token ids as little-endian int32."""
    return hashlib.sha256(np.asarray(tokens[:length], "<i4").tobytes()).hexdigest()


# --- saving and loading ---------------------------------------------------------------------

def _checkpointer() -> ocp.Checkpointer:
    """An orbax checkpointer of this process alone (every handler told so: orbax's default
    waits at barriers for every process): over several processes only process 0 saves,
    and each process loads its own copy."""
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    handler = ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(multiprocessing_options=alone),
        arrays=ocp.StandardCheckpointHandler(multiprocessing_options=alone),
        meta=ocp.JsonCheckpointHandler(multiprocessing_options=alone))
    return ocp.Checkpointer(handler, multiprocessing_options=alone)


def save_states(path: str | Path, states: SavedStates) -> None:
    """One orbax checkpoint in the new directory `path`: item ``arrays`` (positions, per KDA
    layer recurrent [R, H, K, V] and conv [R, C, W - 1], per MLA layer its latent blocks) and
    item ``meta`` (JSON: format, positions, prefix hashes, prompt hash, model fingerprint)."""
    arrays = dict(positions=np.asarray(states.positions, np.int32),
                  kda=[dict(recurrent=r, conv=c) for r, c in zip(states.recurrent, states.conv)],
                  mla=list(states.mla))
    meta = dict(format=FORMAT, positions=list(states.positions),
                prefix_sha256=list(states.prefix_sha256), prompt_sha256=states.prompt_sha256,
                prompt_len=states.prompt_len, block_size=states.block_size,
                fingerprint=states.fingerprint)
    with _checkpointer() as checkpointer:
        checkpointer.save(Path(path).absolute(), args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)))


def load_states(path: str | Path) -> SavedStates:
    """What `save_states` wrote at `path`, as host arrays."""
    with _checkpointer() as checkpointer:
        restored = checkpointer.restore(Path(path).absolute(), args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    meta, arrays = restored["meta"], jax.tree.map(np.asarray, restored["arrays"])
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} checkpoint (format {meta.get('format')!r})")
    return SavedStates(
        tuple(meta["positions"]), [layer["recurrent"] for layer in arrays["kda"]],
        [layer["conv"] for layer in arrays["kda"]], list(arrays["mla"]),
        tuple(meta["prefix_sha256"]), meta["prompt_sha256"], meta["prompt_len"],
        meta["block_size"], meta["fingerprint"])


def resume_position(saved: SavedStates, tokens: np.ndarray, fingerprint: str,
                    block_size: int) -> int:
    """The longest saved position p <= L - 1 whose prefix equals the prompt's; 0: none."""
    if saved.fingerprint != fingerprint or saved.block_size != block_size:
        raise ValueError(f"saved states were made by other weights, config (KV block, dcp) or "
                         f"block size ({saved.block_size}); this run has block size {block_size}")
    matches = [p for p, digest in zip(saved.positions, saved.prefix_sha256)
               if p <= len(tokens) - 1 and prefix_hash(tokens, p) == digest]
    return max(matches, default=0)


# --- between the caches and the host --------------------------------------------------------

def _latent_rows(layout: DCPLayout, block_size: int) -> np.ndarray:
    """int32 [block_size]: the row of a block of the (dcp-sharded) latent cache that holds
    token offset u of the block (the identity on one device)."""
    return np.asarray(layout.block_rows(block_size))


def host_latents(caches: Caches, layout: DCPLayout) -> list[dict[str, np.ndarray]]:
    """Per MLA layer {"latent": [M, P, D] in token order (+ "index_keys")}, on the host."""
    host = host_copy(caches.mla)
    if not host:
        return []
    rows = _latent_rows(layout, host[0].latent.shape[1])
    return [{"latent": c.latent[:, rows]}
            | ({} if c.index_keys is None else {"index_keys": c.index_keys}) for c in host]


def resumed_caches(config: ModelConfig, num_slots: int, num_blocks: int, saved: SavedStates,
                   position: int, plan: ShardingPlan | None) -> Caches:
    """Caches for a run resuming at `position`: the saved states at `position` in the running
    slot, the saved MLA latents of the positions before it in blocks 0.. (in the plan's DCP
    layout), zeros elsewhere; placed on the plan's mesh (None: the default device)."""
    shapes = jax.eval_shape(lambda: Caches.init(config, num_slots, num_blocks))
    host = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    row = saved.positions.index(position)
    for pool, rec, conv in zip(host.kda, saved.recurrent, saved.conv, strict=True):
        pool.recurrent[RUNNING_SLOT], pool.conv[RUNNING_SLOT] = rec[row], conv[row]

    def prefix(pages: np.ndarray, stored: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
        tokens = stored.reshape(-1, *stored.shape[2:])[:position]  # rows past it: recomputed
        flat = pages.reshape(-1, *pages.shape[2:])
        flat[:len(tokens)] = tokens[:len(flat)]
        if rows is not None:  # token offset u of each block goes to row rows[u]
            pages[:, rows] = pages.copy()
        return pages

    layout = DCPLayout() if plan is None else plan.layout
    rows = _latent_rows(layout, config.kv_block_size)
    host = host._replace(mla=tuple(
        MLACache(prefix(c.latent, s["latent"], rows),
                 None if c.index_keys is None else prefix(c.index_keys, s["index_keys"], None))
        for c, s in zip(host.mla, saved.mla, strict=True)))
    if plan is None:
        return jax.device_put(host)
    return put(host, plan.cache_shardings(host))


def kda_slots(caches: Caches, slots: list[int]) -> dict[int, list[tuple[np.ndarray, np.ndarray]]]:
    """{slot: [(recurrent [H, K, V], conv [C, W - 1]) per KDA layer]} on the host, whole."""
    pools = host_copy(caches.kda)
    return {slot: [(p.recurrent[slot], p.conv[slot]) for p in pools] for slot in slots}
