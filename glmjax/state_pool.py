"""KDA state pools and the transactional update of one step's states (DESIGN.md section 3).

Each KDA layer owns a pool of `num_slots` state slots: the fp32 recurrent state
``[S, H, K, V]`` and the conv history ``[S, C, W - 1]`` (the last W - 1 pre-convolution
q|k|v inputs, oldest first). A step reads each sequence's running slot, and writes its
final state back there and each retained snapshot to its checkpoint slot.

The update is all or nothing. `prefill_status` checks the step's slot metadata; if any of
it is invalid, no pool of any layer is written (every destination index becomes the
out-of-range sentinel `num_slots`, which the scatter drops), so the pools come back
bit-identical, and the status says why. A decode step updates the pools in place inside
the layers (`pallas_kernels.kda_decode`); `decode_slots` refuses it the same way, by
running it with every slot -1. Slots are indexed only along the slot axis (a
gather / scatter with one index per slot), never through a flattened element offset, so an
int32 slot id addresses pools of any element count.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from glmjax.batch import PrefillBatch
from glmjax.config import ModelConfig
from glmjax.layers.kda import KDAState

MAX_SLOTS = 2**31 - 1  # slot ids and the drop sentinel `num_slots` are int32


class PoolStatus(enum.IntEnum):
    """Why a step's state update was refused; `OK` means it was applied.

    When several problems are present the lowest non-zero code is reported.
    """

    OK = 0
    BAD_CU_SEQLENS = 1  # cu_seqlens[0] != 0, decreasing, or cu_seqlens[N] > T
    SLOT_OUT_OF_RANGE = 2  # a running or checkpoint slot outside [-1, num_slots)
    MISSING_RUNNING_SLOT = 3  # a span with tokens, or with has_initial, has running slot -1
    OFFSET_OUT_OF_RANGE = 4  # a checkpoint offset that is neither -1 nor in 1..len
    OFFSET_WITHOUT_DESTINATION = 5  # an active offset whose checkpoint slot is -1
    DESTINATION_WITHOUT_OFFSET = 6  # a checkpoint slot whose offset is -1
    DUPLICATE_DESTINATION = 7  # a slot written twice (running or checkpoint, any rows)


class StatePool(NamedTuple):
    """One KDA layer's state slots."""

    recurrent: jax.Array  # fp32 [S, H, K, V]
    conv: jax.Array  # [S, C, W - 1] in the config's activation dtype

    @classmethod
    def zeros(cls, config: ModelConfig, num_slots: int) -> StatePool:
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be in [1, 2**31 - 1], got {num_slots}")
        heads, dim = config.kda_num_heads, config.kda_head_dim
        return cls(jnp.zeros((num_slots, heads, dim, dim), jnp.float32),
                   jnp.zeros((num_slots, config.conv_channels, config.conv_kernel - 1),
                             config.dtype))

    @property
    def num_slots(self) -> int:
        return self.recurrent.shape[0]


def _select_status(conditions: Sequence[tuple[PoolStatus, jax.Array]]) -> jax.Array:
    """The first status whose condition holds, else OK: int32 []."""
    codes, flags = zip(*conditions)
    return jnp.select(list(flags), [jnp.int32(c) for c in codes], jnp.int32(PoolStatus.OK))


def _out_of_range(slots: jax.Array, num_slots: int) -> jax.Array:
    return jnp.any((slots < -1) | (slots >= num_slots))


def _has_duplicates(slots: jax.Array) -> jax.Array:
    """Whether a slot >= 0 occurs twice in the flat int32 `slots` (-1 entries ignored)."""
    ordered = jnp.sort(slots)
    return jnp.any((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0))


def prefill_status(batch: PrefillBatch, num_slots: int) -> jax.Array:
    """Check the slot and checkpoint metadata of a prefill step: int32 [] `PoolStatus`."""
    cu = batch.cu_seqlens
    lengths = cu[1:] - cu[:-1]  # [N]
    running, dests = batch.state_slots, batch.checkpoint_slots  # [N], [N, capacity]
    offsets = batch.checkpoint_offsets
    active = offsets != -1
    return _select_status([
        (PoolStatus.BAD_CU_SEQLENS, (cu[0] != 0) | jnp.any(lengths < 0)
         | (cu[-1] > batch.token_ids.shape[0])),
        (PoolStatus.SLOT_OUT_OF_RANGE,
         _out_of_range(running, num_slots) | _out_of_range(dests, num_slots)),
        (PoolStatus.MISSING_RUNNING_SLOT,
         jnp.any((running == -1) & ((lengths > 0) | batch.has_initial))),
        (PoolStatus.OFFSET_OUT_OF_RANGE,
         jnp.any(active & ((offsets < 1) | (offsets > lengths[:, None])))),
        (PoolStatus.OFFSET_WITHOUT_DESTINATION, jnp.any(active & (dests == -1))),
        (PoolStatus.DESTINATION_WITHOUT_OFFSET, jnp.any(~active & (dests != -1))),
        (PoolStatus.DUPLICATE_DESTINATION,
         _has_duplicates(jnp.concatenate([running, dests.reshape(-1)]))),
    ])


def decode_status(state_slots: jax.Array, num_slots: int) -> jax.Array:
    """Check the running slots of a decode step (-1: padding row): int32 [] `PoolStatus`."""
    return _select_status([
        (PoolStatus.SLOT_OUT_OF_RANGE, _out_of_range(state_slots, num_slots)),
        (PoolStatus.DUPLICATE_DESTINATION, _has_duplicates(state_slots)),
    ])


