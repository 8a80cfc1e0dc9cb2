"""The server's backend in this process: the pair's models in one continuous batch (batching/: the
batch and its scheduler), each request a job run by `jobs.run_job`. `specextend serve` runs one in
its own process; with `--replicas` each Ray replica runs one (ray_serve.py); assemble.py makes it."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request as HTTPRequest

from ..api import Pair
from ..batching.runner import Batching
from ..batching.scheduler import Limits, QueueFull, TooLarge
from .jobs import Job, run_job
from .protocol import APIError


class LocalBackend:
    """The pair's batch and scheduler, made at `start`. `limits` bound the batch (None:
    `scheduler.default_limits(**batching)`, from this machine's memory and the measured step costs)."""

    def __init__(self, pair: Pair, max_queue: int, limits: Limits | None = None,
                 batching: dict[str, Any] | None = None) -> None:
        self.pair, self.max_queue, self.limits = pair, max_queue, limits
        self.batching_args = batching or {}
        self.batching: Batching | None = None

    def start(self) -> None:
        pair = self.pair
        self.batching = Batching(pair, lambda engine, job: run_job(pair, engine, job), self.limits, self.max_queue,
                                 **self.batching_args)

    def submit(self, job: Job) -> None:
        """Queue a job (on the event loop); APIError when it cannot be taken: 429 with Retry-After
        while the queue is full, 400 for caches larger than the KV budget."""
        assert self.batching is not None, "the backend has not started"
        try:
            self.batching.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(429, f"the server is busy ({self.max_queue} requests already waiting); retry in "
                                f"{e.retry_after} s", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except TooLarge as e:
            raise APIError(400, str(e), param="max_tokens", code="kv_budget_exceeded") from None

    async def started(self, job: Job, request: HTTPRequest) -> dict[str, str]:
        return {}  # a stream starts at once: its events say how it goes

    def health(self) -> dict[str, Any]:
        sched = self.batching.scheduler if self.batching is not None else None
        cache = self.pair.prefix_cache
        return {
            "busy": bool(sched and sched.running),
            "running": sched.running if sched else 0,
            "waiting": sched.waiting if sched else 0,
            "max_queue": self.max_queue,
            "completed": sched.completed if sched else 0,
            "batch": sched.stats() if sched else None,
            "prefix_cache": cache.stats() if cache is not None else None,
        }

    def shutdown(self) -> None:
        if self.batching is not None:
            self.batching.shutdown()
