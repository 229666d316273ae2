"""Watching the client while a request waits on the engine.

A request is cancelled the moment its client disconnects or its time runs out, at any
stage: waiting for admission (``AsyncEngine.add_request`` aborts what it had added when
cancelled), in prefill or decode (the owner's ``finally`` aborts it), or while streaming.
Disconnects are seen through the ASGI ``receive`` channel, which yields
``http.disconnect`` once the body has been read and the client has gone; the server
reports it to every caller (uvicorn's is sticky), so a watcher here and Starlette's own
stream listener do not steal it from each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi.responses import StreamingResponse


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def until_disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client has disconnected. Call only after the body was read."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_watched(awaitable: Awaitable, receive, timeout_s: float | None):
    """``awaitable``'s result, unless the client disconnects first (``ClientGone``) or
    ``timeout_s`` passes (``TimeoutError``); in both cases it is cancelled and its
    cleanup has run when this returns."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(until_disconnected(receive))
    try:
        done, _ = await asyncio.wait(
            {task, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task in done:
        return task.result()
    if watcher in done:
        raise ClientGone
    raise TimeoutError


class WatchedStream(StreamingResponse):
    """A streamed response that calls ``on_close`` however it ends: finished, the client
    gone (even before the first chunk), or the server shutting down."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await run_watched(super().__call__(scope, receive, send), receive, None)
        except ClientGone:
            pass
        finally:
            self._on_close()
