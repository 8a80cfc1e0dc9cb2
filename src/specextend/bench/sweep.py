"""Parameter sweep: one prefill per prompt, many decodes with different settings, side by side.

    python -m specextend.bench.sweep --data ../shared/data/govreport/govreport_4K.jsonl \
        --samples 8 --max-new-tokens 128 --base method=specextend \
        --grid retrieve_every=4,8 --grid top_k_chunks=16,32 \
        --point method=sd --point method=specextend,adaptive_refresh=true [--out sweep.jsonl]

Every configuration is the base settings plus one point: each combination of the `--grid` axes
(a cartesian product) and each `--point` (one configuration, KEY=VALUE pairs joined by commas).
`--data stdlib --lengths 2K` runs the built-in code set. `ar` runs once per prompt as the
reference for speedups and exactness. Values are parsed as `bench --set` parses them
(settings.parse_assignments). Each prompt is prefilled once (efficient attention, as `bench
--prefill shared`) and every configuration decodes from a copy of that state. The table gives,
per configuration, the mean rate, the mean and the smallest per-prompt ratio to `ar` and to the
better of `ar` and `sd` (when `method=sd` is one of the points), tau and how many outputs equal
`ar`'s. Used to choose the defaults in settings.py; the README's tables come from this script.
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
from .data import builtin_code_inputs, encode_samples, is_builtin, load_jsonl_inputs, parse_lengths

# --max-new-tokens sets every run's length; a --base, --grid or --point value for it would be overridden.
REFUSED = {"max_new_tokens": "--max-new-tokens"}


def parse_grid(items: list[str]) -> list[dict[str, Any]]:
    """--grid key=v1,v2,... items -> every combination of their values (a cartesian product)."""
    if not items:
        return []
    axes = []  # per item, one single-setting dict per value
    for item in items:
        key, _, values = item.partition("=")
        axes.append([parse_assignments([f"{key}={v}"], "--grid", refused=REFUSED) for v in values.split(",")])
    return [{k: v for point in combo for k, v in point.items()} for combo in itertools.product(*axes)]


def parse_points(items: list[str]) -> list[dict[str, Any]]:
    """--point k=v,k2=v2 items -> one configuration each."""
    return [parse_assignments([p for p in item.split(",") if p], "--point", refused=REFUSED) for item in items]


def describe(point: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in point.items()) or "(base)"


def load_prompts(data: str, lengths: str | None, samples: int, tokenizer: Any, chat: bool) -> list[list[int]]:
    """Token ids of the first `samples` prompts of a JSONL file, or of the built-in code set."""
    if is_builtin(data):
        found = builtin_code_inputs(tokenizer, parse_lengths(lengths or "2K"), samples, chat)
    else:
        found = load_jsonl_inputs([data], samples)
        encode_samples(found, tokenizer, chat)
    return [s.prompt_ids for s in found]


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
    ap.add_argument("--data", help="a JSONL file (field `text`), or `stdlib` for the built-in code set")
    ap.add_argument("--lengths", help="the built-in code set's cut, e.g. 2K (default 2K)")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--start", type=int, default=0, help="skip this many prompts first (to resume a cut run)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-chat", action="store_true")
    ap.add_argument("--base", action="append", default=[], help="key=value applied to every run")
    ap.add_argument("--grid", action="append", default=[], help="key=v1,v2,... (cartesian product)")
    ap.add_argument("--point", action="append", default=[], help="key=v,key2=v2: one more configuration")
    ap.add_argument("--out", help="append one JSON line per run here")
    ap.add_argument("--report", metavar="ROWS", help="only print the table of a run's --out file")
    a = ap.parse_args(argv)
    if a.report:
        return report(Path(a.report))
    if not a.data:
        raise UserError("--data is required (a JSONL file, or stdlib)")
    if a.samples <= 0 or a.max_new_tokens <= 0 or a.start < 0:
        raise UserError("--samples and --max-new-tokens must be positive, --start not negative")

    base = parse_assignments(a.base, "--base", refused=REFUSED)
    points = parse_grid(a.grid) + parse_points(a.point) or [{}]
    # Every configuration is checked before the models load.
    reference = {"method": "ar"}
    runs = [(reference, Settings(method="ar", max_new_tokens=a.max_new_tokens).resolved())]
    runs += [(p, Settings(**{**base, **p, "max_new_tokens": a.max_new_tokens}).resolved()) for p in points]
    needs_draft = any(s.uses_draft for _, s in runs)
    pair = load(a.target, a.draft, **model_options(a), load_draft=needs_draft)
    pair.engine.warmup()
    prompts = load_prompts(a.data, a.lengths, a.start + a.samples, pair.tokenizer, not a.no_chat)[a.start:]
    eng = pair.engine
    rows = []
    bar = tqdm(total=len(prompts) * (len(runs) + 1), file=sys.stderr, desc="sweep")
    for i, ids in enumerate(prompts, a.start):
        bar.set_postfix_str(f"prompt {i}: prefill {len(ids)} tokens")
        state = eng.prefill(ids, Settings(method="sd" if needs_draft else "ar", attention="efficient",
                                          max_new_tokens=a.max_new_tokens))
        bar.update()
        ar = None
        for point, s in runs:
            bar.set_postfix_str(f"prompt {i}: {describe(point)}")
            t = time.perf_counter()
            r = eng.decode(state, s)
            wall = time.perf_counter() - t
            if ar is None:
                ar = r
            row = {"sample": i, "prompt_tokens": len(ids), "point": point, "tok_s": r.decode_tokens_per_s,
                   "tau": r.accepted_per_step, "steps": r.steps, "new_tokens": r.new_tokens, "phases": r.phases,
                   "wall_s": wall, "speedup": r.decode_tokens_per_s / ar.decode_tokens_per_s,
                   "matches_ar": r.token_ids == ar.token_ids, "extra": r.extra}
            rows.append(row)
            if a.out:
                append_jsonl(Path(a.out), row)
            bar.update()
        del state
    bar.close()
    print(table(rows, [p for p, _ in runs]))
    return 0


def report(path: Path) -> int:
    """The table of a finished (or resumed) run's rows, configurations in first-seen order."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read sweep rows from {path}: {e}") from None
    points: list[dict[str, Any]] = []
    for r in rows:
        if r["point"] not in points:
            points.append(r["point"])
    print(f"{len({r['sample'] for r in rows})} prompts, {len(rows)} runs")
    print(table(rows, points))
    return 0


