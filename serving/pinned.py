"""A one-device decode program whose every buffer keeps its device address from call to call.

XLA runs a step as CUDA graphs (``glmjax.xla_options.STEP_OPTIONS``). Before each call it
compares the addresses of the buffers the graph's commands use with the last call's, and
if any moved it re-sets every command of the graph from the host. Measured on an H100's
host (kimi-linear-48b, 27 layers, batch 1, 2026-12-06): the decode program's 514 commands
re-set on every call, 3.1-5.1 ms of host time a step against 3.7 ms of device time, with
4-7 moved allocations a call. The parameters never move and the caches are donated and
written in place; what moved were the step's batch (fresh host arrays, or the fed
tokens), its logits and its status.

So on one device each decode bucket (N, M) gets a device batch that a small program writes
in place (``stage_decode``: the host's rows, placeholder tokens fed from the previous
step's samples), and each N a pair of output buffers the decode program writes its logits
and status into (``glmjax.model.decode_pinned``, donated). The next step's decode
overwrites the status before the engine fetches this one's, so the fetch reads a copy
(``keep_status``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.batch import DecodeBatch
from glmjax.model import DecodeBuffers, DecodeOutput


def fed_token_ids(token_ids: jax.Array, sources: jax.Array, prefill_tokens: jax.Array,
                  decode_tokens: jax.Array) -> jax.Array:
    """A decode batch's token ids with the placeholders fed from the previous step.

    Args:
      token_ids: int32 [N], the host's tokens (0 at placeholders).
      sources: int32 [N], -1 where the host's token stands, else the row of
        ``concat(prefill_tokens, decode_tokens)`` holding the sampled token.
      prefill_tokens, decode_tokens: int32 [R], the previous step's sampled tokens.
    Returns:
      int32 [N].
    """
    sampled = jnp.concatenate([prefill_tokens, decode_tokens])
    return jnp.where(sources >= 0, sampled[jnp.maximum(sources, 0)], token_ids)


def _stage(pinned: DecodeBatch, host: DecodeBatch, sources: jax.Array,
           prefill_tokens: jax.Array, decode_tokens: jax.Array) -> DecodeBatch:
    """``host`` with its placeholder tokens fed, written over ``pinned`` (donated).

    Args:
      pinned: the bucket's device batch (int32, shapes as ``host``'s), donated: the result
        is written into its buffers.
      host: the step's rows, 0 at placeholder tokens.
      sources, prefill_tokens, decode_tokens: as ``fed_token_ids``'s.
    """
    del pinned  # donated and unread: XLA writes each result into its buffer
    return host._replace(token_ids=fed_token_ids(host.token_ids, sources, prefill_tokens,
                                                 decode_tokens))


stage_decode = jax.jit(_stage, donate_argnums=0, keep_unused=True)
keep_status = jax.jit(jnp.copy)  # int32 [] -> a copy the next decode does not overwrite


class PinnedDecode:
    """The pinned batches and output buffers of one engine's decode buckets.

    ``stage`` and ``decode`` take an entry out before they donate it and put the result
    back after the call returns, so a call that raises leaves no consumed buffer behind:
    that bucket's buffers are made afresh at its next step (one graph update).
    """

    def __init__(self, sampler_rows: int, vocab_size: int):
        """Args:
          sampler_rows: rows R of the sampled tokens a step feeds from.
          vocab_size: columns of the logits.
        """
        self._rows = sampler_rows
        self._vocab = vocab_size
        self._batches: dict[tuple[int, int], DecodeBatch] = {}
        self._outputs: dict[int, DecodeBuffers] = {}
        self._no_tokens: jax.Array | None = None

    def stage(self, host: DecodeBatch, sources: np.ndarray,
              tokens: tuple[jax.Array, jax.Array] | None) -> DecodeBatch:
        """The bucket's device batch holding ``host`` (numpy int32 arrays), its tokens fed
        from ``tokens`` (the previous step's sampled prefill and decode tokens, int32 [R]
        each; None when ``sources`` is all -1)."""
        shape = host.block_tables.shape
        pinned = self._batches.pop(shape, None)
        if pinned is None:  # (transfers of host zeros: a jnp.zeros would compile)
            pinned = jax.device_put(jax.tree.map(np.zeros_like, host))
        if tokens is None:
            if self._no_tokens is None:
                self._no_tokens = jax.device_put(np.zeros(self._rows, np.int32))
            tokens = (self._no_tokens, self._no_tokens)
        staged = stage_decode(pinned, host, sources, *tokens)
        self._batches[shape] = staged
        return staged

    def decode(self, program, model_state, caches, batch: DecodeBatch) -> DecodeOutput:
        """``program`` (``glmjax.model.decode_pinned`` or one of its signature) over
        ``batch`` (from ``stage``), its logits and status in the bucket's buffers: the
        caller keeps the returned caches, then fetches a ``keep_status`` copy of the
        status (the next step's decode writes over this one's)."""
        rows = batch.token_ids.shape[0]
        buffers = self._outputs.pop(rows, None)
        if buffers is None:
            buffers = jax.device_put(DecodeBuffers.zeros(rows, self._vocab))
        out = program(model_state, caches, batch, buffers)
        self._outputs[rows] = DecodeBuffers(out.logits, out.status)
        return out
