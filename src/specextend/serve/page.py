"""The page at `GET /`: a document, questions about it, answers streamed with their numbers
(static/: plain HTML, CSS and JavaScript, shipped in the package, nothing fetched from elsewhere),
and the two small routes it needs besides the OpenAI ones:

- `POST /v1/tokenize`: a chat or completions body (as `/v1/chat/completions` takes it) -> its
  prompt's token count, the context, and whether prompt + max_tokens fit (with the server's message
  when they do not), so the page can say so before anything is queued;
- `POST /v1/extract`: a PDF's bytes -> its text (pypdf), for documents the browser cannot read as text.

The page and its files need no key (so a user can type one in); the routes do, as every API route.
"""

from __future__ import annotations

import html
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from ..common.errors import PromptTooLong, UserError
from ..common.settings import METHODS
from . import protocol
from .protocol import APIError

if TYPE_CHECKING:
    from ..api import Prepared
    from ..common.settings import Settings


class Served(Protocol):
    """What the page reads of its server (app.Server): the model's name, the request defaults, the
    encoder (the context and its fit check), whether keys are asked, and a request's prompt tokens."""

    model_id: str
    defaults: Settings
    encoder: Prepared
    api_keys: tuple[str, ...]
    tool_call_recovery: bool

    def tokens(self, req: protocol.Request, whole: bool = False) -> list[int]: ...

STATIC = Path(__file__).parent / "static"
STATIC_PREFIX = "/static/"
MAX_TOKENIZE_BYTES = 4 << 20  # a body to count: several times the longest context's text
MAX_PDF_BYTES = 32 << 20
MAX_PDF_PAGES = 2000


def routes(server: Served) -> list[BaseRoute]:
    """The page, its files and its two routes, over `server` (its encoder and defaults)."""

    async def index(request: HTTPRequest) -> Response:
        return HTMLResponse(index_html(server), headers={"Cache-Control": "no-cache"})

    async def tokenize(request: HTTPRequest) -> Response:
        try:
            return JSONResponse(count(server, await _bounded_body(request, MAX_TOKENIZE_BYTES)))
        except APIError as e:
            return JSONResponse(e.body(), e.status, e.headers)

    async def extract(request: HTTPRequest) -> Response:
        try:
            data = await _bounded_body(request, MAX_PDF_BYTES)
            return JSONResponse(await run_in_threadpool(pdf_text, data))
        except APIError as e:
            return JSONResponse(e.body(), e.status, e.headers)

    return [Route("/", index, methods=["GET"]), Route("/v1/tokenize", tokenize, methods=["POST"]),
            Route("/v1/extract", extract, methods=["POST"]),
            Mount(STATIC_PREFIX.rstrip("/"), app=StaticFiles(directory=STATIC), name="static")]


def is_open(path: str) -> bool:
    """Whether a path is the page or one of its files, which need no API key (auth.py)."""
    return path == "/" or path.startswith(STATIC_PREFIX)


def index_html(server: Served) -> str:
    """index.html with the server's settings in it: the model, the methods, the defaults, whether a key is needed."""
    d = server.defaults
    config = {"model": server.model_id, "methods": list(METHODS), "method": d.method,
              "max_tokens": d.max_new_tokens, "temperature": d.temperature, "context": server.encoder.context,
              "needs_key": bool(server.api_keys)}
    # In a <script type="application/json">: '<' escaped so the text cannot close the element.
    blob = json.dumps(config).replace("<", "\\u003c")
    page = (STATIC / "index.html").read_text(encoding="utf-8")
    return page.replace("{{CONFIG}}", blob).replace("{{MODEL}}", html.escape(server.model_id))


def count(server: Served, raw: bytes) -> dict[str, Any]:
    """The token count of a chat body's messages (or a completions body's prompt) and whether it fits."""
    body = protocol.json_body(raw)
    kind = "completion" if isinstance(body, dict) and "prompt" in body else "chat"
    req = protocol.parse(kind, body, server.defaults, server.tool_call_recovery)
    message = None
    try:
        tokens = len(server.tokens(req, whole=True))  # its body is bounded here: count past the character bound
    except PromptTooLong as e:
        tokens, message = e.tokens, str(e)
    except UserError as e:
        raise APIError(400, str(e), param="messages" if kind == "chat" else "prompt") from None
    if message is None:
        try:
            server.encoder.check_fits(tokens, req.settings)
        except UserError as e:
            message = str(e)
    return {"object": "tokenize", "tokens": tokens, "context": server.encoder.context,
            "max_tokens": req.settings.max_new_tokens, "fits": message is None, "message": message}


def pdf_text(data: bytes) -> dict[str, Any]:
    """A PDF's text, page by page (pypdf); APIError(400) for what is not a readable PDF."""
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    if not data.startswith(b"%PDF"):
        raise APIError(400, "not a PDF (send a PDF's bytes; the page reads text files itself)", param="file")
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise APIError(400, "the PDF is encrypted", param="file")
        if len(reader.pages) > MAX_PDF_PAGES:
            raise APIError(413, f"the PDF has {len(reader.pages)} pages; at most {MAX_PDF_PAGES} are read",
                           param="file", code="too_large")
        pages = [(p.extract_text() or "").strip() for p in reader.pages]
    except APIError:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, OSError) as e:
        raise APIError(400, f"cannot read the PDF: {e}", param="file") from None
    return {"object": "extract", "text": "\n\n".join(p for p in pages if p), "pages": len(pages)}


async def _bounded_body(request: HTTPRequest, limit: int) -> bytes:
    """The request's body, refused with 413 as soon as it passes `limit` bytes."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise _too_large(limit)
    parts, total = [], 0
    async for part in request.stream():
        total += len(part)
        if total > limit:
            raise _too_large(limit)
        parts.append(part)
    return b"".join(parts)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit >> 20} MB", code="too_large")
