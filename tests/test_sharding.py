"""The model on (tp, dcp) meshes of CPU devices (conftest asks JAX for 8) against one device.

- The DCP layout against a round-robin deal of tokens to ranks, written independently.
- LSE merge of per-rank partial attention, with and without the DSA selection, against
  dense attention over every key.
- An MLA layer with a DSA indexer on a (4, 4) mesh: prefill, continuation over the gathered
  prefix, and decode against the float64 oracle; each rank's shard holds exactly its tokens.
- The KDA layer's Pallas kernel per GPU under shard_map (marked gpu), and the MoE with its
  experts split over tp.
- The whole model for every (tp, dcp) in {(1,1), (2,1), (2,2), (4,1), (4,2), (4,4)}: logits
  of two prefill steps (the second continuing over the cached prefix) and two decode steps,
  every retained KDA state (recurrent and conv, each snapshot) and the MLA cache equal the
  one-device run; per-device bytes of the KDA pools shrink by tp, of the MLA cache by dcp.
  The model is the tiny preset at depth 2 (a KDA and an MLA layer, dense MLPs, no mHC):
  compiles dominate this file, and the MoE and mHC would add ~40% to each of the fourteen;
  the MoE's split has its own test and the server test runs the full tiny preset.
- The HTTP server at --tp 4 --dcp 4 answers greedy requests (prefix hits included) with the
  tokens of --tp 1 (`make test-extended`: two servers' every program compiled).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P
from test_layers_dsa_indexer import dsa_config, indexer_select_oracle
from test_layers_mla import make_layer, oracle, pack, random_block_table
from test_layers_moe import moe_params
from test_layers_oracles import f64, moe_oracle, random_module

from glmjax.batch import CHECKPOINT_CAPACITY, DecodeBatch, PrefillBatch
from glmjax.config import ModelConfig
from glmjax.layers.kda import KDA, KDAState
from glmjax.layers.latent_attention import (
    latent_attention,
    merge_partial_attention,
    owned_top_k_mask,
)
from glmjax.layers.moe import MoE
from glmjax.layers.paged_cache import DCPLayout, MLACache
from glmjax.model import HybridModel
from glmjax.shard import Workload, run_workload
from glmjax.sharding import ShardingPlan, make_mesh, single_device_steps
from glmjax.sharding_specs import SPECS

# tp, dcp, interleave: the deployment's TP4 with DCP 1 / 2 / 4 in CI; a one-device mesh
# (`--tp 1` serves without one) and the TP2 meshes (~15-20 s of CI's busy cores each) in
# `make test-extended`.
MESHES = [pytest.param(*mesh, marks=pytest.mark.extended)
          for mesh in ((1, 1, 1), (2, 1, 1), (2, 2, 4))] + [(4, 1, 1), (4, 2, 8), (4, 4, 2)]
LOGIT_RTOL = 2e-5  # max |diff| / max |reference logit|
STATE_TOL = dict(rtol=1e-4, atol=1e-5)


# --- the DCP layout -----------------------------------------------------------------------


@pytest.mark.parametrize("dcp", [1, 2, 4])
@pytest.mark.parametrize("interleave", [1, 2, 8])
def test_layout_deals_runs_of_interleave_tokens_round_robin(dcp, interleave):
    layout, length = DCPLayout(dcp, interleave), 512
    held = [[] for _ in range(dcp)]  # rank -> its tokens in local order
    for run_start in range(0, length, interleave):
        held[(run_start // interleave) % dcp].extend(range(run_start, run_start + interleave))
    for rank, tokens in enumerate(held):
        for local, t in enumerate(tokens):
            assert (layout.owner(t), layout.local_position(t)) == (rank, local)
            assert layout.global_position(local, rank) == t
    block = 16 * dcp * interleave  # P = 16 * interleave rows per rank
    rows_per_rank = layout.check_block(block)
    rows = np.asarray(layout.block_rows(block))
    assert sorted(rows) == list(range(block))
    for t in range(length):  # a block id holds the same tokens on every rank
        assert layout.local_position(t) // rows_per_rank == t // block
        local = layout.local_position(t) % rows_per_rank
        assert rows[t % block] == layout.owner(t) * rows_per_rank + local
    if dcp * interleave > 1:
        with pytest.raises(ValueError, match="interleave"):
            layout.check_block(block + 1)


# --- partial attention merged by LSE, against dense attention ------------------------------


@pytest.mark.parametrize("dcp, interleave, top_k", [(2, 1, None), (4, 2, None), (4, 3, 5),
                                                    (2, 4, 7)])
def test_partial_attention_merges_to_dense_attention(rng, dcp, interleave, top_k):
    """Keys dealt to dcp ranks by the layout (unused local rows hold garbage that must never
    be read); each rank attends to its own, the merge equals attention over all of them.
    With top_k, the selection is of global positions and each rank keeps the ones it owns."""
    n, heads, c, r, length = 3, 4, 16, 8, 48
    layout = DCPLayout(dcp, interleave)
    local_len = -(-length // (dcp * interleave)) * interleave + interleave
    latent = rng.normal(size=(n, length, c + r)).astype(np.float32)
    q_abs = rng.normal(size=(n, heads, c)).astype(np.float32)
    q_pe = rng.normal(size=(n, heads, r)).astype(np.float32)
    context = np.array([length - 1, 17, -1])  # the last row is inactive
    visible = np.arange(length)[None] <= context[:, None]
    mask, top, keep = visible, np.zeros((n, 1), np.int32), np.zeros((n, 1), bool)
    if top_k is not None:
        scores = np.where(visible, rng.normal(size=(n, length)), -np.inf)
        top = np.argsort(-scores, axis=1, kind="stable")[:, :top_k].astype(np.int32)
        keep = np.take_along_axis(visible, top, axis=1)
        mask = np.zeros_like(visible)
        np.put_along_axis(mask, top, keep, axis=1)
    local = rng.normal(size=(dcp, n, local_len, c + r)).astype(np.float32) * 100
    t = np.arange(length)
    local[layout.owner(t), :, layout.local_position(t)] = latent.transpose(1, 0, 2)
    expected, _ = latent_attention(jnp.asarray(q_abs), jnp.asarray(q_pe), jnp.asarray(latent),
                                   jnp.asarray(mask), kv_lora=c, scale=0.3)

    def on_rank(local, q_abs, q_pe, context, top, keep):
        rank = lax.axis_index("dcp")
        if top_k is None:
            positions = layout.global_position(jnp.arange(local_len), rank)
            mask = positions[None] <= context[:, None]
        else:
            mask = owned_top_k_mask(top, keep, layout=layout, rank=rank, local_len=local_len)
        q_abs, q_pe = lax.all_gather((q_abs, q_pe), "dcp", axis=1, tiled=True)
        out, lse = latent_attention(q_abs, q_pe, local[0], mask, kv_lora=c, scale=0.3)
        return merge_partial_attention(out, lse, "dcp")

    mesh = make_mesh(dcp, dcp)
    merged = jax.jit(jax.shard_map(
        on_rank, mesh=mesh, in_specs=(P("dcp"), SPECS.heads, SPECS.heads, P(), P(), P()),
        out_specs=SPECS.heads))(local, q_abs, q_pe, context, top, keep)
    np.testing.assert_allclose(merged, expected, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(merged[-1]))


# --- an MLA layer with a DSA indexer on a mesh ---------------------------------------------


def test_mla_with_dsa_on_a_4x4_mesh_matches_the_oracle(rng):
    """Prefix prefill, continuation and decode under a (tp 4, dcp 4) plan with interleave 2
    (8-token blocks: 2 rows per rank), against the float64 oracle with the oracle's own
    top-3 selection; afterwards every device's shard holds exactly the latents of the
    tokens the layout gives its dcp rank. Prefill attends in query blocks."""
    top_k, num_blocks = 3, 24
    config = dsa_config(top_k)
    layer = make_layer(config, rng)
    layer.query_block = 12  # prefill attends in blocks of 12 queries (the last one padded)
    plan = ShardingPlan(config, make_mesh(4, 4), interleave=2)
    lengths, prefixes = np.array([20, 13, 9, 0]), np.array([8, 0, 6, 0])
    seqs = [rng.normal(size=(n, config.hidden_size)) for n in lengths]
    table = random_block_table(rng)
    empty = MLACache.zeros(config, num_blocks)
    cache = MLACache(jax.device_put(empty.latent, plan.sharding(SPECS.mla_latent)),
                     jax.device_put(empty.index_keys, plan.sharding(SPECS.mla_index_keys)))
    prefill = nnx.jit(lambda m, x, cu, c, t, p: m(x, cu, c, t, p, plan=plan))
    x1, cu1 = pack([s[:p] for s, p in zip(seqs, prefixes)])
    y1, cache = prefill(layer, x1, cu1, cache, table, jnp.zeros(4, jnp.int32))
    x2, cu2 = pack([s[p:] for s, p in zip(seqs, prefixes)])
    y2, cache = prefill(layer, x2, cu2, cache, table, jnp.asarray(prefixes, jnp.int32))
    new = rng.normal(size=(4, config.hidden_size)).astype(np.float32)
    context = jnp.array([*lengths[:-1], -1], jnp.int32)
    y3, cache = nnx.jit(lambda m, x, c, t, n: m.decode(x, c, t, n, plan=plan))(
        layer, jnp.asarray(new), cache, table, context)
    for n, (s, p) in enumerate(zip(seqs[:-1], prefixes)):
        full = np.concatenate([s, new[n:n + 1]])
        expected = oracle(layer, config, full, indexer_select_oracle(layer, config, full, top_k))
        np.testing.assert_allclose(y1[cu1[n]:cu1[n + 1]], expected[:p], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y2[cu2[n]:cu2[n + 1]], expected[p:-1], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y3[n], expected[-1], rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(y3[-1]))
    # Each shard, rank by rank: token t of sequence n at local position lp of its rank.
    layout, rows = plan.layout, config.kv_block_size // 4
    latents = [np.concatenate([s, new[n:n + 1]]) for n, s in enumerate(seqs[:-1])]
    latents = [np.asarray(layer._latent(jnp.asarray(x, jnp.float32))) for x in latents]
    ranks = {d: int(np.argwhere(plan.mesh.devices == d)[0][1]) for d in plan.mesh.devices.flat}
    for shard in cache.latent.addressable_shards:
        rank, pages = ranks[shard.device], np.asarray(shard.data)
        assert pages.shape == (num_blocks, rows, config.kv_lora_rank)
        expected = np.zeros_like(pages)
        for n, x in enumerate(latents):
            for t in range(len(x)):
                if layout.owner(t) == rank:
                    local = layout.local_position(t)
                    expected[table[n, local // rows], local % rows] = x[t]
        np.testing.assert_allclose(pages, expected, rtol=1e-5, atol=1e-6)


# --- the KDA kernel per device and the experts split over tp ------------------------------


@pytest.mark.gpu
def test_pallas_kda_scan_runs_per_device_under_shard_map(rng):
    """The Pallas kernel on the GPUs (up to 4, the tiny preset's head count), each on its
    own heads, against the jax.numpy reference scan on one device. (Without the marker it
    passes on a CPU in interpret mode too, at ~20 s of compile.)

    fp32 matmuls at full precision: at XLA's default (TF32 on the GPU) the projections
    around the scan round the ~1e-7 differences between the two scans to whole TF32 steps
    (up to 5.5e-5 in a few rows of y on the H200, against 1.3e-6 at full precision)."""
    config = dataclasses.replace(ModelConfig.preset("tiny"), kda_backend="pallas")
    layer = random_module(lambda: KDA(config, rngs=nnx.Rngs(0)), rng)
    tp = min(4, 1 << (len(jax.devices()).bit_length() - 1))
    plan = ShardingPlan(config, make_mesh(tp, 1))
    x = jnp.asarray(rng.normal(size=(48, config.hidden_size)), jnp.float32)
    cu = jnp.array([0, 29, 48], jnp.int32)
    heads, dim = config.kda_num_heads, config.kda_head_dim
    state = KDAState(jnp.asarray(rng.normal(size=(2, heads, dim, dim)) * 0.1, jnp.float32),
                     jnp.asarray(rng.normal(size=(2, config.conv_channels, 3)), jnp.float32))
    offsets = jnp.array([[5, 29], [19, -1]], jnp.int32)
    with jax.default_matmul_precision("highest"):
        sharded = nnx.jit(lambda m, *a: m(*a, plan=plan))(layer, x, cu, state, offsets)
        layer.backend = "reference"
        expected = nnx.jit(lambda m, *a: m(*a))(layer, x, cu, state, offsets)
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
    heads_held = {s.data.shape[1] for s in sharded.state.recurrent.addressable_shards}
    assert heads_held == {heads // tp}


@pytest.mark.gpu
def test_pallas_kda_decode_runs_per_device_under_shard_map(rng):
    """The decode kernel on the GPUs, each on its own heads of the pool, against the
    jax.numpy decode on one device (padding row and unnamed slots included)."""
    config = dataclasses.replace(ModelConfig.preset("tiny"), kda_backend="pallas")
    layer = random_module(lambda: KDA(config, rngs=nnx.Rngs(0)), rng)
    tp = min(4, 1 << (len(jax.devices()).bit_length() - 1))
    plan = ShardingPlan(config, make_mesh(tp, 1))
    heads, dim = config.kda_num_heads, config.kda_head_dim
    x = jnp.asarray(rng.normal(size=(3, config.hidden_size)), jnp.float32)
    slots = jnp.array([2, -1, 0], jnp.int32)

    def pool():
        return KDAState(jnp.asarray(rng.normal(size=(4, heads, dim, dim)) * 0.1, jnp.float32),
                        jnp.asarray(rng.normal(size=(4, config.conv_channels, 3)), jnp.float32))

    state = pool()
    with jax.default_matmul_precision("highest"):
        sharded = nnx.jit(lambda m, *a: m.decode(*a, plan=plan))(layer, x, state, slots)
        layer.backend = "reference"
        expected = nnx.jit(lambda m, *a: m.decode(*a))(layer, x, state, slots)
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
    heads_held = {s.data.shape[1] for s in sharded[1].recurrent.addressable_shards}
    assert heads_held == {heads // tp}


def test_moe_with_experts_split_over_tp_matches_the_oracle(rng):
    """Routed and shared experts with their intermediate split over 4 devices (XLA
    partitions the ragged_dot), against the per-token float64 loop."""
    config = ModelConfig.preset("tiny")
    moe = random_module(lambda: MoE(config, rngs=nnx.Rngs(0)), rng)
    plan = ShardingPlan(config, make_mesh(4, 2))
    graphdef, params = nnx.split(moe)
    params = jax.device_put(params, plan.param_shardings(params))
    assert {s.data.shape for s in params["w_down"].addressable_shards} == {(4, 32, 256)}
    x = (rng.normal(size=(19, config.hidden_size)) * 4).astype(np.float32)
    y = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, jnp.asarray(x))
    expected = moe_oracle(moe_params(moe), f64(x), top_k=config.num_experts_per_token,
                          scaling=config.routed_scaling_factor, limit=config.swiglu_limit)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)


# --- the whole model on every mesh ---------------------------------------------------------

CONFIG = dataclasses.replace(ModelConfig.preset("tiny"), num_layers=2, full_attn_interval=2,
                             first_dense_layers=2, mhc_streams=None, kv_block_size=64)
NUM_ROWS, NUM_SPANS, MAX_BLOCKS, NUM_SLOTS, NUM_BLOCKS = 256, 2, 4, 12, 8


def _prefill(tokens, spans):
    """spans: (start, end, slot, blocks, offsets, dests) of the shared token sequence."""
    ids = np.concatenate([tokens[s[0]:s[1]] for s in spans])
    offsets = np.full((NUM_SPANS, CHECKPOINT_CAPACITY), -1, np.int32)
    dests = offsets.copy()
    for n, (*_, o, d) in enumerate(spans):
        offsets[n, :len(o)], dests[n, :len(d)] = o, d
    return PrefillBatch(
        token_ids=np.pad(ids, (0, NUM_ROWS - len(ids))).astype(np.int32),
        positions=np.pad(np.concatenate([np.arange(s[0], s[1]) for s in spans]),
                         (0, NUM_ROWS - len(ids))).astype(np.int32),
        cu_seqlens=np.cumsum([0] + [s[1] - s[0] for s in spans]).astype(np.int32),
        state_slots=np.array([s[2] for s in spans], np.int32),
        has_initial=np.array([s[0] > 0 for s in spans]),
        checkpoint_offsets=offsets, checkpoint_slots=dests,
        block_tables=np.array([s[3] for s in spans], np.int32),
        prefix_lens=np.array([s[0] for s in spans], np.int32))


def model_workload(tokens) -> Workload:
    """Two requests: a cold prefill with snapshots (offset 1 reads the zero conv history,
    64 is on the chunk grid), a continuation over the cached prefix with snapshots of its
    own, then two decode steps."""
    a, b = (0, 1, 2, 3), (4, 5, 6, 7)
    prefills = [
        _prefill(tokens, [(0, 100, 0, a, (1, 37, 64, 100), (2, 3, 4, 5)),
                          (0, 70, 1, b, (70,), (6,))]),
        _prefill(tokens, [(100, 190, 0, a, (1, 28, 90), (7, 8, 9)),
                          (70, 130, 1, b, (60,), (10,))]),
    ]
    decodes = [DecodeBatch(tokens[[190 + i, 130 + i]], np.array([190 + i, 130 + i], np.int32),
                           np.array([0, 1], np.int32), np.array([a, b], np.int32))
               for i in range(2)]
    retained = {0: 192, 1: 132, 2: 1, 3: 37, 4: 64, 5: 100, 6: 70, 7: 101, 8: 128, 9: 190,
                10: 130}
    return Workload(prefills, decodes, NUM_SLOTS, NUM_BLOCKS, retained)


@pytest.fixture(scope="module")
def single_device_run():
    rng = np.random.default_rng(2024)
    model_state = nnx.split(random_module(lambda: HybridModel(CONFIG, nnx.Rngs(0)), rng))
    workload = model_workload(rng.integers(0, CONFIG.vocab_size, 256).astype(np.int32))
    return model_state, workload, run_workload(single_device_steps(CONFIG), model_state,
                                               workload)


@pytest.mark.parametrize("tp, dcp, interleave", MESHES)
def test_model_on_a_mesh_equals_one_device(single_device_run, tp, dcp, interleave):
    model_state, workload, want = single_device_run
    plan = ShardingPlan(CONFIG, make_mesh(tp, dcp), interleave=interleave)
    got = run_workload(plan.steps(), model_state, workload)
    for kind in ("prefill_logits", "decode_logits"):
        for step, (g, w) in enumerate(zip(getattr(got, kind), getattr(want, kind), strict=True)):
            err = np.max(np.abs(g - w)) / np.max(np.abs(w))
            assert err <= LOGIT_RTOL, f"{kind} step {step}: max relative error {err:.2e}"
    for layer, (g, w) in enumerate(zip(got.caches.kda, want.caches.kda, strict=True)):
        for slot in workload.retained:  # every slot the steps wrote, each snapshot included
            np.testing.assert_allclose(g.recurrent[slot], w.recurrent[slot], **STATE_TOL,
                                       err_msg=f"layer {layer} recurrent slot {slot}")
            np.testing.assert_allclose(g.conv[slot], w.conv[slot], **STATE_TOL,
                                       err_msg=f"layer {layer} conv slot {slot}")
        np.testing.assert_array_equal(np.delete(g.recurrent, list(workload.retained), 0), 0)
    for g, w in zip(got.caches.mla, want.caches.mla, strict=True):
        np.testing.assert_allclose(g.latent, w.latent, **STATE_TOL)
    # The fullest device's bytes.
    assert got.bytes_per_device["kda_pools"] * tp == want.bytes_per_device["kda_pools"]
    assert got.bytes_per_device["mla_latent"] * dcp == want.bytes_per_device["mla_latent"]


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("tp, dcp, message", [
    (3, 2, "dcp=2 must divide tp=3"),
    (2, 3, "dcp=3"),
    (0, 1, "tp=0"),
    (16, 4, "tp=16 needs 16 devices"),
])
def test_bad_meshes_are_refused(tp, dcp, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(tp, dcp)


def test_plans_the_model_cannot_split_are_refused():
    tiny = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="tp=8 must divide kda_num_heads=4"):
        ShardingPlan(tiny, make_mesh(8, 2))
    with pytest.raises(ValueError, match="interleave=3"):
        ShardingPlan(tiny, make_mesh(4, 4), interleave=3)  # 512-token blocks, 4 ranks


# --- the server -----------------------------------------------------------------------------

SERVER_ARGS = ["--preset", "tiny", "--block-size", "64", "--max-num-batched-tokens", "256",
               "--max-model-len", "512", "--single-bucket", "--max-num-seqs", "2",
               "--num-kv-blocks", "16", "--num-state-slots", "16", "--dcp", "4"]


def _serve(extra):
    # Imported here: the GPU image runs this file's `gpu` tests without the server's web stack.
    from fastapi.testclient import TestClient

    from serving import server

    engine, tokenizer, name = server.build_engine(server.parse_args([*SERVER_ARGS, *extra]))
    server.warm_up(engine, precompile_all=True)  # as the server starts: nothing compiles later
    app = server.build_app(server.AsyncEngine(engine), tokenizer, model_name=name)
    answers = []
    with TestClient(app) as client:
        # The repeat resumes at position 128 from a retained state, copying its partly
        # shared KV block (128 is inside a 256-token block id at dcp 4).
        for _ in range(2):
            body = client.post("/v1/completions", json={
                "prompt": "x" * 150, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}).json()
            answers.append((body["choices"][0]["logprobs"]["tokens"], body["usage"]))
        metrics = client.get("/metrics").text
    return engine, answers, metrics


@pytest.mark.extended  # ~45-65 s on two busy cores: two servers' every program compiled
def test_server_on_a_4x4_mesh_generates_the_tokens_of_one_device():
    engine, on_mesh, metrics = _serve(["--tp", "4", "--dcp", "4"])
    assert engine.steps.mesh.shape == {"tpo": 1, "dcp": 4}
    assert "glmjax_dcp 4" in metrics
    assert on_mesh[1][1]["prompt_tokens_details"]["cached_tokens"] == 128
    assert engine.metrics().kv_block_copies >= 1
    assert "glmjax_backend_compiles_total 0.0" in metrics
    _, on_one_device, metrics = _serve(["--tp", "1"])
    assert on_mesh == on_one_device
    assert "glmjax_backend_compiles_total 0.0" in metrics
