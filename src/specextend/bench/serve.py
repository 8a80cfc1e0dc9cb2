"""Measure `specextend serve` through the official `openai` client (a dev dependency).

    python -m specextend.bench.serve ttft --start "" \
        --data ../shared/data/govreport/govreport_8K.jsonl --index 0 --out results/serve-ttft.json
    python -m specextend.bench.serve compare results/serve-ttft.json
    python -m specextend.bench.serve load --start "--cache-mb 64" \
        --requests 200 --clients 4 --abandoned 20 --out results/serve-load.json

    python -m specextend.bench.serve concurrent --data ../shared/data/govreport/govreport_2K.jsonl \
        --clients 4 --max-tokens 64 --out results/serve-4x2K
    python -m specextend.bench.serve concurrent --clients 16 --max-tokens 128 --out results/serve-16short
    python -m specextend.bench.serve during --data ../shared/data/govreport/govreport_8K.jsonl \
        --out results/serve-during-8K
    python -m specextend.bench.serve single --data ../shared/data/govreport/govreport_2K.jsonl \
        --rounds 2 --max-tokens 64 --out results/serve-single-2K.json
    python -m specextend.bench.serve replicas --data ../shared/data/govreport/govreport_2K.jsonl \
        --replicas 2 --docs 2 --questions 3 --ar --out results/serve-replicas-2K.json

`--start ARGS` starts `specextend serve --port 0 -q ARGS` for the run (its log goes next to
`--out`) and stops it afterwards; `--url URL` measures a server already running instead.
`ttft`: the same long document (field `text` of a JSONL record) as a chat message followed by
one question, then by another; each request streams, and time to first token is from sending
the request to the first chunk with text. `compare`: runs `specextend generate --json --chat`
on each prompt of a ttft result, with the server's settings, and checks the server answered
the same text in the same number of tokens. `load`: short chat requests from concurrent clients
plus streams abandoned after their first chunk, counting every outcome by kind and sampling the
server's resident memory (from /proc) against the prefix cache's cap. `concurrent` and `during`:
many clients at once against our server, the same server one request at a time, and llama.cpp's
`llama-server -np N` (bench/concurrent.py), written as JSON, a Markdown table and a plot.
`single`: one request alone through the server against `specextend generate --json` on the same
document (raw completion, the same method and settings, greedy), in interleaved rounds (`--rounds`
of them, generate first in even rounds and the server first in odd ones); reports each one's
prefill seconds and decode tokens per second, their ratios (server / generate), and whether the
answers are the same tokens. The server runs with `--cache-mb 0` so that every round prefills the
whole prompt, as generate does. A memory-bound decode follows the host's memory bandwidth, which on
a shared host can shift by a third between one minute and the next, so `--warm-rounds N` adds a
comparison at the same moments: a second server with its prefix cache on against the library
(`specextend generate`'s code and settings, loaded in this process with its own prefix cache), both
answering the document from their prompt's cached KV, alternated request by request N times after
one request each fills the caches; it reports both sides' median decode and their ratio.
`replicas`: `serve --replicas N` once per routing (affinity, round-robin), each time asking
`--questions` questions about each of `--docs` documents (records 0.. of `--data`), one request
at a time, the documents interleaved so that round-robin sends a document's questions to
different replicas; reports each request's replica, cached prompt tokens and time to first
token, and the follow-up questions' time to first token as a share of the first questions';
with `--ar`, whether each answer equals `specextend generate --method ar`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..common.jsonl import text_at

QUESTIONS = ("In one sentence, what is this report about?", "List two numbers that the report mentions.",
             "Who wrote this report, and for whom?", "What does the report recommend?")


@contextlib.contextmanager
def started(args: str, log: Path) -> Iterator[tuple[str, int]]:
    """`specextend serve --port 0 -q ARGS` in a subprocess until the block ends: (base URL, pid)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "specextend.cli", "serve", "--port", "0", "-q", *shlex.split(args)]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stderr=err, stdout=err)
    try:
        # The command prints the address once the models are loaded and the socket listens.
        while True:
            m = re.search(r"serving .* on (http://\S+)/v1", log.read_text())
            if m:
                break
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
            time.sleep(0.2)
        url = m.group(1)
        while True:  # uvicorn answers once its lifespan has started
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.2)
        print(f"server {' '.join(cmd[2:])} on {url} (pid {proc.pid})", flush=True)
        yield url, proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=30) as r:
        return json.loads(r.read())


