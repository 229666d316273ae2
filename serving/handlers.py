"""The request handlers behind the HTTP routes of ``serving.server``.

``Handlers`` parses and validates a request (an HTTP 4xx error with a message for bad
input, nothing submitted) and hands it to a ``serving.generation_job.GenerationJob``,
which submits it to the ``AsyncEngine`` and shapes the outputs into an OpenAI-style
response: whole, or streamed as server-sent events ending in ``data: [DONE]``.

A request is aborted as soon as its client disconnects or its ``request_timeout_s`` runs
out, whatever stage it is in (``serving.client_watch``): a timed-out request is answered
504, or its stream ends with an error event. Errors never carry internals: a failure
inside the server is a 500 naming the request id under which the server log has it.
"""

from __future__ import annotations

import asyncio
import uuid

import pydantic
from fastapi import Request

from serving import api, metrics
from serving.async_engine import AsyncEngine
from serving.client_watch import ClientGone, WatchedStream, run_watched
from serving.generation_job import GenerationJob
from serving.http_guard import DEFAULT_REQUEST_TIMEOUT_S
from serving.json_body import parse_body
from serving.request import SamplingParams
from serving.tokenizer import ChatTemplateError, Tokenizer


class Handlers:
    """The endpoints' work: validate, submit to the engine, answer or stream."""

    def __init__(
        self,
        async_engine: AsyncEngine,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ):
        self.engine = async_engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = async_engine.engine.config.max_model_len
        self.vocab_size = async_engine.engine.model_config.vocab_size
        self.request_timeout_s = request_timeout_s
        self._shutting_down = False
        self._registry = metrics.server_registry(async_engine)

    def shut_down(self) -> None:
        self._shutting_down = True
        self.engine.abort_all()

    def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    def model(self, model_id: str):
        if model_id != self.model_name:
            return self._unknown_model(model_id).response()
        return self._model_card()

    def _model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "glmjax",
            "max_model_len": self.max_model_len,
        }

    def _unknown_model(self, model_id: str) -> api.APIError:
        return api.APIError(
            404,
            f"the model {model_id!r} does not exist; this server serves {self.model_name!r}",
            param="model",
            code="model_not_found",
        )

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
        body = parse_body(await request.body(), model)
        if body.model is not None and body.model != self.model_name:
            raise self._unknown_model(body.model)
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
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise api.APIError(
                400,
                f"prompt: token id {bad} outside the vocabulary [0, {self.vocab_size})",
                param="prompt",
                code="invalid_value",
            )
        return ids

    def _sampling(self, body, prompt: list[int], max_tokens: int | None,
                  top_logprobs: int | None) -> SamplingParams:
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
        if top_k > self.vocab_size:
            raise api.APIError(
                400,
                f"top_k: at most the vocabulary size {self.vocab_size} (-1 or 0: all tokens), "
                f"got {top_k}",
                param="top_k",
                code="invalid_value",
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if top_k < 0 else top_k,
            seed=body.seed,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
            top_logprobs=top_logprobs or 0,
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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            sampling = self._sampling(body, prompt, max_tokens, top_logprobs)
        except api.APIError as error:
            return error.response()
        job = GenerationJob(
            self.engine,
            request_id,
            api.Generation(self.tokenizer, sampling.stop),
            model_name=self.model_name,
            request_timeout_s=self.request_timeout_s,
            chat=chat,
            top_logprobs=top_logprobs,
            created=api.now(),
            deadline=deadline,
        )
        if not body.stream:
            work = job.collect(prompt, sampling)
        else:
            work = job.admit(prompt, sampling)
        try:
            answer = await run_watched(work, request.receive, deadline - loop.time())
        except ClientGone:  # nobody reads the answer; the request was aborted
            return api.APIError(400, "the client disconnected", code="client_gone").response()
        except TimeoutError:
            return job.timed_out().response()
        if answer is not None:
            return answer
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return WatchedStream(job.stream(include_usage), job.close, media_type="text/event-stream")
