"""Fuzzing the HTTP server with schemathesis against its own OpenAPI schema
(``/openapi.json``), on a tiny-preset server on the CPU (a subprocess on a free loopback
port, ``bench.local_server``).

- Every operation gets a bounded number of generated requests, valid by the schema
  ("positive") and invalid ("negative"); none may answer 5xx, hang or drop the connection.
- Where the schema says what a response is, the response conforms (positive requests).
- A corpus of known attacks (issue 19) gets 4xx, and the server stays healthy after each.
- Afterwards ``/health`` answers 200 and a fixed temperature-0 completion gives the answer
  it gave before the fuzzing.

Generations are kept short, so that the run takes well under a minute on 2 cores: the
server's context is 512 tokens (`tests/tiny_server.py`); generated ``max_tokens`` the
server would accept (2 < n <= the context) are lowered to 2 before sending (larger values
are sent as they are: they test the bounds); a chat body without one gets ``max_tokens``
2 (else it would generate to the end of the context). If the server's schema declares no
request body for a POST operation, the body is taken from the pydantic
model in ``serving.api`` (``test_schema_declares_request_bodies`` fails meanwhile).
"""

import copy
import json

import pytest

# The GPU image lacks the server's and the test extra's packages; `make test-gpu` still
# collects this file.
pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("schemathesis")

import httpx
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Config, GenerationMode, openapi
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
)
from tiny_server import MAX_MODEL_LEN, TINY_SERVER_ARGS, tiny_server_env

from bench.local_server import LocalServer
from serving import api

pytestmark = pytest.mark.slow  # a server start (compiles) and some 200 requests

SMALL_MAX_TOKENS = 2
NO_SERVER_ERRORS_EXAMPLES = 15  # per operation and mode
CONFORMANCE_EXAMPLES = 5
REQUEST_TIMEOUT_S = 30
BODIES = {"/v1/completions": api.CompletionRequest, "/v1/chat/completions": api.ChatRequest}
FIXED = {"model": "tiny", "prompt": "The fixed prompt", "max_tokens": 6, "temperature": 0,
         "ignore_eos": True}  # fmt: skip


def complete_fixed(url: str) -> str:
    response = httpx.post(f"{url}/v1/completions", json=FIXED, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    with LocalServer(TINY_SERVER_ARGS, log, env=tiny_server_env(), start_timeout_s=300) as s:
        s.fixed_answer = complete_fixed(s.url)
        s.raw_schema = httpx.get(f"{s.url}/openapi.json", timeout=30).json()
        yield s


def with_request_bodies(raw: dict) -> dict:
    """The schema, with each POST body it leaves undeclared taken from ``serving.api``."""
    schema = copy.deepcopy(raw)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        operation = schema["paths"][path]["post"]
        if "requestBody" in operation:
            continue
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body}},
        }
    return schema


def _lower_max_tokens(case) -> None:
    """Keeps generations short (see the module docstring)."""
    if not isinstance(case.body, dict):
        return
    keys = ("max_tokens", "max_completion_tokens")
    if case.operation.path == "/v1/chat/completions" and all(
        case.body.get(k) is None for k in keys
    ):
        case.body["max_tokens"] = SMALL_MAX_TOKENS  # else it generates to the context's end
    for key in keys:
        value = case.body.get(key)
        if type(value) is int and SMALL_MAX_TOKENS < value <= MAX_MODEL_LEN:
            case.body[key] = SMALL_MAX_TOKENS


def fuzz(server, modes, checks, examples: int) -> list[dict]:
    """Runs every operation's generated requests; returns the failures (all of them, not
    just the first, with the request as a curl command and whether the server was still
    healthy after it)."""
    # Sanitising would print "max_tokens" as "[Filtered]" (its name has "token" in it).
    config = Config.from_dict({"output": {"sanitization": {"enabled": False}}})
    schema = openapi.from_dict(with_request_bodies(server.raw_schema), config=config)
    failures = []
    for result in schema.get_all_operations():
        for mode in modes:
            _fuzz_operation(server, result.ok(), mode, checks, examples, failures)
    return failures


