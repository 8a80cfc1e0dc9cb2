"""API keys: with `--api-key` (or SPECEXTEND_API_KEY, or `--api-key-file`), every route but `/health`
and the page (`/` and its files, where the user types the key in) needs `Authorization: Bearer KEY`.

The check is an ASGI middleware in front of the routes, so a request without a valid key is
answered 401 before its body is read: it costs no tokenizing, no queue slot and no model time.
Keys are compared in constant time (each against every key, `hmac.compare_digest`), and never
logged or echoed: the 401 names neither the key sent nor the ones expected. With replicas the
front end checks (the replicas take no HTTP traffic).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..common.errors import UserError
from .page import is_open

ENV = "SPECEXTEND_API_KEY"  # one key, or several separated by commas
OPEN_PATHS = frozenset({"/health"})  # a load balancer's health check carries no key (and the page: page.is_open)


def load_keys(flags: Sequence[str] | None, file: str | None, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The keys from `--api-key` (repeatable), `--api-key-file` (one key a line; blank lines and
    lines starting with # skipped) and the environment variable, in that order, without duplicates;
    () when none is set (the server is open). UserError (one line, no key in it) for a bad one."""
    env = os.environ if environ is None else environ
    keys: list[str] = list(flags or [])
    if file is not None:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--api-key-file: cannot read {file}: {getattr(e, 'strerror', None) or e}") from None
        found = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        if not found:
            raise UserError(f"--api-key-file: {file} holds no key (one a line)")
        keys += found
    if env.get(ENV, "").strip():
        keys += [k.strip() for k in env[ENV].split(",") if k.strip()]
    for i, key in enumerate(keys):
        if not key or any(c.isspace() for c in key) or not key.isprintable():
            raise UserError(f"API key #{i + 1} is empty or holds whitespace or control characters")
    return tuple(dict.fromkeys(keys))


def middleware(keys: Iterable[str]) -> list[Middleware]:
    """The Starlette middleware that checks the keys; none without keys."""
    keys = tuple(keys)
    return [Middleware(RequireKey, keys=keys)] if keys else []


class RequireKey:
    """ASGI middleware: an HTTP request to any path but OPEN_PATHS needs a bearer token equal to
    one of `keys`; otherwise an OpenAI-shaped 401 and the app is never called."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("RequireKey needs at least one key")
        self.app = app
        self._keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        token = bearer(scope)
        if token is not None and self.valid(token):
            await self.app(scope, receive, send)
            return
        await unauthorized(token is None)(scope, receive, send)

    def valid(self, token: bytes) -> bool:
        # Every key is compared (no early exit), each in constant time: the answer's timing says
        # nothing about which key, or how much of one, matched.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(token, key)
        return ok


def bearer(scope: Scope) -> bytes | None:
    """The token of the request's `Authorization: Bearer TOKEN` header; None without one."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


def unauthorized(missing: bool) -> JSONResponse:
    """OpenAI's 401: no key named, none echoed."""
    message = ("You didn't provide an API key. Send it as `Authorization: Bearer KEY`." if missing else
               "Incorrect API key provided.")
    body: dict[str, Any] = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                      "code": None if missing else "invalid_api_key"}}
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
