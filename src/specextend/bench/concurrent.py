"""Many clients at once against `specextend serve` and against llama.cpp's `llama-server -np N`
(`python -m specextend.bench.serve concurrent|during`, see serve.py for the command line).

`concurrent`: N clients send their requests at the same moment, each a different document (a
JSONL record's `text`) or a different short prompt, streaming `/v1/completions` through the
official `openai` client. Every server gets the same token ids (our tokenizer's), greedy. Servers:
`ours` (continuous batching, the default flags), `ours-one` (the same server with --max-batch 1:
one request at a time, which is also each request's answer served alone) and `llama`
(`llama-server -np N` on the same GGUF files, 2 threads, its defaults otherwise).

`during`: streams already running when a long document arrives; a short prompt sent a few seconds
later. Its time to first token, and the gaps between the running streams' chunks while the
document prefills.

Reported per server: time to the last answer, aggregate tokens per second, time to first token
per client, the gaps between a stream's chunks (p50/p95; a speculative step may send several
tokens in one chunk, so a gap is the wait a reader sees), and whether each answer equals the
same request served alone (ours: the one-at-a-time server's answer; llama: ours-one's, which says
how llama.cpp's batch differs from our kernels).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SHORT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in three sentences.",
    "Write a SQL query that counts the orders per customer.",
    "List five common HTTP status codes and what they mean.",
    "Write a bash one-liner that counts the lines of every .py file in a folder.",
    "What is the difference between a process and a thread?",
    "Write a JavaScript function that debounces another function.",
    "Summarise the rules of chess in a short paragraph.",
    "Write a Rust function that reverses a string.",
    "Explain recursion to a beginner with an example.",
    "Write a Python class for a stack with push, pop and peek.",
    "What does the CAP theorem say?",
    "Write a regular expression that matches an e-mail address.",
    "Explain how a binary search works.",
    "Write a Go function that reads a file line by line.",
    "Describe three ways to speed up a slow database query.",
)


@dataclass
class Stream:
    """One client's request as it saw it."""

    client: int
    sent: float  # seconds from the run's start
    first: float | None = None  # first chunk with text, from the run's start
    end: float | None = None
    chunks: list[float] = field(default_factory=list)  # arrival of every chunk with text
    text: str = ""
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    def gaps(self, start: float = 0.0, stop: float = float("inf")) -> list[float]:
        """Waits between consecutive chunks that arrived within [start, stop]."""
        times = self.chunks
        return [b - a for a, b in itertools.pairwise(times) if start <= b <= stop]


def stream_one(base_url: str, prompt: list[int], max_tokens: int, client: int, t0: float) -> Stream:
    import openai

    api = openai.OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="none", max_retries=0, timeout=3600)
    s = Stream(client, time.perf_counter() - t0)
    try:
        resp = api.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
                                      stream_options={"include_usage": True})
        pieces = []
        for chunk in resp:
            now = time.perf_counter() - t0
            if chunk.choices and chunk.choices[0].text:
                if s.first is None:
                    s.first = now
                s.chunks.append(now)
                pieces.append(chunk.choices[0].text)
            if getattr(chunk, "usage", None) is not None:
                s.tokens = chunk.usage.completion_tokens
        s.text = "".join(pieces)
    except Exception as e:  # a refusal (429) or a failure is an outcome to report, not a crash
        s.error = f"{type(e).__name__}: {e}"
    s.end = time.perf_counter() - t0
    return s


def run_clients(base_url: str, prompts: list[list[int]], max_tokens: int | list[int],
                delays: list[float] | None = None) -> list[Stream]:
    """Every prompt from its own thread, each sent `delays[i]` seconds after the start (default: all
    at once); returns the streams in prompt order."""
    n = len(prompts)
    tokens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    delays = delays or [0.0] * n
    out: list[Stream | None] = [None] * n
    t0 = time.perf_counter()

    def go(i: int) -> None:
        wait = delays[i] - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        out[i] = stream_one(base_url, prompts[i], tokens[i], i, t0)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [s for s in out if s is not None]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def summarise(streams: list[Stream]) -> dict[str, Any]:
    ok = [s for s in streams if s.error is None]
    last = max((s.end or 0.0) for s in streams) if streams else 0.0
    start = min(s.sent for s in streams) if streams else 0.0
    gaps = [g for s in ok for g in s.gaps()]
    total = sum(s.tokens for s in ok)
    return {"clients": len(streams), "answered": len(ok), "errors": [s.error for s in streams if s.error],
            "time_to_last_s": last - start, "tokens": total,
            "tokens_per_s": total / (last - start) if last > start else 0.0,
            "ttft_s": [s.ttft for s in streams], "gap_p50_s": pct(gaps, 0.5), "gap_p95_s": pct(gaps, 0.95)}


