"""Prefill planning: the token spans a prompt is computed in and the states each retains.

The grid (DESIGN section 6): P = ``block_size`` tokens is the physical cache block and the
prefix-lookup unit; A = P * dcp is the scheduler alignment; R = 2 + log2(dcp) is how many
recurrent-state checkpoints one span may snapshot; B = ``budget`` is how many tokens one
step may compute (a positive multiple of A).

A request of L prompt tokens, s of them already computed (s a multiple of P, s < L),
always computes its final block [tail, L) with tail = P * floor((L - 1) / P): the first
generated token needs the logits of the last prompt token, so a prefix hit stops at tail.

- Ladder (coalescing off, the reference behaviour): from s, steps of the largest P * 2^k
  tokens that fit in min(B, tail - pos), then the step [tail, L). Each step ends where the
  next can resume, so every step end on the P grid is a retained state.
- Coalesced: spans of up to B tokens, [s, min(s + B, L)) and on. Inside a span the kernel
  snapshots the ladder's boundaries (those strictly inside it, at most R, the ones closest
  to its end), so one pass retains what the ladder would have retained there.

The ladder boundaries of a continuation are those of the ladder started at the same s:
a request resuming at s after a prefix hit retains the states the ladder from s would.
"""

import dataclasses
import operator

SUPPORTED_DCP = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class PrefillSpan:
    """Prompt tokens [start, end) computed by one model step, and the states it retains.

    Attributes:
      start: first position computed; a multiple of P in every planned span.
      end: one past the last position computed.
      checkpoints: ascending positions strictly inside (start, end) at which the KDA kernel
        snapshots the state of every KDA layer (kernel offset = position - start). At most
        R of them, each a multiple of P.
      retain_end: whether the state after ``end`` is retained too. It is the request's
        running state when the step finishes, copied into a retained slot before decoding
        or the next span moves it on, so it is not a kernel snapshot and does not count
        against R. Only states on the P grid can be found by a prefix lookup, so planned
        spans set it exactly when ``end`` is a multiple of P.
    """

    start: int
    end: int
    checkpoints: tuple[int, ...] = ()
    retain_end: bool = False

    def __post_init__(self):
        if not 0 <= self.start < self.end:
            raise ValueError(f"span [{self.start}, {self.end}) must be non-empty and start at >= 0")
        previous = self.start
        for position in self.checkpoints:
            if not previous < position < self.end:
                raise ValueError(
                    f"checkpoint {position} of span [{self.start}, {self.end}) is not ascending "
                    f"and strictly inside it (checkpoints {self.checkpoints})"
                )
            previous = position

    @property
    def num_tokens(self) -> int:
        """Tokens the span computes: ``end - start``."""
        return self.end - self.start

    @property
    def retained_positions(self) -> tuple[int, ...]:
        """Every position whose state this span retains: checkpoints, then ``end`` if kept."""
        return self.checkpoints + ((self.end,) if self.retain_end else ())


def alignment(block_size: int, dcp: int) -> int:
    """Scheduler alignment A = block_size * dcp (512 / 1024 / 2048 tokens at P = 512)."""
    return _checked_block_size(block_size) * _checked_dcp(dcp)


def retention_capacity(dcp: int) -> int:
    """Checkpoints one span may snapshot: R = 2 + log2(dcp) (2 / 3 / 4)."""
    return 1 + _checked_dcp(dcp).bit_length()


