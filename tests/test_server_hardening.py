"""The HTTP layer against hostile and impatient clients: bounded inputs, body limits,
OpenAI-shaped errors, keep-alive after a 4xx, aborts on disconnect at every stage,
timeouts and the API key.

The server runs in this process (uvicorn on a thread, a free loopback port) around one
real tiny engine compiled once for the module (the settings of ``tests/test_server.py``),
so a test can hold the engine between steps (``StepGate``) and read its metrics directly.
"""

import asyncio
import contextlib
import http.client
import json
import logging
import socket
import threading
import time
import types

import pytest

for _package in ("fastapi", "uvicorn", "pydantic", "httpx"):  # absent on the GPU machines
    pytest.importorskip(_package)

import httpx
import uvicorn
from tiny_server import TINY_SERVER_ARGS

from glmjax import compile_cache
from serving import server as server_module
from serving.async_engine import AsyncEngine
from serving.batch_builder import BatchBuckets
from serving.http_guard import HTTPOptions
from serving.precompile import reachable_programs
from serving.request import SamplingParams
from serving.step import SchedulerConfig

VOCAB = 1024  # the tiny preset's


class StepGate:
    """Holds the engine thread before its next step while closed."""

    def __init__(self, engine):
        self.engine, self._step = engine, engine.step
        self.opened, self.blocked = threading.Event(), threading.Event()
        self.opened.set()
        engine.step = self._gated

    def _gated(self):
        if not self.opened.is_set():
            self.blocked.set()
            self.opened.wait()
            self.blocked.clear()
        return self._step()

    def close(self):
        self.opened.clear()

    def open(self):
        self.opened.set()

    def remove(self):
        self.open()
        self.engine.step = self._step


@pytest.fixture(scope="module")
def engine_parts():
    """The engine `python -m serving.server` builds with the tiny servers' flags, its
    programs compiled, read from the run's compilation cache that those servers fill
    (`tests/tiny_server.py`); the cache is off again for the file's other tests."""
    args = server_module.parse_args(TINY_SERVER_ARGS)
    with compile_cache.enabled(args.compile_cache_dir):
        engine, tokenizer, name = server_module.build_engine(args)
        assert engine.model_config.vocab_size == VOCAB
        server_module.warm_up(engine, precompile_all=True)
    return engine, tokenizer, name


@contextlib.contextmanager
def serve(engine_parts, options=None):
    """A server on a free port: ``.client`` (httpx), ``.port``, ``.engine`` (its
    AsyncEngine), ``.gate`` (a StepGate), ``.handlers``."""
    engine, tokenizer, name = engine_parts
    async_engine = AsyncEngine(engine)
    app = server_module.build_app(async_engine, tokenizer, model_name=name, options=options)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    gate = StepGate(engine)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            yield types.SimpleNamespace(
                client=client,
                port=port,
                engine=async_engine,
                gate=gate,
                handlers=app.state.handlers,
            )
    finally:
        gate.remove()
        uv.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def served(engine_parts):
    with serve(engine_parts) as server:
        yield server