def table(rows: list[dict[str, Any]], points: list[dict[str, Any]]) -> str:
    """One line per configuration: means over prompts, and the worst prompt's ratios."""
    sd = {r["sample"]: r["tok_s"] for r in rows if r["point"] == {"method": "sd"}}
    ar = {r["sample"]: r["tok_s"] for r in rows if r["point"] == {"method": "ar"}}
    lines = ["| setting | tok/s | × ar | min × ar | min × best(ar, sd) | tau | draft s | verify s | = ar |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for point in points:
        sel = [r for r in rows if r["point"] == point]
        if not sel:
            continue
        best = [r["tok_s"] / max(ar[r["sample"]], sd[r["sample"]]) for r in sel if r["sample"] in sd]
        lines.append(
            f"| {describe(point)} | {_mean(sel, 'tok_s'):.2f} | {_mean(sel, 'speedup'):.2f} "
            f"| {min(r['speedup'] for r in sel):.2f} | {f'{min(best):.2f}' if best else '-'} "
            f"| {_mean(sel, 'tau'):.2f} | {_mean(sel, 'draft_s'):.2f} | {_mean(sel, 'verify_s'):.2f} "
            f"| {sum(r['matches_ar'] for r in sel)}/{len(sel)} |")
    return "\n".join(lines)


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    """Mean of a row field, or of a phase's seconds (phases a method lacks count as 0)."""
    return sum(r[key] if key in r else r["phases"].get(key, 0.0) for r in rows) / len(rows)


if __name__ == "__main__":
    sys.exit(main())
