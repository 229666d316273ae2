"""One request submitted to the engine and shaped into an OpenAI-style response.

``GenerationJob`` adds a request (prompt token ids and its ``SamplingParams``) to the
``AsyncEngine`` and turns the engine's ``RequestOutput``s into a completion or chat body:
whole (``collect``: a ``dict``, or an error ``Response``), or as server-sent events
(``admit``, then ``stream``: ``data: <json>`` strings ending in ``data: [DONE]``). A
request that fails, finds the engine dead or runs past its deadline is answered with an
error body naming its request id (the server log has the details under that id), never
with internals. ``serving.handlers`` validates the request and makes the job.
"""

from __future__ import annotations

import asyncio
import json
import logging

from serving import api
from serving.async_engine import AsyncEngine, EngineDeadError
from serving.outputs import FinishReason, RequestOutput
from serving.request import SamplingParams

logger = logging.getLogger("serving.server")


class GenerationJob:
    """A request submitted to the engine, answered whole (``collect``) or as an event
    stream (``admit``, then ``stream``); ``close`` aborts it unless it finished."""

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        generation: api.Generation,
        *,
        model_name: str,
        request_timeout_s: float,
        chat: bool,
        top_logprobs: int | None,
        created: int,
        deadline: float,
    ):
        self.engine, self.id, self.gen = engine, request_id, generation
        self.model_name, self.request_timeout_s = model_name, request_timeout_s
        self.chat, self.top_logprobs, self.created = chat, top_logprobs, created
        self.deadline = deadline
        self.outputs: asyncio.Queue | None = None
        self.finished = False

    def _logprobs(self, texts, logprobs, tops, text_offset):
        """None unless the request asked for logprobs (`top_logprobs` alternatives each)."""
        if self.top_logprobs is None:
            return None
        if self.chat:
            return api.chat_logprobs(texts, logprobs, tops, self.top_logprobs)
        return api.completion_logprobs(texts, logprobs, text_offset, tops, self.top_logprobs)

    def _envelope(self, choice, *, chunk, usage=None):
        return api.envelope(
            self.id,
            self.model_name,
            choice,
            chat=self.chat,
            chunk=chunk,
            created=self.created,
            usage_=usage,
        )

    def _failed(self) -> api.APIError:
        """The step this request was in failed (the server log has why, under its id)."""
        return api.APIError(
            500,
            f"the request failed inside the engine and was stopped; other requests are "
            f"unaffected (request id {self.id})",
            code="request_failed",
        )

    def _engine_dead(self, error: EngineDeadError) -> api.APIError:
        logger.error("request %s: %s", self.id, error)
        return api.APIError(
            503,
            f"the engine is not serving; the server log says why (request id {self.id})",
            code="engine_unavailable",
        )

    def timed_out(self) -> api.APIError:
        return api.APIError(
            504,
            f"the request ran past the server's request timeout of "
            f"{self.request_timeout_s:g} s and was aborted (request id {self.id})",
            code="request_timeout",
        )

    def close(self) -> None:
        if self.outputs is not None and not self.finished:
            self.engine.abort(self.id)

    async def admit(self, prompt: list[int], sampling: SamplingParams):
        """None once the engine has the request, else the error response."""
        adding = asyncio.ensure_future(self.engine.add_request(self.id, prompt, sampling))
        try:
            # Shielded: the engine thread may be adding it right now, and a cancelled add
            # must not race that. The abort queued now follows a queued add (commands run
            # in order); the one once the add is done covers an add not yet queued.
            self.outputs = await asyncio.shield(adding)
        except asyncio.CancelledError:
            self.engine.abort(self.id)
            adding.add_done_callback(self._abort_once_added)
            raise
        except ValueError as error:
            return api.APIError(400, str(error), code="invalid_value").response()
        except EngineDeadError as error:
            return self._engine_dead(error).response()
        return None

    def _abort_once_added(self, adding: asyncio.Future) -> None:
        if not adding.cancelled() and adding.exception() is None:
            self.engine.abort(self.id)

    async def _next(self) -> RequestOutput:
        item = await self.outputs.get()
        if isinstance(item, EngineDeadError):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def collect(self, prompt: list[int], sampling: SamplingParams):
        refused = await self.admit(prompt, sampling)
        if refused is not None:
            return refused
        try:
            output = await self._next()
            while not output.finished:
                output = await self._next()
        except EngineDeadError as error:
            return self._engine_dead(error).response()
        finally:
            self.close()
        if output.finish_reason is FinishReason.ABORT:
            return api.APIError(
                503, "the request was aborted: the server is shutting down", code="aborted"
            ).response()
        if output.finish_reason is FinishReason.ERROR:
            return self._failed().response()
        text, texts, logprobs, tops = self.gen.advance(output)
        logprobs = self._logprobs(texts, logprobs, tops, 0)
        if self.chat:
            choice = api.chat_choice(text, api.finish_reason(output), logprobs, delta=False)
        else:
            choice = api.completion_choice(text, api.finish_reason(output), logprobs)
        usage = api.usage(
            output.num_prompt_tokens, len(output.output_token_ids), output.num_cached_tokens
        )
        return self._envelope(choice, chunk=False, usage=usage)

    async def stream(self, include_usage: bool):
        def event(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        loop = asyncio.get_running_loop()
        try:
            if self.chat:
                yield event(
                    self._envelope(
                        api.chat_choice("", None, None, delta=True, first=True), chunk=True
                    )
                )
            while not self.finished:
                try:
                    output = await asyncio.wait_for(self._next(), self.deadline - loop.time())
                except EngineDeadError as error:
                    yield event(self._engine_dead(error).body())
                    break
                except TimeoutError:
                    yield event(self.timed_out().body())
                    break
                if output.finish_reason is FinishReason.ERROR:
                    yield event(self._failed().body())
                    break
                offset = self.gen.token_chars
                text, texts, logprobs, tops = self.gen.advance(output)
                if not (text or texts or output.finished):
                    continue
                logprobs = self._logprobs(texts, logprobs, tops, offset)
                reason = api.finish_reason(output)
                if self.chat:
                    choice = api.chat_choice(text, reason, logprobs, delta=True)
                else:
                    choice = api.completion_choice(text, reason, logprobs)
                yield event(self._envelope(choice, chunk=True))
                if output.finished and include_usage:
                    usage = api.usage(
                        output.num_prompt_tokens,
                        len(output.output_token_ids),
                        output.num_cached_tokens,
                    )
                    yield event(self._envelope(None, chunk=True, usage=usage))
            yield "data: [DONE]\n\n"
        finally:
            self.close()