def assert_openai_error(response, status, *, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def wait_until_idle(async_engine):
    deadline = time.monotonic() + 30
    while True:
        m = async_engine.metrics()
        if (m.running, m.waiting, m.kv_blocks_used, m.state_slots_used) == (0, 0, 0, 0):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


COMPLETION = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

BAD_BODIES = [
    # (path, raw body, param, message fragment)
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt", "surrogate"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x\\udfffy"}]}',
        "messages.0.content",
        "surrogate",
    ),
    ("/v1/completions", '{"prompt": "x", "stop": ["ok", "\\ud800"]}', "stop.1", "surrogate"),
    ("/v1/completions", '{"prompt": "x", "\\ud800": 1}', None, "surrogate"),
    ("/v1/completions", '{"prompt": ' + deep(2000) + "}", None, "nests deeper"),
    ("/v1/completions", '{"prompt": "x", "extra": ' + deep(200) + "}", "extra", "nests deeper"),
    ("/v1/completions", deep(100_000), None, None),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', None, "NaN"),
    ("/v1/completions", '{"prompt": "x", "top_p": Infinity}', None, "Infinity"),
    ("/v1/completions", '{"prompt": "x", "seed": ' + "9" * 5000 + "}", None, None),
    ("/v1/completions", b'{"prompt": "\xff"}', None, "UTF-8"),
    ("/v1/completions", '{"prompt": "x", "top_k": 1025}', "top_k", "vocabulary size 1024"),
    ("/v1/completions", '{"prompt": "x", "top_k": 3000000000}', "top_k", None),
    ("/v1/completions", '{"prompt": "x", "top_k": -2}', "top_k", None),
    ("/v1/completions", '{"prompt": "x", "seed": 4294967296}', "seed", None),
    ("/v1/completions", '{"prompt": "x", "seed": -1}', "seed", None),
    ("/v1/completions", '{"prompt": [1, 1024]}', "prompt", "token id 1024"),
    ("/v1/completions", '{"prompt": [[3, 2147483648]]}', "prompt.0.1", None),
    ("/v1/completions", '{"prompt": [-1]}', "prompt.0", None),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 2147483648}', "max_tokens", None),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 600}', "max_tokens", "context length"),
    ("/v1/completions", '{"prompt": "x", "n": 2}', "n", None),
    ("/v1/completions", '{"prompt": "x", "n": 0}', "n", None),
    ("/v1/completions", '{"prompt": "x", "logprobs": 6}', "logprobs", None),
    ("/v1/completions", '{"prompt": "x", "presence_penalty": 1e308}', "presence_penalty", None),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}',
        "top_logprobs",
        None,
    ),
    (
        "/v1/completions",
        json.dumps({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}),
        "stop",
        "stop: at most 16 strings, got 17",
    ),
    ("/v1/completions", '{"prompt": "x", "stop": [1]}', "stop.0", "valid string"),
    ("/v1/completions", '{"prompt": "x", "stop": ""}', "stop", "empty"),
]


@pytest.mark.parametrize("path, raw, param, fragment", BAD_BODIES)
def test_bad_bodies_get_400_and_the_connection_stays_open(served, path, raw, param, fragment):
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    raw = raw.encode() if isinstance(raw, str) else raw
    conn.request("POST", path, body=raw, headers={"content-type": "application/json"})
    first = conn.getresponse()
    error = json.loads(first.read())["error"]
    assert first.status == 400, error
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    if fragment is not None:
        assert fragment in error["message"], error
    assert not first.will_close
    sock = conn.sock
    conn.request("GET", "/v1/models")
    second = conn.getresponse()
    assert second.status == 200 and conn.sock is sock  # the same keep-alive connection
    second.read()
    conn.close()
    assert served.engine.error is None


def test_errors_of_routing_have_the_openai_shape(served):
    client = served.client
    assert_openai_error(client.get("/nowhere"), 404, code="not_found")
    response = client.get("/v1/completions")
    assert_openai_error(response, 405, code="method_not_allowed")
    assert "POST" in response.headers["allow"]
    assert_openai_error(client.delete("/v1/models"), 405)
    assert_openai_error(client.get("/v1/models/gpt-4"), 404, param="model", code="model_not_found")
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"


def test_openapi_schema_documents_the_request_bodies(served):
    schema = served.client.get("/openapi.json").json()
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatRequest"),
    ):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert model in schema["components"]["schemas"]
    assert "ChatMessage" in schema["components"]["schemas"]
    assert "prompt" in schema["components"]["schemas"]["CompletionRequest"]["properties"]


