"""Parameter sweep: one prefill per prompt, many decodes with different settings, side by side.

    python -m specextend.bench.sweep --data ../shared/data/govreport/govreport_2K.jsonl \
        --samples 2 --max-new-tokens 128 --base method=sd \
        --grid tree_budget=4,8,12 --grid tree_depth=4,6 [--draft-dtype bfloat16] [--out sweep.jsonl]

Every configuration is the base settings plus one point of the grid (a cartesian product);
`ar` runs once per prompt as the reference for speedups and exactness. Values are parsed as
`bench --set` parses them (settings.parse_assignments). Used to choose the defaults in
settings.py; the tables in the README come from runs of this script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..errors import UserError
from ..jsonl import append_jsonl
from ..models.loader import add_model_arguments, model_options
from ..settings import Settings, parse_assignments

# --max-new-tokens sets every run's length; a --base or --grid value for it would be overridden.
REFUSED = {"max_new_tokens": "--max-new-tokens"}


def parse_grid(items: list[str]) -> list[dict[str, Any]]:
    """--grid key=v1,v2,... items -> every combination of their values (a cartesian product)."""
    axes = []  # per item, one single-setting dict per value
    for item in items:
        key, _, values = item.partition("=")
        axes.append([parse_assignments([f"{key}={v}"], "--grid", refused=REFUSED) for v in values.split(",")])
    return [{k: v for point in combo for k, v in point.items()} for combo in itertools.product(*axes)] or [{}]


def load_prompts(path: str, samples: int, tokenizer, chat: bool) -> list[list[int]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][:samples]
    out = []
    for r in rows:
        text = r["text"]
        if chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m specextend.bench.sweep`; bad input: one line on stderr, exit 2."""
    try:
        return sweep(argv)
    except UserError as e:
        print(f"specextend sweep: error: {e}", file=sys.stderr)
        return 2


def sweep(argv: list[str] | None = None) -> int:
    from ..api import load

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap)
    ap.add_argument("--data", required=True)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-chat", action="store_true")
    ap.add_argument("--base", action="append", default=[], help="key=value applied to every run")
    ap.add_argument("--grid", action="append", default=[], help="key=v1,v2,... (cartesian product)")
    ap.add_argument("--out", help="append one JSON line per run here")
    a = ap.parse_args(argv)

    base = parse_assignments(a.base, "--base", refused=REFUSED)
    grid = parse_grid(a.grid)
    # Every configuration is checked before the models load.
    runs = [(None, Settings(method="ar", max_new_tokens=a.max_new_tokens).resolved())]
    runs += [(point, Settings(**{**base, **point, "max_new_tokens": a.max_new_tokens}).resolved()) for point in grid]
    pair = load(a.target, a.draft, **model_options(a))
    pair.engine.warmup()
    prompts = load_prompts(a.data, a.samples, pair.tokenizer, not a.no_chat)
    eng = pair.engine
    rows = []
    bar = tqdm(total=len(prompts) * (len(grid) + 1), file=sys.stderr, desc="sweep")
    for i, ids in enumerate(prompts):
        states = {}
        ar = None
        for point, s in runs:
            if s.attention not in states:
                states[s.attention] = eng.prefill(ids, Settings(**{**base, "method": "sd",
                                                                   "attention": s.attention,
                                                                   "max_new_tokens": a.max_new_tokens}))
            t = time.perf_counter()
            r = eng.decode(states[s.attention], s)
            wall = time.perf_counter() - t
            if point is None:
                ar = r
            row = {"sample": i, "prompt_tokens": len(ids), "point": point or {"method": "ar"},
                   "tok_s": r.decode_tokens_per_s, "tau": r.accepted_per_step, "steps": r.steps,
                   "new_tokens": r.new_tokens, "phases": r.phases, "wall_s": wall,
                   "speedup": r.decode_tokens_per_s / ar.decode_tokens_per_s,
                   "matches_ar": r.token_ids == ar.token_ids[: len(r.token_ids)], "extra": r.extra}
            rows.append(row)
            if a.out:
                append_jsonl(Path(a.out), row)
            bar.update()
    bar.close()

    print(f"{'setting':60s} {'tok/s':>7s} {'x ar':>6s} {'tau':>5s} {'draft_s':>8s} {'verify_s':>8s} {'match':>5s}")
    for point in [None, *grid]:
        key = point or {"method": "ar"}
        sel = [r for r in rows if r["point"] == key]
        n = len(sel)
        desc = ",".join(f"{k}={v}" for k, v in key.items())
        print(f"{desc:60s} {sum(r['tok_s'] for r in sel) / n:7.2f} {sum(r['speedup'] for r in sel) / n:6.2f} "
              f"{sum(r['tau'] for r in sel) / n:5.2f} {sum(r['phases']['draft_s'] for r in sel) / n:8.2f} "
              f"{sum(r['phases']['verify_s'] for r in sel) / n:8.2f} {sum(r['matches_ar'] for r in sel)}/{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
