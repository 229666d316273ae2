"""Next-token sampling over a batch of logits: greedy, temperature, top-k, top-p, seeds.

Pure, jittable functions of fp32 logits ``[N, V]`` and per-row parameters, so one compiled
sampler serves any mix of greedy and random rows. Row n draws with the key
``fold_in(key(seeds[n]), token_index[n])``: the same request (seed) sampling its k-th output
token gets the same key however the steps are batched, preempted or replayed, which makes
seeded sampling reproducible.

Order of operations (the usual one): divide by the temperature, keep the ``top_k`` largest,
then keep the smallest set of those whose probability (after top-k) reaches ``top_p``,
then draw. The logprob returned is of the chosen token under the model's own distribution
(``log_softmax`` of the raw logits), whatever the sampling parameters.

What costs is paid only by a batch with a row that needs it: the Gumbel draw (a random
row), the sort over the vocabulary (a random row with top-k or top-p) and the most likely
alternatives (a row that asks for them; ``lax.top_k`` of 20 sorts whole rows on a GPU) are
parts of the static ``SamplerVariant`` the host picks from the rows it sends, one compiled
program each (a
device-side ``lax.cond`` would copy its predicate to the host and wait for it, as XLA
leaves a conditional around a sort out of the step's CUDA graph). On the H200, kimi's
163,840-token vocabulary at 64 sampler rows: the sort, the scatter of its mask and the top
20 took 3.6 ms of a 13.4 ms batch-1 decode step (`bench/results/decode_kimi-linear-48b.json`).

The argmax and the log-normaliser reduce each row in two stages (`vocab_tiles`): XLA ran
the draw's argmax over one 163,840-token row as a single 76 us kernel at one row, where
the row cut into tiles spreads over the GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from serving.request import MAX_TOP_LOGPROBS

SEED_LIMIT = 2**32  # seeds are uint32


class SamplingTensors(NamedTuple):
    """Per-row sampling parameters of one batch (N rows, a bucket size)."""

    temperature: jax.Array  # fp32 [N], 0: greedy (argmax)
    top_k: jax.Array  # int32 [N], 0: all tokens
    top_p: jax.Array  # fp32 [N] in (0, 1], 1: all tokens
    seeds: jax.Array  # uint32 [N]
    token_index: jax.Array  # int32 [N], which output token of its request the row samples
    num_top: jax.Array  # int32 [N], alternatives the row reports (0: none)

    @classmethod
    def host(cls, rows: list[tuple[float, int, float, int, int, int]], size: int
             ) -> SamplingTensors:
        """Host NumPy arrays from (temperature, top_k, top_p, seed, token_index, num_top)
        per row, padded to ``size`` greedy rows."""
        if len(rows) > size:
            raise ValueError(f"{len(rows)} sampling rows exceed the bucket size {size}")
        padded = cls(np.zeros(size, np.float32), np.zeros(size, np.int32),
                     np.ones(size, np.float32), np.zeros(size, np.uint32),
                     np.zeros(size, np.int32), np.zeros(size, np.int32))
        for column, values in zip(padded, zip(*rows), strict=False):  # none without rows
            column[: len(values)] = values
        return padded


class SamplerVariant(NamedTuple):
    """The costly parts a batch needs (static: one compiled sampler each)."""

    filter: bool = True  # a random row with top_k or top_p: a sort over the vocabulary
    top: bool = True  # a row that reports alternatives: lax.top_k(20), a sort on a GPU
    draw: bool = True  # a random row: Gumbel noise over the vocabulary (filter implies it)

    @classmethod
    def of(cls, params: SamplingTensors) -> SamplerVariant:
        """What the rows of host ``params`` (NumPy arrays) need."""
        random = np.asarray(params.temperature) > 0
        limited = (np.asarray(params.top_k) > 0) | (np.asarray(params.top_p) < 1)
        return cls(bool((random & limited).any()), bool((np.asarray(params.num_top) > 0).any()),
                   bool(random.any()))


SAMPLER_VARIANTS = tuple(SamplerVariant(f, t, d) for d in (False, True) for f in (False, True)
                         for t in (False, True) if d or not f)
EVERY_PART = SamplerVariant(filter=True, top=True, draw=True)
VOCAB_TILE = 2048  # tokens per first-stage tile of the two-stage reductions


def vocab_tiles(x: jax.Array, fill: float) -> jax.Array:
    """[N, V] -> [N, ceil(V / VOCAB_TILE), VOCAB_TILE], the tail padded with `fill`."""
    num_rows, vocab = x.shape
    if vocab <= VOCAB_TILE:
        return x[:, None, :]
    tiles = -(-vocab // VOCAB_TILE)
    x = jnp.pad(x, ((0, 0), (0, tiles * VOCAB_TILE - vocab)), constant_values=fill)
    return x.reshape(num_rows, tiles, VOCAB_TILE)


def row_argmax(x: jax.Array) -> jax.Array:
    """int32 [N]: the first index of each row's largest value of fp32 [N, V] (NaN-free),
    as ``jnp.argmax``, reduced tile by tile and then across tiles."""
    tiled = vocab_tiles(x, -jnp.inf)
    inner = jnp.argmax(tiled, axis=-1)  # [N, tiles]
    best = jnp.take_along_axis(tiled, inner[..., None], axis=-1)[..., 0]
    tile = jnp.argmax(best, axis=-1)  # the first tile holding the row's maximum
    index = tile * tiled.shape[-1] + jnp.take_along_axis(inner, tile[:, None], axis=-1)[:, 0]
    return index.astype(jnp.int32)


def row_log_softmax(x: jax.Array) -> jax.Array:
    """``jax.nn.log_softmax(x, -1)`` of fp32 [N, V] with two-stage row reductions."""
    top = jnp.max(jnp.max(vocab_tiles(x, -jnp.inf), axis=-1), axis=-1, keepdims=True)
    shifted = x - jax.lax.stop_gradient(top)
    total = jnp.sum(jnp.sum(vocab_tiles(jnp.exp(shifted), 0.0), axis=-1), axis=-1,
                    keepdims=True)
    return shifted - jnp.log(total)


def top_k_top_p_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Which tokens each row may sample: bool [N, V].

    Args:
      logits: fp32 [N, V], already divided by the temperature.
      top_k: int32 [N]; keep the k largest (0: no limit).
      top_p: fp32 [N]; of those, keep the largest tokens while the probability mass
        before each is below top_p (so the top token is always kept).
    """
    num_rows, vocab = logits.shape
    order = jnp.argsort(-logits, axis=-1, stable=True)  # [N, V], largest first
    ranked = jnp.take_along_axis(logits, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)
    keep = (top_k[:, None] <= 0) | (rank[None, :] < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p = 1 keeps everything even where the fp32 running sum rounds up to 1.
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1) | (rank[None, :] == 0)
    rows = jnp.arange(num_rows)[:, None]
    return jnp.zeros((num_rows, vocab), bool).at[rows, order].set(keep)


