"""Draining: how a server stops without cutting off what it accepted.

On SIGTERM or SIGINT the server does not close its port at once. It drains:
- `/health` answers 503 with `"status": "draining"`, so a load balancer takes it out of rotation;
- every other new request is answered 503 with `Retry-After` (`Gate`, an ASGI middleware that
  also counts the requests in flight);
- the requests already taken (running or waiting in the queue) go on until they finish;
- after `--drain-s` seconds (or at a second signal) those still running are cancelled: their
  generations stop at the next step and their clients get an OpenAI-shaped 503 error (in the
  stream, for a stream);
- once nothing is in flight, the server closes and the process exits with status 0.

`DrainingServer` is uvicorn's server with its signal handling taken over for this (uvicorn's
own closes the port at the first signal, waits a few seconds, and exits by the signal: 143).
Behind a front end over replicas every request in flight is the front end's, so draining the
front end drains the replicas: they are stopped once nothing is in flight.
"""

from __future__ import annotations

import json
import logging
import math
import time
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("specextend.serve")

DEFAULT_DRAIN_S = 30.0
OPEN_PATHS = frozenset({"/health", "/metrics"})  # still answered while draining
CUT_GRACE_S = 5.0  # after cancelling: how long the cancelled requests get to send their errors


class Drain:
    """A server's drain: whether (and since when) it is draining, the requests in flight, and the
    jobs that a drain past its deadline cancels."""

    def __init__(self, seconds: float = DEFAULT_DRAIN_S) -> None:
        self.seconds = seconds
        self.since: float | None = None  # time.monotonic() when draining began
        self.cut_at: float | None = None  # when what still ran was cancelled
        self.in_flight = 0  # HTTP requests being answered, but for OPEN_PATHS
        self._jobs: dict[int, Any] = {}  # id -> job (with its `cancel` event) of each request in flight

    @property
    def draining(self) -> bool:
        return self.since is not None

    @property
    def cut(self) -> bool:
        """Whether the drain cancelled what still ran (a cancelled job then ends in a 503)."""
        return self.cut_at is not None

    def begin(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def retry_after(self) -> int:
        """Seconds a refused client should wait: until this server has gone (another takes its place)."""
        left = self.seconds - (time.monotonic() - self.since) if self.since is not None else self.seconds
        return max(1, math.ceil(left))

    def track(self, job: Any) -> None:
        self._jobs[id(job)] = job
        if self.cut:  # it reached its answer after the drain's time was up
            job.cancel.set()

    def untrack(self, job: Any) -> None:
        self._jobs.pop(id(job), None)

    def cancel_all(self) -> int:
        """Cancel every tracked job (each ends at its next step); how many there were."""
        self.cut_at = time.monotonic()
        jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel.set()
        return len(jobs)

    def done(self, now: float) -> bool:
        """Whether the server may close now, cancelling what still runs once the drain's time is up."""
        if self.since is None:
            return False
        if self.in_flight == 0:
            return True
        if self.cut_at is None and now - self.since >= self.seconds:
            n = self.cancel_all()
            log.warning("drain: %.0f s are up; cancelling %d request%s still running", self.seconds, n,
                        "" if n == 1 else "s")
        return self.cut_at is not None and now - self.cut_at >= CUT_GRACE_S

    def shutdown_error(self) -> dict[str, Any]:
        """The error a request cancelled by the drain is answered with (OpenAI's shape)."""
        return {"error": {"message": f"the server is shutting down and cancelled this request after draining for "
                                     f"{self.seconds:g} s; send it again", "type": "server_error", "param": None,
                          "code": "server_shutdown"}}


class Gate:
    """ASGI middleware: while the server drains, new requests (but to OPEN_PATHS) get 503 with
    `Retry-After`; the others are counted in flight until their answer is sent."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            body = json.dumps({"error": {"message": "the server is shutting down (draining); send this request to "
                                                    "another one, or again later", "type": "server_error",
                                         "param": None, "code": "server_shutdown"}}).encode()
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(self.drain.retry_after()).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but the first SIGTERM or SIGINT drains (`Drain`) and a second one cuts the
    drain short; the process then ends normally (status 0), not by the signal."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only flags here (logging could re-enter a lock the loop holds).
        if not self.drain.draining:
            self.drain.begin()
        elif not self.drain.cut:
            self.drain.seconds = 0.0  # a second signal: the drain's time is up now

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if not self.drain.draining:
            return False
        if not self._announced:
            self._announced = True
            log.warning("draining: %d request%s in flight, new ones refused (503); at most %g s (a second Ctrl-C or "
                        "SIGTERM stops at once)", self.drain.in_flight, "" if self.drain.in_flight == 1 else "s",
                        self.drain.seconds)
        return self.drain.done(time.monotonic())

