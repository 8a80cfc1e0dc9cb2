"""The request body's size limit (`--max-body-mb`): an ASGI middleware that refuses a larger body
with 413 before reading it past the limit, so one huge request costs the server neither memory
nor tokenizing time, and every other client goes on being served.

A body that declares its length (`Content-Length`) is refused from the header, before a byte
of it is read; a chunked upload (no length) is counted as it arrives and refused at the first
chunk past the limit. The server's reads are bounded too: the HTTP layer stops reading the
socket while a request's unread body is buffered, so what a client sends past the limit is never
taken in. The 413 closes the connection (the rest of the body is not read).

The default limit is the model's context times BODY_BYTES_PER_TOKEN (at least MIN_BODY_BYTES):
every prompt that fits the context fits it, JSON escapes, a conversation's roles and tools
included, while a body many times what any prompt could be is never read.
"""

from __future__ import annotations

import json

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A token spells a few characters of text on average and a long one up to ~16 bytes of UTF-8;
# JSON may escape each byte as six (\u00XX). 64 bytes a token leaves room for that and the rest.
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 1 << 20
MB = 1 << 20


def default_max_body_bytes(context_tokens: int) -> int:
    """The default body limit for a model of `context_tokens`."""
    return max(MIN_BODY_BYTES, context_tokens * BODY_BYTES_PER_TOKEN)


class _TooLarge(Exception):
    """Raised into the app from `receive` once a chunked body passes the limit."""


def middleware(max_bytes: int) -> list[Middleware]:
    return [Middleware(BodyLimit, max_bytes=max_bytes)]


class BodyLimit:
    """ASGI middleware: HTTP request bodies of at most `max_bytes`; larger ones get OpenAI's
    error shape with 413 and `Connection: close`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, f"declares {declared} bytes")
            return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _TooLarge:
            if not started:  # else the app answered already and has now stopped reading
                await self._refuse(send, f"is more than {self.max_bytes} bytes so far")

    async def _refuse(self, send: Send, what: str) -> None:
        limit_mb = self.max_bytes / MB
        body = {"error": {"message": f"the request body {what}: this server takes at most {self.max_bytes} bytes "
                                     f"({limit_mb:g} MB, --max-body-mb)", "type": "invalid_request_error",
                          "param": None, "code": "request_too_large"}}
        raw = json.dumps(body).encode()
        headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(raw)).encode()), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": raw})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP layer refuses a malformed length itself
    return None