def row_key(seed: jax.Array, token_index: jax.Array) -> jax.Array:
    """The PRNG key of one row: the request's seed folded with its output token index."""
    return jax.random.fold_in(jax.random.key(seed), token_index)


class Sampled(NamedTuple):
    """One step's draws: per row the token, its logprob, and the most likely alternatives
    (all under the model's raw distribution, most likely first; zeros unless a row of the
    batch asked for alternatives)."""

    tokens: jax.Array        # int32 [N]
    logprobs: jax.Array      # fp32 [N]
    top_ids: jax.Array       # int32 [N, min(MAX_TOP_LOGPROBS, V)]
    top_logprobs: jax.Array  # fp32 [N, min(MAX_TOP_LOGPROBS, V)]


def sample(logits: jax.Array, params: SamplingTensors,
           variant: SamplerVariant = EVERY_PART) -> Sampled:
    """One token per row.

    Args:
      logits: fp32 [N, V] raw model logits.
      params: per-row parameters (see ``SamplingTensors``).
      variant: what the rows need (``SamplerVariant.of(params)``; the default, everything,
        serves any rows).
    """
    logits = logits.astype(jnp.float32)
    num_rows, vocab = logits.shape
    greedy = params.temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, params.temperature)[:, None]
    if variant.filter:
        scaled = jnp.where(top_k_top_p_mask(scaled, params.top_k, params.top_p), scaled, -jnp.inf)
    tokens = row_argmax(logits)
    if variant.draw:
        # jax.random.categorical's draw: the argmax of the logits plus Gumbel noise.
        keys = jax.vmap(row_key)(params.seeds, params.token_index)
        noise = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
        tokens = jnp.where(greedy, tokens, row_argmax(scaled + noise))
    log_probs = row_log_softmax(logits)
    logprobs = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    num_top = min(MAX_TOP_LOGPROBS, vocab)
    if variant.top:
        top_logprobs, top_ids = jax.lax.top_k(log_probs, num_top)
    else:
        top_logprobs = jnp.zeros((num_rows, num_top), jnp.float32)
        top_ids = jnp.zeros((num_rows, num_top), jnp.int32)
    return Sampled(tokens, logprobs, top_ids.astype(jnp.int32), top_logprobs)
