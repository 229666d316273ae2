"""DSA selection across prefill schedules: is a ladder's selection the coalesced span's?

    python -m bench.dsa_schedule --out $OUT/dsa_schedule.json   # 3K, 8K, 16K on a GPU
    python -m bench.dsa_schedule --quick                        # CPU smoke: tiny shapes

One glm5.3-flash MLA layer with its DSA indexer (bf16, random weights, top-k 2048) over one
random prompt x [S, hidden], prefilled through its paged cache as the engine plans it
(`serving.plan.plan_prefill`): coalesced spans of up to --budget tokens, and the ladder of
shrinking continuations. At 3K the ladder's first step (2048 tokens) sees at most top-k
keys, so the layer skips its indexer there (dense flash attention, non-absorbed) where the
coalesced span selects (sparse attention, absorbed): the same keys, rounded differently.
Per prompt length:

- schedule: the same bf16 x through both schedules. Of the cached latents and index keys,
  the fraction of elements whose bits differ (the projections run at each step's row count:
  a GEMM whose rounding depends on its shape shows here); the queries whose selected key
  sets differ and the keys swapped per query; the rows of the layer output y that differ
  bitwise, and the median / max relative difference of a row. "dense": the same with the
  indexer removed (the same other weights), the layer's flash attention instead.
- perturbed: x against x with a fraction --ulp-fraction of its elements moved by one bf16
  step (rounding noise, as a different upstream schedule leaves it), coalesced both times:
  the same statistics, with DSA and dense. Their ratio is how much the discrete selection
  amplifies rounding noise in y.
- model (--model-layers N > 0): the whole model (--preset, glm5.3-flash by default, cut
  to N layers and --model-experts experts, random weights; `glmjax.random_weights`; in
  fp32 with --model-dtype float32) over random tokens, through
  `glmjax.prefill_loop.run_prefill` along both schedules (each pads its steps to its
  longest span): the next-token logprobs (max difference, both argmaxes, each run's gap
  between them), every KDA layer's recurrent state at each position both retain (fraction
  of elements whose bits differ, and the largest relative difference, ||a - b|| / ||b||
  of a state), and every MLA layer's cached latents and index keys (fraction of positions
  with a differing bit, the first one, the median and largest relative difference of a
  position's row). Layer by layer, the relative differences tell rounding from logic: a
  schedule's rounding starts near the dtype's epsilon and grows with depth (in jumps where
  a router or DSA flips a discrete choice); a logic error stands out at its layer, in
  fp32 too.

  python -m bench.dsa_schedule --no-layer-rows --preset kimi-linear-48b --model-layers 27 \
      --model-experts 64 --model-dtype float32 --lengths 8192    # where kimi's schedules part

Where both schedules take the same attention path, identical inputs give schedule rows of
zero with kernels whose rows do not depend on the step's shape (as the CPU's: the quick
run's are zero); non-zero cached-key rows mean the projections are not shape-invariant on
the device.
The JSON (--out) is rewritten after every length.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import (
    add_batch_invariant,
    batch_invariant,
    fill_defaults,
    positive_sizes,
    write_json,
)
from glmjax.config import MLA_ATTENTIONS, ModelConfig
from glmjax.layers.mla import MLA
from glmjax.layers.mla_cache import read_prefix
from glmjax.layers.paged_cache import MLACache
from glmjax.layers.prefill_keys import sequence_keys
from glmjax.prefill_loop import run_prefill
from glmjax.random_weights import random_model
from serving.plan import plan_prefill

RESULTS = Path(__file__).parent / "results"
QUICK = dict(lengths="64", block_size=8, budget=64, ulp_fraction=0.01, pad_to=64,
             model_layers=2, model_experts=4)
FULL = dict(lengths="3072,8192,16384", block_size=512, budget=8192, ulp_fraction=0.01, pad_to=0,
            model_layers=6, model_experts=288)


def layer_config(quick: bool, block_size: int, batch_invariant: bool = False) -> ModelConfig:
    config = (dataclasses.replace(ModelConfig.preset("tiny"), dsa_top_k=8, dsa_num_heads=4,
                                  dsa_head_dim=32, dtype=jnp.bfloat16,
                                  param_dtype=jnp.bfloat16)
              if quick else ModelConfig.preset("glm5.3-flash"))
    return dataclasses.replace(config, kv_block_size=block_size,
                               batch_invariant=batch_invariant)


def model_config(args) -> ModelConfig:
    """The model of the model rows; quick: the tiny preset as one dense KDA layer and one
    MLA layer with DSA and MoE, bf16, a plain residual (no mHC: half the compile time)."""
    if args.quick:
        config = dataclasses.replace(layer_config(True, args.block_size, args.batch_invariant),
                                     num_layers=args.model_layers, full_attn_last=True,
                                     num_experts=args.model_experts,
                                     num_experts_per_token=min(2, args.model_experts),
                                     mhc_streams=None)
    else:
        config = dataclasses.replace(
            ModelConfig.preset(args.preset).replace_depth(args.model_layers,
                                                          args.model_experts),
            batch_invariant=args.batch_invariant)
    if args.model_dtype == "float32":
        config = dataclasses.replace(config, dtype=jnp.float32, param_dtype=jnp.float32)
    return dataclasses.replace(config, kv_block_size=args.block_size,
                               mla_attention=args.mla_attention)


@nnx.jit(static_argnames="select")
def _step(layer, x, length, cache, table, prefix_len, select: bool):
    """One span, the first `length` rows of x [R, D] (the rest padding), continuing
    prefix_len cached tokens: y [R, D], the cache, and with `select` the key positions
    int32 [R, min(top_k, keys)] each query selects (-1: none), as `MLA.attend` selects
    them."""
    rows = x.shape[0]
    cu, prefix_lens = jnp.stack([0, length]).astype(jnp.int32), prefix_len[None]
    positions = None
    if select:
        keys, cu_keys, _, used = sequence_keys(read_prefix(cache, table, None),
                                               layer._latent(x), layer.indexer.keys(x), cu,
                                               prefix_lens)
        pos = used[0] + jnp.arange(rows, dtype=jnp.int32)
        valid = jnp.arange(rows) < length
        top = layer.select_keys(layer.indexer.queries(x, layer._queries(x)[2]), keys,
                                cu_keys, jnp.zeros_like(pos), jnp.where(valid, pos, 0), valid)
        positions = jnp.where(top >= 0, keys.pos[jnp.maximum(top, 0)], -1)
    y, cache = layer(x, cu, cache, table, prefix_lens)
    return y, cache, positions


def prefill(layer, config, x, spans, *, select: bool, pad_to: int = 0):
    """x [S, D] through `spans` ((start, end) tiling [0, S)) over a fresh cache, each span
    padded with zero rows to pad_to rows (0: none): y [S, D], the cache's latents and index
    keys [S, ...] in position order (None: no indexer), and the selections [S, k] (None
    without `select`)."""
    length, block = x.shape[0], config.kv_block_size
    num_blocks = -(-length // block)
    cache = MLACache.zeros(config, num_blocks)
    table = jnp.arange(num_blocks, dtype=jnp.int32)[None]
    width = min(config.dsa_top_k, length) if select else 0
    ys, selections = [], []
    for start, end in spans:
        span = jnp.pad(x[start:end], ((0, max(pad_to - (end - start), 0)), (0, 0)))
        y, cache, positions = _step(layer, span, jnp.asarray(end - start, jnp.int32), cache,
                                    table, jnp.asarray(start, jnp.int32), select)
        ys.append(y[:end - start])
        if select:  # narrower rows (a step sees fewer keys than top_k): padded with -1
            positions = positions[:end - start, :width]
            selections.append(jnp.pad(positions, ((0, 0), (0, width - positions.shape[1])),
                                      constant_values=-1))
    cached = [None if a is None else a.reshape(-1, a.shape[-1])[:length]
              for a in (cache.latent, cache.index_keys)]
    return (jnp.concatenate(ys), cached,
            jnp.concatenate(selections) if select else None)


def swapped_keys(a, b) -> jax.Array:
    """Selections int32 [S, k] (distinct positions, -1 padding) -> keys of a not in b, per
    row (as many as b has that a lacks, when both keep k)."""
    both = jnp.sort(jnp.concatenate([a, b], axis=1), axis=1)
    common = jnp.sum((both[:, 1:] == both[:, :-1]) & (both[:, 1:] >= 0), axis=1)
    return jnp.sum(a >= 0, axis=1) - common


@jax.jit
def _difference_stats(y, y_other, sel, sel_other) -> dict:
    rel = (jnp.linalg.norm((y - y_other).astype(jnp.float32), axis=1)
           / jnp.linalg.norm(y_other.astype(jnp.float32), axis=1))
    out = {"rows_differing": jnp.mean(jnp.any(y != y_other, axis=1)),
           "row_rel_diff_median": jnp.median(rel), "row_rel_diff_max": rel.max()}
    if sel is not None:
        swaps = swapped_keys(sel, sel_other)
        out |= {"queries_with_swaps": jnp.mean(swaps > 0),
                "swaps_per_query_mean": jnp.mean(swaps), "swaps_max": swaps.max()}
    return out


def differences(y, y_other, sel=None, sel_other=None) -> dict:
    """How two runs' outputs y [S, D] (and selections [S, k]) differ: the fraction of rows
    not equal bit for bit, the median / max relative difference of a row; the fraction of
    queries whose key sets differ, keys swapped per query (mean, max)."""
    return {k: v.item() for k, v in _difference_stats(y, y_other, sel, sel_other).items()}


@functools.partial(jax.jit, static_argnums=1)
def one_ulp(x, fraction: float, key) -> jax.Array:
    """bf16 x with a random `fraction` of its elements moved one bf16 step up or down."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32)
    move_key, sign_key = jax.random.split(key)
    move = jax.random.bernoulli(move_key, fraction, x.shape)
    step = jnp.where(jax.random.bernoulli(sign_key, 0.5, x.shape), 1, -1)
    moved = jnp.where(move & (bits & 0x7FFF != 0), bits + step, bits)  # never through zero
    return jax.lax.bitcast_convert_type(moved.astype(jnp.uint16), jnp.bfloat16)