def test_an_unexpected_error_is_a_generic_500_in_the_log(served, caplog, monkeypatch):
    def broken(text):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(served.handlers, "tokenizer", types.SimpleNamespace(encode=broken))
    with caplog.at_level(logging.ERROR, logger="serving.server"):
        response = served.client.post("/v1/completions", json=COMPLETION)
    error = assert_openai_error(response, 500, code="internal_error")
    assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
    request_id = error["message"].split("request id ")[1].split(";")[0]
    assert any(request_id in record.getMessage() for record in caplog.records)
    assert "secret internals" in caplog.text
    monkeypatch.undo()
    assert served.client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_a_50_mb_body_is_refused_at_once(served):
    start = time.monotonic()
    response = served.client.post("/v1/completions", content=b"x" * (50 << 20))
    assert time.monotonic() - start < 2
    assert_openai_error(response, 413, code="request_too_large")

    def chunks():  # no Content-Length: the server counts while it reads
        for _ in range(160):
            yield b"y" * (64 << 10)

    with httpx.Client(base_url=served.client.base_url, timeout=30) as fresh:
        response = fresh.post("/v1/completions", content=chunks())
    assert_openai_error(response, 413, code="request_too_large")
    assert served.client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_streamed_text_offsets_match_the_whole_answer(served):
    body = dict(COMPLETION, prompt="offsets", max_tokens=6, ignore_eos=True, logprobs=1)
    whole = served.client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    offsets, tokens = [], []
    with served.client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                logprobs = json.loads(line[6:])["choices"][0]["logprobs"]
                offsets += logprobs["text_offset"]
                tokens += logprobs["tokens"]
    assert tokens == whole["tokens"]
    assert offsets == whole["text_offset"]
    assert whole["text_offset"] == [sum(map(len, tokens[:i])) for i in range(len(tokens))]


# --- aborts on disconnect, at every stage -------------------------------------------------


def send_raw(port: int, body: dict) -> socket.socket:
    """A socket that has sent ``body`` to /v1/completions and reads nothing back."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def wait_for(predicate, what: str, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


LONG = dict(COMPLETION, max_tokens=300, ignore_eos=True)


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_waiting_for_admission_aborts(served, stream):
    """The engine thread is held inside a step, so the request's add command waits in the
    queue; the client leaves; the request must be aborted before it generates anything."""
    before = wait_until_idle(served.engine)
    served.gate.close()
    occupier = threading.Thread(
        target=served.client.post, args=("/v1/completions",), kwargs={"json": COMPLETION}
    )
    occupier.start()
    wait_for(served.gate.blocked.is_set, "the engine thread did not reach the gate")
    sock = send_raw(served.port, dict(LONG, stream=stream))
    time.sleep(0.3)  # the handler now awaits admission
    sock.close()
    time.sleep(0.3)  # the disconnect is seen and the abort queued behind the add
    served.gate.open()
    occupier.join(30)
    after = wait_until_idle(served.engine)
    assert after.requests_aborted == before.requests_aborted + 1
    assert after.generated_tokens - before.generated_tokens == COMPLETION["max_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_during_prefill_aborts(served, stream):
    """A prompt of four steps' budget; the client leaves while the first step is held."""
    before = wait_until_idle(served.engine)
    served.gate.close()
    sock = send_raw(served.port, dict(LONG, prompt="p" * 450, max_tokens=40, stream=stream))
    wait_for(served.gate.blocked.is_set, "the request's first step did not start")
    sock.close()
    time.sleep(0.3)
    served.gate.open()
    after = wait_until_idle(served.engine)
    assert after.requests_aborted == before.requests_aborted + 1
    assert after.generated_tokens == before.generated_tokens  # no prefill finished


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_during_decode_aborts(served, stream):
    before = wait_until_idle(served.engine)
    sock = send_raw(served.port, dict(LONG, stream=stream))
    wait_for(
        lambda: served.engine.metrics().generated_tokens >= before.generated_tokens + 3,
        "no tokens were generated",
    )
    sock.close()
    after = wait_until_idle(served.engine)
    assert after.requests_aborted == before.requests_aborted + 1
    assert after.generated_tokens - before.generated_tokens < LONG["max_tokens"]


# --- timeouts and the API key (a server of their own each) --------------------------------