# --------------------------------------------------------------------------- the servers


@contextlib.contextmanager
def ours(start: Any, serve_args: str, log: Path) -> Iterator[str]:
    """`specextend serve ARGS` for the block, through `start` (serve.py's `started`)."""
    with start(serve_args, log) as (url, _pid):
        yield url


@contextlib.contextmanager
def llama(clients: int, context: int, threads: int = 2, info: dict[str, Any] | None = None) -> Iterator[str]:
    """`llama-server -np N` over the default target's GGUF, each slot `context` tokens, on a free port.
    One that dies of SIGILL or SIGSEGV while starting or on a first short prompt runs once more with
    --no-repack (llama.cpp's AMX path faults on some Xeons: bench/llamacpp.py); `info["no_repack"]`
    says which ran."""
    from .llamacpp import NO_REPACK, REPACK_FAULTS, _free_port, _server_env, find_peer, gguf_for

    peer = find_peer()
    for no_repack in (False, True):
        port = _free_port()
        argv = [str(peer.binary), "-m", str(gguf_for(None, "target")), "--host", "127.0.0.1", "--port", str(port),
                "-np", str(clients), "-c", str(clients * context), "-t", str(threads), "-tb", str(threads),
                "--no-webui", *([NO_REPACK] if no_repack else [])]
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=_server_env(), start_new_session=True)
            try:
                url = f"http://127.0.0.1:{port}"
                status = _llama_serving(proc, url)
                if status in REPACK_FAULTS and not no_repack:
                    print(f"llama-server died of signal {-status}; retrying once with {NO_REPACK}", flush=True)
                    continue
                if status is not None:
                    log.seek(0)
                    raise SystemExit(f"llama-server exited ({status}): {log.read().decode(errors='replace')[-2000:]}")
                print(f"llama-server {peer.version} -np {clients} on {url}" + (f" ({NO_REPACK})" if no_repack else ""),
                      flush=True)
                if info is not None:
                    info["no_repack"] = no_repack
                yield url
                return
            finally:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _llama_serving(proc: subprocess.Popen, url: str) -> int | None:
    """None once the server answers /health and a first 32-token prompt (many rows through its
    weights, where a matrix path would fault); its exit status if it exits first."""
    import urllib.request

    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            return proc.returncode
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            if r.status == 200:
                break
        if time.monotonic() > deadline:
            raise SystemExit("llama-server did not start in 300 s")
        time.sleep(0.2)
    body = json.dumps({"prompt": list(range(1, 33)), "n_predict": 1, "cache_prompt": False}).encode()
    req = urllib.request.Request(f"{url}/completion", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
    except OSError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(15)
        raise
    return None


def server(kind: str, start: Any, serve_args: str, clients: int, context: int, log: Path,
           info: dict[str, Any] | None = None) -> contextlib.AbstractContextManager[str]:
    if kind == "ours":
        return ours(start, serve_args, log)
    if kind == "ours-one":
        return ours(start, f"--max-batch 1 --max-queue {max(16, clients)} {serve_args}", log)
    if kind == "llama":
        return llama(clients, context, info=info)
    raise SystemExit(f"unknown server {kind!r}: choose ours, ours-one, llama")


def warm(url: str, encode: Any) -> None:
    """One short request first, not counted (first-use costs are not what a client of a running server pays)."""
    stream_one(url, encode("Say hello."), 4, 0, time.perf_counter())


# --------------------------------------------------------------------------- the scenarios


@dataclass
class Scenario:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    delays: list[float]
    window: tuple[int, int] | None = None  # (running streams up to, the long document's index): `during`


def equal_to(reference: list[Stream] | None, streams: list[Stream]) -> list[bool | None]:
    if reference is None:
        return [None] * len(streams)
    return [None if (a.error or b.error) else a.text == b.text for a, b in zip(streams, reference, strict=True)]


def run(scenario: Scenario, kinds: list[str], serve_args: str, out: Path, encode: Any, start: Any, health: Any
        ) -> dict[str, Any]:
    """Each server in turn: `start(args, log)` starts ours (serve.py's `started`), `health(url)`
    reads its /health after the run."""
    context = max(len(p) for p in scenario.prompts) + max(scenario.max_tokens) + 64
    results: dict[str, Any] = {"scenario": scenario.name, "serve_args": serve_args, "servers": {},
                               "prompt_tokens": [len(p) for p in scenario.prompts],
                               "max_tokens": scenario.max_tokens, "delays": scenario.delays}
    streams_by: dict[str, list[Stream]] = {}
    for kind in kinds:
        log = out / f"{scenario.name}-{kind}.log"
        info: dict[str, Any] = {}
        with server(kind, start, serve_args, len(scenario.prompts), context, log, info) as url:
            warm(url, encode)
            streams = run_clients(url, scenario.prompts, scenario.max_tokens, scenario.delays)
            after = health(url) if kind != "llama" else None
        streams_by[kind] = streams
        summary = summarise(streams)
        if scenario.window is not None:
            summary.update(during(streams, scenario.window))
        summary["health_after"] = after
        results["servers"][kind] = {"summary": summary, "streams": [asdict(s) for s in streams], **info}
        print(f"{scenario.name} {kind}: {json.dumps({k: v for k, v in summary.items() if k != 'health_after'})}",
              flush=True)
    reference = streams_by.get("ours-one")
    for kind, streams in streams_by.items():
        same = equal_to(reference, streams)
        results["servers"][kind]["summary"]["equal_to_alone"] = same
        results["servers"][kind]["summary"]["all_equal_to_alone"] = (all(x is True for x in same)
                                                                     if reference is not None else None)
    return results


def during(streams: list[Stream], window: tuple[int, int]) -> dict[str, Any]:
    """Running streams 0..k-1, the long document k, the short prompt after it (k + 1)."""
    k, doc = window
    d = streams[doc]
    start, stop = d.sent, d.first if d.first is not None else (d.end or d.sent)
    gaps = [g for s in streams[:k] for g in s.gaps(start, stop)]
    short = streams[doc + 1]
    return {"document_ttft_s": d.ttft, "short_ttft_s": short.ttft, "running_gap_p50_s": pct(gaps, 0.5),
            "running_gap_p95_s": pct(gaps, 0.95), "running_gap_max_s": max(gaps) if gaps else None,
            "running_gaps": len(gaps)}


# --------------------------------------------------------------------------- the report


def table(results: dict[str, Any]) -> str:
    servers = results["servers"]
    lines = [f"### {results['scenario']}", "",
             f"{len(results['prompt_tokens'])} clients, prompts of {min(results['prompt_tokens'])}-"
             f"{max(results['prompt_tokens'])} tokens, {max(results['max_tokens'])} new tokens each; "
             f"server flags `{results['serve_args']}`", "",
             "| server | time to last answer (s) | tokens/s | TTFT first / median / last (s) | chunk gap p50 / p95 (s) "
             "| answers = alone |", "|---|---:|---:|---|---|---|"]
    for kind, r in servers.items():
        s = r["summary"]
        ttft = sorted(t for t in s["ttft_s"] if t is not None)
        t3 = f"{ttft[0]:.1f} / {statistics.median(ttft):.1f} / {ttft[-1]:.1f}" if ttft else "-"
        gaps = "-" if s["gap_p50_s"] is None else f"{s['gap_p50_s']:.2f} / {s['gap_p95_s']:.2f}"
        same = s.get("equal_to_alone") or []
        eq = "-" if not same or all(x is None for x in same) else f"{sum(x is True for x in same)}/{len(same)}"
        err = f" ({len(s['errors'])} refused or failed)" if s["errors"] else ""
        lines.append(f"| {kind} | {s['time_to_last_s']:.1f}{err} | {s['tokens_per_s']:.1f} | {t3} | {gaps} | {eq} |")
        if "short_ttft_s" in s:
            lines.append(f"| {kind}: during the document's prefill | document TTFT {_f(s['document_ttft_s'])} s | | "
                         f"short prompt TTFT {_f(s['short_ttft_s'])} s | running streams' gap p50 / p95 / max "
                         f"{_f(s['running_gap_p50_s'])} / {_f(s['running_gap_p95_s'])} / "
                         f"{_f(s['running_gap_max_s'])} ({s['running_gaps']} gaps) | |")
    kinds = list(servers)
    base = servers.get("ours", {}).get("summary")
    if base:
        for other in ("ours-one", "llama"):
            if other in servers and servers[other]["summary"]["time_to_last_s"]:
                r = base["time_to_last_s"] / servers[other]["summary"]["time_to_last_s"]
                lines.append(f"\nours / {other}: time to last answer {r:.2f}x, tokens/s "
                             f"{base['tokens_per_s'] / max(1e-9, servers[other]['summary']['tokens_per_s']):.2f}x")
    del kinds
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for kind, r in results["servers"].items():
        st = r["streams"]
        ax.plot([s["client"] for s in st], [(s["first"] or 0) - s["sent"] for s in st], "o-", label=f"{kind} TTFT")
        ax.plot([s["client"] for s in st], [(s["end"] or 0) for s in st], "x--", label=f"{kind} done")
    ax.set_xlabel("client")
    ax.set_ylabel("seconds from the start")
    ax.set_title(results["scenario"])
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(f".{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
