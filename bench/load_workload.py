"""The requests of a load test (``bench.load``): a reproducible mix drawn from a seed.

A few long shared prefixes (so the prefix cache is hit while requests run together), a
pool of distinct request bodies built on them (``/v1/completions`` and
``/v1/chat/completions``), and the sends: each picks a body from the pool, streams or not,
and may disconnect mid-request or mid-stream. Bodies at temperature 0 are "checked": their
answers under load must equal the same body's answer sent alone.
"""

from __future__ import annotations

import dataclasses
import random

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
WORDS = (
    "alpha beta gamma delta kernel block prefix cache state slot decode prefill token "
    "latency batch stream server client request answer question model layer expert"
).split()


@dataclasses.dataclass(frozen=True)
class WorkloadOptions:
    requests: int = 512  # sends in all
    distinct: int = 48  # distinct bodies they are drawn from
    prefixes: int = 4  # shared prefixes the bodies start with
    prefix_chars: int = 600  # their length (byte tokenizer: tokens); > a block to be cached
    max_tokens: int = 32  # each body asks for 1..max_tokens
    stream_fraction: float = 0.5
    chat_fraction: float = 0.5
    disconnect_fraction: float = 0.1  # sends that disconnect (half mid-request, half mid-stream)
    sampled_fraction: float = 0.1  # bodies at temperature 0.8: load only, not compared
    seed: int = 0

    def __post_init__(self):
        for name in ("requests", "distinct", "prefixes", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        for name in ("stream_fraction", "chat_fraction", "disconnect_fraction", "sampled_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be in [0, 1]")
        if self.prefix_chars < 0:
            raise ValueError(f"prefix_chars={self.prefix_chars}: must be >= 0")


@dataclasses.dataclass(frozen=True)
class Body:
    """A distinct request body (``stream`` is set per send)."""

    key: int
    path: str
    json: dict
    checked: bool  # temperature 0: compared with its answer alone


@dataclasses.dataclass(frozen=True)
class Send:
    index: int
    body: Body
    stream: bool
    # None, "mid-request" (give up after `disconnect_after` seconds) or "mid-stream"
    # (close after `disconnect_after` events; only for streams).
    disconnect: str | None
    disconnect_after: float


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


def make_bodies(options: WorkloadOptions, model: str) -> list[Body]:
    rng = random.Random(options.seed)
    prefixes = [f"[{p}] " + _text(rng, options.prefix_chars) for p in range(options.prefixes)]
    bodies = []
    for key in range(options.distinct):
        prefix = prefixes[key % options.prefixes]
        question = f" question {key}: " + _text(rng, rng.randint(4, 40))
        sampled = rng.random() < options.sampled_fraction
        fields = {
            "model": model,
            "max_tokens": rng.randint(1, options.max_tokens),
            "temperature": 0.8 if sampled else 0.0,
            "ignore_eos": rng.random() < 0.75,
        }
        if rng.random() < options.chat_fraction:
            messages = [
                {"role": "system", "content": prefix},
                {"role": "user", "content": question},
            ]
            bodies.append(Body(key, CHAT, {**fields, "messages": messages}, not sampled))
        else:
            bodies.append(
                Body(key, COMPLETIONS, {**fields, "prompt": prefix + question}, not sampled)
            )
    return bodies


def make_sends(options: WorkloadOptions, bodies: list[Body]) -> list[Send]:
    rng = random.Random(options.seed + 1)
    sends = []
    for index in range(options.requests):
        body = rng.choice(bodies)
        stream = rng.random() < options.stream_fraction
        disconnect, after = None, 0.0
        if rng.random() < options.disconnect_fraction:
            if stream and rng.random() < 0.5:
                disconnect, after = "mid-stream", float(rng.randint(1, 4))
            else:
                disconnect, after = "mid-request", rng.uniform(0.01, 0.5)
        sends.append(Send(index, body, stream, disconnect, after))
    return sends
