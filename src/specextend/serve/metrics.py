"""`GET /metrics`: the server's Prometheus metrics (text format, through `prometheus-client`).

Three narrow feeds, so the server calls this in a few lines:
- `middleware()` counts every HTTP answer by route and status (401s and 429s included);
- `observe(job, event, value)` sees each event the server reads off a job: the first piece of
  text gives the time to first token (from the job's admission), the gaps between pieces the
  inter-token latency, the finished outcome the token counts, the accepted tokens per step and
  whether the draft ran;
- the gauges (requests running and waiting, KV in use, the prefix cache) are read at scrape time
  from the server's `/health` body, so they are never stale and cost nothing between scrapes.
  Behind a front end over replicas they come per replica (label `replica`) from the replicas'
  last reports; the counters and histograms are the front end's, over every request it served.

Each server keeps its own registry (two servers in one process do not mix their counts). The
names are in docs/serving.md.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "specextend"
ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
GAP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
ACCEPT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
MB = 2**20


class ServerMetrics:
    """One server's metrics; `health` returns its /health body (read at each scrape)."""

    def __init__(self, health: Callable[[], dict[str, Any]]) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=registry)
        self.generations = Counter(f"{PREFIX}_generations", "Generations ended, by finish reason "
                                   "(stop, length, cancelled, error)", ["finish_reason"],
                                   registry=registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "From a request's admission to its first "
                              "piece of text", buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Between successive pieces of an answer "
                             "(a piece is the tokens one step accepted)", buckets=GAP_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{PREFIX}_request_duration_seconds", "From a request's admission to its last token",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished generations", registry=registry)
        self.cached = Counter(f"{PREFIX}_cached_prompt_tokens", "Prompt tokens whose KV came from the prefix "
                              "cache", registry=registry)
        self.generated = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=registry)
        self.accepted = Histogram(f"{PREFIX}_accepted_tokens_per_step", "Proposed tokens the target accepted, "
                                  "per decoding step of a speculative method", buckets=ACCEPT_BUCKETS,
                                  registry=registry)
        self.steps = Counter(f"{PREFIX}_decode_steps", "Decoding steps, by whether the draft model ran in them "
                             "(draft=ran) or not (draft=none: lookup, forced tokens or plain steps)", ["draft"],
                             registry=registry)
        registry.register(_Gauges(health))
        self._last: dict[int, float] = {}  # per job being answered: when its last piece was read
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- feeds

    def middleware(self) -> list[Middleware]:
        return [Middleware(_CountAnswers, counter=self.requests)]

    def observe(self, job: Any, event: str, value: Any) -> None:
        """One event the server read off `job` (its `submitted` is the perf_counter of admission):
        "text", "done" (an Outcome), "error" or "cancelled"."""
        now = time.perf_counter()
        key = id(job)
        if event == "text":
            with self._lock:
                last = self._last.get(key)
                self._last[key] = now
            if last is None:
                self.ttft.observe(now - job.submitted)
                weakref.finalize(job, self._forget, key)  # a client gone mid-answer leaves no entry behind
            else:
                self.itl.observe(now - last)
            return
        self._forget(key)
        if event == "done":
            self.e2e.observe(now - job.submitted)
            self.finished(value)
        else:
            self.generations.labels(event).inc()

    def finished(self, outcome: Any) -> None:
        """The counts of a finished generation (its Outcome: finish_reason and the Result)."""
        r = outcome.result
        self.generations.labels(outcome.finish_reason).inc()
        self.prompt.inc(r.prompt_tokens)
        self.cached.inc(r.cached_prompt_tokens)
        self.generated.inc(r.new_tokens)
        if r.method != "ar":
            for a in r.accept_lengths:
                self.accepted.observe(a)
        drafted = int((r.extra or {}).get("draft_steps", 0))
        self.steps.labels("ran").inc(drafted)
        self.steps.labels("none").inc(max(0, r.steps - drafted))

    def _forget(self, key: int) -> None:
        with self._lock:
            self._last.pop(key, None)

    # ----------------------------------------------------------------- the route

    async def endpoint(self, request: HTTPRequest) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _CountAnswers:
    """ASGI middleware: count each HTTP answer's status by route (unknown paths as "other")."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


class _Gauges:
    """A custom collector: the server's state, read from its /health body at each scrape."""

    def __init__(self, health: Callable[[], dict[str, Any]]) -> None:
        self.health = health

    def describe(self) -> list[Metric]:
        return []  # the gauges depend on the body; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        body = self.health()
        parts = body.get("replicas")
        one = parts is None
        rows = [body] if one else parts
        labels = [] if one else ["replica"]

        def family(kind: type, name: str, doc: str, read: Callable[[dict[str, Any]], float | None]) -> Metric:
            m = kind(f"{PREFIX}_{name}", doc, labels=labels)
            for row in rows:
                v = read(row)
                if v is not None:
                    m.add_metric([] if one else [str(row.get("replica"))], float(v))
            return m

        batch = lambda k: lambda r: (r.get("batch") or {}).get(k)  # noqa: E731
        cache = lambda k: lambda r: (r.get("prefix_cache") or {}).get(k)  # noqa: E731
        yield family(GaugeMetricFamily, "requests_running", "Requests being generated", lambda r: r.get("running"))
        yield family(GaugeMetricFamily, "requests_waiting", "Requests queued, not yet running",
                     lambda r: r.get("waiting"))
        yield family(CounterMetricFamily, "batch_steps", "Batch steps run", batch("steps"))
        yield family(GaugeMetricFamily, "kv_cache_used_bytes", "Memory the running requests' KV caches take",
                     lambda r: _mb(batch("kv_in_use_mb")(r)))
        yield family(GaugeMetricFamily, "kv_cache_budget_bytes", "The running requests' KV budget (--kv-mb)",
                     lambda r: _mb(batch("kv_budget_mb")(r)))
        yield family(CounterMetricFamily, "prefix_cache_hits", "Prompts that continued from a cached prefix",
                     cache("hits"))
        yield family(CounterMetricFamily, "prefix_cache_misses", "Prompts with no cached prefix", cache("misses"))
        yield family(GaugeMetricFamily, "prefix_cache_entries", "Prefixes held in memory", cache("entries"))
        yield family(GaugeMetricFamily, "prefix_cache_bytes", "Memory the prefix cache takes", cache("bytes"))
        yield family(GaugeMetricFamily, "prefix_cache_max_bytes", "The prefix cache's memory cap (--cache-mb)",
                     cache("max_bytes"))


def _mb(v: float | None) -> float | None:
    return None if v is None else v * MB
