"""Packs a ``ScheduledStep`` into the model's ``PrefillBatch`` and ``DecodeBatch``.

Arrays are host NumPy arrays (int32, ``has_initial`` bool) at bucket shapes, checked
(``serving.batch_validation``) before they reach the device; the engine puts them on the
device with its shardings.
Buckets, so that a new mix of requests reuses a compiled shape:

- tokens T: P, 2P, 4P, ... below the budget, then the budget itself
  (512, 1024, ..., 8192 at the defaults; 512, 1024, 1536 for a budget of 1536).
- sequences N: 1, 2, 4, 8, ... up to ``max_num_seqs`` rounded up to a power of two.
- block-table width M: 1, 2, 4, ... below the blocks of a ``max_model_len`` request,
  then that count.

A decode's ``PLACEHOLDER`` token (sampled by the step in flight: asynchronous scheduling)
is packed as token 0; the engine feeds the sampled token on the device.

Padding is inert: sequences past the real ones have zero length (``cu_seqlens`` flat),
slot -1, no initial state, offsets and destinations -1, block table -1 and prefix length
0; token rows past ``cu_seqlens[N]`` hold token 0 at position 0.
"""

import dataclasses

import numpy as np

from glmjax.batch import CHECKPOINT_CAPACITY, DecodeBatch, PrefillBatch, VerifyBatch
from serving.batch_validation import BatchValidator
from serving.request import PLACEHOLDER
from serving.step import ScheduledDecode, ScheduledPrefill, ScheduledStep, SchedulerConfig


def power_of_two_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """``smallest * 2^k`` below ``largest``, then ``largest``."""
    buckets = []
    size = smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    return (*buckets, largest)


