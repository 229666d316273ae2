"""serving.precompile: the programs it lists are every shape the batch builder can pad a
batch to (checked against `bucket_for` over every token and sequence count)."""

import pytest

from serving.batch_builder import BatchBuckets, bucket_for
from serving.precompile import reachable_programs
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
def test_every_reachable_shape_is_listed_and_nothing_else(config, single, feed):
    buckets = BatchBuckets.for_config(config)
    if single:
        buckets = buckets.largest_only()
    listed = {(p.kind, p.shape) for p in reachable_programs(buckets, feed=feed)}
    mixed = {(p.kind, p.shape) for p in reachable_programs(buckets, feed=feed, mixed=True)}
    widths = buckets.block_table_widths
    reached = set()
    for tokens in range(1, config.budget + 1):  # k spans of at least one token each
        for seqs in range(1, min(tokens, config.max_num_seqs) + 1):
            t = bucket_for(buckets.tokens, tokens, "tokens")
            n = bucket_for(buckets.seqs, seqs, "sequences")
            reached |= {("prefill", (t, n, m)) for m in widths}
    for seqs in range(1, config.max_num_seqs + 1):
        n = bucket_for(buckets.seqs, seqs, "sequences")
        reached |= {("decode", (n, m)) for m in widths} | {("sample", (n,))}
        if feed:  # placeholder tokens of a decode batch fed from the step in flight
            reached.add(("feed", (n,)))
    reached |= {("copy_kv_blocks", ()), ("copy_state_slots", ())}
    assert listed == reached
    assert {kind for kind, _ in mixed - listed} == {"mixed"}
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
    assert both == mixed - listed
