"""The HTTP side: OpenAI-compatible routes on Starlette, over a backend.

`POST /v1/chat/completions`, `POST /v1/completions` (JSON, or server-sent events with
`stream: true`), `GET /v1/models`, `GET /health`, `GET /metrics` (metrics.py; API keys: auth.py).
A request is checked and tokenized here, on the event loop, before it is queued, so a bad
request is refused at once whatever is running; the `Backend` runs the generations: in this
process together on the scheduler's thread (continuous batching, local.py), or on Ray Serve
replicas (ray_serve.py). Every failure is an OpenAI-shaped JSON error; an unexpected one is
logged with its traceback on the server and answered 500 without it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..api import Prepared
from ..common.errors import ContextLengthExceeded, UserError
from ..common.jsonl import finite_json
from ..common.settings import Settings
from ..requests.harmony import HarmonyParser
from ..requests.reasoning import AnswerParser, ThinkParser
from ..requests.toolcalls import answer_parser, template_messages
from ..sampling.grammar import Grammar
from . import auth, limits, page, protocol
from .drain import Drain, DrainingServer, Gate
from .jobs import Job, Outcome
from .metrics import ServerMetrics
from .protocol import APIError

log = logging.getLogger("specextend.serve")

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streaming request checks that its client is still there


class Backend(Protocol):
    """Where a server's requests run: in this process (`local.LocalBackend`: the scheduler over
    a batch of the pair's models) or on replicas (`ray_serve.RayBackend`)."""

    def start(self) -> None:
        """On the event loop, before the first request."""

    def submit(self, job: Job) -> None:
        """Queue a job (on the event loop); APIError when it cannot be taken."""

    async def started(self, job: Job, request: HTTPRequest) -> dict[str, str]:
        """Headers of a streamed response, once it may start (or the APIError that ended it)."""

    def health(self) -> dict[str, Any]:
        """The backend's part of /health."""

    def shutdown(self) -> None:
        """Stop; running and waiting requests end as cancelled."""


