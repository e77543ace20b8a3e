"""Two pure ASGI middlewares that run before any routing: API-key check and body-size limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pagedkv.server.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, status: int, message: str, **kw: Any) -> None:
    body = json.dumps(error_body(status, message, **kw)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if status == 413:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class APIKeyMiddleware:
    """401 for the paths under `prefixes` (default: everything under ``/v1``) when the
    `Authorization: Bearer <key>` header is missing or wrong."""

    def __init__(
        self, app: ASGIApp, api_key: str, prefixes: tuple[str, ...] = ("/v1",)
    ) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.prefixes = prefixes

    def _guarded(self, path: str) -> bool:
        return any(path == p or path.startswith(p + "/") for p in self.prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization")
        if given is None:
            await send_error(
                send,
                401,
                "missing API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
            return
        if not secrets.compare_digest(given, self.expected):
            await send_error(send, 401, "incorrect API key provided", code="invalid_api_key")
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a request body over `max_bytes`, declared (Content-Length) or streamed (chunked).

    The body is read up front, at most `max_bytes` of it, and replayed to the app; after the
    body, `receive` is the server's own, so the app still sees the client's disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1 (got {max_bytes})")
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, send: Send) -> Awaitable[None]:
        return send_error(
            send,
            413,
            f"request body is larger than this server accepts ({self.max_bytes} bytes); "
            "send fewer or shorter prompts",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await send_error(send, 400, "Content-Length is not a number")
                return
            if size > self.max_bytes:
                await self._too_large(send)
                return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
