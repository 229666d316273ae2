"""The engine behind an asyncio front end: one thread owns the ``Engine`` and steps it.

Every engine call happens on that thread; the front end sends it commands through a
thread-safe queue and awaits their results as futures. Requests in flight together share
each step. The thread delivers every ``RequestOutput`` to the request's own
``asyncio.Queue`` on the front end's event loop, and records the time to first token and
the time between tokens for ``/metrics``.

When idle (nothing unfinished) the thread sleeps on the command queue. A failed step
fails only its own requests (``Engine.step`` reports them finished with
``FinishReason.ERROR``) and the loop goes on. Only what escapes ``Engine.step`` (the
device was lost) discards the engine: every live request gets an ``EngineDeadError`` on
its queue and new requests are refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from serving.compiles import CompileLog
from serving.engine import Engine
from serving.metrics import latency_histograms
from serving.outputs import EngineMetrics, RequestOutput
from serving.request import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine failed a step or was shut down; it serves nothing more."""


@dataclasses.dataclass(eq=False)
class _Live:
    """A request the front end waits on."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    arrival: float
    last_token_at: float | None = None
    num_tokens: int = 0


class AsyncEngine:
    """Owns an ``Engine`` on a background thread; the methods are for the event loop."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.ttft, self.time_per_output_token = latency_histograms()
        self.compiles = CompileLog()  # every XLA compile of the process while serving
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._metrics = engine.metrics()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self.compiles.start()
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped serving, or None while it serves."""
        return self._error

    def metrics(self) -> EngineMetrics:
        """The engine's counters as of its last step or command."""
        return self._metrics

    async def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams
    ) -> asyncio.Queue:
        """Queues a request; returns the queue its outputs arrive on (the last one has
        ``finished`` set; an ``EngineDeadError`` instead if the engine fails).

        Raises:
          ValueError: the engine rejected the request (the message says why).
          EngineDeadError: the engine is not serving.
        """
        live = _Live(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())

        def add(engine: Engine) -> None:
            engine.add_request(request_id, prompt_token_ids, sampling)
            self._live[request_id] = live

        try:
            await self._call(add)
        except asyncio.CancelledError:  # the client left while the request was being added
            self.abort(request_id)
            raise
        return live.outputs

    def abort(self, request_id: str) -> None:
        """Aborts a request without waiting (safe from a cancelled task or finaliser, and
        for an id the engine does not know or has finished)."""
        if self._error is None:
            self._commands.put((lambda engine: engine.abort(request_id), None))

    def abort_all(self) -> None:
        """Aborts every live request (shutdown); callable from any thread."""
        if self._error is None:
            self._commands.put((self._abort_all, None))

    def fail(self, error: BaseException) -> None:
        """Stops serving from any thread, for a failure the engine thread cannot see (it
        may be waiting in a device call that never returns, as on a multi-process mesh
        that lost a process): every live request and queued command gets an
        ``EngineDeadError``, new requests are refused."""
        self._error = error
        self._fail_all(error)

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts everything still live, ends the loop and joins the thread."""
        self._stopping = True
        self.abort_all()
        self._commands.put((None, None))
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.compiles.stop()

    async def _call(self, fn: Callable[[Engine], object]):
        if self._error is not None or self._stopping:
            raise EngineDeadError(f"the engine is not serving: {self._error or 'shutting down'}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    def _abort_all(self, engine: Engine) -> None:
        for request_id in list(self._live):
            engine.abort(request_id)

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                if not self._drain(block=not busy):
                    break
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._deliver(outputs, time.monotonic())
                self._metrics = self.engine.metrics()
        except BaseException as error:  # the engine is discarded: tell every waiter why
            logger.exception("engine loop failed; the engine serves nothing more")
            self._error = error
            self._fail_all(error)

    def _drain(self, *, block: bool) -> bool:
        """Runs queued commands (waiting for one when ``block``); False on the stop command."""
        while True:
            try:
                fn, future = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if fn is None:
                return False
            if future is not None and not future.set_running_or_notify_cancel():
                continue  # its caller was cancelled before it ran
            try:
                result = fn(self.engine)
            except Exception as error:  # a rejected request: the caller reports it
                if future is None:  # a fire-and-forget command (abort) has nobody to tell
                    logger.exception("engine command failed")
                else:
                    future.set_exception(error)
            else:
                if future is not None:
                    future.set_result(result)
            self._metrics = self.engine.metrics()

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            new_tokens = len(output.output_token_ids) - live.num_tokens
            if new_tokens > 0:
                if live.last_token_at is None:
                    self.ttft.observe(now - live.arrival)
                else:
                    self.time_per_output_token.observe((now - live.last_token_at) / new_tokens)
                live.last_token_at, live.num_tokens = now, len(output.output_token_ids)
            if output.finished:
                del self._live[output.request_id]
            _put(live, output)

    def _fail_all(self, error: BaseException) -> None:
        dead = EngineDeadError("the engine failed and serves nothing more (the server log says why)")
        for live in list(self._live.values()):  # `fail` may run beside the engine thread
            _put(live, dead)
        self._live.clear()
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(dead)  # (a cancelled caller's future takes none)


def _put(live: _Live, item: RequestOutput | EngineDeadError) -> None:
    try:
        live.loop.call_soon_threadsafe(live.outputs.put_nowait, item)
    except RuntimeError:  # the front end's loop has closed (shutdown): nobody waits
        pass
