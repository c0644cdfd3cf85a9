"""``BodyLimit``: request bodies larger than ``ServeSettings.max_body_bytes`` are answered 413 before they are parsed.

A pure ASGI middleware (no ``BaseHTTPMiddleware``, which would buffer streams): a ``Content-Length`` over the limit
is refused before one byte of the body is read; a body without one (chunked) is read up to the limit and refused
as soon as it passes it. Either way the server never holds, parses or tokenises more than the limit of one body,
and the other clients' answers go on. A body within the limit is handed on as it arrived, and the connection's
later messages (the client's disconnect, which ends its answer) pass through unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import APIError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimit:
    """Refuse request bodies over ``limit()`` bytes with 413 and OpenAI's error body.

    Args:
        app: the ASGI app behind it.
        limit: the limit in bytes, read per request (a Ray replica's settings arrive after the app is built).
    """

    def __init__(self, app: Callable[..., Awaitable[None]], limit: Callable[[], int]) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _too_large(send, limit, int(length))
            return
        chunks, size = [], 0
        while True:  # read what the app would read anyway, stopping at the limit
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the body
                await self.app(scope, _replay([message], receive), send)
                return
            size += len(message.get("body", b""))
            if size > limit:
                await _too_large(send, limit, None)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that gives ``messages`` first, then the connection's own."""

    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed


async def _too_large(send: Send, limit: int, length: int | None) -> None:
    size = f"has {length} bytes, more than" if length is not None else "is longer than"
    error = APIError(413, f"The request body {size} this server's limit of {limit} bytes (--max-body-bytes); send a "
                          "shorter prompt or fewer prompts per request.")
    body = json.dumps(error.body()).encode()
    # The body left unread: the connection closes after this answer (uvicorn would otherwise wait for it).
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
