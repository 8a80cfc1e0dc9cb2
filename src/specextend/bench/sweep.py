"""Parameter sweep: one prefill per prompt, many decodes with different settings, side by side.

    python -m specextend.bench.sweep --data ../shared/data/govreport/govreport_2K.jsonl \
        --samples 2 --max-new-tokens 128 --base method=sd \
        --grid tree_budget=4,8,12 --grid tree_depth=4,6 [--draft-dtype bfloat16] [--out sweep.jsonl]

Every configuration is the base settings plus one point of the grid (a cartesian product);
`ar` runs once per prompt as the reference for speedups and exactness. Used to choose the
defaults in settings.py; the tables in the README come from runs of this script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

from tqdm import tqdm

from ..settings import Settings


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_grid(items: list[str]) -> list[dict]:
    keys, values = [], []
    names = {f.name for f in fields(Settings)}
    for item in items:
        key, _, vals = item.partition("=")
        if key not in names:
            raise SystemExit(f"unknown setting {key!r}")
        keys.append(key)
        values.append([_value(v) for v in vals.split(",")])
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)] or [{}]


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
    from ..api import load

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-dtype")
    ap.add_argument("--data", required=True)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-chat", action="store_true")
    ap.add_argument("--base", action="append", default=[], help="key=value applied to every run")
    ap.add_argument("--grid", action="append", default=[], help="key=v1,v2,... (cartesian product)")
    ap.add_argument("--out", help="append one JSON line per run here")
    a = ap.parse_args(argv)

    base = {k: _value(v) for k, _, v in (b.partition("=") for b in a.base)}
    grid = parse_grid(a.grid)
    pair = load(a.target, a.draft, dtype=a.dtype, draft_dtype=a.draft_dtype)
    pair.engine.warmup()
    prompts = load_prompts(a.data, a.samples, pair.tokenizer, not a.no_chat)
    eng = pair.engine
    rows = []
    bar = tqdm(total=len(prompts) * (len(grid) + 1), file=sys.stderr, desc="sweep")
    for i, ids in enumerate(prompts):
        states = {}
        ar = None
        for point in [None, *grid]:
            s = Settings(method="ar", max_new_tokens=a.max_new_tokens) if point is None else \
                Settings(**{**base, **point, "max_new_tokens": a.max_new_tokens})
            s = s.resolved()
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
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
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
