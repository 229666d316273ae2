"""serving.precompile: the programs it lists are every shape the batch builder can pad a
batch to (checked against `bucket_for` over every token and sequence count), and the
sampler among them has one shape."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import serving.engine
from glmjax.config import ModelConfig
from glmjax.model import DecodeOutput, HybridModel, PrefillOutput
from glmjax.sharding import single_device_steps
from serving.batch_builder import BatchBuckets, bucket_for
from serving.compiles import CompileLog
from serving.engine import Engine, EngineConfig
from serving.precompile import reachable_programs
from serving.request import SamplingParams
from serving.step import SchedulerConfig


@pytest.mark.parametrize(
    "config",
    [
        SchedulerConfig(max_model_len=512, block_size=64, budget=128, max_num_seqs=4),
        SchedulerConfig(max_model_len=1024, block_size=64, budget=192, max_num_seqs=256),
        SchedulerConfig(max_model_len=4096, block_size=512, budget=8192, max_num_seqs=64),
    ],
    ids=["tests", "budget-off-the-grid", "defaults"],
)
@pytest.mark.parametrize("single", [False, True], ids=["buckets", "single-bucket"])
def test_every_reachable_shape_is_listed_and_nothing_else(config, single):
    buckets = BatchBuckets.for_config(config)
    if single:
        buckets = buckets.largest_only()
    listed = {(p.kind, p.shape) for p in reachable_programs(buckets)}
    widths = buckets.block_table_widths
    reached = set()
    for tokens in range(1, config.budget + 1):  # k spans of at least one token each
        for seqs in range(1, min(tokens, config.max_num_seqs) + 1):
            t = bucket_for(buckets.tokens, tokens, "tokens")
            n = bucket_for(buckets.seqs, seqs, "sequences")
            reached |= {("prefill", (t, n, m)) for m in widths}
    for seqs in range(1, config.max_num_seqs + 1):
        n = bucket_for(buckets.seqs, seqs, "sequences")
        reached |= {("decode", (n, m)) for m in widths} | {("gather_rows", (n,))}
    reached |= {("copy_kv_blocks", ()), ("copy_state_slots", ()), ("sample", ())}
    assert listed == reached


def test_the_sampler_compiles_once_across_sequence_buckets():
    """An engine whose batches reach several sequence buckets (prefill and decode, one to
    four requests) compiles the sampler once; only the row gather compiles per bucket.
    The model steps are stand-ins returning logits of the batch's shape (the sampler's
    compiles do not depend on the model)."""
    config = dataclasses.replace(ModelConfig.preset("tiny"), kv_block_size=16)
    steps = single_device_steps(config)
    rows_seen = set()

    def logits(token_ids, rows):
        rows_seen.add(rows)
        return _fake_logits(token_ids[:rows], config.vocab_size)

    def prefill(model_state, caches, batch, **_):
        n = batch.block_tables.shape[0]
        return PrefillOutput(logits(batch.token_ids, n), caches, np.int32(0), None)

    def decode(model_state, caches, batch):
        return DecodeOutput(logits(batch.token_ids, batch.token_ids.shape[0]), caches,
                            np.int32(0))

    model = nnx.state(nnx.eval_shape(lambda: HybridModel(config, nnx.Rngs(0))))
    engine = Engine(config, model, EngineConfig(
        max_model_len=96, block_size=16, budget=64, max_num_seqs=4, num_kv_blocks=32,
        num_state_slots=16), steps=steps._replace(prefill=prefill, decode=decode))
    serving.engine._sample.clear_cache()  # whatever other tests compiled before
    serving.engine._gather_rows.clear_cache()
    with CompileLog() as log:
        for k, length in enumerate([5, 40, 3, 17, 9, 30]):
            engine.add_request(f"r{k}", list(range(1, length + 1)),
                               SamplingParams(max_tokens=3 + k, temperature=k % 2))
            engine.step()
        engine.run_until_done()
    compiles = log.by_function()

    assert len(rows_seen) >= 3  # several sequence buckets were sampled from
    assert compiles["jit(sample)"]["count"] == 1
    assert compiles["jit(_gather_rows)"]["count"] == len(rows_seen)


@functools.partial(jax.jit, static_argnums=1)
def _fake_logits(token_ids, vocab_size):
    return jax.nn.one_hot(token_ids % vocab_size, vocab_size, dtype=jnp.float32)
