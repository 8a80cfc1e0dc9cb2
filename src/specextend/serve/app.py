"""The HTTP side: OpenAI-compatible routes on Starlette.

`POST /v1/chat/completions`, `POST /v1/completions` (JSON, or server-sent events with
`stream: true`), `GET /v1/models`, `GET /health`. A request is checked and tokenized here,
on the event loop, before it is queued, so a bad request is refused at once whatever is running;
the generations run together on the scheduler's thread (continuous batching, scheduler.py).
Every failure is an OpenAI-shaped JSON error; an unexpected one is logged with its traceback on
the server and answered 500 without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..api import Pair, Prepared
from ..batch import Batch
from ..errors import UserError
from ..grammar import Grammar
from ..jsonl import finite_json
from ..scheduler import Limits, QueueFull, Scheduler, TooLarge, default_limits
from ..settings import Settings
from . import protocol
from .jobs import Job, Outcome, run_job
from .protocol import APIError

log = logging.getLogger("specextend.serve")

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streaming request checks that its client is still there


class Server:
    """The loaded pair, the tokenizer the HTTP side encodes with, the defaults and the scheduler.
    `limits` bound the batch (None: `scheduler.default_limits(**batching)`, from this machine's memory
    and the target's measured step costs)."""

    def __init__(self, pair: Pair, encoder: Prepared, defaults: Settings, max_queue: int, model_id: str,
                 limits: Limits | None = None, batching: dict[str, Any] | None = None) -> None:
        # `encoder` holds its own tokenizer: the event loop encodes prompts while the worker
        # thread decodes with the pair's, and a tokenizer is not safe to share across threads.
        self.pair, self.encoder, self.defaults, self.model_id = pair, encoder, defaults, model_id
        encoder.warm_grammars()  # before serving: compiling a request's grammar then takes milliseconds
        self.max_queue = max_queue
        self.limits = limits
        self.batching = batching or {}  # default_limits' arguments when `limits` is None
        self.scheduler: Scheduler | None = None  # made on the event loop, at startup
        self.started = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        return Starlette(routes=routes, lifespan=self._lifespan,
                         exception_handlers={HTTPException: _http_error, Exception: _internal_error})

    def _lifespan(self, app: Starlette) -> Any:
        server = self

        class _Life:
            async def __aenter__(self) -> None:
                server.scheduler = server.start()

            async def __aexit__(self, *exc: object) -> None:
                if server.scheduler is not None:
                    server.scheduler.shutdown()

        return _Life()

    def start(self) -> Scheduler:
        """The batch over the pair's models and the scheduler that runs it."""
        pair = self.pair
        batch = Batch(pair.target, pair.draft)
        engine = batch.engine(pair.eos_ids, pair.step_costs())  # measures the step costs once per machine (cached)
        if self.limits is None:
            self.limits = default_limits(pair, self.max_queue, **self.batching)
        return Scheduler(batch, lambda job: run_job(pair, engine, job),
                         lambda job: pair.kv_bytes(len(job.ids), job.settings), self.limits)

    # ----------------------------------------------------------------- routes

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, "completion")

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.started, "owned_by": "specextend"}]})

    async def health(self, request: HTTPRequest) -> Response:
        return JSONResponse(finite_json(self.health_body()))

    def health_body(self) -> dict[str, Any]:
        sched = self.scheduler
        cache = self.pair.prefix_cache
        return {
            "status": "ok",
            "model": self.model_id,
            "busy": bool(sched and sched.running),
            "running": sched.running if sched else 0,
            "waiting": sched.waiting if sched else 0,
            "max_queue": self.max_queue,
            "completed": sched.completed if sched else 0,
            "batch": sched.stats() if sched else None,
            "prefix_cache": cache.stats() if cache is not None else None,
        }

    # ----------------------------------------------------------------- generation

    async def _generate(self, request: HTTPRequest, kind: str) -> Response:
        try:
            req = protocol.parse(kind, await _json_body(request), self.defaults)  # type: ignore[arg-type]
            ids = self._encode(req)
            job = self.job(req, ids)
            self.submit(job)
        except APIError as e:
            return _error(e)
        rid, created = protocol.new_id(kind), protocol.now()
        if req.stream:
            try:
                headers = await self._started(job, request)
            except APIError as e:
                return _error(e)
            return StreamingResponse(self._events(job, kind, rid, created, req.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        try:
            outcome = await self._wait(job, request)
        except APIError as e:
            return _error(e)
        if outcome is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        use = protocol.usage(outcome.result, outcome.queue_s, outcome.replica)
        return _json(protocol.response(kind, rid, created, self.model_id, outcome.text, outcome.finish_reason, use,
                                       outcome.result.logprobs), headers=protocol.replica_header(outcome.replica))

    def submit(self, job: Job) -> None:
        """Queue a job (on the event loop); APIError when it cannot be taken: 429 with Retry-After
        while the queue is full, 400 for caches larger than the KV budget."""
        assert self.scheduler is not None
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(429, f"the server is busy ({self.max_queue} requests already waiting); retry in "
                                f"{e.retry_after} s", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except TooLarge as e:
            raise APIError(400, str(e), param="max_tokens", code="kv_budget_exceeded") from None

    def job(self, req: protocol.Request, ids: list[int]) -> Job:
        """The generation a checked, tokenized request asks for (on the running event loop)."""
        return Job(ids, req.settings, req.stops, asyncio.get_running_loop(), self._grammar(req), req.logprobs)

    async def _started(self, job: Job, request: HTTPRequest) -> dict[str, str]:
        """Headers of a streamed response, sent before its first chunk: none here (a front end over
        replicas waits for the replica's first event and names it, or raises the APIError that
        ended the request before it started)."""
        return {}

    def _grammar(self, req: protocol.Request) -> Grammar | None:
        """The request's response_format compiled (cached per grammar); APIError(400) otherwise."""
        try:
            return self.encoder.grammar(req.response_format)
        except UserError as e:
            raise APIError(400, str(e), param="response_format", code="invalid_response_format") from None

    def _encode(self, req: protocol.Request) -> list[int]:
        """Prompt token ids, checked against the context; APIError(400) otherwise."""
        param = "messages" if req.kind == "chat" else "prompt"
        try:
            if req.messages is not None:
                ids = self.encoder.encode_chat(req.messages)
            else:
                assert req.prompt is not None
                ids = self.encoder.prompt_ids(req.prompt, chat=False)
        except UserError as e:
            raise APIError(400, str(e), param=param) from None
        try:
            self.encoder.check_fits(len(ids), req.settings)
        except UserError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        if req.settings.uses_draft and self.encoder.draft_path is None:
            raise APIError(400, f"method {req.settings.method!r} needs a draft model; this server has none",
                           param="method")
        return ids

    async def _wait(self, job: Job, request: HTTPRequest) -> Outcome | None:
        """The job's outcome for a non-streaming request; None if its client disconnected."""
        text_parts: list[str] = []
        getter: asyncio.Task[tuple[str, Any]] | None = None
        try:
            while True:
                getter = getter or asyncio.ensure_future(job.events.get())
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if not done:
                    if await request.is_disconnected():
                        job.cancel.set()
                        return None
                    continue
                kind, value = getter.result()
                getter = None
                if kind == "text":
                    text_parts.append(value[0])
                elif kind == "done":
                    return value
                elif kind == "cancelled":
                    return None
                else:
                    raise generation_error(value)
        finally:
            if getter is not None:
                getter.cancel()

    async def _events(self, job: Job, kind: str, rid: str, created: int, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per accepted batch of tokens, the closing chunk, [DONE].
        If the client goes away this generator is closed, and the generation stops at its next step."""
        model = self.model_id
        try:
            if kind == "chat":
                yield _sse(protocol.chunk(kind, rid, created, model, None, role=True))
            offset = 0  # text sent so far (completions' logprobs count offsets in it)
            while True:
                event, value = await job.events.get()
                if event == "text":
                    text, entries = value
                    yield _sse(protocol.chunk(kind, rid, created, model, text,
                                              logprobs=protocol.logprobs_object(kind, entries, offset)))
                    offset += len(text)
                elif event == "done":
                    yield _sse(protocol.chunk(kind, rid, created, model, None, finish=value.finish_reason))
                    if include_usage:
                        use = protocol.usage(value.result, value.queue_s, value.replica)
                        yield _sse(protocol.usage_chunk(kind, rid, created, model, use))
                    yield "data: [DONE]\n\n"
                    return
                elif event == "cancelled":
                    return
                else:
                    yield _sse(generation_error(value).body())
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancel.set()  # a no-op once the job has finished


# --------------------------------------------------------------------------- helpers


async def _json_body(request: HTTPRequest) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


def generation_error(e: BaseException) -> APIError:
    """The OpenAI-shaped error a failed generation is answered with (an unexpected one is logged)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, UserError):
        return APIError(400, str(e))
    log.error("generation failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def run_http(server: Server, sock: socket.socket, quiet: bool) -> None:
    """Announce the address and serve `server`'s routes on `sock` until Ctrl-C."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"specextend: serving {server.model_id} ({server.defaults.method}) on http://{shown}:{port}/v1",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(server.app(), log_level="warning" if quiet else "info", access_log=not quiet,
                            timeout_graceful_shutdown=5)
    # uvicorn shuts down gracefully on Ctrl-C, then re-raises it: a normal stop for a server.
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run(sockets=[sock])
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
