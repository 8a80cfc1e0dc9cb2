"""The server's backend in this process: the pair's models in one continuous batch (batching.py:
the batch and its scheduler), each request a job run by `jobs.run_job`; and `build`, which loads
the pair from `serve`'s flags, sizes its prefix cache and makes the `Server` over this backend.
`specextend serve` runs one in its own process; with `--replicas` each Ray replica runs one
(ray_serve.py)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from starlette.requests import Request as HTTPRequest

from ..api import Pair
from ..batching import Batching
from ..scheduler import Limits, QueueFull, TooLarge, available_memory_mb, default_kv_mb
from .app import Server
from .jobs import Job, run_job
from .protocol import APIError

CACHE_SHARE = 0.4  # of the memory still available once the models are loaded
MIN_DEFAULT_CACHE_MB = 256

log = logging.getLogger("specextend.serve")


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


def default_cache_mb(reserved_mb: float = 0.0) -> float:
    """The prefix cache's share of the memory available, less `reserved_mb` (the KV budget)."""
    avail = available_memory_mb()
    return 2048.0 if avail is None else max(MIN_DEFAULT_CACHE_MB, CACHE_SHARE * (avail - reserved_mb))


def build(args: argparse.Namespace, memory_share: float = 1.0) -> Server:
    """Load the pair `args` names and make its server. The default KV budget and prefix cache take
    `memory_share` of their usual shares (replicas that share a machine split its memory)."""
    from .. import api
    from ..options import model_options, settings_from_args

    defaults = settings_from_args(args)
    prepared = api.prepare(args.target, args.draft, **model_options(args), progress=not args.quiet)
    encoder = prepared.with_own_tokenizer()
    pair = prepared.load()
    # The KV budget's default share is of the memory available now; the prefix cache's of what is left.
    kv_mb = args.kv_mb if args.kv_mb is not None else default_kv_mb() * memory_share
    cache_mb = default_cache_mb(kv_mb) * memory_share if args.cache_mb is None else args.cache_mb
    if cache_mb > 0 or args.cache_dir is not None:
        cache = pair.enable_prefix_cache(cache_mb, Path(args.cache_dir) if args.cache_dir else None,
                                         args.cache_disk_mb)
        where = f", mirrored in {args.cache_dir}" if args.cache_dir else ""
        log.info("prefix cache: up to %.0f MB%s (%d entries on disk)", cache_mb, where,
                 cache.stats().get("disk_entries", 0))
    backend = LocalBackend(pair, args.max_queue,
                           batching=dict(max_batch=args.max_batch, step_tokens=args.step_tokens, kv_mb=kv_mb))
    return Server(backend, encoder, defaults, prepared.target_path.name)