def run_length(length: int, args) -> dict:
    config = layer_config(args.quick, args.block_size, args.batch_invariant)
    layer = nnx.jit(lambda: MLA(config, rngs=nnx.Rngs(args.seed)))()
    key = jax.random.key(args.seed)
    x = jax.random.normal(key, (length, config.hidden_size), jnp.float32).astype(jnp.bfloat16)
    plan = {mode: [(s.start, s.end) for s in plan_prefill(
        length, 0, block_size=args.block_size, budget=args.budget, coalesce=mode == "coalesced")]
        for mode in ("coalesced", "ladder")}
    noisy = one_ulp(x, args.ulp_fraction, jax.random.fold_in(key, 1))
    result = {"length": length, "top_k": config.dsa_top_k, "spans": plan,
              "x_elements_moved": float(jnp.mean(noisy != x))}
    # The same weights without the indexer: dense flash attention over every visible key.
    dense_config = dataclasses.replace(config, dsa_top_k=None)
    dense = nnx.eval_shape(lambda: MLA(dense_config, rngs=nnx.Rngs(0)))
    nnx.update(dense, nnx.State({k: v for k, v in nnx.state(layer).items() if k != "indexer"}))
    for name, module, module_config in (("dsa", layer, config), ("dense", dense, dense_config)):
        select = name == "dsa"
        run = functools.partial(prefill, module, module_config, select=select,
                                pad_to=args.pad_to)
        y, cached, sel = run(x, plan["coalesced"])
        y_ladder, cached_ladder, sel_ladder = run(x, plan["ladder"])
        schedule = differences(y, y_ladder, sel, sel_ladder)
        for what, a, b in zip(("latent", "index_keys"), cached, cached_ladder, strict=True):
            if a is not None:
                schedule[f"cached_{what}_bits_differing"] = float(jnp.mean(a != b))
        y_noisy, _, sel_noisy = run(noisy, plan["coalesced"])
        result[name] = {"schedule": schedule,
                        "perturbed": differences(y, y_noisy, sel, sel_noisy)}
        print(f"{length} {name}: {result[name]}", flush=True)
    dsa, dense = (result[n]["perturbed"]["row_rel_diff_median"] for n in ("dsa", "dense"))
    result["perturbed_amplification"] = dsa / dense if dense else None
    return result


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def relative_difference(a: np.ndarray, b: np.ndarray, axis=None) -> np.ndarray:
    """||a - b|| / ||b|| in float64 over `axis` (None: the whole array; 0 when b is 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    norm = np.linalg.norm(b, axis=axis)
    return np.linalg.norm(a - b, axis=axis) / np.where(norm > 0, norm, 1.0)


def run_model(length: int, args, config: ModelConfig, model_state) -> dict:
    tokens = np.random.default_rng(args.seed).integers(0, config.vocab_size, length)
    runs = {mode: run_prefill(model_state, config, tokens, plan_prefill(
        length, 0, block_size=args.block_size, budget=args.budget,
        coalesce=mode == "coalesced"), keep_states=True) for mode in ("coalesced", "ladder")}
    a, b = runs["coalesced"], runs["ladder"]
    lp_a, lp_b = _log_softmax(a.logits), _log_softmax(b.logits)
    top_a, top_b = int(lp_a.argmax()), int(lp_b.argmax())
    out = {"logprobs": {"max_abs_diff": float(np.abs(lp_a - lp_b).max()),
                        "argmax": [top_a, top_b],
                        "gaps": [float(lp_a[top_a] - lp_a[top_b]),
                                 float(lp_b[top_b] - lp_b[top_a])]}}
    sa, sb = a.states, b.states
    common = sorted(set(sa.positions) & set(sb.positions))
    pairs = [[(ra[sa.positions.index(p)], rb[sb.positions.index(p)]) for p in common]
             for ra, rb in zip(sa.recurrent, sb.recurrent, strict=True)]
    out["kda_recurrent_bits_differing"] = [
        {str(p): float(np.mean(x != y)) for p, (x, y) in zip(common, layer)} for layer in pairs]
    out["kda_recurrent_rel_diff_max"] = [
        max((float(relative_difference(x, y)) for x, y in layer), default=0.0)
        for layer in pairs]
    out["mla"] = []
    for ma, mb in zip(sa.mla, sb.mla, strict=True):
        layer = {}
        for name in ma:
            rows = [m[name].reshape(-1, m[name].shape[-1])[:length] for m in (ma, mb)]
            differ = np.any(rows[0] != rows[1], axis=1)
            rel = relative_difference(*rows, axis=1)
            layer[name] = {"positions_differing": float(differ.mean()),
                           "first_differing": int(differ.argmax()) if differ.any() else None,
                           "row_rel_diff_median": float(np.median(rel)),
                           "row_rel_diff_max": float(rel.max())}
        out["mla"].append(layer)
    print(f"{length} model: {out}", flush=True)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.dsa_schedule",
                                     description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="CPU smoke: the tiny preset's MLA, short prompts")
    add("--lengths", help="prompt lengths, comma-separated (3072,8192,16384)")
    add("--block-size", type=int, help="P, tokens per KV block (512)")
    add("--budget", type=int, help="tokens per step (8192)")
    add("--ulp-fraction", type=float, help="x elements moved one bf16 step (0.01)")
    add("--pad-to", type=int,
        help="rows every step is padded to, as one engine bucket (0: each span's own size)")
    add("--model-layers", type=int,
        help="layers of the model rows (6; 0: no model rows)")
    add("--model-experts", type=int, help="routed experts of the model rows (288)")
    add("--preset", default="glm5.3-flash", help="the model rows' preset (glm5.3-flash)")
    add("--model-dtype", choices=("preset", "float32"), default="preset",
        help="float32: the model rows' weights, activations and caches in fp32 (with "
             "JAX_DEFAULT_MATMUL_PRECISION=highest)")
    add("--mla-attention", choices=MLA_ATTENTIONS,
        help="the model rows' MLA prefill attention (default: the device's pick; cuDNN's "
             "rounds a query by its span on an H100, our flash kernel does not)")
    add_batch_invariant(parser)
    add("--layer-rows", action=argparse.BooleanOptionalAction, default=True,
        help="the glm5.3-flash DSA layer's rows (off: the model rows alone)")
    add("--seed", type=int, default=0)
    add("--out", type=Path, help="output (bench/results/dsa_schedule.json)")
    args = parser.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    args.lengths = positive_sizes(parser, "--lengths", args.lengths)
    args.out = args.out or RESULTS / "dsa_schedule.json"
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    batch_invariant(args)  # before JAX starts
    result = {"device": str(jax.devices()[0]), "host": platform.node(),
              "args": {k: str(v) for k, v in vars(args).items()}, "lengths": []}
    for length in args.lengths if args.layer_rows else ():
        result["lengths"].append(run_length(length, args))
        write_json(result, args.out)
    if args.model_layers:
        config = model_config(args)
        model_state = nnx.split(random_model(config, args.seed))
        result["model"] = {"config": config.name, "layer_types": config.layer_types,
                           "lengths": []}
        for length in args.lengths:
            result["model"]["lengths"].append({"length": length} | run_model(
                length, args, config, model_state))
            write_json(result, args.out)
    write_json(result, args.out)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
