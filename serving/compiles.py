"""Counting XLA backend compiles: a server proves it compiles nothing while it serves, a
benchmark that its timed samples never compiled.

JAX reports each backend compile through ``jax.monitoring``; ``CompileLog`` records them
(the jitted function's name and the seconds) while it is active. The listener sees every
compile of the process, whichever thread triggers it.
"""

from __future__ import annotations

import collections
import threading

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileLog:
    """Backend compiles reported while active: (function name, seconds)."""

    def __init__(self):
        self.events: list[tuple[str, float]] = []
        self._lock = threading.Lock()
        self._listening = False

    def _listen(self, event: str, seconds: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            with self._lock:
                self.events.append((str(kwargs.get("fun_name", "?")), seconds))

    def start(self) -> None:
        """Starts recording (once; a second call does nothing)."""
        if not self._listening:
            self._listening = True
            jax.monitoring.register_event_duration_secs_listener(self._listen)

    def stop(self) -> None:
        """Stops recording; nothing happens if it is not recording."""
        if self._listening:
            self._listening = False
            jax.monitoring.unregister_event_duration_listener(self._listen)

    def __enter__(self) -> CompileLog:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def count(self) -> int:
        return len(self.events)

    @property
    def seconds(self) -> float:
        with self._lock:
            return sum(seconds for _, seconds in self.events)

    def by_function(self) -> dict[str, dict]:
        table = collections.defaultdict(lambda: {"count": 0, "seconds": 0.0})
        with self._lock:
            events = list(self.events)
        for name, seconds in events:
            table[name]["count"] += 1
            table[name]["seconds"] += seconds
        return dict(sorted(table.items()))
