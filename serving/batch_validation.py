"""Checks the host batches of one step before they reach the device.

``BatchValidator`` checks what ``serving.batch_builder`` packs: ``PrefillBatch``,
``DecodeBatch`` and ``VerifyBatch`` of host NumPy arrays, int32 (``has_initial`` bool),
padded as that module's docstring says, each alone and a step's two together. Each raises
``ValueError`` naming the row and value of anything the device must not see: wrong dtypes
or shapes, padding rows that are not trailing and inert, slots or blocks outside the pool,
a state slot written twice, a block written by one row and read or written by another,
positions that do not match the spans, block tables that do not cover them.
"""

import collections

import numpy as np

from glmjax.batch import DecodeBatch, PrefillBatch, VerifyBatch
from pallas_kernels.validation import validate_checkpoint_metadata
from serving.plan import retention_capacity
from serving.step import SchedulerConfig


class BatchValidator:
    """The checks of each step's batches for one pool of blocks and slots."""

    def __init__(self, config: SchedulerConfig, *, num_blocks: int, num_slots: int):
        self.config = config
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.tokens_per_block = config.block_size * config.dcp

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
        """Checks across both batches: no slot written twice, no block written and shared.
        A step of one batch has nothing to cross: its own checks cover both."""
        if prefill is None or decode is None:
            return
        p = {name: np.asarray(value) for name, value in prefill._asdict().items()}
        real = int(np.count_nonzero(np.diff(p["cu_seqlens"])))
        slots = [p["state_slots"][:real], p["checkpoint_slots"][p["checkpoint_slots"] != -1]]
        starts = p["prefix_lens"][:real]
        ends = starts + np.diff(p["cu_seqlens"])[:real]
        rows = self._table_rows("prefill", p["block_tables"][:real], starts, ends)
        if isinstance(decode, VerifyBatch):
            chain = np.asarray(decode.slot_chain)
            slots.append(chain[chain != -1])
            rows += self._verify_rows({k: np.asarray(v) for k, v in decode._asdict().items()})
        else:
            real = int(np.count_nonzero(np.asarray(decode.state_slots) != -1))
            positions = np.asarray(decode.positions)[:real]
            slots.append(np.asarray(decode.state_slots)[:real])
            rows += self._table_rows(
                "decode", np.asarray(decode.block_tables)[:real], positions, positions + 1
            )
        values, counts = np.unique(np.concatenate(slots), return_counts=True)
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
            entries = table.tolist()
            _check_range(f"{label} block_tables", entries[:needed], self.num_blocks)
            if any(entry != -1 for entry in entries[needed:]):
                raise ValueError(f"{label}: block table entries past block {needed} must be -1")
            written = set(entries[int(start) // self.tokens_per_block : needed])
            rows.append((label, set(entries[:needed]), written))
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


def _check_range(what: str, values: np.ndarray | list[int], size: int) -> None:
    """Every value in [0, size) and none twice (in Python: a step's arrays are small, and
    NumPy's per-call cost was most of a batch-1 step's validation)."""
    values = values.tolist() if isinstance(values, np.ndarray) else values
    bad = [value for value in values if not 0 <= value < size]
    if bad:
        raise ValueError(f"{what}: {bad[0]} is outside [0, {size})")
    distinct = set(values)
    if len(distinct) != len(values):
        twice = min(value for value in distinct if values.count(value) > 1)
        raise ValueError(f"{what}: {twice} appears more than once")


def _check_writes(rows) -> None:
    """No row writes a block that another row reads or writes (rows: label, read, written)."""
    if len(rows) < 2:
        return
    readers = collections.defaultdict(list)
    for label, read, _ in rows:
        for block in read:
            readers[block].append(label)
    for label, _, written in rows:
        for block in sorted(written):
            if len(readers[block]) > 1:
                other = next(other for other in readers[block] if other != label)
                raise ValueError(f"{label} writes block {block} that {other} also uses")
