"""`specextend serve --replicas N`: the same OpenAI API, served by N replicas of the model pair on Ray
Serve, each request routed to the replica that holds its document.

- A replica (`Replica`, a Ray Serve deployment) is the one-process server's backend (local.py): its
  own pair, prefix cache and batching scheduler. Ray starts the replicas, checks their health and
  restarts one that dies.
- The front end is this process's `Server` (app.py) over a `RayBackend`: the server checks and
  tokenizes a request as the one-process server does, then the backend streams it from a replica
  through a Ray Serve deployment handle. The handle's router is `ray_router.Router`, Ray Serve's
  request-router interface over a policy of routing.py (document affinity, or round-robin for
  contrast); it counts each replica's requests in flight, which is what "saturated" reads.
- Faults: a request whose replica is lost (its process died, its node left) before any of its
  tokens reached the client is sent again to another replica; one that had streamed tokens ends
  with an OpenAI-shaped error in the stream. A replica's own errors are answered as the
  one-process server answers them.
- Each response names its replica (`x-specextend-replica`, `usage.speculative.replica`), and
  `/health` lists the replicas with their load and cache use as they last reported them: the
  backend asks every replica for its report each STATS_PERIOD_S (the deployment's `health`,
  broadcast) and counts its own requests per replica.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
import os
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from starlette.requests import Request as HTTPRequest

from ..batching.scheduler import DEFAULT_MAX_BATCH
from ..common.errors import UserError
from . import protocol, ray_router
from .app import DISCONNECT_POLL_S, Server, generation_error, run_http
from .assemble import build
from .jobs import STREAM_EVENTS, Job
from .protocol import APIError
from .routing import Route

log = logging.getLogger("specextend.serve")

APP = "specextend"
ATTEMPTS = 3  # replicas a request may be tried on when the one serving it is lost
STATS_PERIOD_S = 1.0  # how often the front end asks the replicas for their load and cache
REPORT_TIMEOUT_S = 5.0  # a round of reports slower than this is dropped (the last ones stay, aging)
LOST = (RayActorError, ActorDiedError, ActorUnavailableError, ReplicaUnavailableError)


# --------------------------------------------------------------------------- the replicas


SHARE_PAGES_ENV = "SPECEXTEND_HUGE_PAGES"


class Replica:
    """One Ray Serve replica: the one-process server's pair, prefix cache and scheduler."""

    def __init__(self, args: argparse.Namespace, memory_share: float, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        if memory_share < 1.0:
            # Replicas that share a node share the file's pages (a memory map) unless told otherwise:
            # weights read into huge pages are a copy each (runtime/hugepages.py; its ENV, named here so
            # that the server does not import the runtime's modules: tests/test_hugepages.py checks it).
            os.environ.setdefault(SHARE_PAGES_ENV, "0")
        logging.basicConfig(format="specextend: %(message)s")
        logging.getLogger("specextend").setLevel(logging.WARNING if args.quiet else logging.INFO)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        self.server = build(args, memory_share)
        gc.collect()  # the pair lives as long as the replica's process: out of the collector's passes (command.py)
        gc.freeze()
        self.server.backend.start()

    async def generate(self, route: Route, req: protocol.Request) -> AsyncIterator[tuple[str, Any]]:
        """The request's events as the one-process server's job posts them, after ("replica", name);
        an error as ("error", APIError's fields). Cancelling the stream cancels the generation."""
        yield "replica", self.name
        try:
            job = self.server.job(req, list(route.ids))
            self.server.backend.submit(job)
        except APIError as e:
            yield "error", _fields(e)
            return
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "done":
                    value.replica = self.name
                elif kind == "error":
                    value = _fields(generation_error(value))
                yield kind, value
                if kind not in STREAM_EVENTS:
                    return
        finally:
            job.cancel.set()  # the client or the front end is gone: free the batch slot

    def health(self) -> dict[str, Any]:
        body = self.server.health_body()
        return {"replica": self.name, "node": self.node, "pid": os.getpid(), "at": time.time(),
                **{k: body[k] for k in ("running", "waiting", "completed", "batch", "prefix_cache")}}

    def __del__(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.backend.shutdown()


def _fields(e: APIError) -> dict[str, Any]:
    return {"status": e.status, "message": e.message, "type": e.type, "param": e.param, "code": e.code,
            "headers": e.headers}


def _api_error(fields: dict[str, Any]) -> APIError:
    return APIError(fields["status"], fields["message"], type=fields["type"], param=fields["param"],
                    code=fields["code"], headers=fields["headers"])


# --------------------------------------------------------------------------- the front end


@dataclass
class _Flight:
    """A job in flight on the replicas: `started` is set at its first event for the client (text,
    done, error, cancelled), by then `replica` names the replica serving it."""

    job: Job
    replica: str | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    early: APIError | None = None  # the error that ended it before its first token


class RayBackend:
    """The front end's backend: each job generated on a replica through `handle` (its router
    picks the replica), retried on another while none of its tokens has been sent. `reports`:
    the replicas' first reports (their `health`); the backend asks for new ones every
    STATS_PERIOD_S while it runs."""

    def __init__(self, handle: Any, routing: str, max_queue: int, reports: list[dict[str, Any]]) -> None:
        self.replicas = handle
        self.handle = handle.options(stream=True, method_name="generate")
        self.routing, self.max_queue = routing, max_queue
        self.reports = {r["replica"]: r for r in reports}
        self.routed: Counter[str] = Counter()  # requests this front end sent to each replica
        self.flights: dict[int, _Flight] = {}  # by id(job)
        self.tasks: set[asyncio.Task[None]] = set()
        self.watcher: asyncio.Task[None] | None = None
        self.completed = 0

    def start(self) -> None:
        self.watcher = asyncio.ensure_future(self._watch())  # the replicas are up already (run_replicas)

    async def _watch(self) -> None:
        """Every STATS_PERIOD_S, the live replicas' reports; a replica that is gone drops out."""
        while True:
            await asyncio.sleep(STATS_PERIOD_S)
            try:
                answers = await self.replicas.broadcast("health").results_async(
                    timeout_s=REPORT_TIMEOUT_S, return_exceptions=True)
            except DeploymentUnavailableError:
                answers = []  # no replica is up
            except Exception as e:  # a slow round: the last reports stay, their age shows it
                log.debug("the replicas' reports did not come: %s", e)
                continue
            self.reports = {r["replica"]: r for r in answers if isinstance(r, dict)}

    def submit(self, job: Job) -> None:
        flight = self.flights[id(job)] = _Flight(job)
        task = asyncio.ensure_future(self._pump(flight))
        self.tasks.add(task)
        task.add_done_callback(lambda t: self._landed(t, job))

    def _landed(self, task: asyncio.Task[None], job: Job) -> None:
        self.tasks.discard(task)
        self.flights.pop(id(job), None)
        self.completed += 1

    async def started(self, job: Job, request: HTTPRequest) -> dict[str, str]:
        """Wait for the replica's first event before the stream's headers go out, so a request
        retried on another replica before its first token names the replica that served it."""
        flight = self.flights.get(id(job)) or _Flight(job)
        while not flight.started.is_set():
            try:
                await asyncio.wait_for(flight.started.wait(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    break
        if flight.early is not None:  # answered with its own status, as the one-process server does
            raise flight.early
        return protocol.replica_header(flight.replica) or {}

    def health(self) -> dict[str, Any]:
        in_flight = Counter(f.replica for f in self.flights.values() if f.replica is not None)
        now = time.time()
        replicas = [{"replica": name, "in_flight": in_flight[name], "routed": self.routed[name],
                     "reported_s_ago": round(now - r["at"], 1),
                     **{k: v for k, v in r.items() if k not in ("replica", "at")}}
                    for name, r in sorted(self.reports.items())]
        return {"status": "ok" if replicas else "starting", "routing": self.routing, "busy": bool(self.tasks),
                "running": len(self.tasks), "completed": self.completed, "max_queue": self.max_queue,
                "replicas": replicas}

    def shutdown(self) -> None:
        for t in [*self.tasks, *([self.watcher] if self.watcher else [])]:
            t.cancel()

    def _deliver(self, flight: _Flight, kind: str, value: Any = None) -> None:
        if kind == "error" and not flight.started.is_set():
            flight.early = value
        flight.started.set()
        flight.job.events.put_nowait((kind, value))

    async def _pump(self, flight: _Flight) -> None:
        """Stream the job from a replica into its events; on a lost replica, try another while no
        token has reached the client."""
        job = flight.job
        avoid: list[str] = []
        streamed = False
        for attempt in range(ATTEMPTS):
            replica: str | None = None
            stream = self.handle.remote(Route(tuple(job.ids), tuple(avoid)), job.request)
            try:
                async for kind, value in _until_cancelled(stream, job):
                    if kind == "replica":
                        replica = flight.replica = value
                        self.routed[value] += 1
                        continue
                    if kind == "error":
                        value = _api_error(value)
                    streamed = streamed or (kind == "text" and job.request.stream)
                    self._deliver(flight, kind, value)
                    if kind not in STREAM_EVENTS:
                        return
                if job.cancel.is_set():
                    self._deliver(flight, "cancelled")
                    return
                lost: BaseException = RuntimeError("the stream ended without an answer")
            except BackPressureError:
                self._deliver(flight, "error", APIError(
                    429, "every replica is busy; retry in a few seconds", type="rate_limit_error",
                    code="queue_full", headers={"Retry-After": "5"}))
                return
            except LOST as e:
                lost = e
            except Exception as e:  # the replica's own failure, not its loss: no retry
                self._deliver(flight, "error", generation_error(e))
                return
            if not self._retry(flight, lost, replica, streamed, attempt):
                return
            if replica:
                avoid.append(replica)
        self._deliver(flight, "error", APIError(
            503, f"the replicas serving this request were lost {ATTEMPTS} times; retry later",
            type="server_error", code="replica_lost"))

    def _retry(self, flight: _Flight, lost: BaseException, replica: str | None, streamed: bool,
               attempt: int) -> bool:
        """Whether a request whose replica was lost goes to another: not once tokens were sent."""
        where = f"replica {replica}" if replica else "its replica"
        if streamed:
            log.warning("%s was lost after streaming part of a request: %s", where, type(lost).__name__)
            self._deliver(flight, "error", APIError(
                502, f"{where} was lost while streaming this answer ({type(lost).__name__}); the text "
                     "sent so far is incomplete: send the request again", type="server_error", code="replica_lost"))
            return False
        log.warning("%s was lost before answering (attempt %d of %d): %s", where, attempt + 1, ATTEMPTS,
                    type(lost).__name__)
        return True


async def _until_cancelled(stream: Any, job: Job) -> AsyncIterator[tuple[str, Any]]:
    """The replica's events until the stream ends or the client goes (`job.cancel`), which
    cancels the stream (and so the replica's generation)."""
    it = stream.__aiter__()
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S)
            if not done:
                if job.cancel.is_set():
                    return
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        stream.cancel()


# --------------------------------------------------------------------------- the command


def placement(replicas: int, replica_cpus: float | None) -> tuple[float, int, float]:
    """Each replica's CPUs (a Ray resource), its threads, and its share of a machine's memory: the
    replicas that may land on one node share it (ceil(replicas / nodes) of them)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = math.ceil(replicas / max(1, len(nodes)))
    if replica_cpus is None:
        smallest = min((n.get("Resources", {}).get("CPU", 1.0) for n in nodes), default=1.0)
        replica_cpus = max(1.0, math.floor(smallest / per_node))
    return replica_cpus, max(1, int(replica_cpus)), 1.0 / per_node


def _first_reports(handle: Any, replicas: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Every replica's first report (its `health`, what /health shows), or as many as came in
    `timeout_s`: the handle's router knows the replicas as Ray starts them."""
    deadline = time.monotonic() + timeout_s
    reports: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            answers = handle.broadcast("health").results(timeout_s=REPORT_TIMEOUT_S, return_exceptions=True)
        except (DeploymentUnavailableError, TimeoutError):
            answers = []
        reports = [r for r in answers if isinstance(r, dict)]
        if len(reports) >= replicas:
            return reports
        time.sleep(0.2)
    log.warning("not every replica has reported its load yet; /health shows them as they do")
    return reports


def run_replicas(args: argparse.Namespace, sock: socket.socket, api_keys: tuple[str, ...] = ()) -> int:
    from .. import api
    from ..options import model_options, settings_from_args

    defaults = settings_from_args(args)
    encoder = api.prepare(args.target, args.draft, **model_options(args), progress=not args.quiet)
    routing = args.routing or "affinity"
    level = logging.WARNING if args.quiet else logging.INFO
    logging.getLogger("ray.serve").setLevel(level)
    try:
        if args.ray_address:
            ray.init(address=args.ray_address, logging_level=level, log_to_driver=not args.quiet)
        else:
            # "local": a new cluster of this machine, even where `ray start` left one running. Its
            # raylet starts no idle task workers ahead (one a CPU by default): the server runs
            # actors only, which get workers of their own (2-core machine: serving 13.1 s -> 10.6 s).
            os.environ.setdefault("RAY_enable_worker_prestart", "0")
            ray.init(address="local", include_dashboard=False, logging_level=level, log_to_driver=not args.quiet)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise UserError(f"cannot join the Ray cluster at {args.ray_address}: {e}") from None
    try:
        cpus, threads, share = placement(args.replicas, args.replica_cpus)
        capacity = args.max_batch or DEFAULT_MAX_BATCH
        deployment = serve.deployment(Replica, name="replica").options(
            num_replicas=args.replicas,
            max_ongoing_requests=capacity + args.max_queue,
            max_queued_requests=max(1, args.max_queue * args.replicas),  # Ray's least is 1
            ray_actor_options={"num_cpus": cpus},
            health_check_period_s=2,
            graceful_shutdown_timeout_s=5,
            request_router_config=RequestRouterConfig(
                request_router_class=f"{ray_router.__name__}:Router",
                request_router_kwargs={"routing_policy": routing, "capacity": capacity},
            ),
        )
        log.info("starting %d replicas (%s CPUs, %d threads each; routing: %s)", args.replicas, cpus, threads,
                 routing)
        serve.start(proxy_location="Disabled")
        # The front end checks the keys; the replicas (no HTTP of their own) are not handed them.
        keyless = argparse.Namespace(**{**vars(args), "api_key": None, "api_key_file": None})
        handle = serve.run(deployment.bind(keyless, share, threads), name=APP, route_prefix=None)
        handle.health.remote().result()  # the first call makes the handle's router (and checks a replica)
        reports = _first_reports(handle, args.replicas)
        front = Server(RayBackend(handle, routing, args.max_queue, reports), encoder.with_own_tokenizer(),
                       defaults, encoder.target_path.name)
        front.configure(api_keys, args.max_body_mb, args.drain_s, args.tool_call_recovery)
        run_http(front, sock, args.quiet)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
