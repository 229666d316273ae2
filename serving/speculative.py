"""MTP speculative decoding in the engine (``EngineConfig.speculative_tokens`` N > 0, the
server's ``--speculative-tokens``): how one step runs, and what it reports.

Every greedy decode verifies the drafts its request got from the previous step (up to N,
fewer near ``max_tokens`` or when the budget or the free state slots run short; see
``serving.scheduler``), and every request sampled in a step gets N new drafts from the
model's MTP head. One step dispatches, back to back:

    block copies, resume copies                      (as without speculation)
    spec_prefill   prefill spans; also fills the MTP cache over them
    verify         each decode's token and drafts, J = N + 1 rows per decode
    retain copies
    sampler        prefill rows; then the verify rows, one call per row j
    accept_and_draft   after the prefill rows (J = 1) and after the verify rows: keeps the
                   KDA state after the accepted tokens, writes the MTP cache, drafts
    one device_get: every status, every draw, the accepted counts and the drafts

A decode that accepted a of its drafts gains a + 1 tokens: the sampler's tokens after its
rows 0..a, each the target's greedy token after a verified prefix, so greedy output is the
output of plain decoding (``tests/test_speculative.py`` checks it token for token, with
the MTP's drafts and with oracle drafts that are partly right). A stop token, a stop
string or ``max_tokens`` inside the accepted tokens ends the request there, as plain
decoding would (``trim_draws``). Requests sampled with a temperature decode one token per
step: exact rejection sampling of drafts is not implemented.

Programs (``serving.precompile`` compiles them all at start): ``spec_prefill`` per prefill
bucket (T, N, M), ``verify`` per (N, M), the engine's one sampler (called once per verify
row j) and its row gathers (also over the J N rows of each verify bucket),
``draft_prefill`` per prefill (N, M) and ``draft_verify`` per (N, M).

Limits: one device (a mesh's steps are refused); the drafting depths 2..N write their MTP
cache rows only where the request's blocks already reach (a draft past them attends
without its own key; exactness is unaffected).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from glmjax.batch import PrefillBatch, VerifyBatch
from glmjax.caches import Caches
from glmjax.config import ModelConfig
from glmjax.speculative import accept_and_draft, spec_prefill, verify
from glmjax.state_pool import PoolStatus
from serving.batch_builder import BatchBuckets
from serving.dispatch import Draw, StepRefusedError, sample_rows
from serving.request import PLACEHOLDER, Request
from serving.sampling import Sampled, SamplingTensors
from serving.step import ScheduledStep

if TYPE_CHECKING:
    from serving.engine import Engine

COUNTERS = ("spec_verified_decodes", "spec_draft_tokens", "spec_accepted_tokens")


def check_supported(config: ModelConfig, *, on_mesh: bool) -> None:
    """Raises ValueError for a model without an MTP layer, or steps on a mesh."""
    if config.num_mtp_layers < 1:
        raise ValueError(f"speculative decoding drafts with the MTP head; model "
                         f"{config.name!r} has num_mtp_layers={config.num_mtp_layers}")
    if on_mesh:
        raise ValueError("speculative decoding runs on one device; the steps are on a mesh")


@dataclasses.dataclass(eq=False)
class SpeculativeInFlight:
    """A dispatched speculative step whose results are not fetched yet.

    Attributes:
      step: the step.
      statuses: (what, PoolStatus as an int32 [] device scalar) of each call that can refuse.
      parts: per sampled part (the prefill rows, the verify rows): the ``Sampled`` of each
        row j (device arrays), (drafts, accepted, status) of its ``accept_and_draft``, and
        the request ids of its columns.
      owners: what the engine tracks for each request the step samples, at dispatch.
    """

    step: ScheduledStep
    statuses: list[tuple[str, jax.Array]]
    parts: list[tuple[list[Sampled], tuple, list[str]]]
    owners: dict[str, object]


class SpeculativeRunner:
    """Runs the engine's steps with MTP drafts (see the module docstring)."""

    def __init__(self, config: ModelConfig, num_speculative: int, *, on_mesh: bool):
        """Raises ValueError as ``check_supported``."""
        check_supported(config, on_mesh=on_mesh)
        self.config = config
        self.num_speculative = num_speculative
        self.drafts: dict[str, tuple[int, ...]] = {}  # the last step's, for set_drafts

    def init_caches(self, num_state_slots: int, num_kv_blocks: int) -> Caches:
        """Empty caches with the MTP layer's own (block ids shared with the model's)."""
        return Caches.init(self.config, num_state_slots, num_kv_blocks, mtp=True)

    def dispatch(self, engine: Engine, step: ScheduledStep, owners: dict, sampling: dict
                 ) -> SpeculativeInFlight:
        """The step's calls (module docstring), dispatched back to back; nothing is fetched.
        ``owners`` and ``sampling`` as ``StepDispatch.dispatch`` takes them (a verified
        decode's row j draws output token index ``sampling[i][4] + j``)."""
        prefill_batch, verify_batch = engine.builder.build(step)
        statuses = []  # (what, PoolStatus as a device scalar)
        if step.block_copies:
            engine.caches = engine.steps.copy_kv_blocks(engine.caches,
                                                        *engine._pairs(step.block_copies))
            engine._counts["kv_block_copies"] += len(step.block_copies)
        if step.resume_state_copies:
            statuses.append(("resume copies", engine._copy_slots(step.resume_state_copies)))
        prefill = verified = None
        if prefill_batch is not None:
            out = spec_prefill(engine.model_state, engine.caches, prefill_batch,
                               self._following_tokens(engine, step, prefill_batch))
            engine.caches, prefill = out.caches, out
            statuses.append(("prefill", out.status))
        if verify_batch is not None:
            out = verify(engine.model_state, engine.caches, verify_batch)
            engine.caches, verified = out.caches, out
            statuses.append(("verify", out.status))
        if step.retain_state_copies:
            statuses.append(("retain copies", engine._copy_slots(step.retain_state_copies)))
        parts = []  # ([Sampled per row j], (drafts, accepted, status), request ids by column)
        rows = [p for p in step.prefills if p.samples]
        if rows:
            parts.append(self._draft_after_prefill(engine, step, prefill, prefill_batch, rows,
                                                   sampling))
            statuses.append(("prefill drafts", parts[-1][1][2]))
        if verified is not None:
            parts.append(self._verify_and_draft(engine, step, verified, verify_batch, sampling))
            statuses.append(("verify drafts", parts[-1][1][2]))
        return SpeculativeInFlight(step, statuses, parts, owners)

    def fetch(self, engine: Engine, flight: SpeculativeInFlight) -> dict[str, list[Draw]]:
        """The step's one blocking transfer; the draws of every request it samples,
        1 + accepted for a verified decode. Raises ``StepRefusedError`` as
        ``StepDispatch.fetch``."""
        step = flight.step
        self.drafts = {}
        codes, fetched = engine.device_get(([s for _, s in flight.statuses],
                                            [(sampled, drafted[:2])
                                             for sampled, drafted, _ in flight.parts]))
        for (what, _), code in zip(flight.statuses, codes):
            if PoolStatus(int(code)) is not PoolStatus.OK:
                raise StepRefusedError(f"step {step.step_id}: the model refused the {what} "
                                       f"({PoolStatus(int(code)).name})")
        draws = {}
        for (sampled, (drafts, accepted)), (_, _, request_ids) in zip(fetched, flight.parts):
            for r, request_id in enumerate(request_ids):
                num_top = flight.owners[request_id].request.sampling.top_logprobs
                draws[request_id] = [Draw.from_row(sampled[j], r, num_top)
                                     for j in range(int(accepted[r]) + 1)]
                self.drafts[request_id] = tuple(int(t) for t in drafts[r])
        counts = engine._counts
        for decode in step.decodes:
            if decode.draft_token_ids:
                counts["spec_verified_decodes"] += 1
                counts["spec_draft_tokens"] += len(decode.draft_token_ids)
                counts["spec_accepted_tokens"] += len(draws[decode.request_id]) - 1
        return draws

    def set_drafts(self, engine: Engine) -> None:
        """Hands the last step's drafts to the scheduler (after its ``update_from_step``)."""
        for request_id, drafts in self.drafts.items():
            engine.scheduler.set_drafts(request_id, drafts)
        self.drafts = {}

    def _following_tokens(self, engine: Engine, step: ScheduledStep, batch: PrefillBatch
                          ) -> np.ndarray:
        """int32 [N]: the token after each span's end (0 where the span ends the sequence)."""
        following = np.zeros(batch.state_slots.shape[0], np.int32)
        for i, scheduled in enumerate(step.prefills):
            tokens = engine.scheduler.get_request(scheduled.request_id).token_ids
            if scheduled.span.end < len(tokens):
                following[i] = tokens[scheduled.span.end]
        return following

    def _draft_after_prefill(self, engine: Engine, step, out, batch: PrefillBatch, rows,
                             sampling: dict):
        """Sample the spans that end their prompt and draft from them (J = 1)."""
        width = engine.sampler_rows
        index = np.zeros(width, np.int32)
        index[: len(rows)] = [step.prefills.index(p) for p in rows]
        params = [sampling[p.request_id] for p in rows]
        sampled = sample_rows(out.logits, index, SamplingTensors.host(params, width))
        tables = np.full((width, batch.block_tables.shape[1]), -1, np.int32)
        tables[: len(rows)] = batch.block_tables[index[: len(rows)]]
        positions = np.full(width, -1, np.int32)
        positions[: len(rows)] = [p.span.end - 1 for p in rows]
        zeros = np.zeros((1, width), np.int32)
        start = VerifyBatch(zeros, positions, zeros[0], zeros - 1, tables)
        drafted = accept_and_draft(engine.model_state, engine.caches, start, (sampled.tokens,),
                                   out.last_hidden, index, out.status,
                                   num_speculative=self.num_speculative)
        engine.caches = drafted.caches
        return [sampled], (drafted.drafts, drafted.accepted, drafted.status), \
            [p.request_id for p in rows]

    def _verify_and_draft(self, engine: Engine, step, out, batch: VerifyBatch, sampling: dict):
        """Sample every verify row (J R of them: one call of the engine's sampler per row
        j) and keep what each decode accepted."""
        chain, width = batch.token_ids.shape
        rows = [sampling[d.request_id] for d in step.decodes]
        sampled = []
        for j in range(chain):
            index = np.zeros(engine.sampler_rows, np.int32)
            index[:width] = j * width + np.arange(width)
            params = [(*row[:4], row[4] + j, row[5]) for row in rows]
            sampled.append(sample_rows(out.logits, index,
                                       SamplingTensors.host(params, engine.sampler_rows)))
        drafted = accept_and_draft(engine.model_state, engine.caches, batch,
                                   tuple(s.tokens for s in sampled), out.hidden,
                                   np.arange(chain * width, dtype=np.int32), out.status,
                                   num_speculative=self.num_speculative)
        engine.caches = drafted.caches
        return sampled, (drafted.drafts, drafted.accepted, drafted.status), \
            [d.request_id for d in step.decodes]


