"""The HTTP side of a load test (``bench.load``): one send of a request body, whole or
streamed, timed (TTFT: the first event with text; latency: to the end of the answer), with its
planned disconnect; N concurrent clients draining one queue of sends; and the checked
bodies sent alone, one at a time. Each send ends as a `Result`: completed, failed (an HTTP
error, a broken stream, a timeout) or disconnected (by the client, on purpose); `bench.load`
marks completed ones "wrong" when they differ from the answer alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx

from bench.load_workload import Body, Send


@dataclasses.dataclass
class Result:
    index: int
    key: int
    path: str
    stream: bool
    disconnect: str | None
    outcome: str = "failed"  # completed | failed | wrong | disconnected
    status: int | None = None
    error: str | None = None
    text: str | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None


def _answer(body: dict, chat: bool) -> tuple[str, str | None, int]:
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return text or "", choice["finish_reason"], body["usage"]["completion_tokens"]


async def _send_whole(client: httpx.AsyncClient, send: Send, result: Result, start: float):
    response = await client.post(send.body.path, json={**send.body.json, "stream": False})
    result.status = response.status_code
    if response.status_code != 200:
        result.error = response.text[:500]
        return
    result.text, result.finish_reason, result.completion_tokens = _answer(
        response.json(), send.body.path.endswith("chat/completions")
    )
    result.outcome = "completed"


async def _send_stream(client: httpx.AsyncClient, send: Send, result: Result, start: float):
    chat = send.body.path.endswith("chat/completions")
    body = {**send.body.json, "stream": True, "stream_options": {"include_usage": True}}
    parts, events, done = [], 0, False
    async with client.stream("POST", send.body.path, json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")[:500]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                result.error = json.dumps(event)[:500]
                return
            events += 1
            if event.get("usage"):
                result.completion_tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text = (choice["delta"].get("content") if chat else choice["text"]) or ""
                if text and result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - start
                parts.append(text)
                result.finish_reason = choice["finish_reason"] or result.finish_reason
            if send.disconnect == "mid-stream" and events >= send.disconnect_after:
                result.outcome = "disconnected"
                return  # leaving the block closes the connection
    if not done:
        result.error = "the stream ended without data: [DONE]"
        return
    result.text, result.outcome = "".join(parts), "completed"


async def send_one(client: httpx.AsyncClient, send: Send, timeout_s: float) -> Result:
    """`send` on `client`, within `timeout_s` seconds (or until its planned disconnect)."""
    result = Result(send.index, send.body.key, send.body.path, send.stream, send.disconnect)
    start = time.perf_counter()
    call = (_send_stream if send.stream else _send_whole)(client, send, result, start)
    limit = send.disconnect_after if send.disconnect == "mid-request" else timeout_s
    try:
        await asyncio.wait_for(call, limit)
    except TimeoutError:
        if send.disconnect == "mid-request":
            result.outcome = "disconnected"
        else:
            result.error = f"no answer within {timeout_s} s"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as error:
        result.error = f"{type(error).__name__}: {error}"[:500]
    if result.outcome == "completed":
        result.latency_s = time.perf_counter() - start
    return result


async def run_clients(
    url: str, sends: list[Send], clients: int, duration_s: float, request_timeout_s: float
) -> tuple[list[Result], float]:
    """`sends` by `clients` concurrent clients, none starting after `duration_s` seconds:
    (the results in send order, the wall time in seconds)."""
    queue: asyncio.Queue[Send] = asyncio.Queue()
    for send in sends:
        queue.put_nowait(send)
    results: list[Result] = []
    start = time.perf_counter()
    deadline = start + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client_loop(client: httpx.AsyncClient):
        while not queue.empty() and time.perf_counter() < deadline:
            results.append(await send_one(client, queue.get_nowait(), request_timeout_s))

    async with httpx.AsyncClient(base_url=url, timeout=request_timeout_s, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return sorted(results, key=lambda r: r.index), time.perf_counter() - start


async def send_alone(url: str, bodies: list[Body], timeout_s: float) -> dict[int, Result]:
    """Each checked body sent alone, one at a time, whole."""
    answers = {}
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        for body in bodies:
            if body.checked:
                send = Send(-1, body, False, None, 0.0)
                answers[body.key] = await send_one(client, send, timeout_s)
    return answers