def plan_prefill(
    prompt_len: int,
    num_computed: int,
    *,
    block_size: int = 512,
    dcp: int = 1,
    budget: int = 8192,
    coalesce: bool = True,
) -> list[PrefillSpan]:
    """Splits the uncomputed prompt [num_computed, prompt_len) into prefill spans.

    Args:
      prompt_len: L, prompt tokens (>= 1).
      num_computed: s, tokens already computed (prefix-cache hit); a multiple of
        ``block_size`` below ``prompt_len``.
      block_size: P, the cache block and prefix-lookup unit in tokens.
      dcp: decode-context-parallel ranks, one of 1, 2, 4.
      budget: B, the most tokens one step computes; a positive multiple of block_size * dcp.
      coalesce: coalesced spans of up to B tokens with kernel checkpoints (True), or the
        reference ladder of shrinking steps (False).

    Returns:
      Spans tiling [num_computed, prompt_len) in order. For example, with the defaults
      an 8192-token prompt gives the ladder 4096, 2048, 1024, 512, 512 and, at dcp 4, one
      coalesced span with checkpoints at 4096, 6144, 7168, 7680 and its end retained.

    Raises:
      ValueError: naming the argument and value that is out of range.
    """
    block_size = _checked_block_size(block_size)
    dcp = _checked_dcp(dcp)
    prompt_len = _as_int("prompt_len", prompt_len)
    num_computed = _as_int("num_computed", num_computed)
    budget = _as_int("budget", budget)
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    if not 0 <= num_computed < prompt_len or num_computed % block_size:
        raise ValueError(
            f"num_computed must be a multiple of block_size {block_size} in [0, prompt_len "
            f"{prompt_len}), got {num_computed}"
        )
    align = block_size * dcp
    if budget < align or budget % align:
        raise ValueError(
            f"budget must be a positive multiple of block_size * dcp = {align}, got {budget}"
        )

    ladder_ends = _ladder_ends(prompt_len, num_computed, block_size, budget)
    if not coalesce:
        starts = [num_computed, *ladder_ends[:-1]]
        return [
            PrefillSpan(start, end, retain_end=end % block_size == 0)
            for start, end in zip(starts, ladder_ends)
        ]

    capacity = retention_capacity(dcp)
    spans = []
    for start in range(num_computed, prompt_len, budget):
        end = min(start + budget, prompt_len)
        inside = [position for position in ladder_ends if start < position < end]
        spans.append(PrefillSpan(start, end, tuple(inside[-capacity:]), end % block_size == 0))
    return spans


def cut_span_to_budget(
    span: PrefillSpan, token_budget: int, *, block_size: int = 512
) -> PrefillSpan | None:
    """The part of ``span`` that fits in the ``token_budget`` tokens a step has left.

    A span that fits is returned unchanged. Otherwise it is cut to end on the P grid
    (so the next step can resume from a retained state): the cut span keeps the
    checkpoints strictly inside it and retains its end. None when fewer than
    ``block_size`` tokens fit: the request waits for a later step.

    Raises:
      ValueError: for a negative budget, a non-positive block size, or a span that does
        not start on the block grid.
    """
    block_size = _checked_block_size(block_size)
    token_budget = _as_int("token_budget", token_budget)
    if token_budget < 0:
        raise ValueError(f"token_budget must be >= 0, got {token_budget}")
    if span.start % block_size:
        raise ValueError(f"span start {span.start} is not a multiple of block_size {block_size}")
    if span.num_tokens <= token_budget:
        return span
    end = span.start + token_budget // block_size * block_size
    if end == span.start:
        return None
    kept = tuple(position for position in span.checkpoints if position < end)
    return PrefillSpan(span.start, end, kept, retain_end=True)


def _ladder_ends(prompt_len: int, num_computed: int, block_size: int, budget: int) -> list[int]:
    """End positions of the reference ladder from num_computed; the last one is prompt_len."""
    tail = block_size * ((prompt_len - 1) // block_size)
    ends = []
    position = num_computed
    while position < tail:
        blocks_that_fit = min(budget, tail - position) // block_size
        position += block_size << (blocks_that_fit.bit_length() - 1)
        ends.append(position)
    ends.append(prompt_len)
    return ends


def _as_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _checked_block_size(block_size) -> int:
    block_size = _as_int("block_size", block_size)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return block_size


def _checked_dcp(dcp) -> int:
    if isinstance(dcp, bool) or dcp not in SUPPORTED_DCP:
        raise ValueError(f"dcp must be one of {SUPPORTED_DCP}, got {dcp!r}")
    return int(dcp)
