"""The HTTP server end to end: ``python -m serving.server`` in a subprocess on a free
loopback port (tiny preset, random weights, byte tokenizer, 64-token blocks, one batch
shape), driven with httpx.

One server serves the whole module (its start compiles the model); the shutdown test
runs last and stops it.
"""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The server's own packages: absent on the GPU machines, where `pytest -m gpu` must still
# collect this module.
for _package in ("fastapi", "uvicorn", "pydantic", "httpx"):
    pytest.importorskip(_package)

import httpx
from tiny_server import MAX_MODEL_LEN, TINY_SERVER_ARGS, tiny_server_env

from serving.api import Generation
from serving.async_engine import AsyncEngine, EngineDeadError
from serving.engine import DeviceLostError
from serving.outputs import FinishReason, RequestOutput
from serving.request import SamplingParams
from serving.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = dict(os.environ, **tiny_server_env())
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.server", *TINY_SERVER_ARGS, "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited at start:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{proc.stdout.read()}")
        time.sleep(0.5)
    with httpx.Client(base_url=url, timeout=120) as client:
        client.proc = proc
        yield client
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def complete(client, prompt, **fields):
    response = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": prompt, "temperature": 0, **fields}
    )
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(client, path, body):
    """The decoded ``data:`` events of a streamed request, and whether [DONE] ended it."""
    events = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def metrics(client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(glmjax_[a-z_]+) (\S+)$", text, re.M)}


# --- pieces, without a server ---------------------------------------------------------------


def _output(token_ids, text, finished=False):
    return RequestOutput(
        "r",
        (1,),
        tuple(token_ids),
        (-1.0,) * len(token_ids),
        ((),) * len(token_ids),
        text,
        FinishReason.LENGTH if finished else None,
        None,
        1,
        0,
        0,
    )


def test_streamed_text_never_takes_back_what_it_sent():
    """A character split over tokens and a stop string that may still complete are held
    back until they are whole."""
    tok = ByteTokenizer(1024)
    ids = tok.encode("a✓bST")
    gen = Generation(tok, stop=("STOP",))
    sent = []
    for n in range(1, len(ids) + 1):
        text = gen.advance(_output(ids[:n], tok.decode(ids[:n])))[0]
        sent.append(text)
        assert "\ufffd" not in "".join(sent)
    text = gen.advance(_output(ids, tok.decode(ids), finished=True))[0]
    assert "".join(sent) + text == "a✓bST"
    assert text == "bST"  # the last len("STOP") - 1 characters wait for the finish


class _FailingEngine:
    """Stands in for an ``Engine`` whose first step the model refuses."""

    config = None

    def __init__(self):
        self.requests = []

    def metrics(self):
        return None

    def has_unfinished(self):
        return bool(self.requests)

    def add_request(self, request_id, prompt, sampling):
        self.requests.append(request_id)

    def abort(self, request_id):
        return False

    def step(self):
        raise DeviceLostError("the device failed")


def test_failed_step_fails_waiters_and_refuses_new_requests():
    async def scenario():
        engine = AsyncEngine(_FailingEngine())
        engine.start()
        outputs = await engine.add_request("a", [1], SamplingParams())
        item = await asyncio.wait_for(outputs.get(), 10)
        assert isinstance(item, EngineDeadError) and "server log" in str(item)
        assert isinstance(engine.error, DeviceLostError)
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", [1], SamplingParams())
        engine.stop()

    asyncio.run(scenario())


# --- the server ---------------------------------------------------------------------------


def test_a_mesh_it_cannot_build_is_refused():
    result = subprocess.run(
        [sys.executable, "-m", "serving.server", "--tp", "2", "--dcp", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert result.returncode != 0
    assert "--tp 2 --dcp 4" in result.stderr and "dcp=4 must divide tp=2" in result.stderr


def test_health_and_models(server):
    assert server.get("/health").json() == {"status": "ok"}
    models = server.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_completion_shape_logprobs_and_reproducibility(server):
    body = complete(server, "Hello, world", max_tokens=8, logprobs=0, ignore_eos=True)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 8
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert "".join(lp["tokens"]) == choice["text"]
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(b"Hello, world")
    assert usage["completion_tokens"] == 8 and usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert "cached_tokens" in usage["prompt_tokens_details"]
    again = complete(server, list(b"Hello, world"), max_tokens=8, ignore_eos=True)
    assert again["choices"][0]["text"] == choice["text"]
    assert again["choices"][0]["logprobs"] is None


def test_top_logprob_alternatives(server):
    body = complete(server, "Hello, world", max_tokens=5, logprobs=3, ignore_eos=True)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == 5
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                   strict=True):
        values = list(top.values())
        assert 1 <= len(top) <= 3 and values == sorted(values, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert top[token] == pytest.approx(logprob, abs=1e-5) == pytest.approx(values[0])
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    chat = server.post("/v1/chat/completions", json=request).json()
    for entry in chat["choices"][0]["logprobs"]["content"]:
        assert len(entry["top_logprobs"]) == 2
        best = entry["top_logprobs"][0]
        assert best["token"] == entry["token"]
        assert best["logprob"] == pytest.approx(entry["logprob"], abs=1e-5)
        assert best["bytes"] == list(best["token"].encode())


def test_seeded_sampling_reproduces(server):
    fields = dict(max_tokens=6, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    first = complete(server, "seeded", **fields)["choices"][0]["text"]
    assert complete(server, "seeded", **fields)["choices"][0]["text"] == first


def test_streamed_completion_equals_whole(server):
    whole = complete(server, "stream me", max_tokens=10, ignore_eos=True)
    chunks = stream_events(
        server,
        "/v1/completions",
        {
            "prompt": "stream me",
            "max_tokens": 10,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_chat_whole_and_streamed(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    request = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
    }
    whole = server.post("/v1/chat/completions", json=request)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert len(body["choices"][0]["logprobs"]["content"]) == 6
    prompt = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert body["usage"]["prompt_tokens"] == len(prompt.encode())
    chunks = stream_events(server, "/v1/chat/completions", request)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_text_whole_and_streamed(server):
    full = complete(server, "stop here", max_tokens=24, ignore_eos=True)["choices"][0]["text"]
    assert len(full) > 8
    stop = full[5:8]
    expected = full[: full.find(stop)]
    body = complete(server, "stop here", max_tokens=24, ignore_eos=True, stop=[stop, "\x00zz"])
    assert body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    chunks = stream_events(
        server,
        "/v1/completions",
        {
            "prompt": "stop here",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stop": stop,
        },
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": 3.5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x" * (MAX_MODEL_LEN + 5)}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [5000]}, 400, None),
        ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages.0.role",
        ),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = server.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_a_top_k_past_int32_is_refused_and_the_server_serves_on(server):
    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    before = server.post("/v1/completions", json=body)
    assert before.status_code == 200, before.text
    response = server.post("/v1/completions", json=body | {"top_k": 3_000_000_000})
    assert 400 <= response.status_code < 500, response.text
    assert "top_k" in response.json()["error"]["message"]
    assert server.get("/health").status_code == 200
    after = server.post("/v1/completions", json=body)
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]


def test_concurrent_clients_match_sequential(server):
    """16 clients at once (8 distinct prompts, each sent twice; 4 run per step, the rest
    wait) get what each prompt gets alone."""
    prompts = [f"client {i}: " + "abcdefgh"[: i + 1] * (1 + 5 * i) for i in range(8)]
    lengths = [3 + i % 4 for i in range(8)]

    def body(i):
        i %= 8
        return {
            "model": "tiny",
            "prompt": prompts[i],
            "max_tokens": lengths[i],
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        }

    sequential = [server.post("/v1/completions", json=body(i)).json() for i in range(8)] * 2

    async def all_at_once():
        async with httpx.AsyncClient(base_url=str(server.base_url), timeout=120) as client:
            return await asyncio.gather(
                *(client.post("/v1/completions", json=body(i)) for i in range(16))
            )

    before = metrics(server)["glmjax_steps_total"]
    concurrent = [r.json() for r in asyncio.run(all_at_once())]
    steps = metrics(server)["glmjax_steps_total"] - before
    for seq, con in zip(sequential, concurrent, strict=True):
        assert con["choices"][0]["text"] == seq["choices"][0]["text"]
        assert con["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            seq["choices"][0]["logprobs"]["token_logprobs"], abs=1e-3
        )
    assert steps < 2 * sum(lengths), "concurrent requests should share steps"


def test_repeated_prefix_reports_cached_tokens(server):
    prompt = "A shared preamble of a few hundred bytes. " * 7 + "Question one?"
    first = complete(server, prompt, max_tokens=4, ignore_eos=True)
    before = metrics(server)
    second = complete(server, prompt, max_tokens=4, ignore_eos=True)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached > 0 and cached % 64 == 0 and cached < len(prompt)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    after = metrics(server)
    assert after["glmjax_prefix_cache_hits_total"] > before["glmjax_prefix_cache_hits_total"]
    assert (
        after["glmjax_cached_prompt_tokens_total"] - before["glmjax_cached_prompt_tokens_total"]
        == cached
    )


def wait_until_nothing_held(client) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:
        m = metrics(client)
        if (
            m["glmjax_running"],
            m["glmjax_waiting"],
            m["glmjax_kv_blocks_used"],
            m["glmjax_state_slots_used"],
        ) == (0, 0, 0, 0):
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    return m


def test_disconnect_mid_stream_frees_everything(server):
    before = metrics(server)["glmjax_requests_aborted_total"]
    request = {
        "model": "tiny",
        "prompt": "a long story " * 4,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with server.stream("POST", "/v1/completions", json=request) as response:
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break
    assert wait_until_nothing_held(server)["glmjax_requests_aborted_total"] == before + 1


def test_client_giving_up_on_a_whole_response_aborts_it(server):
    before = metrics(server)["glmjax_requests_aborted_total"]
    request = {"model": "tiny", "prompt": "abandoned", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", json=request, timeout=1.0)
    assert wait_until_nothing_held(server)["glmjax_requests_aborted_total"] == before + 1


def test_metrics_exposition(server):
    text = server.get("/metrics").text
    for name in (
        "glmjax_requests_added_total",
        "glmjax_prompt_tokens_total",
        "glmjax_cached_prompt_tokens_total",
        "glmjax_running",
        "glmjax_waiting",
        "glmjax_kv_blocks_used",
        "glmjax_state_slots_used",
        'glmjax_feature_enabled{feature="prefix_caching"} 1',
        'glmjax_time_to_first_token_seconds_bucket{le="+Inf"}',
        "glmjax_time_per_output_token_seconds_count",
    ):
        assert name in text, name


def test_nothing_compiled_while_serving(server):
    """Every test above ran against this server (mixed prefill and decode steps, streams,
    concurrent clients, prefix hits): all of it ran on the programs compiled at start."""
    values = metrics(server)
    assert values["glmjax_requests_added_total"] > 20
    assert values["glmjax_backend_compiles_total"] == 0


def test_sigterm_aborts_streams_and_exits(server):
    """Last: stops the module's server."""
    request = {
        "model": "tiny",
        "prompt": "until shutdown",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    reasons = []
    with server.stream("POST", "/v1/completions", json=request) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[len("data: ") :])
            reasons.append(chunk["choices"][0]["finish_reason"])
            if len(reasons) == 2:
                server.proc.send_signal(signal.SIGTERM)
    assert reasons[-1] == "abort"
    assert server.proc.wait(timeout=30) == 0


def test_weights_load_from_safetensors_and_orbax(tmp_path):
    """--weights: a safetensors folder (with --family) and an orbax checkpoint both give
    back the parameters that were written."""
    import jax
    import numpy as np
    from flax import nnx
    from safetensors.numpy import save_file

    from glmjax.weights import save_params, upstream_tensors
    from serving import server as server_module

    args = server_module.parse_args(["--block-size", "64"])
    config = server_module.build_config(args)
    source = server_module.random_model(config, seed=3)
    expected = jax.tree_util.tree_leaves(nnx.state(source, nnx.Param))
    (tmp_path / "st").mkdir()
    save_file(upstream_tensors(source, "glm"), str(tmp_path / "st" / "model.safetensors"))
    save_params(tmp_path / "orbax", source)

    args.weights = tmp_path / "st"
    with pytest.raises(ValueError, match="--family"):
        server_module.load_model(args, config)
    args.family = "glm"
    for folder in ("st", "orbax"):
        args.weights = tmp_path / folder
        loaded = jax.tree_util.tree_leaves(
            nnx.state(server_module.load_model(args, config), nnx.Param)
        )
        for a, b in zip(expected, loaded, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
