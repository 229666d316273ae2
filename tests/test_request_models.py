"""Hypothesis-driven tests of the request bodies of ``serving.api`` (no server).

Any JSON object either validates into a request whose fields are within what the model
and the device dtypes can hold (ints within int32, seeds within uint32, finite floats in
their ranges, at most ``MAX_STOP_STRINGS`` stop strings), or is refused with a
``pydantic.ValidationError`` or the API's own 400 ``APIError``; never another exception.
A valid request survives a JSON round trip unchanged.
"""

import json
import math

import pytest

for _package in ("fastapi", "pydantic"):  # absent on the GPU machines
    pytest.importorskip(_package)

import pydantic  # noqa: E402
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import api

INT32_MAX = 2**31 - 1
EDGE_INTS = (-(2**63), -(2**31), -2, -1, 0, 1, 2, 5, 6, 16, 17, 20, 21, 2**31 - 1, 2**31,
             2**32 - 1, 2**32, 3_000_000_000, 2**63 - 1, 2**63, 2**64, 10**30)  # fmt: skip
EDGE_FLOATS = (-1.0, -0.0, 0.0, 1e-300, 0.5, 1.0, 2.0, 2.0000001, 1e308, math.inf, -math.inf,
               math.nan)  # fmt: skip

# What json.loads can give (NaN and Infinity included: Python's json accepts them).
strings = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates too
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(EDGE_INTS)
    | st.floats()
    | st.sampled_from(EDGE_FLOATS)
    | strings
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(strings, inner, max_size=4),
    max_leaves=12,
)
# Typed values (right JSON type, any value), so that most bodies reach the bounds checks.
ints = st.none() | st.integers() | st.sampled_from(EDGE_INTS)
floats = st.none() | st.floats() | st.sampled_from(EDGE_FLOATS) | st.sampled_from(EDGE_INTS)
token_ids = st.lists(st.integers(min_value=0, max_value=300) | st.sampled_from(EDGE_INTS),
                     min_size=1, max_size=6)  # fmt: skip
parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": strings}), max_size=3)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"])},
    optional={"content": strings | st.none() | parts},
)
SAMPLING = {
    "model": st.none() | strings,
    "temperature": floats,
    "top_p": floats,
    "top_k": ints,
    "seed": ints,
    "stop": st.none() | strings | st.lists(strings, max_size=18),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "n": ints,
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "max_tokens": ints,
    "unknown_field": json_values,
}
COMPLETION = {
    **SAMPLING,
    "logprobs": ints,
    "echo": st.booleans(),
    "best_of": ints,
    "suffix": st.none() | strings,
}
CHAT = {
    **SAMPLING,
    "max_completion_tokens": ints,
    "logprobs": st.booleans(),
    "top_logprobs": ints,
}
prompts = strings | token_ids | st.lists(strings, max_size=2) | st.lists(token_ids, max_size=2)


def _bodies(required: dict, optional: dict) -> st.SearchStrategy[dict]:
    """Typed bodies, and the same with one field's value replaced by any JSON value."""
    typed = st.fixed_dictionaries(required, optional=optional)
    names = sorted({*required, *optional})
    broken = st.tuples(typed, st.sampled_from(names), json_values).map(
        lambda t: {**t[0], t[1]: t[2]}
    )
    return typed | broken