def programs(buckets: BatchBuckets, prefill_shapes: Sequence[tuple[int, int, int]]
             ) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, shape) of every speculative program an engine padding to `buckets` can call,
    given the prefill shapes (T, N, M) it can reach."""
    widths, seqs = buckets.block_table_widths, buckets.seqs
    prefill_seqs = sorted({n for _, n, _ in prefill_shapes})
    return ([("verify", (n, m)) for n in seqs for m in widths]
            + [("draft_verify", (n, m)) for n in seqs for m in widths]
            + [("draft_prefill", (n, m)) for n in prefill_seqs for m in widths]
            + [("spec_prefill", shape) for shape in prefill_shapes])


def lower(engine: Engine, kind: str, shape: tuple[int, ...]):
    """The program lowered with arguments shaped as `SpeculativeRunner.run` passes them."""
    from serving.precompile import padding_prefill

    chain, rows = engine.config.speculative_tokens + 1, engine.sampler_rows
    state, caches = engine.model_state, engine.caches
    if kind == "spec_prefill":
        t, n, m = shape
        return spec_prefill.lower(state, caches, jax.device_put(padding_prefill(t, n, m)),
                                  np.zeros(n, np.int32))
    n, m = shape
    if kind == "verify":
        return verify.lower(state, caches, jax.device_put(_padding_verify(chain, n, m)))
    hidden = jax.ShapeDtypeStruct((chain * n if kind == "draft_verify" else n,
                                   engine.model_config.hidden_size), _hidden_dtype(engine))
    status = np.zeros((), np.int32)
    if kind == "draft_verify":
        return accept_and_draft.lower(state, caches, _padding_verify(chain, n, m),
                                      (np.zeros(rows, np.int32),) * chain, hidden,
                                      np.zeros(chain * n, np.int32), status,
                                      num_speculative=chain - 1)
    return accept_and_draft.lower(state, caches, _padding_verify(1, rows, m),
                                  (np.zeros(rows, np.int32),), hidden, np.zeros(rows, np.int32),
                                  status, num_speculative=chain - 1)


def _padding_verify(chain: int, n: int, m: int) -> VerifyBatch:
    zeros = np.zeros((chain, n), np.int32)
    return VerifyBatch(zeros, np.full(n, -1, np.int32), zeros[0], zeros - 1,
                       np.full((n, m), -1, np.int32))


def _hidden_dtype(engine: Engine):
    """The dtype of the model's final hidden states (what `verify` returns)."""
    out = jax.eval_shape(verify, engine.model_state, engine.caches, _padding_verify(1, 1, 1))
    return out.hidden.dtype


def trim_draws(request: Request, draws: Sequence[Draw], stop_token_ids: frozenset[int],
               detokenize: Callable[[Sequence[int]], str] | None) -> list[Draw]:
    """The draws plain decoding would have produced one step at a time: up to the first
    stop token, the ``max_tokens``-th token, or the token whose text completes a stop
    string (each kept, as plain decoding keeps it)."""
    sampling = request.sampling
    output = [t for t in request.output_token_ids if t != PLACEHOLDER]  # schedule()'s
    kept = []
    for draw in draws:
        kept.append(draw)
        output.append(draw.token)
        if draw.token in stop_token_ids or len(output) >= sampling.max_tokens:
            break
        if sampling.stop and any(s in detokenize(output) for s in sampling.stop):
            break
    return kept
