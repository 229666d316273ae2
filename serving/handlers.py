"""The request handlers behind the HTTP routes of ``serving.server``.

``Handlers`` parses and validates a request (an HTTP 4xx error with a message for bad
input, nothing submitted), submits it to the ``AsyncEngine`` and hands the outputs to a
``_Job``, which shapes them into an OpenAI-style response: whole, or streamed as
server-sent events ending in ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pydantic
from fastapi import Request
from fastapi.responses import StreamingResponse

from serving import api, metrics
from serving.async_engine import AsyncEngine, EngineDeadError
from serving.outputs import FinishReason, RequestOutput
from serving.request import SamplingParams
from serving.tokenizer import ChatTemplateError, Tokenizer


class Handlers:
    """The endpoints' work: validate, submit to the engine, answer or stream."""

    def __init__(self, async_engine: AsyncEngine, tokenizer: Tokenizer, *, model_name: str):
        self.engine = async_engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = async_engine.engine.config.max_model_len
        self._shutting_down = False
        self._registry = metrics.server_registry(async_engine)

    def shut_down(self) -> None:
        self._shutting_down = True
        self.engine.abort_all()

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "glmjax",
                    "max_model_len": self.max_model_len,
                }
            ],
        }

    def prometheus_text(self) -> str:
        return metrics.exposition(self._registry)

    async def completions(self, request: Request):
        try:
            body = await self._parse(request, api.CompletionRequest)
            prompt = self._completion_prompt(body.prompt)
        except api.APIError as error:
            return error.response()
        return await self._generate(
            request,
            body,
            prompt,
            chat=False,
            top_logprobs=body.logprobs,
            max_tokens=body.max_tokens,
        )

    async def chat(self, request: Request):
        try:
            body = await self._parse(request, api.ChatRequest)
            text = self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in body.messages]
            )
            prompt = self.tokenizer.encode(text)
        except api.APIError as error:
            return error.response()
        except ChatTemplateError as error:
            return api.APIError(
                400, str(error), param="messages", code="chat_template_error"
            ).response()
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._generate(
            request,
            body,
            prompt,
            chat=True,
            top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            max_tokens=max_tokens,
        )

    async def _parse(self, request: Request, model: type[pydantic.BaseModel]):
        if self._shutting_down:
            raise api.APIError(503, "the server is shutting down", code="shutting_down")
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise api.APIError(
                400, f"the body is not valid JSON: {error}", code="invalid_json"
            ) from None
        if not isinstance(data, dict):
            raise api.APIError(400, "the body must be a JSON object", code="invalid_json")
        try:
            body = model.model_validate(data)
        except pydantic.ValidationError as error:
            first = error.errors()[0]
            param = ".".join(map(str, first["loc"])) or None
            raise api.APIError(
                400, f"{param}: {first['msg']}", param=param, code="invalid_value"
            ) from None
        if body.model is not None and body.model != self.model_name:
            raise api.APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return body

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise api.APIError(
                    400,
                    "batched prompts are not supported: send one prompt per request",
                    param="prompt",
                    code="unsupported_parameter",
                )
            prompt = prompt[0]
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise api.APIError(400, "the prompt is empty", param="prompt", code="empty_prompt")
        return ids

    def _sampling(self, body, prompt: list[int], max_tokens: int | None) -> SamplingParams:
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise api.APIError(
                400,
                f"the prompt has {len(prompt)} tokens; this model's "
                f"maximum context length is {self.max_model_len} (prompt plus "
                "at least one generated token)",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = room if isinstance(body, api.ChatRequest) else 16
        if max_tokens > room:
            raise api.APIError(
                400,
                f"max_tokens {max_tokens} plus the prompt's {len(prompt)} "
                f"tokens exceeds this model's maximum context length "
                f"{self.max_model_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        top_k = body.top_k or 0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if top_k < 0 else top_k,
            seed=body.seed,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
        )

    async def _generate(
        self,
        request: Request,
        body,
        prompt: list[int],
        *,
        chat: bool,
        top_logprobs: int | None,
        max_tokens: int | None,
    ):
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            sampling = self._sampling(body, prompt, max_tokens)
            outputs = await self.engine.add_request(request_id, prompt, sampling)
        except api.APIError as error:
            return error.response()
        except ValueError as error:
            return api.APIError(400, str(error), code="invalid_value").response()
        except EngineDeadError as error:
            return api.APIError(503, str(error), code="engine_unavailable").response()
        generation = api.Generation(self.tokenizer, sampling.stop)
        job = _Job(
            self,
            request,
            request_id,
            outputs,
            generation,
            chat=chat,
            top_logprobs=top_logprobs,
            created=api.now(),
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(job.stream(include_usage), media_type="text/event-stream")
        return await job.collect()


class _Job:
    """A submitted request, answered whole (``collect``) or as an event stream."""

    POLL_S = 0.5  # how often a non-streaming wait checks that the client is still there

    def __init__(
        self,
        handlers: Handlers,
        request: Request,
        request_id: str,
        outputs: asyncio.Queue,
        generation: api.Generation,
        *,
        chat: bool,
        top_logprobs: int | None,
        created: int,
    ):
        self.h, self.request, self.id, self.outputs = handlers, request, request_id, outputs
        self.gen, self.chat, self.top_logprobs, self.created = (
            generation,
            chat,
            top_logprobs,
            created,
        )
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
            self.h.model_name,
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

    async def _next(self) -> RequestOutput:
        item = await self.outputs.get()
        if isinstance(item, EngineDeadError):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def collect(self):
        clock = asyncio.get_running_loop().time
        check_at = clock() + self.POLL_S
        try:
            while True:
                try:
                    output = await asyncio.wait_for(self._next(), self.POLL_S)
                except TimeoutError:
                    output = None
                if output is not None and output.finished:
                    break
                if clock() >= check_at:
                    if await self.request.is_disconnected():
                        return None
                    check_at = clock() + self.POLL_S
        except EngineDeadError as error:
            return api.APIError(500, str(error), code="engine_failed").response()
        finally:
            if not self.finished:
                self.h.engine.abort(self.id)
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

        try:
            if self.chat:
                yield event(
                    self._envelope(
                        api.chat_choice("", None, None, delta=True, first=True), chunk=True
                    )
                )
            while not self.finished:
                try:
                    output = await self._next()
                except EngineDeadError as error:
                    yield event(api.APIError(500, str(error), code="engine_failed").body())
                    break
                if await self.request.is_disconnected():
                    return
                if output.finish_reason is FinishReason.ERROR:
                    yield event(self._failed().body())
                    break
                offset = len(self.gen.sent)
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
            if not self.finished:
                self.h.engine.abort(self.id)
