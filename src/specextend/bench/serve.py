"""Measure a running `specextend serve` through the official `openai` client (a dev dependency).

    python -m specextend.bench.serve ttft --url http://127.0.0.1:8000 \
        --data ../shared/data/govreport/govreport_8K.jsonl --index 0 --out results/serve-ttft.json
    python -m specextend.bench.serve load --url http://127.0.0.1:8000 --pid PID \
        --requests 200 --clients 4 --abandoned 20 --out results/serve-load.json

`ttft`: the same long document (field `text` of a JSONL record) as a chat message followed by
one question, then by another; each request streams, and time to first token is from sending
the request to the first chunk with text. `load`: short chat requests from concurrent clients
plus streams abandoned after their first chunk, counting every outcome by kind and sampling the
server's resident memory (from /proc, given its pid).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

QUESTIONS = ("In one sentence, what is this report about?", "List two numbers that the report mentions.")


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
    from ..cli import read_jsonl_text

    doc = read_jsonl_text(args.data, args.index)
    client = _client(args.url)
    runs = []
    for q in QUESTIONS:
        r = _stream_one(client, f"{doc}\n\n{q}", args.max_tokens)
        r["question"] = q
        runs.append(r)
        spec = (r["usage"] or {}).get("speculative", {})
        print(f"ttft {r['ttft_s']:.2f} s, total {r['total_s']:.2f} s, prompt {r['usage']['prompt_tokens']} tokens "
              f"({spec.get('cached_prompt_tokens')} cached), prefill {spec.get('prefill_s', 0):.2f} s", flush=True)
    return {"runs": runs, "ttft_ratio": runs[1]["ttft_s"] / runs[0]["ttft_s"]}


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def load(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    client = _client(args.url, timeout=600)
    outcomes: Counter[str] = Counter()
    errors: list[str] = []
    lock = threading.Lock()
    rss: list[tuple[float, float]] = []
    stop = threading.Event()
    t_start = time.perf_counter()

    def sample() -> None:
        while not stop.is_set():
            v = _rss_mb(args.pid) if args.pid else None
            if v is not None:
                rss.append((time.perf_counter() - t_start, v))
            stop.wait(1.0)

    def note(kind: str, detail: str | None = None) -> None:
        with lock:
            outcomes[kind] += 1
            if detail and len(errors) < 20:
                errors.append(detail)

    def short(i: int) -> None:
        try:
            r = client.chat.completions.create(
                model="specextend", max_tokens=args.max_tokens,
                messages=[{"role": "user", "content": f"Request {i}: write a Python one-liner that adds {i} to x."}])
            note("ok" if r.choices[0].message.content is not None else "empty")
        except openai.RateLimitError:
            note("429")
        except Exception as e:
            note("error", f"{type(e).__name__}: {e}")

    def abandoned(i: int) -> None:
        try:
            stream = client.chat.completions.create(
                model="specextend", max_tokens=256, stream=True,
                messages=[{"role": "user", "content": f"Stream {i}: explain Python generators at length."}])
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    break
            stream.close()  # the client goes away mid-answer
            note("abandoned")
        except openai.RateLimitError:
            note("429")
        except Exception as e:
            note("error", f"{type(e).__name__}: {e}")

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    every = max(1, args.requests // max(1, args.abandoned))
    jobs = []
    with ThreadPoolExecutor(args.clients) as pool:
        n_abandoned = 0
        for i in range(args.requests):
            jobs.append(pool.submit(short, i))
            if n_abandoned < args.abandoned and i % every == every - 1:
                jobs.append(pool.submit(abandoned, n_abandoned))
                n_abandoned += 1
        for j in jobs:
            j.result()
    wall = time.perf_counter() - t_start
    import urllib.request

    with urllib.request.urlopen(f"{args.url.rstrip('/')}/health", timeout=30) as r:
        health = json.loads(r.read())
    stop.set()
    sampler.join()
    values = [v for _, v in rss]
    out = {"outcomes": dict(outcomes), "errors": errors, "wall_s": wall, "health_after": health,
           "rss_mb": {"first": values[0] if values else None, "max": max(values) if values else None,
                      "last": values[-1] if values else None}, "rss_samples": rss}
    print(json.dumps({k: v for k, v in out.items() if k != "rss_samples"}, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specextend.bench.serve", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("ttft", help="time to first token: the same long document asked twice")
    t.add_argument("--url", required=True)
    t.add_argument("--data", required=True, help="a JSONL file with field `text`")
    t.add_argument("--index", type=int, default=0)
    t.add_argument("--max-tokens", type=int, default=64)
    t.add_argument("--out", type=Path)
    ld = sub.add_parser("load", help="concurrent short requests and abandoned streams")
    ld.add_argument("--url", required=True)
    ld.add_argument("--pid", type=int, help="the server's process id, to sample its resident memory")
    ld.add_argument("--requests", type=int, default=200)
    ld.add_argument("--clients", type=int, default=4)
    ld.add_argument("--abandoned", type=int, default=20)
    ld.add_argument("--max-tokens", type=int, default=8)
    ld.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    result = ttft(args) if args.what == "ttft" else load(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
