"""DSA benchmark: the glm5.3-flash MLA layer with DSA (sparse) vs dense causal flash.

    python -m bench.sparse_attention                    # 8K, 16K, 32K
    python -m bench.sparse_attention --cases 32K --out $OUT/sparse_attention.json
    python -m bench.sparse_attention --quick            # CPU smoke: tiny shapes
    python -m bench.sparse_attention --cases 32K --sweep  # also every tiling in the sweeps

Per case (one causal span of T tokens, no prefix, bf16, random weights), rows:
- layer-dense-<impl>: one MLA prefill without the indexer: flash attention over the
  expanded keys (`prefill_attention`, each implementation the device has);
- layer-dsa: the same layer with its DSA indexer (top-k 2048): index scores per block of
  1024 queries (`index_scores`), `select_top_k`, and `sparse_attention` over the selected
  latents;
- layer-dsa-reference: the same layer and weights through the jax.numpy DSA ops (index
  scores as [1024, 32, T] head scores, the sparse attention's reference), with layer-dsa's
  max relative error against it (near-tied index scores may select differently);
- select: the indexer's selection alone (`MLA.select_keys`: index scores and top-k);
- top_k-sort / top_k-radix / top_k-pallas: one causal [1024, T] block of scores (row i
  sees its first i T / 1024 + 1 keys: every length a layer has) through lax.top_k,
  `select_top_k`'s jax.numpy radix select ("reference") and its Pallas kernel (interpret
  mode on a CPU), both given the row lengths as the layer gives them, times the T / 1024
  blocks of a layer; rows_unlike_sort: rows whose set differs from the sort's (must be 0);
- index-op: `index_scores` alone on the last block of 1024 queries (it sees every key), and
  that times the T / 1024 blocks (an upper bound: earlier blocks skip their causal tiles);
- sparse-op: `sparse_attention` alone on [T, 64, 512] absorbed queries with random
  selections of min(top_k, t + 1) distinct keys (`random_selection`) (TFLOP/s: 2 x heads x (512 + 512) per selected
  pair), with its max relative error against the jax.numpy reference;
- dense-op: `prefill_attention` alone at the layer's shapes (64 heads, qk 256, v 256).
--sweep adds index-op, sparse-op and top_k-pallas rows for every tiling in INDEX_SWEEP /
SPARSE_SWEEP / TOP_K_SWEEP
(all compile for sm_90: `python -m pallas_kernels.aot`) and select rows for the query
blocks in QUERY_BLOCK_SWEEP (smaller: the [block, T] scores may stay in L2 over the top-k's
passes; more loop steps). The bar (issue 18): layer-dsa at
most 0.6 x layer-dense at 32K; `ratio` rows report it.

Timing as `bench.attention`: warm-up, then the median of `--samples` samples of `--iters`
queued calls. The JSON (--out) is rewritten after every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import relative_error, time_calls, write_json
from glmjax.config import ModelConfig
from glmjax.layers.mla import MLA
from glmjax.layers.prefill_keys import sequence_keys
from pallas_kernels.attention import prefill_attention
from pallas_kernels.attention_cudnn import cudnn_available
from pallas_kernels.index_scores import index_scores
from pallas_kernels.index_scores_pallas import IndexConfig
from pallas_kernels.sparse_attention import sparse_attention
from pallas_kernels.sparse_attention_pallas import SparseConfig
from pallas_kernels.top_k import select_top_k
from pallas_kernels.top_k_pallas import TopKConfig

RESULTS = Path(__file__).parent / "results"
CASES = {"8K": 8192, "16K": 16384, "32K": 32768}
QUICK = {"tiny-48": 48}
BAR = 0.6
SPARSE_SWEEP = (SparseConfig(64, 32, 8, 2), SparseConfig(64, 32, 8, 3),
                SparseConfig(64, 16, 8, 2), SparseConfig(64, 64, 8, 2),
                SparseConfig(64, 64, 8, 3), SparseConfig(32, 32, 4, 2),
                SparseConfig(32, 32, 8, 2), SparseConfig(16, 32, 4, 2))
QUERY_BLOCK_SWEEP = (256, 512, 2048)  # queries per selection block (MLA.query_block)
# (tile, resident, streamed_digit_bits, num_warps): 16 warps hold a 32K row at 64 keys a
# thread; tile 2048 / 8192: the compaction's step.
TOP_K_SWEEP = (TopKConfig(4096, 32768, 2, 16), TopKConfig(2048, 32768, 2, 8),
               TopKConfig(8192, 32768, 2, 16), TopKConfig(4096, 16384, 2, 8),
               TopKConfig(4096, 16384, 4, 8))
INDEX_SWEEP = (IndexConfig(128, 128, 8, 2), IndexConfig(128, 128, 8, 3),
               IndexConfig(64, 128, 4, 2), IndexConfig(64, 64, 4, 2), IndexConfig(128, 64, 4, 2))


def tiling(config) -> str:
    return " ".join(f"{v}" for v in dataclasses.astuple(config))


def layer_config(quick: bool, attention: str | None, dsa: bool) -> ModelConfig:
    if quick:
        config = dataclasses.replace(ModelConfig.preset("tiny"), dsa_top_k=8,
                                     dsa_num_heads=4, dsa_head_dim=32)
    else:
        config = ModelConfig.preset("glm5.3-flash")
    return dataclasses.replace(config, mla_attention=attention,
                               dsa_top_k=config.dsa_top_k if dsa else None)


def random_selection(rng, tokens, top_k):
    """int32 [T, top_k], a selection shaped like `select_top_k`'s: query t keeps all of its
    t + 1 keys when they are at most top_k (then -1), otherwise top_k distinct ones in
    ascending order, one drawn from each of top_k equal strata of 0..t."""
    t, j = np.arange(tokens)[:, None], np.arange(top_k)[None]
    strata = np.floor((j + rng.random((tokens, 1))) * (t + 1) / top_k).astype(np.int32)
    return np.where(t + 1 >= top_k, strata, np.where(j <= t, j, -1)).astype(np.int32)


def run_case(name, tokens, args, save=lambda rows: None):
    """One case's rows; `save(rows)` after each, so a run cut short keeps what it timed."""
    rng = np.random.default_rng(0)
    dense_impls = ["reference"] if args.quick else ["pallas"] + (
        ["cudnn"] if cudnn_available() else [])
    config = layer_config(args.quick, None, True)
    dtype, top_k = config.dtype, config.dsa_top_k
    draws = itertools.count()

    def normal(*shape):  # drawn on the device: [32K, 64, 512] is 8 GB as host float64
        key = jax.random.fold_in(jax.random.key(0), next(draws))
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)

    x = normal(tokens, config.hidden_size)
    cu = jnp.array([0, tokens], jnp.int32)
    rows = {}

    def timed(row, fn, *inputs, flops=None):
        try:
            ms, _ = time_calls(lambda: fn(*inputs), iters=args.iters, samples=args.samples)
        except Exception as error:  # out of memory, a shape refused: the row says so
            rows[row] = {"error": f"{type(error).__name__}: {error}"[:300]}
            print(f"{name} {row}: {rows[row]['error']}", flush=True)
            save(rows)
            return
        rows[row] = {"ms": ms}
        if flops:
            rows[row]["tflops"] = flops / (ms * 1e-3) / 1e12
        print(f"{name} {row}: {ms:.3f} ms", flush=True)
        save(rows)

    @nnx.jit
    def prefill(layer, x):
        return layer(x, cu)[0]

    for impl in dense_impls:
        dense = MLA(layer_config(args.quick, impl, False), rngs=nnx.Rngs(0))
        timed(f"layer-dense-{impl}", prefill, dense, x)
        del dense
    layer = MLA(config, rngs=nnx.Rngs(0))
    timed("layer-dsa", prefill, layer, x)
    # The same weights through the jax.numpy DSA ops (on a CPU: the same ops as layer-dsa).
    reference = nnx.eval_shape(lambda: MLA(layer_config(args.quick, "reference", True),
                                           rngs=nnx.Rngs(0)))
    nnx.update(reference, nnx.state(layer))
    timed("layer-dsa-reference", prefill, reference, x)
    if "ms" in rows["layer-dsa"] and "ms" in rows["layer-dsa-reference"]:
        rows["layer-dsa"]["error_vs_reference"] = relative_error(prefill(layer, x),
                                                                 prefill(reference, x))
    del reference

    @nnx.jit
    def select(layer, x):
        q_latent = layer._queries(x)[2]
        keys, *_ = sequence_keys(None, layer._latent(x), layer.indexer.keys(x), cu,
                                 jnp.zeros((1,), jnp.int32))
        pos = jnp.arange(tokens, dtype=jnp.int32)
        return layer.select_keys(layer.indexer.queries(x, q_latent), keys, cu,
                                 jnp.zeros_like(pos), pos, jnp.ones((tokens,), bool))

    timed("select", select, layer, x)
    default_block = layer.query_block
    for query_block in QUERY_BLOCK_SWEEP if args.sweep else ():
        layer.query_block = query_block  # static under nnx.jit: a new trace each
        timed(f"select qb={query_block}", select, layer, x)
    layer.query_block = default_block
    block = min(1024, tokens)
    scores = normal(block, tokens).astype(jnp.float32)
    lengths = jnp.arange(block, dtype=jnp.int32) * tokens // block + 1  # causal rows
    scores = jnp.where(jnp.arange(tokens)[None] < lengths[:, None], scores, -jnp.inf)
    k = min(top_k, tokens)
    selections = {
        "top_k-sort": lambda s: jax.lax.top_k(s, k)[1],
        "top_k-radix": lambda s: select_top_k(s, k, lengths=lengths,
                                              implementation="reference"),
        "top_k-pallas": lambda s: select_top_k(s, k, lengths=lengths, implementation="pallas"),
    }
    for top_k_config in TOP_K_SWEEP if args.sweep else ():
        selections[f"top_k-pallas {tiling(top_k_config)}"] = functools.partial(
            lambda s, c: select_top_k(s, k, lengths=lengths, implementation="pallas",
                                      config=c), c=top_k_config)
    expected = None  # the sort's set of each row
    for row, fn in selections.items():
        fn = jax.jit(fn)
        timed(row, fn, scores)
        if "ms" not in rows[row]:
            continue
        rows[row]["ms_per_layer"] = rows[row]["ms"] * -(-tokens // block)
        chosen = jnp.sort(fn(scores), axis=1)
        if row == "top_k-sort":
            expected = chosen
        if expected is not None:
            rows[row]["rows_unlike_sort"] = int(jnp.sum(jnp.any(chosen != expected, axis=1)))
    del expected

    index_q = normal(block, config.dsa_num_heads, config.dsa_head_dim)
    index_w = normal(block, config.dsa_num_heads).astype(jnp.float32)
    index_k = normal(tokens, config.dsa_head_dim)
    first = jnp.zeros((block,), jnp.int32)
    last = jnp.arange(tokens - block + 1, tokens + 1, dtype=jnp.int32)
    index_configs = {"index-op": None}
    if args.sweep:
        index_configs.update({f"index-op {tiling(c)}": c for c in INDEX_SWEEP})
    for row, index_config in index_configs.items():
        fn = jax.jit(lambda *a, c=index_config: index_scores(*a, config=c))
        timed(row, fn, index_q, index_w, index_k, first, last)
        if "ms" in rows[row]:
            rows[row]["ms_per_layer"] = rows[row]["ms"] * -(-tokens // block)
    del index_q, index_w, index_k

    heads, kv_lora = config.mla_num_heads, config.kv_lora_rank
    width = kv_lora + config.qk_rope_head_dim
    q, latent = normal(tokens, heads, width), normal(tokens, width)
    indices = random_selection(rng, tokens, k)
    pairs = int((indices >= 0).sum())
    indices = jnp.asarray(indices)
    ops = {}
    for impl in ("pallas", "reference"):
        fn = jax.jit(lambda q, latent, i, impl=impl: sparse_attention(
            q, latent, i, kv_lora=kv_lora, scale=width ** -0.5, implementation=impl)[0])
        row = "sparse-op" if impl == "pallas" else "sparse-op-reference"
        timed(row, fn, q, latent, indices, flops=2 * heads * (width + kv_lora) * pairs)
        if "ms" in rows[row]:
            ops[impl] = fn(q, latent, indices)
    if len(ops) == 2:
        rows["sparse-op"]["error_vs_reference"] = relative_error(ops["pallas"],
                                                                 ops["reference"])
    for sparse_config in SPARSE_SWEEP if args.sweep else ():
        fn = jax.jit(lambda q, latent, i, c=sparse_config: sparse_attention(
            q, latent, i, kv_lora=kv_lora, scale=width ** -0.5, implementation="pallas",
            config=c)[0])
        timed(f"sparse-op {tiling(sparse_config)}", fn, q, latent, indices,
              flops=2 * heads * (width + kv_lora) * pairs)
    del q, latent, indices, ops
    head_qk, head_v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    for impl in dense_impls:
        fn = jax.jit(lambda q, k, v, impl=impl: prefill_attention(
            q, k, v, cu, cu, implementation=impl)[0])
        timed(f"dense-op-{impl}", fn, normal(tokens, heads, head_qk),
              normal(tokens, heads, head_qk), normal(tokens, heads, head_v),
              flops=2 * heads * (head_qk + head_v) * tokens * (tokens + 1) // 2)
    for impl in dense_impls:
        a, b = rows.get("layer-dsa", {}), rows.get(f"layer-dense-{impl}", {})
        if "ms" in a and "ms" in b:
            rows[f"ratio-dsa/dense-{impl}"] = a["ms"] / b["ms"]
    return {"tokens": tokens, "top_k": top_k, "heads": heads, "latent": width, "rows": rows}


def format_table(results) -> str:
    lines = [f"{'case':10} {'row':24} {'ms':>9} {'TFLOP/s':>8}  note"]
    for name, case in results.items():
        for row, value in case["rows"].items():
            if not isinstance(value, dict):
                verdict = "meets" if value <= BAR else "misses"
                lines.append(f"{name:10} {row:24} {value:9.3f} {'':>8}  {verdict} the "
                             f"{BAR} bar")
            elif "error" in value:
                lines.append(f"{name:10} {row:24} {value['error'][:60]}")
            else:
                note = ""
                if "ms_per_layer" in value:
                    note = f"{value['ms_per_layer']:.2f} ms per layer"
                if value.get("rows_unlike_sort"):
                    note += f", {value['rows_unlike_sort']} rows unlike the sort's"
                if "error_vs_reference" in value:
                    note = f"err {value['error_vs_reference']:.1e}"
                tflops = f"{value['tflops']:8.1f}" if "tflops" in value else f"{'':>8}"
                lines.append(f"{name:10} {row:24} {value['ms']:9.3f} {tflops}  {note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--sweep", action="store_true",
                        help="also time every tiling in INDEX_SWEEP and SPARSE_SWEEP")
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke test: a tiny layer, the kernel in interpret mode")
    parser.add_argument("--out", type=Path, default=RESULTS / "sparse_attention.json")
    args = parser.parse_args(argv)
    if args.quick:
        cases = dict(QUICK)
        args.iters, args.samples = 1, 1
    else:
        names = [c for c in args.cases.split(",") if c]
        if set(names) - set(CASES):
            parser.error(f"unknown cases {sorted(set(names) - set(CASES))}")
        cases = {n: CASES[n] for n in names}
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "host": platform.node(), "args": {k: str(v) for k, v in vars(args).items()},
              "cases": {}}
    for name, tokens in cases.items():
        def save(rows, name=name, tokens=tokens):
            record["cases"][name] = {"tokens": tokens, "complete": False, "rows": rows}
            write_json(record, args.out)

        record["cases"][name] = run_case(name, tokens, args, save)
        write_json(record, args.out)
    print(format_table(record["cases"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
