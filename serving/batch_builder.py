"""Packs a ``ScheduledStep`` into the model's ``PrefillBatch`` and ``DecodeBatch``.

Arrays are host NumPy arrays (int32, ``has_initial`` bool) at bucket shapes, checked here
before they reach the device; the engine puts them on the device with its shardings.
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

import collections
import dataclasses

import numpy as np

from glmjax.batch import CHECKPOINT_CAPACITY, DecodeBatch, PrefillBatch, VerifyBatch
from pallas_kernels.validation import validate_checkpoint_metadata
from serving.plan import retention_capacity
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
    """Builds and checks the batches of each step for one pool of blocks and slots."""

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
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.tokens_per_block = config.block_size * config.dcp

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
        self.validate_step(prefill, decode)
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
        self.validate_prefill(batch)
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
        self.validate_decode(batch)
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
        self.validate_verify(batch)
        return batch

    def validate_verify(self, batch: VerifyBatch) -> None:
        """Raises ValueError naming the row and value of anything invalid in ``batch``."""
        b = {name: np.asarray(value) for name, value in batch._asdict().items()}
        for name, value in b.items():
            if value.dtype != np.int32:
                raise ValueError(f"verify {name} must be int32, got {value.dtype}")
        chain, n = b["slot_chain"].shape
        for name, shape in (("token_ids", (chain, n)), ("positions", (n,)), ("num_drafts", (n,))):
            if b[name].shape != shape:
                raise ValueError(f"verify {name} has shape {b[name].shape}, expected {shape}")
        if b["block_tables"].ndim != 2 or b["block_tables"].shape[0] != n:
            raise ValueError(f"verify block_tables has shape {b['block_tables'].shape}")
        real = _trailing_padding("verify", b["positions"] != -1)
        for i in range(real, n):
            _check_padding_row("verify", i, b, ("num_drafts", "block_tables"))
        drafts = b["num_drafts"]
        bad = np.flatnonzero((drafts < 0) | (drafts >= chain))
        if bad.size:
            raise ValueError(f"verify row {bad[0]}: {drafts[bad[0]]} drafts outside [0, {chain})")
        active = np.arange(chain)[:, None] <= np.where(b["positions"] >= 0, drafts, -1)[None]
        wrong = np.argwhere(active != (b["slot_chain"] != -1))
        if wrong.size:
            j, i = wrong[0]
            raise ValueError(f"verify row {i}, token {j}: slot {b['slot_chain'][j, i]} with "
                             f"{drafts[i]} drafts (a slot exactly for the token and each draft)")
        _check_range("verify slot_chain", b["slot_chain"][active], self.num_slots)
        if np.any(b["token_ids"][active] < 0) or np.any(b["token_ids"][~active]):
            raise ValueError("verify token ids must be >= 0, and 0 past each row's drafts")
        if np.any(b["positions"][:real] < 0):
            raise ValueError(f"verify position {b['positions'][:real].min()} is negative")
        _check_writes(self._verify_rows(b))

    def _verify_rows(self, b: dict) -> list:
        real = int(np.count_nonzero(b["positions"] != -1))
        starts = b["positions"][:real]
        return self._table_rows("verify", b["block_tables"][:real], starts,
                                starts + b["num_drafts"][:real] + 1)

    def validate_prefill(self, batch: PrefillBatch) -> None:
        """Raises ValueError naming the row and value of anything invalid in ``batch``.

        Beyond ``validate_checkpoint_metadata``: padding sequences trailing and inert;
        running slots and snapshot destinations in the pool and all distinct; a
        destination exactly where an offset is active; at most R checkpoints a row;
        ``has_initial`` exactly for spans that resume (prefix > 0, on the P grid);
        positions matching the spans; block tables covering each span and writing no
        block another row reads or writes.
        """
        b = {name: np.asarray(value) for name, value in batch._asdict().items()}
        for name, value in b.items():
            want = np.bool_ if name == "has_initial" else np.int32
            if value.dtype != want:
                raise ValueError(f"prefill {name} must be {np.dtype(want)}, got {value.dtype}")
        num_tokens, n = b["token_ids"].shape[0], b["state_slots"].shape[0]
        for name, shape in (
            ("positions", (num_tokens,)),
            ("has_initial", (n,)),
            ("checkpoint_slots", b["checkpoint_offsets"].shape),
            ("prefix_lens", (n,)),
        ):
            if b[name].shape != shape:
                raise ValueError(f"prefill {name} has shape {b[name].shape}, expected {shape}")
        if b["block_tables"].ndim != 2 or b["block_tables"].shape[0] != n:
            raise ValueError(f"prefill block_tables has shape {b['block_tables'].shape}")
        validate_checkpoint_metadata(
            b["cu_seqlens"], b["checkpoint_offsets"], num_tokens=num_tokens
        )
        lengths = np.diff(b["cu_seqlens"])
        real = _trailing_padding("prefill", lengths > 0)
        prefix, offsets = b["prefix_lens"], b["checkpoint_offsets"]
        padded = ("state_slots", "has_initial", "checkpoint_slots", "block_tables", "prefix_lens")
        for i in range(real, n):
            _check_padding_row("prefill", i, b, padded)
        _check_range("prefill state_slots", b["state_slots"][:real], self.num_slots)
        if np.any(b["token_ids"] < 0):
            raise ValueError(f"prefill token id {b['token_ids'].min()} is negative")
        active = offsets[:real] != -1
        destinations = b["checkpoint_slots"][:real]
        mismatch = np.argwhere(active != (destinations != -1))
        if mismatch.size:
            i, c = mismatch[0]
            raise ValueError(
                f"prefill row {i}, checkpoint {c}: offset {offsets[i, c]} with destination "
                f"slot {destinations[i, c]} (an active offset needs a slot, -1 needs -1)"
            )
        capacity = retention_capacity(self.config.dcp)
        too_many = np.flatnonzero(active.sum(axis=1) > capacity)
        if too_many.size:
            raise ValueError(f"prefill row {too_many[0]} has more than R = {capacity} checkpoints")
        _check_range("prefill checkpoint_slots", destinations[active], self.num_slots)
        _check_range(
            "prefill running and checkpoint slots",
            np.concatenate([b["state_slots"][:real], destinations[active]]),
            self.num_slots,
        )
        for i in range(real):
            if prefix[i] < 0 or prefix[i] % self.config.block_size:
                raise ValueError(
                    f"prefill row {i}: prefix_len {prefix[i]} is not a multiple of "
                    f"block_size {self.config.block_size} >= 0"
                )
            if b["has_initial"][i] != (prefix[i] > 0):
                raise ValueError(
                    f"prefill row {i}: has_initial {b['has_initial'][i]} with prefix_len "
                    f"{prefix[i]} (a span resumes a state exactly when its prefix is cached)"
                )
            start, end = b["cu_seqlens"][i], b["cu_seqlens"][i + 1]
            expected = np.arange(prefix[i], prefix[i] + lengths[i])
            wrong = np.flatnonzero(b["positions"][start:end] != expected)
            if wrong.size:
                raise ValueError(
                    f"prefill row {i}: token row {start + wrong[0]} has position "
                    f"{b['positions'][start + wrong[0]]}, expected {expected[wrong[0]]}"
                )
        if np.any(b["positions"][b["cu_seqlens"][-1] :]):
            raise ValueError("prefill padding token rows must have position 0")
        _check_writes(self._table_rows("prefill", b["block_tables"], prefix, prefix + lengths))

    def validate_decode(self, batch: DecodeBatch) -> None:
        """Raises ValueError naming the row and value of anything invalid in ``batch``."""
        b = {name: np.asarray(value) for name, value in batch._asdict().items()}
        for name, value in b.items():
            if value.dtype != np.int32:
                raise ValueError(f"decode {name} must be int32, got {value.dtype}")
        n = b["state_slots"].shape[0]
        for name in ("token_ids", "positions"):
            if b[name].shape != (n,):
                raise ValueError(f"decode {name} has shape {b[name].shape}, expected {(n,)}")
        if b["block_tables"].ndim != 2 or b["block_tables"].shape[0] != n:
            raise ValueError(f"decode block_tables has shape {b['block_tables'].shape}")
        real = _trailing_padding("decode", b["state_slots"] != -1)
        for i in range(real, n):
            _check_padding_row("decode", i, b, ("token_ids", "positions", "block_tables"))
        _check_range("decode state_slots", b["state_slots"][:real], self.num_slots)
        if np.any(b["token_ids"] < 0):
            raise ValueError(f"decode token id {b['token_ids'].min()} is negative")
        positions = b["positions"][:real]
        if np.any(positions < 0):
            raise ValueError(f"decode position {positions.min()} is negative")
        _check_writes(self._table_rows("decode", b["block_tables"], positions, positions + 1))

    def validate_step(
        self, prefill: PrefillBatch | None, decode: DecodeBatch | VerifyBatch | None
    ) -> None:
        """Checks across both batches: no slot written twice, no block written and shared."""
        slots, rows = [], []
        if prefill is not None:
            p = {name: np.asarray(value) for name, value in prefill._asdict().items()}
            real = int(np.count_nonzero(np.diff(p["cu_seqlens"])))
            slots += [p["state_slots"][:real], p["checkpoint_slots"][p["checkpoint_slots"] != -1]]
            starts = p["prefix_lens"][:real]
            ends = starts + np.diff(p["cu_seqlens"])[:real]
            rows += self._table_rows("prefill", p["block_tables"][:real], starts, ends)
        if isinstance(decode, VerifyBatch):
            chain = np.asarray(decode.slot_chain)
            slots.append(chain[chain != -1])
            rows += self._verify_rows({k: np.asarray(v) for k, v in decode._asdict().items()})
        elif decode is not None:
            real = int(np.count_nonzero(np.asarray(decode.state_slots) != -1))
            positions = np.asarray(decode.positions)[:real]
            slots.append(np.asarray(decode.state_slots)[:real])
            rows += self._table_rows(
                "decode", np.asarray(decode.block_tables)[:real], positions, positions + 1
            )
        all_slots = np.concatenate(slots) if slots else np.zeros(0, np.int32)
        values, counts = np.unique(all_slots, return_counts=True)
        if np.any(counts > 1):
            raise ValueError(
                f"state slot {values[counts > 1][0]} is written by more than one row "
                "(running slots and snapshot destinations must all differ)"
            )
        _check_writes(rows)

    def _table_rows(self, kind, block_tables, starts, ends):
        """(label, blocks read, blocks written) per row, after checking each table."""
        rows = []
        for i, (start, end) in enumerate(zip(starts, ends)):
            if end == 0:
                continue
            table = block_tables[i]
            needed = -(-int(end) // self.tokens_per_block)
            label = f"{kind} row {i}"
            if needed > table.size:
                raise ValueError(
                    f"{label}: {end} tokens need {needed} blocks, table has {table.size}"
                )
            _check_range(f"{label} block_tables", table[:needed], self.num_blocks)
            if np.any(table[needed:] != -1):
                raise ValueError(f"{label}: block table entries past block {needed} must be -1")
            if np.unique(table[:needed]).size != needed:
                raise ValueError(f"{label}: block table {table[:needed].tolist()} repeats a block")
            written = set(table[int(start) // self.tokens_per_block : needed].tolist())
            rows.append((label, set(table[:needed].tolist()), written))
        return rows


def _trailing_padding(kind: str, real: np.ndarray) -> int:
    """The number of real rows, checking that padding rows only follow them."""
    count = int(np.count_nonzero(real))
    if not real[:count].all():
        raise ValueError(f"{kind} row {int(np.flatnonzero(~real)[0])} is padding before a real row")
    return count


def _check_padding_row(kind: str, i: int, arrays: dict, names: tuple[str, ...]) -> None:
    inert = {"has_initial": False, "prefix_lens": 0, "token_ids": 0, "positions": 0,
             "num_drafts": 0}
    for name in names:
        want = inert.get(name, -1)
        if np.any(arrays[name][i] != want):
            raise ValueError(
                f"{kind} padding row {i}: {name} {arrays[name][i].tolist()} must be {want}"
            )


def _check_range(what: str, values: np.ndarray, size: int) -> None:
    bad = values[(values < 0) | (values >= size)]
    if bad.size:
        raise ValueError(f"{what}: {bad[0]} is outside [0, {size})")
    unique, counts = np.unique(values, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"{what}: {unique[counts > 1][0]} appears more than once")


def _check_writes(rows) -> None:
    """No row writes a block that another row reads or writes (rows: label, read, written)."""
    readers = collections.defaultdict(list)
    for label, read, _ in rows:
        for block in read:
            readers[block].append(label)
    for label, _, written in rows:
        for block in sorted(written):
            if len(readers[block]) > 1:
                other = next(other for other in readers[block] if other != label)
                raise ValueError(f"{label} writes block {block} that {other} also uses")
