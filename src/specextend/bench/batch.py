"""Batching from Python measured: a list of prompts in one `generate` call against one call each.

A list through `pair.generate([...])` runs in one continuous batch (batching/runner.py).

    python -m specextend.bench.batch [--prompts 16] [--max-new-tokens 128] [--methods ar,specextend]
                                     [--rounds 1] [--out FILE.json]

The prompts are the serve bench's short chat prompts (bench/concurrent.py), so the figure sits
beside the server's 16-short-clients scenario. One short generation each way per method runs
first and is not counted (first-use costs: the batch's measurement of the step costs, buffers).
Per method and round the two ways run back to back, one at a time first; the throughput is
generated tokens over wall time, and every batched answer is checked against the same prompt's
answer alone."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .. import api
from ..common.settings import METHODS
from ..options import OneLineParser
from .concurrent import SHORT_PROMPTS
from .report import write_text_atomic


def one_at_a_time(pair: Any, prompts: list[str], method: str, max_new: int) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    out = [list(pair.generate(p, chat=True, method=method, max_new_tokens=max_new).token_ids)
           for p in tqdm(prompts, desc=f"{method} one at a time", leave=False)]
    return time.perf_counter() - t, out


def batched(pair: Any, prompts: list[str], method: str, max_new: int) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    results = pair.generate(list(prompts), chat=True, method=method, max_new_tokens=max_new)
    return time.perf_counter() - t, [list(r.token_ids) for r in results]


def measure(pair: Any, prompts: list[str], method: str, max_new: int, rounds: int) -> dict[str, Any]:
    """Both ways, `rounds` times each; the best wall time of each counts."""
    # First uses, not counted: each way's buffers, and the batch's (its engine measures the step
    # costs on a machine that has not cached them yet: tens of seconds).
    pair.generate(prompts[0], chat=True, method=method, max_new_tokens=8)
    pair.generate(list(prompts[:2]), chat=True, method=method, max_new_tokens=8)
    alone_s, batch_s, equal = [], [], []
    tokens = 0
    for _ in range(rounds):
        s, alone = one_at_a_time(pair, prompts, method, max_new)
        alone_s.append(s)
        s, together = batched(pair, prompts, method, max_new)
        batch_s.append(s)
        tokens = sum(len(t) for t in alone)
        equal.append(sum(a == b for a, b in zip(alone, together, strict=True)))
    one, many = min(alone_s), min(batch_s)
    return {"method": method, "prompts": len(prompts), "max_new_tokens": max_new, "rounds": rounds,
            "generated_tokens": tokens, "one_at_a_time_s": alone_s, "batched_s": batch_s,
            "one_at_a_time_tok_s": tokens / one, "batched_tok_s": tokens / many, "speedup": one / many,
            "equal_to_alone": min(equal)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| method | prompts | tokens | one at a time (s, tok/s) | batched (s, tok/s) | speedup | = alone |",
             "|---|---:|---:|---|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['prompts']} | {r['generated_tokens']} | "
                     f"{min(r['one_at_a_time_s']):.1f}, {r['one_at_a_time_tok_s']:.1f} | "
                     f"{min(r['batched_s']):.1f}, {r['batched_tok_s']:.1f} | **{r['speedup']:.2f}x** | "
                     f"{r['equal_to_alone']}/{r['prompts']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help=f"how many short prompts (1-{len(SHORT_PROMPTS)})")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="ar,specextend", help="comma-separated decoding methods")
    ap.add_argument("--rounds", type=int, default=1, help="runs of both ways per method (the best counts)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    a: argparse.Namespace = ap.parse_args(argv)
    if not 1 <= a.prompts <= len(SHORT_PROMPTS):
        ap.error(f"--prompts must be 1-{len(SHORT_PROMPTS)}")
    if a.rounds < 1 or a.max_new_tokens < 1:
        ap.error("--rounds and --max-new-tokens must be at least 1")
    methods = a.methods.split(",")
    if unknown := [m for m in methods if m not in METHODS]:
        ap.error(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}")
    prompts = list(SHORT_PROMPTS[:a.prompts])
    with api.load() as pair:
        rows = [measure(pair, prompts, m, a.max_new_tokens, a.rounds) for m in methods]
        kernels = pair.last_result.cpu_kernels
    print(table(rows))
    if a.out is not None:
        write_text_atomic(a.out, json.dumps({"cpu_kernels": kernels, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