class Server:
    """The HTTP side over a backend: the tokenizer the event loop encodes and checks requests
    with (`encoder`, its own: the backend decodes on other threads), the defaults, the routes."""

    api_keys: tuple[str, ...] = ()  # with keys, every route but /health needs one (auth.py)
    tool_call_recovery = True  # a request's default for its tool_call_recovery field (requests/toolcalls.py)
    max_body_bytes: int | None = None  # None: limits.default_max_body_bytes of the context

    def __init__(self, backend: Backend, encoder: Prepared, defaults: Settings, model_id: str) -> None:
        self.backend, self.encoder, self.defaults, self.model_id = backend, encoder, defaults, model_id
        encoder.warm_grammars()  # before serving: compiling a request's grammar then takes milliseconds
        encoder.max_prompt_chars()  # read once, before the first request
        self.drain = Drain()  # its `seconds`: --drain-s
        self.started = int(time.time())
        self.metrics = ServerMetrics(self.health_body)

    def configure(self, api_keys: tuple[str, ...], max_body_mb: float | None, drain_s: float,
                  tool_call_recovery: bool = True) -> None:
        """The HTTP side's flags (`serve`'s; the one-process server's or the replicas' front end's)."""
        self.api_keys = api_keys
        self.tool_call_recovery = tool_call_recovery
        if max_body_mb is not None:
            self.max_body_bytes = max(1, int(max_body_mb * 2**20))
        self.drain.seconds = drain_s

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics.endpoint, methods=["GET"]),
            *page.routes(self),  # the page at / and the routes it uses (page.py)
        ]
        max_body = self.max_body_bytes or limits.default_max_body_bytes(self.encoder.context)
        # Outermost first: every answer is counted (401, 413 and 503 too); a draining server refuses
        # before the key is checked; a body is bounded only once its key is good.
        middleware = [*self.metrics.middleware(), Middleware(Gate, drain=self.drain), *auth.middleware(self.api_keys),
                      *limits.middleware(max_body)]
        return Starlette(routes=routes, middleware=middleware, lifespan=self._lifespan,
                         exception_handlers={HTTPException: _http_error, Exception: _internal_error})

    def _lifespan(self, app: Starlette) -> Any:
        backend = self.backend

        class _Life:
            async def __aenter__(self) -> None:
                backend.start()

            async def __aexit__(self, *exc: object) -> None:
                backend.shutdown()

        return _Life()

    # ----------------------------------------------------------------- routes

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, "completion")

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.started, "owned_by": "specextend"}]})

    async def health(self, request: HTTPRequest) -> Response:
        body = self.health_body()
        # 503 while draining: a load balancer that reads only the status takes the server out too.
        return JSONResponse(finite_json(body), status_code=503 if self.drain.draining else 200)

    def health_body(self) -> dict[str, Any]:
        body = {"status": "ok", "model": self.model_id, "context": self.encoder.context, **self.backend.health()}
        if self.drain.draining:
            body["status"] = "draining"
        return body

    # ----------------------------------------------------------------- generation

    async def _generate(self, request: HTTPRequest, kind: Literal["chat", "completion"]) -> Response:
        try:
            req = protocol.parse(kind, await _json_body(request), self.defaults, self.tool_call_recovery)
            ids = self._encode(req)
            job = self.job(req, ids)
            self.backend.submit(job)
        except APIError as e:
            return _error(e)
        rid, created = protocol.new_id(kind), protocol.now()
        # A chat answer parsed into tool calls, and (harmony, a thinking model's) its reasoning apart.
        calls = answer_parser(self.encoder.tokenizer, req.tools) if kind == "chat" else None
        if req.stream:
            try:
                headers = await self.backend.started(job, request)
            except APIError as e:
                return _error(e)
            return StreamingResponse(self._events(job, kind, rid, created, req.include_usage, calls),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        try:
            outcome = await self._wait(job, request)
        except APIError as e:
            return _error(e)
        if outcome is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        use = protocol.usage(outcome.result, outcome.queue_s, outcome.replica)
        text, tool_calls = calls.answer(outcome.text) if calls is not None else (outcome.text, None)
        finish = calls.finish_reason(outcome.finish_reason) if calls is not None else outcome.finish_reason
        reasoning = calls.reasoning if isinstance(calls, HarmonyParser | ThinkParser) else None
        return _json(protocol.response(kind, rid, created, self.model_id, text, finish, use, outcome.result.logprobs,
                                       tool_calls, reasoning), headers=protocol.replica_header(outcome.replica))

    def job(self, req: protocol.Request, ids: list[int]) -> Job:
        """The generation a checked, tokenized request asks for (on the running event loop)."""
        return Job(ids, req.settings, req.stops, asyncio.get_running_loop(), self._grammar(req), req.logprobs,
                   request=req)

    def _grammar(self, req: protocol.Request) -> Grammar | None:
        """The request's response_format, or its tools' calls, compiled (cached per grammar);
        APIError(400) otherwise."""
        if req.tools is not None:
            try:
                return self.encoder.grammar(req.tools.grammar(self.encoder.tokenizer))
            except UserError as e:
                raise APIError(400, str(e), param="tools", code="invalid_tools") from None
        try:
            return self.encoder.grammar(req.response_format)
        except UserError as e:
            raise APIError(400, str(e), param="response_format", code="invalid_response_format") from None

    def _encode(self, req: protocol.Request) -> list[int]:
        """Prompt token ids, checked against the context; APIError(400) otherwise."""
        param = "messages" if req.kind == "chat" else "prompt"
        try:
            ids = self.tokens(req)
            self.encoder.check_fits(len(ids), req.settings)
        except ContextLengthExceeded as e:  # the prompt alone, or with max_tokens: one code for both
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except UserError as e:  # a ToolError names its own field (tools a template cannot describe)
            raise APIError(400, str(e), param=getattr(e, "param", param)) from None
        if req.settings.uses_draft and self.encoder.draft_path is None:
            raise APIError(400, f"method {req.settings.method!r} needs a draft model; this server has none",
                           param="method")
        return ids

    def tokens(self, req: protocol.Request, whole: bool = False) -> list[int]:
        """A request's prompt token ids (UserError for a prompt that cannot be encoded, a
        ContextLengthExceeded past the context), not yet checked against prompt + max_tokens.
        `whole`: count a text past the character bound too (Prompts.encode), for a caller that
        bounds the body itself."""
        if req.messages is not None:
            tools = req.tools.template_tools() if req.tools is not None else None
            return self.encoder.encode_chat(template_messages(req.messages), tools, whole=whole,
                                            template_kwargs=req.template_kwargs)
        assert req.prompt is not None
        if isinstance(req.prompt, str):
            return self.encoder.encode(req.prompt, whole=whole)
        return self.encoder.prompt_ids(req.prompt, chat=False)

    async def _wait(self, job: Job, request: HTTPRequest) -> Outcome | None:
        """The job's outcome for a non-streaming request; None if its client disconnected."""
        text_parts: list[str] = []
        getter: asyncio.Task[tuple[str, Any]] | None = None
        self.drain.track(job)  # a drain past its time cancels it
        try:
            while True:
                getter = getter or asyncio.ensure_future(job.events.get())
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if not done:
                    if await request.is_disconnected():
                        job.cancel.set()
                        self.metrics.observe(job, "cancelled", None)  # its own event is never read
                        return None
                    continue
                kind, value = getter.result()
                getter = None
                if kind == "progress":  # a streamed answer's; nobody sees it here
                    continue
                self.metrics.observe(job, kind, value)
                if kind == "text":
                    text_parts.append(value[0])
                elif kind == "done":
                    return value
                elif kind == "cancelled":
                    if self.drain.cut:
                        raise APIError(503, **_fields(self.drain.shutdown_error()))
                    return None
                else:
                    raise generation_error(value)
        finally:
            self.drain.untrack(job)
            if getter is not None:
                getter.cancel()

    async def _events(self, job: Job, kind: str, rid: str, created: int, include_usage: bool,
                      calls: AnswerParser | None = None) -> AsyncIterator[str]:
        """Server-sent events: `: prefill DONE/TOTAL` comment lines while the prompt prefills (its
        tokens in the cache after each chunk), a chunk per accepted batch of tokens, the closing chunk, [DONE].
        With `calls`, the text goes out as content or tool-call deltas (requests/toolcalls.py).
        If the client goes away this generator is closed, and the generation stops at its next step."""
        model = self.model_id
        ended = False  # an event that ends the job was read (else the client hung up first)
        self.drain.track(job)  # a drain past its time cancels it
        try:
            # The role goes first. With tools it rides on the first delta, as OpenAI's does: on a
            # call's, with `content` null (the message has no text), on text's, as its own chunk.
            role_due = kind == "chat"
            if role_due and calls is None:
                yield _sse(protocol.chunk(kind, rid, created, model, None, role=True))
                role_due = False
            offset = 0  # text sent so far (completions' logprobs count offsets in it)
            while True:
                event, value = await job.events.get()
                if event == "progress":  # a comment line, which OpenAI's clients skip; the page draws a bar
                    yield f": prefill {value[0]}/{value[1]}\n\n"
                    continue
                self.metrics.observe(job, event, value)
                ended = event != "text"
                if event == "text":
                    text, entries = value
                    lp = protocol.logprobs_object(kind, entries, offset)
                    if calls is not None:
                        for delta in calls.push(text) or ([{}] if lp else []):
                            if role_due:
                                delta, role_due = _with_role(delta), False
                            yield _sse(protocol.chunk(kind, rid, created, model, None, logprobs=lp, delta=delta))
                            lp = None
                    else:
                        yield _sse(protocol.chunk(kind, rid, created, model, text, logprobs=lp))
                    offset += len(text)
                elif event == "done":
                    for line in _closing(kind, rid, created, model, value, calls, role_due, include_usage):
                        yield line
                    return
                elif event == "cancelled":
                    if self.drain.cut:  # cancelled by a drain past its time: say so, and end the stream
                        yield _sse(self.drain.shutdown_error())
                        yield "data: [DONE]\n\n"
                    return
                else:
                    yield _sse(generation_error(value).body())
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancel.set()  # a no-op once the job has finished
            self.drain.untrack(job)
            if not ended:  # the client hung up: its job's own "cancelled" event is never read
                self.metrics.observe(job, "cancelled", None)


# --------------------------------------------------------------------------- helpers


async def _json_body(request: HTTPRequest) -> Any:
    return protocol.json_body(await request.body())


def _closing(kind: str, rid: str, created: int, model: str, done: Any, calls: AnswerParser | None,
             role_due: bool, include_usage: bool) -> list[str]:
    """A stream's last events: the deltas the call parser held back, the role if nothing has
    carried it yet (an answer with no text and no call still says whose it is), the finish
    reason, the usage when asked for, [DONE]."""
    out, finish = [], done.finish_reason
    if calls is not None:
        for delta in calls.finish():
            if role_due:
                delta, role_due = _with_role(delta), False
            out.append(_sse(protocol.chunk(kind, rid, created, model, None, delta=delta)))
        finish = calls.finish_reason(finish)
    if role_due:
        out.append(_sse(protocol.chunk(kind, rid, created, model, None, role=True)))
    out.append(_sse(protocol.chunk(kind, rid, created, model, None, finish=finish)))
    if include_usage:
        use = protocol.usage(done.result, done.queue_s, done.replica)
        out.append(_sse(protocol.usage_chunk(kind, rid, created, model, use)))
    out.append("data: [DONE]\n\n")
    return out


def _with_role(delta: dict[str, Any]) -> dict[str, Any]:
    """A chat stream's first delta with the role: a call's with `content` null, as OpenAI's."""
    if "tool_calls" in delta:
        return {"role": "assistant", "content": None, **delta}
    return {"role": "assistant", **({"content": ""} | delta)}


def _fields(body: dict[str, Any]) -> dict[str, Any]:
    """An APIError's keyword arguments from an error body (OpenAI's shape)."""
    err = body["error"]
    return {"message": err["message"], "type": err["type"], "param": err["param"], "code": err["code"]}


def generation_error(e: BaseException) -> APIError:
    """The OpenAI-shaped error a failed generation is answered with (an unexpected one is logged)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, UserError):
        return APIError(400, str(e))
    log.error("generation failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def run_http(server: Server, sock: socket.socket, quiet: bool) -> None:
    """Announce the address and serve `server`'s routes on `sock` until SIGTERM or Ctrl-C, which
    drain it first (drain.py)."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"specextend: serving {server.model_id} ({server.defaults.method}) on http://{shown}:{port}/v1 "
          f"(a page for questions about documents: http://{shown}:{port}/)", file=sys.stderr, flush=True)
    config = uvicorn.Config(server.app(), log_level="warning" if quiet else "info", access_log=not quiet,
                            timeout_graceful_shutdown=5)
    DrainingServer(config, server.drain).run(sockets=[sock])
    print("specextend: server stopped", file=sys.stderr, flush=True)


def _json(obj: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(finite_json(obj), status_code=status, headers=headers)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(finite_json(obj), ensure_ascii=False)}\n\n"


def _error(e: APIError) -> JSONResponse:
    return _json(e.body(), e.status, e.headers)


async def _http_error(request: HTTPRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind))


async def _internal_error(request: HTTPRequest, exc: Exception) -> Response:
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))
