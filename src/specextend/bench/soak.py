"""A soak of `specextend serve`: minutes of mixed clients against one server, then its health.

    python -m specextend.bench.soak --minutes 10 --out results/soak.json
    python -m specextend.bench.soak --url http://127.0.0.1:8000 --pid PID --api-key KEY --minutes 2

`--clients` threads send requests until `--minutes` are up (or `--max-requests` were sent), each
request's kind in turn from a seeded shuffle of KINDS: short chats, long prompts (`--long-words`
words), streams read to the end, streams the client hangs up on after the first text, bodies
that are not JSON, tool calls, json_schema answers, a wrong API key, and prompts too long for
the context. Without `--url` it starts `specextend serve --port 0 -q --api-key KEY SERVE_ARGS`
for the run (log next to `--out`) and stops it afterwards; with `--url` the server must be on
this machine (loopback only: the soak samples its memory from /proc).

It reports, and checks (exit status 1 when one fails):
- no 5xx and no broken connection: every request sent was served (2xx) or refused (4xx);
- each kind answered as it should (a short chat 200, bad JSON 400, a wrong key 401, a prompt
  too long 400; 429 counts as refused for any kind);
- the server's resident memory at the end within 10% of the sample at a fifth of the run (after
  warm-up; a leak keeps growing);
- once the clients stop, no request running or waiting and no KV in use (/health);
- /metrics agreeing with the clients: its count of answers by route and status over the run
  equals the clients', and the generations it saw end (stop, length, cancelled) are the
  requests that reached a generation (a stream hung up on after its generation had finished is
  counted by its finish, so `cancelled` is at most the hang-ups).
The result is JSON (`--out`) and a Markdown table (stdout).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from .serve import _rss_mb, started

KEY = "soak-key"
KINDS = ("short", "short", "long", "stream", "hangup", "bad_json", "tools", "json_schema", "wrong_key", "too_long")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# What each kind should be answered with (429 and 503 aside: a busy server may refuse any kind).
EXPECTED = {"short": 200, "long": 200, "stream": 200, "hangup": 200, "bad_json": 400, "tools": 200,
            "json_schema": 200, "wrong_key": 401, "too_long": 400}
GENERATES = ("short", "long", "stream", "hangup", "tools", "json_schema")  # kinds that run a generation when served
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
FACTS = {"type": "json_schema", "json_schema": {"name": "facts", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["name", "year"], "additionalProperties": False}}}
FILLER = ("The committee reviewed the quarterly budget, the staffing plan and the schedule of hearings, and asked "
          "for a shorter report next time. ")


class Soak:
    """The run: who sends what, and what came back (counted under a lock from the clients' threads)."""

    def __init__(self, url: str, key: str, max_tokens: int, long_words: int, context_words: int, seed: int) -> None:
        self.url, self.key, self.max_tokens = url.rstrip("/"), key, max_tokens
        words = FILLER.split()
        self.long_prompt = " ".join(words[i % len(words)] for i in range(long_words))
        self.too_long_prompt = " ".join(words[i % len(words)] for i in range(context_words))
        self.rng = random.Random(seed)
        self.order: list[str] = []
        self.sent: Counter[str] = Counter()
        self.answers: Counter[tuple[str, int]] = Counter()  # (kind, status); status 0: no answer
        self.by_route: Counter[tuple[str, int]] = Counter()  # (route, status) as /metrics counts them
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def next_kind(self) -> str:
        with self.lock:
            if not self.order:
                self.order = list(KINDS)
                self.rng.shuffle(self.order)
            return self.order.pop()

    def client(self, deadline: float, budget: Callable[[], bool]) -> None:
        with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {self.key}"}) as h:
            while time.monotonic() < deadline and budget():
                kind = self.next_kind()
                error = None
                try:
                    route, status = self.send(h, kind)
                except httpx.HTTPError as e:
                    route, status, error = "?", 0, f"{kind}: {type(e).__name__}: {e}"
                if status and status != EXPECTED[kind] and status not in (429, 503):
                    error = f"{kind}: {status}"
                with self.lock:
                    self.sent[kind] += 1
                    self.answers[kind, status] += 1
                    if status:
                        self.by_route[route, status] += 1
                    if error and len(self.errors) < 30:
                        self.errors.append(error)

    def send(self, h: httpx.Client, kind: str) -> tuple[str, int]:
        """One request of `kind`; (its route, the HTTP status)."""
        n = self.max_tokens
        ask = lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": n}  # noqa: E731
        if kind == "short":
            return CHAT, h.post(self.url + CHAT, json=ask("Write a Python one-liner that adds 2 to x.")).status_code
        if kind == "long":
            return CHAT, h.post(self.url + CHAT, json=ask(f"{self.long_prompt}\n\nSummarise this.")).status_code
        if kind == "too_long":
            return COMPLETIONS, h.post(self.url + COMPLETIONS, json={"prompt": self.too_long_prompt,
                                                                      "max_tokens": n}).status_code
        if kind == "bad_json":
            return CHAT, h.post(self.url + CHAT, content=b'{"messages": [', headers={
                "Content-Type": "application/json"}).status_code
        if kind == "wrong_key":
            return CHAT, h.post(self.url + CHAT, json=ask("hi"), headers={"Authorization": "Bearer wrong"}).status_code
        if kind == "tools":
            body = {**ask("What's the weather in Oslo right now?"), "tools": [WEATHER], "tool_choice": "required"}
            return CHAT, h.post(self.url + CHAT, json=body).status_code
        if kind == "json_schema":
            body = {**ask("Name a programming language and the year it appeared."), "response_format": FACTS}
            return CHAT, h.post(self.url + CHAT, json=body).status_code
        # A stream: read to the end, or hung up on after the first piece of text.
        body = {"prompt": "def fibonacci(n):", "max_tokens": 4 * n if kind == "hangup" else n, "stream": True}
        with h.stream("POST", self.url + COMPLETIONS, json=body) as r:
            if r.status_code == 200:
                for line in r.iter_lines():
                    if kind == "hangup" and line.startswith("data: {"):
                        break  # leaving the block closes the connection mid-answer
            return COMPLETIONS, r.status_code


def scrape(url: str, key: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=60).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def health(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/health", timeout=60).json()


def _loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def run(url: str, pid: int | None, *, seconds: float, clients: int, max_requests: int, key: str = KEY,
        max_tokens: int = 8, long_words: int = 6000, context_words: int | None = None, seed: int = 0,
        idle_s: float = 60.0) -> dict[str, Any]:
    """Soak the server at `url` (whose process is `pid`, for its memory) and check it (module doc)."""
    if not _loopback(url):
        raise SystemExit(f"the soak runs against a server on this machine only (loopback), not {url}")
    context = int(health(url).get("context") or 32768)
    # Twice the context in words: more tokens than the context (a word is a token or more).
    soak = Soak(url, key, max_tokens, long_words, context_words or 2 * context, seed)
    with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {key}"}) as h:  # warm-up, not counted
        h.post(url + CHAT, json={"messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 2})
    before = scrape(url, key)
    samples: list[tuple[float, float]] = []
    t0 = time.monotonic()
    deadline = t0 + seconds
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            v = _rss_mb(pid) if pid else None
            if v is not None:
                samples.append((time.monotonic() - t0, v))
            stop.wait(1.0)

    sent = 0
    sent_lock = threading.Lock()

    def budget() -> bool:
        nonlocal sent
        with sent_lock:
            sent += 1
            return sent <= max_requests

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=soak.client, args=(deadline, budget)) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    idle, idle_after_s = _idle(url, idle_s)
    stop.set()
    sampler.join()
    after = scrape(url, key)
    return report(soak, before, after, samples, idle, idle_after_s, wall, seconds)


def _idle(url: str, within_s: float) -> tuple[dict[str, Any], float | None]:
    """The server's /health once nothing runs or waits (and the seconds that took), or the last one."""
    t0 = time.monotonic()
    while True:
        h = health(url)
        if not h.get("running") and not h.get("waiting") and not (h.get("batch") or {}).get("kv_in_use_mb"):
            return h, time.monotonic() - t0
        if time.monotonic() - t0 > within_s:
            return h, None
        time.sleep(0.2)


def _delta(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    out = 0.0
    for (n, lab), v in after.items():
        d = dict(lab)
        if n == name and all(d.get(k) == val for k, val in labels.items()):
            out += v - before.get((n, lab), 0.0)
    return out


def report(soak: Soak, before: dict[Any, float], after: dict[Any, float], samples: list[tuple[float, float]],
           idle: dict[str, Any], idle_after_s: float | None, wall: float, seconds: float) -> dict[str, Any]:
    total = sum(soak.sent.values())
    statuses = Counter(status for (_, status) in soak.answers.elements())
    served = sum(n for s, n in statuses.items() if 200 <= s < 300)
    refused = sum(n for s, n in statuses.items() if 400 <= s < 500)
    failed = sum(n for s, n in statuses.items() if s >= 500 or s == 0)
    expected = sum(n for (kind, s), n in soak.answers.items() if s in (EXPECTED[kind], 429, 503))
    # Memory: the sample at a fifth of the run (after warm-up) against the last.
    early = next((v for t, v in samples if t >= seconds / 5), samples[0][1] if samples else None)
    last = samples[-1][1] if samples else None
    rss_ok = None if early is None or last is None else last <= early * 1.10
    metrics_routes = {}
    for (name, labels), v in sorted(after.items()):
        d = dict(labels)
        if name == "specextend_requests_total" and d.get("route") in (CHAT, COMPLETIONS):
            n = v - before.get((name, labels), 0.0)
            if n:
                metrics_routes[f"{d['route']} {d['status']}"] = n
    clients_routes = {f"{route} {status}": float(n) for (route, status), n in sorted(soak.by_route.items())}
    generations = {r: _delta(before, after, "specextend_generations_total", finish_reason=r)
                   for r in ("stop", "length", "cancelled", "error")}
    generated = sum(n for (kind, s), n in soak.answers.items() if kind in GENERATES and s == 200)
    hangups = soak.answers["hangup", 200]
    checks = {
        "no_5xx_or_broken": failed == 0,
        "served_plus_refused_is_sent": served + refused == total,
        "each_kind_answered_as_expected": expected == total,
        "rss_end_within_10pct_of_early": rss_ok,
        "idle_kv_back_to_0": idle_after_s is not None,
        "metrics_answers_match_clients": metrics_routes == clients_routes,
        "metrics_generations_match": (sum(generations.values()) == generated and generations["error"] == 0
                                      and generations["cancelled"] <= hangups),
    }
    return {"seconds": seconds, "wall_s": round(wall, 1), "sent": total, "served": served, "refused": refused,
            "failed": failed, "by_kind": {k: dict(sorted(Counter({s: n for (kk, s), n in soak.answers.items()
                                                                  if kk == k}).items())) for k in sorted(soak.sent)},
            "statuses": dict(sorted(statuses.items())), "errors": soak.errors,
            "rss_mb": {"early": early, "last": last, "max": max((v for _, v in samples), default=None),
                       "samples": samples},
            "idle": {"after_s": idle_after_s, "running": idle.get("running"), "waiting": idle.get("waiting"),
                     "kv_in_use_mb": (idle.get("batch") or {}).get("kv_in_use_mb"),
                     # the prefix cache's part of the memory's growth (it fills up to its cap, then evicts)
                     "prefix_cache_mb": round((idle.get("prefix_cache") or {}).get("bytes", 0) / 2**20, 1)},
            "metrics": {"answers": metrics_routes, "clients": clients_routes, "generations": generations,
                        "generations_expected": generated, "hangups": hangups},
            "checks": checks, "ok": all(v is not False for v in checks.values())}


def table(result: dict[str, Any]) -> str:
    """The run as Markdown: what was sent and answered per kind, then the checks."""
    rows = ["| kind | sent | answers (status: count) |", "|---|---:|---|"]
    for kind, answers in result["by_kind"].items():
        rows.append(f"| {kind} | {sum(answers.values())} | "
                    + ", ".join(f"{s or 'none'}: {n}" for s, n in answers.items()) + " |")
    rss, idle, m = result["rss_mb"], result["idle"], result["metrics"]
    idle_s = "never" if idle["after_s"] is None else f"after {idle['after_s']:.1f} s"
    ends = ", ".join(f"{k} {v:.0f}" for k, v in m["generations"].items())
    rows += ["", f"{result['sent']} sent in {result['wall_s']} s: {result['served']} served, {result['refused']} "
                 f"refused, {result['failed']} failed (5xx or no answer); RSS {_mb(rss['early'])} at a fifth of the "
                 f"run, {_mb(rss['last'])} at the end (the prefix cache: {idle['prefix_cache_mb']} MB); idle "
                 f"{idle_s} with {idle['kv_in_use_mb']} MB of KV in use; "
                 f"/metrics' generations: {ends} ({m['generations_expected']} served, {m['hangups']} hung up on)",
             "", "| check | |", "|---|---|"]
    rows += [f"| {name} | {'ok' if v else ('n/a' if v is None else 'FAILED')} |"
             for name, v in result["checks"].items()]
    return "\n".join(rows)


def _mb(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} MB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specextend.bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long the clients send (default 10)")
    p.add_argument("--clients", type=int, default=4, help="client threads (default 4)")
    p.add_argument("--max-requests", type=int, default=100_000, help="a bound on the requests sent")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each request (hang-ups ask 4x)")
    p.add_argument("--long-words", type=int, default=6000, help="words of a long prompt (about 8K tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help="flags for the `specextend serve` the soak starts (default: the default pair)")
    p.add_argument("--url", help="soak a server already running on this machine instead (with --pid, --api-key)")
    p.add_argument("--pid", type=int, help="with --url: the server's process id, for its memory")
    p.add_argument("--api-key", default=KEY, help="the server's key (the soak starts its server with it)")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1 or args.max_requests < 1:
        p.error("--minutes must be > 0, --clients and --max-requests >= 1")
    kw = dict(seconds=args.minutes * 60, clients=args.clients, max_requests=args.max_requests, key=args.api_key,
              max_tokens=args.max_tokens, long_words=args.long_words, seed=args.seed)
    if args.url:
        result = run(args.url, args.pid, **kw)  # type: ignore[arg-type]
    else:
        log = (args.out or Path("results/soak.json")).with_suffix(".server.log")
        with started(f"--api-key {args.api_key} {args.serve_args}", log) as (url, pid):
            result = run(url, pid, **kw)  # type: ignore[arg-type]
    print(table(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