def _client(url: str, timeout: float = 1200.0) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="none", max_retries=0, timeout=timeout)


def _stream_one(client: Any, content: str, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage = None
    stream = client.chat.completions.create(model="specextend", messages=[{"role": "user", "content": content}],
                                            max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": "".join(text), "usage": usage}


def ttft(args: argparse.Namespace) -> dict[str, Any]:
    doc = text_at(args.data, args.index)
    client = _client(args.url)
    runs = []
    for q in QUESTIONS:
        r = _stream_one(client, f"{doc}\n\n{q}", args.max_tokens)
        r["question"] = q
        r["max_tokens"] = args.max_tokens
        runs.append(r)
        spec = (r["usage"] or {}).get("speculative", {})
        print(f"ttft {r['ttft_s']:.2f} s, total {r['total_s']:.2f} s, prompt {r['usage']['prompt_tokens']} tokens "
              f"({spec.get('cached_prompt_tokens')} cached), prefill {spec.get('prefill_s', 0):.2f} s", flush=True)
    ratio = runs[1]["ttft_s"] / runs[0]["ttft_s"]
    print(f"second request's time to first token: {100 * ratio:.2f}% of the first's", flush=True)
    return {"data": args.data, "index": args.index, "server": args.start, "runs": runs, "ttft_ratio": ratio,
            "health_after": _health(args.url)}


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Each prompt of a ttft result through `specextend generate --json --chat` (greedy, the
    server's method): the same text in the same number of tokens as the server's answer."""
    measured = json.loads(Path(args.result).read_text())
    doc = text_at(measured["data"], measured["index"])
    rows = []
    for run in measured["runs"]:
        spec = run["usage"]["speculative"]
        cmd = [sys.executable, "-m", "specextend.cli", "generate", "--json", "-q", "--chat", "--prompt-file", "-",
               "--method", spec["method"], "--max-new-tokens", str(run["max_tokens"]),
               *shlex.split(args.generate_args)]
        out = subprocess.run(cmd, input=f"{doc}\n\n{run['question']}", capture_output=True, text=True, check=True)
        generated = json.loads(out.stdout)
        row = {"question": run["question"], "method": spec["method"],
               "cached_prompt_tokens": spec["cached_prompt_tokens"],
               "server_tokens": run["usage"]["completion_tokens"], "generate_tokens": generated["new_tokens"],
               "same_text": generated["text"] == run["text"], "same_count": generated["new_tokens"] ==
               run["usage"]["completion_tokens"], "prompt_tokens": [run["usage"]["prompt_tokens"],
                                                                     generated["prompt_tokens"]]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows, "all_equal": all(r["same_text"] and r["same_count"] for r in rows)}


def _generate_once(doc: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "specextend.cli", "generate", "--json", "-q", "--prompt-file", "-",
           "--max-new-tokens", str(args.max_tokens), *shlex.split(args.generate_args)]
    out = subprocess.run(cmd, input=doc, capture_output=True, text=True, check=True)
    return _generated(json.loads(out.stdout))


def _generated(g: dict[str, Any]) -> dict[str, Any]:
    """What `single` keeps of a `generate --json` object (`Result.to_json`)."""
    return {"prefill_s": g["prefill_s"], "decode_s": g["decode_s"], "new_tokens": g["new_tokens"],
            "prompt_tokens": g["prompt_tokens"], "text": g["text"], "method": g["method"],
            "cpu_kernels": g["config"].get("cpu_kernels"), "steps": g["steps"], "phases": g["phases"],
            "extra": g["extra"], "cached_prompt_tokens": g["cached_prompt_tokens"]}


def _served_once(url: str, doc: str, args: argparse.Namespace) -> dict[str, Any]:
    body = json.dumps({"model": "specextend", "prompt": doc, "max_tokens": args.max_tokens, "temperature": 0,
                       **json.loads(args.request_fields)}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        answer = json.loads(r.read())
    use = answer["usage"]
    spec = use["speculative"]
    return {"prefill_s": spec["prefill_s"], "decode_s": spec["decode_s"], "new_tokens": use["completion_tokens"],
            "prompt_tokens": use["prompt_tokens"], "text": answer["choices"][0]["text"], "method": spec["method"],
            "steps": spec["steps"], "queue_s": spec["queue_s"], "cached_prompt_tokens": spec["cached_prompt_tokens"],
            "phases": {k: spec[k] for k in ("draft_s", "verify_s", "retrieval_s")}, "extra": spec.get("stats", {})}


def single(args: argparse.Namespace) -> dict[str, Any]:
    """One request alone: the server against `generate`, interleaved rounds on the same document."""
    doc = text_at(args.data, args.index)
    rounds = []
    for i in range(args.rounds):
        # Odd rounds serve first: a side that always ran second would meet whatever state of the
        # host the other side left behind.
        if i % 2 == 0:
            gen = _generate_once(doc, args)
            srv = _served_once(args.url, doc, args)
        else:
            srv = _served_once(args.url, doc, args)
            gen = _generate_once(doc, args)
        row = {"round": i, "first": "generate" if i % 2 == 0 else "server", "generate": gen, "server": srv,
               "same_text": gen["text"] == srv["text"],
               "prefill_ratio": srv["prefill_s"] / gen["prefill_s"],
               "decode_ratio": (srv["new_tokens"] / srv["decode_s"]) / (gen["new_tokens"] / gen["decode_s"])}
        rounds.append(row)
        print(f"round {i}: {gen['prompt_tokens']} prompt tokens; prefill generate {gen['prefill_s']:.2f} s, server "
              f"{srv['prefill_s']:.2f} s ({row['prefill_ratio']:.3f}x); decode generate "
              f"{gen['new_tokens'] / gen['decode_s']:.2f} tok/s, server {srv['new_tokens'] / srv['decode_s']:.2f} "
              f"tok/s ({row['decode_ratio']:.3f}x); same text {row['same_text']}", flush=True)

    def mean(key: str) -> float:
        return sum(r[key] for r in rounds) / len(rounds)

    summary = {"prefill_ratio": mean("prefill_ratio"), "decode_ratio": mean("decode_ratio"),
               "all_same_text": all(r["same_text"] for r in rounds), "rounds": len(rounds),
               "prompt_tokens": rounds[0]["generate"]["prompt_tokens"] if rounds else None}
    print(json.dumps(summary), flush=True)
    out = {"data": args.data, "index": args.index, "max_tokens": args.max_tokens, "server": args.start,
           "generate_args": args.generate_args, "summary": summary, "rounds": rounds,
           "health_after": _health(args.url)}
    if args.warm_rounds:
        out["warm"] = _warm_with_server(doc, args)
    return out


def _library(args: argparse.Namespace) -> tuple[Any, Any]:
    """The pair and settings that `specextend generate --max-new-tokens N ARGS` runs, loaded here."""
    from .. import api
    from ..options import (
        add_method_arguments,
        add_model_arguments,
        add_tuning_arguments,
        model_options,
        settings_from_args,
    )

    p = argparse.ArgumentParser(prog="--generate-args")
    add_method_arguments(p)
    add_model_arguments(p)
    add_tuning_arguments(p)
    ns = p.parse_args(["--max-new-tokens", str(args.max_tokens), *shlex.split(args.generate_args)])
    settings = settings_from_args(ns)
    return api.load(ns.target, ns.draft, **model_options(ns), load_draft=settings.uses_draft), settings


def _warm_with_server(doc: str, args: argparse.Namespace) -> dict[str, Any]:
    """`warm` against a server of its own with the prefix cache on (--start), or the --url one."""
    if args.start is None:
        return warm(doc, args, args.url)
    log = (args.out or Path("results/serve.json")).with_suffix(".warm-server.log")
    with started(args.start, log) as (url, _pid):
        return warm(doc, args, url)


def warm(doc: str, args: argparse.Namespace, url: str) -> dict[str, Any]:
    """The decode alone at the same moments: the server at `url` against the library, both from
    their prompt's cached KV (one request each fills the caches first), alternated request by
    request `args.warm_rounds` times (the library first in even rounds)."""
    pair, settings = _library(args)
    with pair:
        pair.enable_prefix_cache(2 * pair.kv_bytes(len(pair.encode(doc)), settings) / 2**20)

        def library() -> dict[str, Any]:
            return _generated(pair.generate(doc, settings=settings).to_json())

        library()  # each side's first answer fills its cache
        _served_once(url, doc, args)
        rows = []
        for i in range(args.warm_rounds):
            if i % 2 == 0:
                lib = library()
                srv = _served_once(url, doc, args)
            else:
                srv = _served_once(url, doc, args)
                lib = library()
            rows.append({"round": i, "library": lib, "server": srv, "same_text": lib["text"] == srv["text"]})
            print(f"warm round {i}: decode library {lib['new_tokens'] / lib['decode_s']:.2f} tok/s ({lib['steps']} "
                  f"steps), server {srv['new_tokens'] / srv['decode_s']:.2f} tok/s ({srv['steps']} steps); cached "
                  f"prompt tokens {lib['cached_prompt_tokens']} / {srv['cached_prompt_tokens']}; same text "
                  f"{rows[-1]['same_text']}", flush=True)
    return {"rounds": rows, "summary": _warm_summary(rows)}


def _warm_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def median_rate(side: str) -> float:
        return statistics.median(r[side]["new_tokens"] / r[side]["decode_s"] for r in rows)

    lib, srv = median_rate("library"), median_rate("server")
    summary = {"rounds": len(rows), "library_decode_tok_s": lib, "server_decode_tok_s": srv,
               "decode_ratio": srv / lib, "all_same_text": all(r["same_text"] for r in rows),
               "all_cached": all(r[s]["cached_prompt_tokens"] > 0 for r in rows for s in ("library", "server"))}
    print(json.dumps({"warm": summary}), flush=True)
    return summary


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def memory(samples: list[tuple[float, float]], cache: dict[str, Any]) -> dict[str, Any]:
    """Resident memory over a load run against the prefix cache: growth from the first sample,
    how much of it the cache's own bytes explain, and growth over the last third (a leak keeps
    growing there; a full cache that evicts does not)."""
    if not samples:
        return {}
    values = [v for _, v in samples]
    last = values[len(values) * 2 // 3:]
    cap_mb, cache_mb = (cache.get("max_bytes") or 0) / 2**20, (cache.get("bytes") or 0) / 2**20
    growth = max(values) - values[0]
    return {"first": values[0], "max": max(values), "last": values[-1], "growth": growth, "cache_cap": cap_mb,
            "cache_bytes_mb": cache_mb, "growth_beyond_cache": growth - cache_mb,
            "growth_last_third": max(last) - last[0], "growth_within_cap": growth <= cap_mb}


class _Outcomes:
    """Every request's outcome by kind ("ok", "empty", "abandoned", "429", "error"), counted from
    the clients' threads, and the first errors' messages."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def note(self, kind: str, detail: str | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if detail and len(self.errors) < 20:
                self.errors.append(detail)

    def run(self, request: Any) -> None:
        """Make one request (a function returning its outcome's kind) and count how it ended."""
        import openai

        try:
            self.note(request())
        except openai.RateLimitError:
            self.note("429")
        except Exception as e:
            self.note("error", f"{type(e).__name__}: {e}")


class _RSSSampler:
    """The server's resident memory once a second, on a thread, while the block runs."""

    def __init__(self, pid: int | None) -> None:
        self.pid, self.samples = pid, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            v = _rss_mb(self.pid) if self.pid else None
            if v is not None:
                self.samples.append((time.perf_counter() - self.t_start, v))
            self.stop.wait(1.0)

    def __enter__(self) -> _RSSSampler:
        self.t_start = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def _short(client: Any, i: int, max_tokens: int) -> str:
    r = client.chat.completions.create(
        model="specextend", max_tokens=max_tokens,
        messages=[{"role": "user", "content": f"Request {i}: write a Python one-liner that adds {i} to x."}])
    return "ok" if r.choices[0].message.content is not None else "empty"


def _abandoned(client: Any, i: int) -> str:
    stream = client.chat.completions.create(
        model="specextend", max_tokens=256, stream=True,
        messages=[{"role": "user", "content": f"Stream {i}: explain Python generators at length."}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()  # the client goes away mid-answer
    return "abandoned"


def _send_all(client: Any, args: argparse.Namespace, outcomes: _Outcomes) -> None:
    """--requests short requests from --clients threads, with --abandoned streams spread among them."""
    every = max(1, args.requests // max(1, args.abandoned))
    jobs = []
    with ThreadPoolExecutor(args.clients) as pool:
        n_abandoned = 0
        for i in range(args.requests):
            jobs.append(pool.submit(outcomes.run, lambda i=i: _short(client, i, args.max_tokens)))
            if n_abandoned < args.abandoned and i % every == every - 1:
                jobs.append(pool.submit(outcomes.run, lambda n=n_abandoned: _abandoned(client, n)))
                n_abandoned += 1
        for j in jobs:
            j.result()


def load(args: argparse.Namespace) -> dict[str, Any]:
    client = _client(args.url, timeout=600)
    outcomes = _Outcomes()
    # One request first, not counted: buffers the models allocate on first use are not growth.
    client.chat.completions.create(model="specextend", max_tokens=args.max_tokens,
                                   messages=[{"role": "user", "content": "Warm up: say one word."}])
    with _RSSSampler(args.pid) as rss:
        t_start = time.perf_counter()
        _send_all(client, args, outcomes)
        wall = time.perf_counter() - t_start
        health = _health(args.url)
        # The server still answers after the load: one more request, timed.
        t0 = time.perf_counter()
        after = client.chat.completions.create(model="specextend", max_tokens=args.max_tokens,
                                               messages=[{"role": "user", "content": "Say hello."}])
        after_s = time.perf_counter() - t0
    out = {"server": args.start, "outcomes": dict(outcomes.counts), "errors": outcomes.errors, "wall_s": wall,
           "health_after": health, "answer_after_load": {"s": after_s, "text": after.choices[0].message.content},
           "rss_mb": memory(rss.samples, health.get("prefix_cache") or {}),
           "rss_samples": rss.samples}
    print(json.dumps({k: v for k, v in out.items() if k != "rss_samples"}, indent=1))
    return out


def _concurrent(args: argparse.Namespace) -> dict[str, Any]:
    from ..api import prepare
    from . import concurrent as cc

    enc = prepare(progress=False)

    def encode(text: str) -> list[int]:
        return enc.prompt_ids(text)

    if args.what == "concurrent":
        if args.data and args.same_document:
            doc = text_at(args.data, 0)
            prompts = [encode(f"{doc}\n\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}")
                       for i in range(args.clients)]
            name = f"{args.clients} questions at once about one {Path(args.data).stem} document"
        elif args.data:
            prompts = [encode(text_at(args.data, i)) for i in range(args.clients)]
            name = f"{args.clients} clients x {Path(args.data).stem}"
        else:
            prompts = [encode(cc.SHORT_PROMPTS[i % len(cc.SHORT_PROMPTS)] + (f" (variant {i})" if i >= 16 else ""))
                       for i in range(args.clients)]
            name = f"{args.clients} clients x short prompts"
        scenario = cc.Scenario(name, prompts, [args.max_tokens] * args.clients, [0.0] * args.clients)
    else:
        k = args.running
        prompts = [encode(cc.SHORT_PROMPTS[i]) for i in range(k)]
        prompts += [encode(text_at(args.data, args.index)), encode("Say one word.")]
        scenario = cc.Scenario(f"short prompt during a {Path(args.data).stem} prefill", prompts,
                               [args.running_tokens] * k + [args.max_tokens, 16],
                               [0.0] * k + [args.doc_at, args.doc_at + args.after], window=(k, k))
    args.out.mkdir(parents=True, exist_ok=True)
    result = cc.run(scenario, [k.strip() for k in args.servers.split(",") if k.strip()], args.serve_args, args.out,
                    encode, started, _health)
    (args.out / "summary.md").write_text(cc.table(result))
    cc.plot(result, args.out / "clients.png")
    print(cc.table(result), flush=True)
    return result


def replicas(args: argparse.Namespace) -> dict[str, Any]:
    docs = [text_at(args.data, i) for i in range(args.docs)]
    order = [(d, q) for q in range(args.questions)
             for d in (range(args.docs) if q % 2 == 0 else reversed(range(args.docs)))]
    questions = [f"Question {q + 1}: {QUESTIONS[q % len(QUESTIONS)]}" for q in range(args.questions)]
    runs: dict[str, list[dict[str, Any]]] = {}
    summary: dict[str, dict[str, Any]] = {}
    for routing in args.routing.split(","):
        out = args.out or Path("results/serve-replicas.json")
        flags = f"--replicas {args.replicas} --routing {routing} {args.serve_args}"
        with started(flags, out.with_suffix(f".{routing}.server.log")) as (url, _):
            client = _client(url)
            rows = []
            for d, q in order:
                r = _stream_one(client, f"{docs[d]}\n\n{questions[q]}", args.max_tokens)
                spec = r["usage"]["speculative"]
                row = {"doc": d, "question": q, "replica": spec["replica"], "ttft_s": r["ttft_s"],
                       "total_s": r["total_s"], "prompt_tokens": r["usage"]["prompt_tokens"],
                       "cached_prompt_tokens": spec["cached_prompt_tokens"], "prefill_s": spec["prefill_s"],
                       "text": r["text"], "completion_tokens": r["usage"]["completion_tokens"]}
                rows.append(row)
                print(f"{routing}: doc {d} question {q + 1} on {row['replica']}: ttft {row['ttft_s']:.2f} s, "
                      f"{row['cached_prompt_tokens']} of {row['prompt_tokens']} prompt tokens cached", flush=True)
            health = _health(url)
        firsts = [r["ttft_s"] for r in rows if r["question"] == 0]
        follow = [r["ttft_s"] for r in rows if r["question"] > 0]
        mean_first, mean_follow = sum(firsts) / len(firsts), sum(follow) / max(1, len(follow))
        summary[routing] = {
            "first_ttft_s": mean_first, "follow_up_ttft_s": mean_follow, "follow_up_share": mean_follow / mean_first,
            "follow_ups_cached": sum(r["cached_prompt_tokens"] >= 0.9 * r["prompt_tokens"]
                                     for r in rows if r["question"] > 0),
            "follow_ups": len(follow), "replicas_per_doc": {d: sorted({r["replica"] for r in rows if r["doc"] == d})
                                                            for d in range(args.docs)},
            "health_after": health}
        runs[routing] = rows
        print(f"{routing}: follow-up time to first token {100 * summary[routing]['follow_up_share']:.1f}% of the "
              f"first question's ({mean_follow:.2f} s / {mean_first:.2f} s)", flush=True)
    if args.ar:
        for d, q in sorted(set(order)):
            cmd = [sys.executable, "-m", "specextend.cli", "generate", "--json", "-q", "--chat", "--prompt-file", "-",
                   "--method", "ar", "--max-new-tokens", str(args.max_tokens), *shlex.split(args.generate_args)]
            out = subprocess.run(cmd, input=f"{docs[d]}\n\n{questions[q]}", capture_output=True, text=True,
                                 check=True)
            text = json.loads(out.stdout)["text"]
            for rows in runs.values():
                for r in rows:
                    if (r["doc"], r["question"]) == (d, q):
                        r["matches_ar"] = r["text"] == text
        for routing, rows in runs.items():
            summary[routing]["all_match_ar"] = all(r["matches_ar"] for r in rows)
            print(f"{routing}: every answer equals ar's: {summary[routing]['all_match_ar']}", flush=True)
    return {"data": args.data, "docs": args.docs, "questions": args.questions, "replicas": args.replicas,
            "serve_args": args.serve_args, "max_tokens": args.max_tokens, "summary": summary, "runs": runs}


def _server_options(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's base URL (http://127.0.0.1:8000)")
    where.add_argument("--start", metavar="ARGS", help="start `specextend serve --port 0 -q ARGS` for the run")


def _add_replicas(sub: Any) -> None:
    r = sub.add_parser("replicas", help="serve --replicas: follow-up questions' time to first token per routing")
    r.add_argument("--data", required=True, help="a JSONL file with field `text`: records 0.. are the documents")
    r.add_argument("--replicas", type=int, default=2)
    r.add_argument("--routing", default="affinity,round-robin", help="routings to run, in turn")
    r.add_argument("--docs", type=int, default=2)
    r.add_argument("--questions", type=int, default=3)
    r.add_argument("--max-tokens", type=int, default=32)
    r.add_argument("--serve-args", default="", metavar="ARGS", help="more flags for `specextend serve`")
    r.add_argument("--ar", action="store_true", help="check every answer against `specextend generate --method ar`")
    r.add_argument("--generate-args", default="", metavar="ARGS", help="model flags for generate (with --ar)")
    r.add_argument("--out", type=Path)


def _add_concurrent(sub: Any) -> None:
    for name in ("concurrent", "during"):
        q = sub.add_parser(name, help="many clients at once: ours, ours one at a time, llama-server -np N" if
                           name == "concurrent" else "a short prompt (and running streams) during a long prefill")
        q.add_argument("--servers", default="ours,ours-one,llama", help="any of ours, ours-one, llama")
        q.add_argument("--serve-args", default="", metavar="ARGS", help="flags for `specextend serve` (ours)")
        q.add_argument("--max-tokens", type=int, default=64)
        q.add_argument("--out", type=Path, required=True, help="folder for the JSON, summary.md and the plot")
        if name == "concurrent":
            q.add_argument("--data", help="a JSONL file: client i sends record i's text (default: short prompts)")
            q.add_argument("--clients", type=int, default=4)
            q.add_argument("--same-document", action="store_true",
                           help="every client asks its own question about --data's first record (one document, "
                                "questions at once)")
        else:
            q.add_argument("--data", required=True, help="a JSONL file with the long document")
            q.add_argument("--index", type=int, default=0)
            q.add_argument("--running", type=int, default=2, help="streams already running")
            q.add_argument("--running-tokens", type=int, default=256)
            q.add_argument("--doc-at", type=float, default=3.0, help="seconds after the streams start")
            q.add_argument("--after", type=float, default=2.0, help="the short prompt, seconds after the document")


def _add_single(sub: Any) -> None:
    one = sub.add_parser("single", help="one request alone: the server against `specextend generate`")
    _server_options(one)
    one.add_argument("--data", required=True, help="a JSONL file with field `text`")
    one.add_argument("--index", type=int, default=0)
    one.add_argument("--rounds", type=int, default=2)
    one.add_argument("--max-tokens", type=int, default=64)
    one.add_argument("--generate-args", default="", metavar="ARGS",
                     help="model and setting flags for generate (the server's --start ARGS should match)")
    one.add_argument("--request-fields", default="{}", metavar="JSON",
                     help="settings in the request body matching --generate-args (e.g. '{\"method\": \"sd\"}')")
    one.add_argument("--warm-rounds", type=int, default=0, metavar="N",
                     help="then N request-by-request rounds of the decode alone, both sides from their prompt's "
                          "cached KV (a second server with its prefix cache on, against the library in this process)")
    one.add_argument("--out", type=Path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specextend.bench.serve", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("ttft", help="time to first token: the same long document asked twice")
    _server_options(t)
    t.add_argument("--data", required=True, help="a JSONL file with field `text`")
    t.add_argument("--index", type=int, default=0)
    t.add_argument("--max-tokens", type=int, default=64)
    t.add_argument("--out", type=Path)
    ld = sub.add_parser("load", help="concurrent short requests and abandoned streams")
    _server_options(ld)
    ld.add_argument("--pid", type=int, help="the server's process id (with --url), to sample its resident memory")
    ld.add_argument("--requests", type=int, default=200)
    ld.add_argument("--clients", type=int, default=4)
    ld.add_argument("--abandoned", type=int, default=20)
    ld.add_argument("--max-tokens", type=int, default=8)
    ld.add_argument("--out", type=Path)
    c = sub.add_parser("compare", help="the server's answers of a ttft result against `specextend generate`")
    c.add_argument("result", type=Path, help="the JSON that `ttft --out` wrote")
    c.add_argument("--generate-args", default="", metavar="ARGS",
                   help="model and setting flags the server was started with, for generate too")
    c.add_argument("--out", type=Path)
    _add_concurrent(sub)
    _add_replicas(sub)
    _add_single(sub)
    args = p.parse_args(argv)
    if args.what == "single" and args.warm_rounds < 0:
        p.error(f"--warm-rounds must be 0 or more, got {args.warm_rounds}")
    if args.what == "concurrent" and args.same_document and not args.data:
        p.error("--same-document needs --data (the document's JSONL file)")
    if args.what in ("concurrent", "during"):
        result = _concurrent(args)
        (args.out / "result.json").write_text(json.dumps(result, indent=1))
        return 0
    if args.what in ("compare", "replicas"):
        result = compare(args) if args.what == "compare" else replicas(args)
    elif args.start is not None:
        log = (args.out or Path("results/serve.json")).with_suffix(".server.log")
        start = f"--cache-mb 0 {args.start}" if args.what == "single" else args.start
        with started(start, log) as (url, pid):
            args.url, args.pid = url, pid
            result = _measure(args)
    else:
        result = _measure(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 1 if _differs(args, result) else 0


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    return {"ttft": ttft, "load": load, "single": single}[args.what](args)


def _differs(args: argparse.Namespace, result: dict[str, Any]) -> bool:
    """Whether an answer differed from what it is checked against (compare, replicas --ar)."""
    if args.what == "compare":
        return not result["all_equal"]
    if args.what == "single":
        summaries = [result["summary"]] + ([result["warm"]["summary"]] if "warm" in result else [])
        return not all(summary["all_same_text"] for summary in summaries)
    return args.what == "replicas" and args.ar and not all(v["all_match_ar"] for v in result["summary"].values())


if __name__ == "__main__":
    raise SystemExit(main())
