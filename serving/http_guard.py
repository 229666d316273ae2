"""The layer every HTTP request passes first (pure ASGI, outside FastAPI's routing).

In order: the API key (``--api-key``: ``Authorization: Bearer KEY`` on ``/v1/*``; a
missing or wrong key is answered 401 before any of the body is read; ``/health`` and
``/metrics`` stay open so probes and scrapers need no secret), the body size limit
(``--max-body-bytes``: a ``Content-Length`` over it is answered 413 at once, and the bytes
of a body without one, chunked, are counted while they are read, so an oversized body is
never held whole; a body still arriving after ``--request-timeout`` is answered 408), and a
last resort for exceptions nothing else handled: a 500 whose
message is generic and names a request id, the traceback going to the server log under
that id. Answering here rather than letting the exception reach the server keeps a
keep-alive connection open.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import uuid

from serving.api import APIError

logger = logging.getLogger("serving.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class HTTPOptions:
    """What the HTTP layer enforces.

    Attributes:
      api_key: required as ``Authorization: Bearer <key>`` on ``/v1/*`` (None: open).
      max_body_bytes: largest request body read; larger is answered 413.
      request_timeout_s: a request still unanswered this long after it arrived is aborted
        and answered 504 (a stream ends with an error event); a body still arriving then
        is answered 408.
    """

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S

    def __post_init__(self):
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not 0 < self.request_timeout_s < float("inf"):
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")


class _BodyTooLarge(Exception):
    pass


class _BodyTooSlow(Exception):
    pass


class HTTPGuard:
    """ASGI middleware enforcing ``HTTPOptions`` (see the module docstring)."""

    def __init__(self, app, options: HTTPOptions):
        self.app = app
        self.options = options

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        started = False

        async def send_tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        received, body_done = 0, False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.request_timeout_s

        async def receive_counted():
            nonlocal received, body_done
            if body_done:  # only a disconnect is left to receive: no deadline on that
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except TimeoutError:
                raise _BodyTooSlow from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.options.max_body_bytes:
                    raise _BodyTooLarge
                body_done = not message.get("more_body", False)
            return message

        try:
            await self.app(scope, receive_counted, send_tracked)
        except _BodyTooLarge:
            if not started:
                await self._too_large().response()(scope, receive, send)
        except _BodyTooSlow:
            if not started:
                error = APIError(
                    408,
                    f"the request body did not arrive within {self.options.request_timeout_s:g} s",
                    code="request_timeout",
                    headers={"connection": "close"},
                )
                await error.response()(scope, receive, send)
        except Exception:
            request_id = "req-" + uuid.uuid4().hex
            logger.exception("request %s: unexpected error on %s", request_id, scope["path"])
            if not started:
                error = APIError(
                    500,
                    f"internal server error (request id {request_id}; the server log has "
                    "the details)",
                    code="internal_error",
                )
                await error.response()(scope, receive, send)

    def _refusal(self, scope) -> APIError | None:
        """A 401 or 413 decided from the headers alone, or None."""
        headers = dict(scope["headers"])
        key = self.options.api_key
        if key is not None and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + key.encode()):
                return APIError(
                    401,
                    "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.options.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> APIError:
        # The unread rest of the body makes the connection unusable: close it.
        return APIError(
            413,
            f"the request body exceeds the server's limit of {self.options.max_body_bytes} bytes",
            code="request_too_large",
            headers={"connection": "close"},
        )
