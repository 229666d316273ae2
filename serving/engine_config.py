"""``EngineConfig``: the memory and scheduling of one ``serving.engine.Engine``."""

from __future__ import annotations

import dataclasses
import logging

from serving.step import SchedulerConfig

logger = logging.getLogger("serving.engine")  # the engine's log, where its users look


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig(SchedulerConfig):
    """Memory and scheduling of one engine (see ``SchedulerConfig`` for the knobs it shares).

    Attributes:
      num_kv_blocks: MLA KV block ids (each P * dcp tokens).
      num_state_slots: KDA state slots (running requests and retained states).
      eos_token_id: finishes a request unless its ``ignore_eos`` (None: no such token).
      single_bucket: pad every batch to the largest bucket, so each entry point compiles
        once; good for small models and tests, wasteful for long budgets.
      speculative_tokens (from ``SchedulerConfig``): N > 0 drafts N tokens per request
        with the model's MTP head and verifies them in the next step
        (``serving.speculative``; greedy requests, one device). It turns
        ``async_scheduling`` off (logged) and refuses ``mixed_steps``.
      seed: draws the seed of every request that brings none.
      async_scheduling: schedule and dispatch step n + 1 before fetching step n (on by
        default in the engine, off in a bare ``SchedulerConfig``).
      mixed_steps: run a step's prefill spans and decode rows in one forward
        (``glmjax.mixed``: the weights read once) rather than two; needs steps with a
        ``mixed`` entry point (one device).
    """

    num_kv_blocks: int
    num_state_slots: int
    eos_token_id: int | None = None
    single_bucket: bool = False
    seed: int = 0
    async_scheduling: bool = True
    mixed_steps: bool = False

    def __post_init__(self):
        if self.speculative_tokens and self.mixed_steps:
            raise ValueError(f"--speculative-tokens {self.speculative_tokens} cannot run with "
                             "--mixed-steps (a mixed step has no verify rows)")
        if self.speculative_tokens and self.async_scheduling:
            logger.info("speculative_tokens=%d: asynchronous scheduling off (a verified "
                        "decode's length is known only after its step's fetch)",
                        self.speculative_tokens)
            object.__setattr__(self, "async_scheduling", False)
        super().__post_init__()

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduling knobs alone."""
        names = (field.name for field in dataclasses.fields(SchedulerConfig))
        return SchedulerConfig(**{name: getattr(self, name) for name in names})