def test_a_request_past_its_timeout_is_aborted_504_and_a_slow_body_408(engine_parts):
    with serve(engine_parts, HTTPOptions(request_timeout_s=1.0)) as server:
        before = wait_until_idle(server.engine)
        server.gate.close()
        start = time.monotonic()
        response = server.client.post("/v1/completions", json=LONG)
        assert 1.0 <= time.monotonic() - start < 5
        error = assert_openai_error(response, 504, code="request_timeout")
        assert "1 s" in error["message"]
        server.gate.open()
        wait_until_idle(server.engine)
        server.gate.close()  # admitted at once (the engine is idle), then held
        events = []
        with server.client.stream(
            "POST", "/v1/chat/completions", json=dict(CHAT, stream=True)
        ) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        server.gate.open()
        after = wait_until_idle(server.engine)
        assert after.requests_aborted == before.requests_aborted + 2
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as slow:
            slow.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"
            )
            start = time.monotonic()
            answer = b""
            while chunk := slow.recv(4096):  # the server closes the connection after it
                answer += chunk
            answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408") and "request_timeout" in answer
        assert time.monotonic() - start < 5


def test_api_key_guards_v1_only(engine_parts):
    with serve(engine_parts, HTTPOptions(api_key="sekret")) as server:
        client = server.client
        assert_openai_error(client.get("/v1/models"), 401, code="invalid_api_key")
        wrong = {"authorization": "Bearer nope"}
        assert_openai_error(client.get("/v1/models", headers=wrong), 401)
        response = client.post("/v1/completions", content=b"x" * (50 << 20))
        assert_openai_error(response, 401)  # refused before the body is read
        right = {"authorization": "Bearer sekret"}
        assert client.get("/v1/models", headers=right).status_code == 200
        response = client.post("/v1/completions", json=COMPLETION, headers=right)
        assert response.status_code == 200, response.text
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


def test_help_shows_defaults_and_limits(capsys):
    with pytest.raises(SystemExit):
        server_module.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in (
        "(default: 4194304)",  # --max-body-bytes
        "(default: 600.0)",  # --request-timeout
        "(default: 4096)",  # --max-model-len
        "(default: 512)",  # --block-size
        "(default: 127.0.0.1)",
        "n = best_of = 1",
        "logprobs <= 5",
        "at most 16 non-empty strings",
        "KV block ids",
        "--precompile none: ready once the weights are in memory",
        "python -m bench.startup",
    ):
        assert shown in text, shown
    # The start-up section counts the default flags' programs as the precompile lists them.
    defaults = SchedulerConfig(max_model_len=4096, block_size=512, budget=8192, max_num_seqs=64)
    # Asynchronous scheduling is on by default, on one device with pinned decode buffers:
    # their staging programs count.
    programs = len(reachable_programs(BatchBuckets.for_config(defaults), feed=True,
                                      pinned=True))
    assert f"the default flags reach {programs} programs" in text
    with pytest.raises(SystemExit):
        server_module.parse_args(["--max-body-bytes", "0"])


class _SlowAddEngine:
    """Stands in for an ``Engine`` whose ``add_request`` takes until ``release``."""

    config = None

    def __init__(self):
        self.release = threading.Event()
        self.added, self.aborted = [], []

    def metrics(self):
        return None

    def has_unfinished(self):
        return False

    def add_request(self, request_id, prompt, sampling):
        self.release.wait(10)
        self.added.append(request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)


def test_cancelling_add_request_leaves_the_engine_serving():
    async def scenario():
        fake = _SlowAddEngine()
        engine = AsyncEngine(fake)
        engine.start()
        adding = asyncio.ensure_future(engine.add_request("a", [1], SamplingParams()))
        await asyncio.sleep(0.2)  # the engine thread is inside add_request("a")
        adding.cancel()
        await asyncio.sleep(0.2)  # the cancellation has reached the command's future
        fake.release.set()
        try:
            await asyncio.wait_for(engine.add_request("b", [1], SamplingParams()), 10)
            assert engine.error is None
            assert fake.added == ["a", "b"] and "a" in fake.aborted
        finally:
            engine.stop()

    asyncio.run(scenario())
