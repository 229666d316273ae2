"""Two executables of one jitted step, called in turn.

Why: a decode step at batch 1 is host-bound on the H200, and most of the host's time is
XLA re-recording the step's CUDA graph. With asynchronous dispatch (step n + 1 enqueued
before step n's results are fetched) consecutive calls of one executable find their
temporaries at alternating addresses, so XLA updates every command of the graph on every
call (901 commands, 1-2.6 ms each time in `bench.cmdbuf_pingpong`'s log). Two executables
called in turn each find the addresses of their own previous call again, two steps back,
and launch their graphs as recorded: on the H200 a 600-kernel chain dispatched that way
took 2.87 ms a call against 3.94 with one executable (median of three runs,
`bench/results/cmdbuf_pingpong_2026-12-05.json`).

Through the engine it saved nothing (whole kimi, batch 1, one H200, the two alternately:
3.85 / 3.53 ms a step with two executables, 3.63 / 3.55 with one; `bench.decode
--decode-executables`), so the engine keeps one; likely because the engine fetches each
step's tokens before it dispatches the next, so one executable's temporaries come back at
the same addresses (not checked in XLA's log).

The two copies trace the same function under the same name, so their programs are
identical: with the persistent compilation cache on (`glmjax.compile_cache`) the second
should be read from the cache as an executable of its own (not yet checked on a GPU);
without it (the tests), it is a second compile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax


class _LoweredPair:
    """Both copies lowered; `compile` compiles both and returns the first's `Compiled`
    (its shardings and memory analysis are the second's too)."""

    def __init__(self, lowered):
        self.lowered = lowered

    def compile(self):
        return [lowered.compile() for lowered in self.lowered][0]


class Alternating:
    """`jax.jit(fn, **jit_kwargs)` twice; each call runs the copy the previous call did not.

    Call it and lower it as the jitted function (``lower`` lowers both copies: what an
    ahead-of-time compile of it compiles, both executables are). Not thread-safe: one
    caller (the engine's thread) dispatches the steps.
    """

    def __init__(self, fn: Callable, **jit_kwargs):
        def copy():
            @functools.wraps(fn)
            def step(*args, **kwargs):
                return fn(*args, **kwargs)
            return jax.jit(step, **jit_kwargs)

        self.copies = (copy(), copy())
        self._turn = 0
        self.__name__ = fn.__name__

    def __call__(self, *args, **kwargs):
        step = self.copies[self._turn]
        self._turn ^= 1
        return step(*args, **kwargs)

    def lower(self, *args, **kwargs) -> _LoweredPair:
        return _LoweredPair([step.lower(*args, **kwargs) for step in self.copies])