def bucket_for(buckets: tuple[int, ...], count: int, what: str) -> int:
    """The smallest bucket holding ``count``; ValueError naming ``what`` if none does."""
    for size in buckets:
        if count <= size:
            return size
    raise ValueError(f"{count} {what} exceed the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class BatchBuckets:
    """The static sizes batches are padded to (see the module docstring)."""

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    block_table_widths: tuple[int, ...]

    @classmethod
    def for_config(cls, config: SchedulerConfig) -> "BatchBuckets":
        tokens_per_block = config.block_size * config.dcp
        max_width = -(-config.max_model_len // tokens_per_block)
        max_seqs = 1 << (config.max_num_seqs - 1).bit_length()
        return cls(
            tokens=power_of_two_buckets(config.block_size, config.budget),
            seqs=power_of_two_buckets(1, max_seqs),
            block_table_widths=power_of_two_buckets(1, max_width),
        )

    def largest_only(self) -> "BatchBuckets":
        """Only the largest bucket of each kind: every batch has one shape, so each model
        entry point compiles once (small models, tests), at the cost of padding."""
        return BatchBuckets(self.tokens[-1:], self.seqs[-1:], self.block_table_widths[-1:])


class BatchBuilder:
    """Builds the batches of each step for one pool of blocks and slots, and checks them
    with its ``validator``."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        num_blocks: int,
        num_slots: int,
        buckets: BatchBuckets | None = None,
    ):
        """``buckets`` defaults to ``BatchBuckets.for_config(config)``."""
        self.config = config
        self.buckets = buckets or BatchBuckets.for_config(config)
        self.validator = BatchValidator(config, num_blocks=num_blocks, num_slots=num_slots)

    def build(self, step: ScheduledStep, *, mixed: bool = False
              ) -> tuple[PrefillBatch | None, DecodeBatch | VerifyBatch | None]:
        """The step's batches (None where it has no rows of that kind), checked together.
        ``mixed``: a step with both kinds pads both to one sequence count N and table
        width M (one forward over both, ``glmjax.mixed``: its shape is (T, N, M)).
        With ``speculative_tokens`` the decodes form a ``VerifyBatch`` (never mixed).

        Raises:
          ValueError: naming the row and value of anything the device must not see.
        """
        if mixed and self.config.speculative_tokens:
            raise ValueError("mixed steps cannot verify drafts "
                             f"(speculative_tokens={self.config.speculative_tokens})")
        n = m = None
        if mixed and step.prefills and step.decodes:
            n = bucket_for(self.buckets.seqs, max(len(step.prefills), len(step.decodes)),
                           "prefill sequences or decode rows")
            m = self._block_table_width(step.prefills + step.decodes)
        prefill = self.prefill_batch(step.prefills, n, m) if step.prefills else None
        decode = None
        if step.decodes:
            decode = (self.verify_batch(step.decodes) if self.config.speculative_tokens
                      else self.decode_batch(step.decodes, n, m))
        self.validator.validate_step(prefill, decode)
        return prefill, decode

    def _block_table_width(self, rows) -> int:
        """The block-table width bucket that holds the longest table of `rows`."""
        widest = max(len(row.block_table) for row in rows)
        return bucket_for(self.buckets.block_table_widths, widest, "blocks in a block table")

    def prefill_batch(self, prefills: tuple[ScheduledPrefill, ...], n: int | None = None,
                      m: int | None = None) -> PrefillBatch:
        """Packs the spans in order; offsets are span-relative (position - span start).
        ``n``, ``m``: the sequence and width buckets (default: the smallest that hold them)."""
        num_tokens = sum(p.span.num_tokens for p in prefills)
        t = bucket_for(self.buckets.tokens, num_tokens, "prefill tokens")
        n = n or bucket_for(self.buckets.seqs, len(prefills), "prefill sequences")
        m = m or self._block_table_width(prefills)
        token_ids = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        cu_seqlens = np.full(n + 1, num_tokens, np.int32)
        state_slots = np.full(n, -1, np.int32)
        has_initial = np.zeros(n, bool)
        offsets = np.full((n, CHECKPOINT_CAPACITY), -1, np.int32)
        destinations = np.full((n, CHECKPOINT_CAPACITY), -1, np.int32)
        block_tables = np.full((n, m), -1, np.int32)
        prefix_lens = np.zeros(n, np.int32)
        row = 0
        for i, prefill in enumerate(prefills):
            span = prefill.span
            if len(span.checkpoints) > CHECKPOINT_CAPACITY:
                raise ValueError(
                    f"request {prefill.request_id!r}: {len(span.checkpoints)} checkpoints "
                    f"exceed the capacity {CHECKPOINT_CAPACITY}"
                )
            cu_seqlens[i] = row
            token_ids[row : row + span.num_tokens] = prefill.token_ids
            positions[row : row + span.num_tokens] = np.arange(span.start, span.end)
            row += span.num_tokens
            state_slots[i] = prefill.state_slot
            has_initial[i] = prefill.has_initial
            count = len(span.checkpoints)
            offsets[i, :count] = np.asarray(span.checkpoints) - span.start
            destinations[i, :count] = prefill.checkpoint_slots
            block_tables[i, : len(prefill.block_table)] = prefill.block_table
            prefix_lens[i] = span.start
        batch = PrefillBatch(
            token_ids, positions, cu_seqlens, state_slots, has_initial, offsets,
            destinations, block_tables, prefix_lens,
        )  # fmt: skip
        self.validator.validate_prefill(batch)
        return batch

    def decode_batch(self, decodes: tuple[ScheduledDecode, ...], n: int | None = None,
                     m: int | None = None) -> DecodeBatch:
        """One row per decode, padded to a sequence bucket (``n``, ``m``: as
        ``prefill_batch``)."""
        n = n or bucket_for(self.buckets.seqs, len(decodes), "decode rows")
        m = m or self._block_table_width(decodes)
        token_ids = np.zeros(n, np.int32)
        positions = np.zeros(n, np.int32)
        state_slots = np.full(n, -1, np.int32)
        block_tables = np.full((n, m), -1, np.int32)
        for i, decode in enumerate(decodes):
            token_ids[i] = 0 if decode.token_id == PLACEHOLDER else decode.token_id
            positions[i] = decode.position
            state_slots[i] = decode.state_slot
            block_tables[i, : len(decode.block_table)] = decode.block_table
        batch = DecodeBatch(token_ids, positions, state_slots, block_tables)
        self.validator.validate_decode(batch)
        return batch

    def verify_batch(self, decodes: tuple[ScheduledDecode, ...]) -> VerifyBatch:
        """One column per decode (its token, then its drafts), J = speculative_tokens + 1
        rows, padded to a sequence bucket."""
        chain = self.config.speculative_tokens + 1
        n = bucket_for(self.buckets.seqs, len(decodes), "decode rows")
        m = self._block_table_width(decodes)
        token_ids = np.zeros((chain, n), np.int32)
        positions = np.full(n, -1, np.int32)
        num_drafts = np.zeros(n, np.int32)
        slot_chain = np.full((chain, n), -1, np.int32)
        block_tables = np.full((n, m), -1, np.int32)
        for i, decode in enumerate(decodes):
            count = len(decode.draft_token_ids)
            if count >= chain or len(decode.draft_slots) != count:
                raise ValueError(f"request {decode.request_id!r}: {count} drafts with "
                                 f"{len(decode.draft_slots)} slots (at most {chain - 1})")
            token_ids[: count + 1, i] = (decode.token_id, *decode.draft_token_ids)
            positions[i] = decode.position
            num_drafts[i] = count
            slot_chain[: count + 1, i] = (decode.state_slot, *decode.draft_slots)
            block_tables[i, : len(decode.block_table)] = decode.block_table
        batch = VerifyBatch(token_ids, positions, num_drafts, slot_chain, block_tables)
        self.validator.validate_verify(batch)
        return batch