def slot_index(slots: jax.Array, write: jax.Array, num_slots: int) -> jax.Array:
    """Per-slot-axis index: `slots` where `write` and the slot is in range, else the
    sentinel `num_slots`, which a ``mode="drop"`` scatter skips and a ``mode="fill"`` gather
    reads as zeros. Always int32; no element offsets are formed."""
    slots = slots.astype(jnp.int32)
    keep = write & (slots >= 0) & (slots < num_slots)
    return jnp.where(keep, slots, jnp.int32(num_slots))


def read_states(pools: Sequence[StatePool], state_slots: jax.Array,
                has_initial: jax.Array) -> list[KDAState]:
    """Initial state of every sequence for every layer: the running slot where
    `has_initial`, zeros otherwise. Returns per layer recurrent [N, H, K, V], conv
    [N, C, W - 1]."""
    out = []
    for pool in pools:
        index = slot_index(state_slots, has_initial, pool.num_slots)
        out.append(KDAState(pool.recurrent.at[index].get(mode="fill", fill_value=0),
                            pool.conv.at[index].get(mode="fill", fill_value=0)))
    return out


def _scatter(pool: StatePool, index: jax.Array, states: KDAState) -> StatePool:
    """Write states[i] to slot index[i] (leading axes of index and states match)."""
    return StatePool(
        pool.recurrent.at[index].set(states.recurrent.astype(pool.recurrent.dtype), mode="drop"),
        pool.conv.at[index].set(states.conv.astype(pool.conv.dtype), mode="drop"))


def commit_prefill(pools: Sequence[StatePool], batch: PrefillBatch,
                   finals: Sequence[KDAState], snapshots: Sequence[KDAState]
                   ) -> tuple[tuple[StatePool, ...], jax.Array]:
    """Apply one prefill's states to every layer's pool, or to none.

    Args:
      pools: one per KDA layer.
      batch: the step's metadata (`state_slots`, `checkpoint_slots`, offsets, lengths).
      finals: per layer, the state after each whole span (recurrent [N, H, K, V], conv
        [N, C, W - 1]); written to `state_slots[n]` (-1: not written).
      snapshots: per layer, [N, capacity, ...]; snapshot c of span n is written to
        `checkpoint_slots[n, c]` (-1: not written).
    Returns:
      the new pools and the int32 [] `PoolStatus`; unless it is OK, the pools are the
      inputs, bit for bit.
    """
    num_slots = pools[0].num_slots if pools else 0
    status = prefill_status(batch, num_slots)
    ok = status == PoolStatus.OK
    running = slot_index(batch.state_slots, ok, num_slots)  # [N]
    dests = slot_index(batch.checkpoint_slots, ok, num_slots)  # [N, capacity]
    index = jnp.concatenate([running, dests.reshape(-1)])
    new_pools = []
    for pool, final, snap in zip(pools, finals, snapshots, strict=True):
        states = KDAState(*(jnp.concatenate([f, s.reshape(-1, *s.shape[2:]).astype(f.dtype)])
                            for f, s in zip(final, snap)))
        new_pools.append(_scatter(pool, index, states))
    return tuple(new_pools), status


def decode_slots(state_slots: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """The running slots a decode step runs with, and its int32 [] `PoolStatus`.

    A decode step updates each row's slot in place in every layer's pool (the KDA layers'
    `decode`), reading and writing only the slots it is given; so a refused step runs
    with every slot -1 (all padding rows) and writes nothing, in any layer.
    Returns int32 [N]: `state_slots` if the status is OK, else all -1.
    """
    status = decode_status(state_slots, num_slots)
    return jnp.where(status == PoolStatus.OK, state_slots, jnp.int32(-1)), status


def copy_slots(pools: Sequence[StatePool], sources: jax.Array, destinations: jax.Array
               ) -> tuple[tuple[StatePool, ...], jax.Array]:
    """Copy slot ``sources[i]`` to ``destinations[i]`` in every pool, or in none.

    Used to resume from a retained checkpoint (copy it into a fresh running slot) and to
    retain a prompt's end state before decoding moves its running slot on. Pairs with
    destination -1 are skipped. All reads happen before any write.
    Refused: a slot outside [-1, num_slots) (SLOT_OUT_OF_RANGE), a destination without a
    source (MISSING_RUNNING_SLOT), a destination repeated (DUPLICATE_DESTINATION).
    """
    num_slots = pools[0].num_slots if pools else 0
    status = _select_status([
        (PoolStatus.SLOT_OUT_OF_RANGE,
         _out_of_range(sources, num_slots) | _out_of_range(destinations, num_slots)),
        (PoolStatus.MISSING_RUNNING_SLOT, jnp.any((destinations >= 0) & (sources == -1))),
        (PoolStatus.DUPLICATE_DESTINATION, _has_duplicates(destinations)),
    ])
    ok = status == PoolStatus.OK
    source = slot_index(sources, ok, num_slots)
    index = slot_index(destinations, ok, num_slots)
    new_pools = tuple(
        _scatter(pool, index, KDAState(pool.recurrent.at[source].get(mode="fill", fill_value=0),
                                       pool.conv.at[source].get(mode="fill", fill_value=0)))
        for pool in pools)
    return new_pools, status