def _fuzz_operation(server, operation, mode, checks, examples, failures: list[dict]) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        _lower_max_tokens(case)
        try:
            case.call_and_validate(base_url=server.url, checks=checks, timeout=REQUEST_TIMEOUT_S)
        except FailureGroup as group:
            failure = str(group)[:1500]
        except requests.RequestException as error:
            failure = f"{type(error).__name__}: {error}"
        else:
            return
        failures.append(
            {
                "operation": operation.label,
                "mode": mode.value,
                "request": case.as_curl_command(base_url=server.url),
                "failure": failure,
                "healthy_after": _healthy(server.url),
            }
        )

    try:
        run()
    except Unsatisfiable:
        # Nothing to generate: an operation without parameters has no invalid requests.
        assert mode is GenerationMode.NEGATIVE, operation.label


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


def _report(failures: list[dict]) -> str:
    return f"{len(failures)} failures; the first 8:\n" + json.dumps(failures[:8], indent=1)


def test_schema_declares_request_bodies(server):
    """Clients and fuzzers learn the request bodies from /openapi.json."""
    missing = [p for p in BODIES if "requestBody" not in server.raw_schema["paths"][p]["post"]]
    assert not missing, f"/openapi.json declares no request body for {missing}"


# Known attacks first (they pin down what the generated requests may find again).
C, CHAT = "/v1/completions", "/v1/chat/completions"
ATTACKS = {  # name: (path, body)
    "lone surrogate in prompt": (C, b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    "lone surrogate in chat": (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    "lone surrogate in stop": (C, b'{"prompt": "a", "max_tokens": 2, "stop": "\\ud800"}'),
    "deep JSON": (C, b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"),
    "deep JSON in chat": (CHAT, b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}"),
    "deep JSON top level": (C, b"[" * 100_000 + b"]" * 100_000),
    "token id past the vocabulary": (C, b'{"prompt": [5000], "max_tokens": 2}'),
    "negative token id": (C, b'{"prompt": [-1], "max_tokens": 2}'),
    "token id past int64": (C, b'{"prompt": [[1, 100000000000000000000]], "max_tokens": 2}'),
    "max_tokens past int64": (C, b'{"prompt": "a", "max_tokens": 100000000000000000000}'),
    "max_completion_tokens past int64": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "a"}], '
        b'"max_completion_tokens": 100000000000000000000}',
    ),
    "seed past uint64": (C, b'{"prompt": "a", "max_tokens": 2, "seed": 100000000000000000000}'),
    "17 stop strings": (C, json.dumps({"prompt": "a", "stop": ["s"] * 17}).encode()),
    "NaN temperature": (C, b'{"prompt": "a", "max_tokens": 2, "temperature": NaN}'),
    "invalid UTF-8": (C, b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
    # Last: today it stops the engine (issue 19), and every later request gets 503.
    "top_k past int32": (C, b'{"prompt": "Hi", "max_tokens": 4, "top_k": 3000000000}'),
    "top_k past int32 in chat": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "top_k": 3000000000}',
    ),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_known_attacks_get_4xx_and_leave_the_server_healthy(server, name):
    path, body = ATTACKS[name]
    response = httpx.post(
        server.url + path,
        content=body,
        headers={"content-type": "application/json"},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert _healthy(server.url), server.log_tail(20)


@pytest.mark.parametrize(
    "method, path, status",
    [("GET", "/nope", 404), ("GET", C, 405), ("DELETE", "/health", 405), ("PUT", CHAT, 405)],
)
def test_unknown_routes_and_methods_get_openai_errors(server, method, path, status):
    response = httpx.request(method, server.url + path, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == status
    assert set(response.json().get("error", ())) == {"message", "type", "param", "code"}, (
        response.text
    )


def test_no_server_errors(server):
    """Generated requests, valid and invalid, to every operation: never a 5xx or a hang."""
    failures = fuzz(
        server,
        [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        [not_a_server_error],
        NO_SERVER_ERRORS_EXAMPLES,
    )
    assert not failures, _report(failures)


def test_responses_conform_to_the_schema(server):
    failures = fuzz(
        server,
        [GenerationMode.POSITIVE],
        [content_type_conformance, response_schema_conformance],
        CONFORMANCE_EXAMPLES,
    )
    assert not failures, _report(failures)


def test_healthy_and_unchanged_after_fuzzing(server):
    """Last: the fuzzing left the server serving, and serving the same answers."""
    assert _healthy(server.url), server.log_tail(40)
    assert complete_fixed(server.url) == server.fixed_answer
    assert server.alive()
