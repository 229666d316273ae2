"""serving.precompile: the programs it lists are every shape the batch builder can pad a
batch to (checked against `bucket_for` over every token and sequence count), and the
sampler among them has one shape. A program compiled before the process's first Pallas
kernel is not compiled again after it."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import serving.dispatch
from glmjax.config import ModelConfig
from glmjax.model import DecodeOutput, HybridModel, PrefillOutput
from glmjax.sharding import single_device_steps
from serving.batch_builder import BatchBuckets, bucket_for
from serving.compiles import CompileLog
from serving.engine import Engine, EngineConfig
from serving.precompile import precompile, reachable_programs
from serving.request import SamplingParams
from serving.sampling import SAMPLER_VARIANTS
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
@pytest.mark.parametrize("feed", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "pinned"])
def test_every_reachable_shape_is_listed_and_nothing_else(config, single, feed, pinned):
    buckets = BatchBuckets.for_config(config)
    if single:
        buckets = buckets.largest_only()
    listed = {(p.kind, p.shape) for p in reachable_programs(buckets, feed=feed, pinned=pinned)}
    mixed = {(p.kind, p.shape)
             for p in reachable_programs(buckets, feed=feed, mixed=True, pinned=pinned)}
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
        if pinned:  # the batch written into the bucket's buffers (placeholders fed there)
            reached |= {("stage", (n, m)) for m in widths}
        elif feed:  # placeholder tokens of a decode batch fed from the step in flight
            reached.add(("feed", (n,)))
    reached |= {("copy_kv_blocks", ()), ("copy_state_slots", ())}
    reached |= {("keep_status", ())} if pinned else set()
    reached |= {("sample", variant) for variant in SAMPLER_VARIANTS}
    assert listed == reached
    # Mixed steps' decode rows are fed as the unpinned engine feeds them.
    assert {kind for kind, _ in mixed - listed} == {"mixed"} | ({"feed"} if pinned and feed
                                                                else set())
    if config.budget * config.max_num_seqs > 1024:
        return  # the brute force below is for small configs
    # Mixed steps: k spans of p tokens beside d decode rows, one bucket (N, M) for both.
    both = set()
    for p in range(1, config.budget):
        for k in range(1, min(p, config.max_num_seqs - 1) + 1):
            for d in range(1, min(config.max_num_seqs - k, config.budget - p) + 1):
                t = bucket_for(buckets.tokens, p, "tokens")
                n = bucket_for(buckets.seqs, max(k, d), "sequences")
                both |= {("mixed", (t, n, m)) for m in widths}
    assert both == {(kind, shape) for kind, shape in mixed - listed if kind == "mixed"}


class FakeStep:
    """A model step's stand-in: logits one-hot at each row's last token, caches passed
    through, status OK. Jitted per bucket as the real step is, with the same ``lower``
    (the sampler's and the copies' compiles do not depend on the model); ``pinned``: the
    decode writing into donated buffers (`glmjax.model.decode_pinned`)."""

    def __init__(self, kind: str, vocab_size: int, *, pinned: bool = False):
        self.kind, self.vocab_size, self.rows_seen = kind, vocab_size, set()
        self.jitted = jax.jit(self._step, donate_argnums=(2,) if pinned else (),
                              keep_unused=pinned)

    def _step(self, caches, batch, buffers=None):
        if self.kind == "prefill":
            last = jnp.clip(batch.cu_seqlens[1:] - 1, 0, batch.token_ids.shape[0] - 1)
            logits = jax.nn.one_hot(batch.token_ids[last] % self.vocab_size, self.vocab_size)
            return PrefillOutput(logits, caches, jnp.int32(0), None)
        logits = jax.nn.one_hot(batch.token_ids % self.vocab_size, self.vocab_size)
        return DecodeOutput(logits, caches, jnp.int32(0))

    def __call__(self, model_state, caches, batch, *buffers):
        self.rows_seen.add(batch.block_tables.shape[0])
        return self.jitted(caches, batch, *buffers)

    def lower(self, model_state, caches, batch, *buffers):
        return self.jitted.lower(caches, batch, *buffers)


def fake_engine(*, pinned: bool = True, **config) -> Engine:
    """An engine of the tiny preset's shapes on `FakeStep`s (its decode steps through
    `serving.pinned` or not)."""
    model_config = dataclasses.replace(ModelConfig.preset("tiny"), kv_block_size=16)
    vocab = model_config.vocab_size
    steps = single_device_steps(model_config)._replace(
        prefill=FakeStep("prefill", vocab), decode=FakeStep("decode", vocab),
        decode_pinned=FakeStep("decode", vocab, pinned=True) if pinned else None)
    model = nnx.state(nnx.eval_shape(lambda: HybridModel(model_config, nnx.Rngs(0))))
    return Engine(model_config, model, EngineConfig(block_size=16, **config), steps=steps)


def mixed_workload(engine: Engine, rng, requests: int = 10) -> None:
    """Requests of random lengths (some sharing a prefix), greedy and sampled, arriving
    while others run, until all finish."""
    shared = rng.integers(1, 200, 40).tolist()
    for k in range(requests):
        length = int(rng.integers(1, 45))
        prompt = (shared[:length] if k % 3 == 0 else rng.integers(1, 200, length).tolist())
        engine.add_request(f"r{k}", prompt, SamplingParams(
            max_tokens=int(rng.integers(1, 12)), temperature=float(k % 2), top_k=k % 4))
        for _ in range(int(rng.integers(0, 3))):
            engine.step()
    engine.run_until_done()


def test_the_sampler_compiles_once_per_variant_across_sequence_buckets(rng):
    """An engine whose batches reach several sequence buckets (prefill and decode, one to
    four requests) compiles the sampler once per `SamplerVariant` its batches need (greedy
    with sampled, top-k or not: two here); only the row gather compiles per bucket."""
    engine = fake_engine(max_model_len=64, budget=32, max_num_seqs=4, num_kv_blocks=32,
                         num_state_slots=16)
    serving.dispatch.sample_gathered.clear_cache()  # whatever other tests compiled before
    serving.dispatch.gather_rows.clear_cache()
    with CompileLog() as log:
        mixed_workload(engine, rng)
    compiles = log.by_function()

    steps = engine.steps
    rows_seen = steps.prefill.rows_seen | steps.decode.rows_seen | steps.decode_pinned.rows_seen
    assert len(rows_seen) >= 3  # several sequence buckets were sampled from
    assert compiles["jit(sample)"]["count"] == 2
    assert compiles["jit(gather_rows)"]["count"] == len(rows_seen)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned"])
def test_after_precompile_a_mixed_workload_compiles_nothing(rng, pinned):
    """Every program the engine calls while serving requests of any shape within its
    limits (prefix hits and their copies included) was compiled by `precompile`, with
    its decode steps through pinned buffers (`serving.pinned`) or not."""
    engine = fake_engine(max_model_len=64, budget=32, max_num_seqs=4, num_kv_blocks=24,
                         num_state_slots=12, pinned=pinned)
    precompile(engine, workers=2, progress=False)
    with CompileLog() as log:
        mixed_workload(engine, rng, requests=16)

    assert engine.metrics().prefix_cache_hits > 0
    assert log.count == 0, log.by_function()


# Compiles f, traces one interpret-mode Pallas kernel, calls f again: prints how many
# programs f's jit holds. `import pallas_kernels` first or not, by argv[1].
FIRST_KERNEL = """
import sys
import jax
import jax.numpy as jnp
if sys.argv[1] == "import":
    import pallas_kernels
from jax.experimental import pallas as pl

def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

f = jax.jit(lambda x: x * 2)
x = jnp.ones((8, 128), jnp.float32)
f(x)
pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
f(x)
print(f._cache_size())
"""


def printed_count(script: str, *args: str) -> int:
    """Runs `script` with `args` in a fresh Python process from the repository root (a
    process's first compiles and traces are what these checks count): the last integer it
    prints."""
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[1], check=True,
                            timeout=120)
    return int(result.stdout.split()[-1])


def test_the_first_pallas_kernel_does_not_recompile_earlier_programs():
    """Pallas's interpret mode imports its fuser on its first trace, which adds a config
    value to jit's keys: every program compiled before compiles again (on the CPU the
    whole model, once a process). `pallas_kernels` imports it up front; without that the
    same script holds two programs (the check can fail)."""
    assert printed_count(FIRST_KERNEL, "import") == 1
    assert printed_count(FIRST_KERNEL, "no-import") == 2
