"""The OpenAI-style HTTP API: request bodies (pydantic, strict types), error bodies, and
the response and stream-chunk shapes of ``/v1/completions`` and ``/v1/chat/completions``.

Request fields OpenAI defines but this server cannot honour are refused (400) when set to
anything but their neutral value, never ignored: ``n`` and ``best_of`` other than 1,
penalties other than 0, ``logit_bias``, ``suffix`` and ``echo``. Log-probabilities:
``logprobs`` = n (completions) or ``logprobs: true`` with ``top_logprobs`` = n (chat)
return each sampled token's log-probability and the n most likely alternatives, under the
model's raw distribution. Unknown fields are ignored. Extensions
(as in vLLM): ``top_k`` (-1 or 0: all tokens) and ``ignore_eos``.

Every number is bounded by what the device dtypes hold (counts, ``top_k`` and token ids
below 2**31, seeds below 2**32); the handlers then bound ``top_k`` and token ids by the
vocabulary and ``max_tokens`` by the context length. ``stop`` holds at most
``MAX_STOP_STRINGS`` non-empty strings.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Annotated, Literal

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from serving.outputs import RequestOutput
from serving.request import MAX_TOP_LOGPROBS
from serving.tokenizer import Tokenizer

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 5  # completions' legacy ``logprobs``, as OpenAI limits it
SEED_LIMIT = 2**32  # seeds become uint32 on the device (serving.sampling)
INT32_LIMIT = 2**31  # counts and token ids become int32; the model's limits are lower still


class APIError(Exception):
    """An error answered with OpenAI's body ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        # ASCII JSON: a message quoting client input can never fail to encode.
        return Response(
            json.dumps(self.body()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


TokenId = Annotated[int, Field(ge=0, lt=INT32_LIMIT)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        """Lone surrogates and deep nesting are refused (400) for a body that did not come
        through ``serving.json_body`` too (a model built in Python)."""
        from serving.json_body import check_values  # it imports this module

        if isinstance(data, dict):
            check_values(data)
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, lt=INT32_LIMIT)] | None = None
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    # Counted in a validator, not by the type, so that too many strings get a clear message.
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, lt=INT32_LIMIT)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        _refuse(self.n not in (None, 1), "n", "only n=1 is supported")
        for name in ("presence_penalty", "frequency_penalty"):
            _refuse(getattr(self, name) not in (None, 0, 0.0), name, f"{name} is not supported")
        _refuse(bool(self.logit_bias), "logit_bias", "logit_bias is not supported")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(
                400,
                f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}",
                param="stop",
                code="invalid_value",
            )
        if "" in stops:
            raise APIError(
                400, "stop: strings must not be empty", param="stop", code="invalid_value"
            )
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    # Token ids are checked against the model's vocabulary by the handler.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=1, lt=INT32_LIMIT)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, lt=INT32_LIMIT)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _refuse_completion_extras(self):
        _refuse(self.echo, "echo", "echo=true is not supported")
        _refuse(self.best_of not in (None, 1), "best_of", "only best_of=1 is supported")
        _refuse(self.suffix is not None, "suffix", "suffix is not supported")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, lt=INT32_LIMIT)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, lt=INT32_LIMIT)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _refuse_chat_extras(self):
        _refuse(
            bool(self.top_logprobs) and not self.logprobs,
            "top_logprobs",
            "top_logprobs needs logprobs=true",
        )
        return self


def _refuse(condition: bool, param: str, message: str) -> None:
    if condition:
        raise APIError(400, message, param=param, code="unsupported_parameter")


# --- responses ----------------------------------------------------------------------------


class Generation:
    """One request's output as the client has seen it: text sent so far, tokens seen."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]):
        self._tokenizer = tokenizer
        # A stop string may still be completing: hold back what could be its beginning.
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = ""
        self.num_tokens = 0
        self.token_chars = 0  # characters of the tokens' own texts so far: text_offset

    def advance(
        self, output: RequestOutput
    ) -> tuple[str, list[str], list[float], list[list[tuple[str, float]]]]:
        """(new text, texts of the new tokens, their logprobs, their most likely
        alternatives as (text, logprob)) since the last call."""
        text = output.text or ""
        if not output.finished:
            text = text[: max(len(text) - self._holdback, 0)]
            text = text.rstrip("\ufffd")  # a character whose bytes are still arriving
        delta = text[len(self.sent) :] if len(text) > len(self.sent) else ""
        self.sent += delta
        new_ids = output.output_token_ids[self.num_tokens :]
        logprobs = list(output.logprobs[self.num_tokens :])
        tops = [
            [(self._tokenizer.token_text(token), logprob) for token, logprob in alternatives]
            for alternatives in output.top_logprobs[self.num_tokens :]
        ]
        self.num_tokens = len(output.output_token_ids)
        texts = [self._tokenizer.token_text(t) for t in new_ids]
        self.token_chars += sum(map(len, texts))
        return delta, texts, logprobs, tops


def finish_reason(output: RequestOutput) -> str | None:
    return None if output.finish_reason is None else output.finish_reason.value


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def completion_logprobs(
    token_texts: Sequence[str],
    logprobs: Sequence[float],
    text_offset: int,
    tops: Sequence[Sequence[tuple[str, float]]],
    num_top: int,
) -> dict:
    """The legacy completions ``logprobs`` object for these tokens, with the `num_top` most
    likely alternatives of each (None when 0)."""
    offsets, position = [], text_offset
    for text in token_texts:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": list(token_texts),
        "token_logprobs": list(logprobs),
        "top_logprobs": [_most_likely_per_text(top[:num_top]) for top in tops]
        if num_top
        else None,
        "text_offset": offsets,
    }


def _most_likely_per_text(pairs: Sequence[tuple[str, float]]) -> dict[str, float]:
    """{text: logprob}, most likely first; two tokens with one text keep the likelier."""
    mapping: dict[str, float] = {}
    for text, logprob in pairs:
        mapping.setdefault(text, logprob)
    return mapping


def chat_logprobs(
    token_texts: Sequence[str],
    logprobs: Sequence[float],
    tops: Sequence[Sequence[tuple[str, float]]],
    num_top: int,
) -> dict:
    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(text, logprob), "top_logprobs": [entry(*alt) for alt in top[:num_top]]}
            for text, logprob, top in zip(token_texts, logprobs, tops, strict=True)
        ]
    }


def completion_choice(text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    text: str | None,
    finish_reason: str | None,
    logprobs: dict | None,
    *,
    delta: bool,
    first: bool = False,
) -> dict:
    message: dict = {}
    if not delta or first:
        message["role"] = "assistant"
    if text is not None or not delta:
        message["content"] = text
    key = "delta" if delta else "message"
    return {"index": 0, key: message, "logprobs": logprobs, "finish_reason": finish_reason}


def envelope(
    request_id: str,
    model: str,
    choice: dict | None,
    *,
    chat: bool,
    chunk: bool,
    created: int,
    usage_: dict | None = None,
) -> dict:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    body = {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [] if choice is None else [choice],
    }
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def now() -> int:
    return int(time.time())