completion_bodies = _bodies({"prompt": prompts}, COMPLETION)
chat_bodies = _bodies({"messages": st.lists(message, min_size=1, max_size=3)}, CHAT)
HYPOTHESIS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def validate_or_refuse(model: type[pydantic.BaseModel], data: dict):
    """The validated request, or None when it is refused the documented way."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError:
        return None
    except api.APIError as error:
        assert error.status == 400, error.body()
        return None


# Predicates, asserted at separate lines so that hypothesis reports each kind of bad
# value as a bug of its own.
def fits_int32(value, low: int = 0) -> bool:
    return value is None or low <= value <= INT32_MAX


def is_unicode(text: str | None) -> bool:
    """False for a string with a lone surrogate (it cannot be encoded to UTF-8)."""
    try:
        (text or "").encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def in_range(value: float | None, low: float, high: float, *, open_low: bool = False) -> bool:
    if value is None:
        return True
    return math.isfinite(value) and (low < value if open_low else low <= value) and value <= high


def check_sampling_bounds(body: api._Sampling) -> None:
    assert in_range(body.temperature, 0, 2), body.temperature
    assert in_range(body.top_p, 0, 1, open_low=True), body.top_p
    assert fits_int32(body.top_k, low=-1), f"top_k={body.top_k} does not fit int32"
    assert body.seed is None or 0 <= body.seed < 2**32, body.seed
    assert body.n in (None, 1), body.n
    stops = body.stop_strings()
    assert len(stops) <= api.MAX_STOP_STRINGS and all(stops), stops
    assert all(map(is_unicode, stops)), f"stop={stops!r}: a lone surrogate"
    assert is_unicode(body.model), f"model={body.model!r}: a lone surrogate"


@HYPOTHESIS
@given(completion_bodies)
def test_completion_bodies_validate_within_bounds_or_are_refused(data):
    body = validate_or_refuse(api.CompletionRequest, data)
    if body is None:
        return
    check_sampling_bounds(body)
    assert fits_int32(body.max_tokens, low=1), f"max_tokens={body.max_tokens} does not fit int32"
    assert body.logprobs is None or 0 <= body.logprobs <= 5
    prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    texts = [p for p in prompts if isinstance(p, str)]
    ids = [p for p in prompts if isinstance(p, int)]
    ids += [t for p in prompts if isinstance(p, list) for t in p]
    assert all(map(is_unicode, texts)), f"prompt={texts!r}: a lone surrogate"
    assert all(map(fits_int32, ids)), f"prompt token ids {ids} outside [0, 2**31)"


@HYPOTHESIS
@given(chat_bodies)
def test_chat_bodies_validate_within_bounds_or_are_refused(data):
    body = validate_or_refuse(api.ChatRequest, data)
    if body is None:
        return
    check_sampling_bounds(body)
    assert body.messages
    assert fits_int32(body.max_tokens, low=1), f"max_tokens={body.max_tokens} does not fit int32"
    assert fits_int32(body.max_completion_tokens, low=1), (
        f"max_completion_tokens={body.max_completion_tokens} does not fit int32"
    )
    assert body.top_logprobs is None or 0 <= body.top_logprobs <= 20
    assert all(m.role in ("system", "user", "assistant") for m in body.messages)
    contents = [m.text() for m in body.messages]
    assert all(map(is_unicode, contents)), f"content={contents!r}: a lone surrogate"


@HYPOTHESIS
@given(st.one_of(completion_bodies.map(lambda d: (api.CompletionRequest, d)),
                 chat_bodies.map(lambda d: (api.ChatRequest, d))))  # fmt: skip
def test_valid_bodies_survive_a_json_round_trip(model_and_data):
    model, data = model_and_data
    body = validate_or_refuse(model, data)
    if body is None:
        return
    wire = json.dumps(body.model_dump(mode="json", exclude_unset=True))
    assert model.model_validate(json.loads(wire)) == body


@HYPOTHESIS
@given(json_values)
def test_any_json_value_is_refused_or_valid(data):
    """Whatever the top-level JSON value (the server answers non-objects 400 before the
    models see them; the models must still not raise anything else)."""
    for model in (api.CompletionRequest, api.ChatRequest):
        validate_or_refuse(model, data)


_HI = {"prompt": "hi"}
_CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "model, data",
    [
        (api.CompletionRequest, {**_HI, "top_k": 3_000_000_000}),  # issue 19: killed the engine
        (api.CompletionRequest, {**_HI, "top_k": 2**63}),
        (api.CompletionRequest, {**_HI, "max_tokens": 2**40}),
        (api.ChatRequest, {**_CHAT, "max_tokens": 2**40}),
        (api.ChatRequest, {**_CHAT, "max_completion_tokens": 2**40}),
        (api.CompletionRequest, {"prompt": [-1]}),
        (api.CompletionRequest, {"prompt": [2**40]}),
        (api.CompletionRequest, {"prompt": [[1, 2**31]]}),
        (api.CompletionRequest, {"prompt": "a\ud800b"}),
        (api.CompletionRequest, {"prompt": ["a\udfff"]}),
        (api.CompletionRequest, {**_HI, "stop": "\ud800"}),
        (api.CompletionRequest, {**_HI, "stop": ["ok", "\ud800"]}),
        (api.ChatRequest, {"messages": [{"role": "user", "content": "a\ud800b"}]}),
        (
            api.ChatRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
        ),
        (api.CompletionRequest, {**_HI, "seed": 2**32}),
        (api.CompletionRequest, {**_HI, "temperature": math.nan}),
        (api.CompletionRequest, {**_HI, "logprobs": 6}),
        (api.ChatRequest, {**_CHAT, "logprobs": True, "top_logprobs": 21}),
        (api.CompletionRequest, {**_HI, "stop": ["s"] * (api.MAX_STOP_STRINGS + 1)}),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else json.dumps(x)[:60],
)
def test_known_bad_bodies_are_refused(model, data):
    """Values that fuzzing or issue 19 found (or that sit just past a bound)."""
    assert validate_or_refuse(model, data) is None, f"{data!r} validated"
