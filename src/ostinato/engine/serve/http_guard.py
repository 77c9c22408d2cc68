"""What every request passes before a route sees it: a bounded body and, when the server
has one, its API key. A plain ASGI middleware, so a body over the bound is refused as
its bytes arrive, before anything parses it, and a refused request costs the event loop
no more than reading the bytes it was sent.

Guarantees: a body over ``max_body_bytes`` (by its ``Content-Length``, or counted as it
streams) is answered 413; with ``api_key`` set, every route but ``/health`` needs
``Authorization: Bearer <key>`` (compared in constant time) and is answered 401
otherwise; both in OpenAI's error shape. Every HTTP request's arrival, before its body
is read, is ``request.state.arrived`` (``time.perf_counter``): the start of its time to
first token.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

DEFAULT_MAX_BODY_BYTES = 2 << 20  # 2 MiB: far above any prompt that fits a context
OPEN_PATHS = ("/health",)  # a load balancer's probe carries no key

Scope = dict[str, Any]
Receive = Any
Send = Any


class HttpGuard:
    """The middleware over ``app`` (see the module docstring)."""

    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: at least 1, got {max_body_bytes}")
        self.app, self.max_body_bytes = app, max_body_bytes
        self._key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrived"] = time.perf_counter()
        headers = dict(scope.get("headers", ()))
        if self._key is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._key):
                return await _refuse(send, 401, "invalid_api_key", "Incorrect API key provided.")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _refuse(send, 413, "body_too_large", self._too_large())
        body = await self._read(receive)
        if body is None:  # over the bound as it streamed
            return await _refuse(send, 413, "body_too_large", self._too_large())
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> str:
        return f"the request body is over {self.max_body_bytes} bytes (--max-body-bytes)"

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it is over the bound (a body without a
        length is counted as it streams; the bound makes holding it cheap)."""
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return b""
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` whole first, then what the client sends next
    (its disconnect, which the routes watch for)."""
    given = False

    async def replay() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send: Send, status: int, code: str, message: str) -> None:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
