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
--prefill shared`) and every configuration decodes from that state (`Pair.prefill`, then
`Pair.decode` per configuration). The table gives, per configuration, the mean rate, the mean
and the smallest per-prompt ratio to `ar` and to the better of `ar` and `sd` (when `method=sd` is
one of the points), tau and how many outputs equal `ar`'s. Used to choose the defaults in
common/settings.py; the tables behind docs/benchmarks.md's "Measured choices"
(docs/log/2026-11-measured-choices.md) come from this script.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..common.errors import UserError
from ..common.jsonl import append_jsonl, read_rows
from ..common.settings import Settings, parse_assignments
from ..options import add_model_arguments, model_options
from .data import builtin_code_inputs, encode_samples, is_builtin, load_jsonl_inputs, parse_lengths
from .report import mean

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


def _parser() -> argparse.ArgumentParser:
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
    return ap


def sweep(argv: list[str] | None = None) -> int:
    from .. import api

    a = _parser().parse_args(argv)
    if a.report:
        return report(Path(a.report))
    if not a.data:
        raise UserError("--data is required (a JSONL file, or stdlib)")
    if a.samples <= 0 or a.max_new_tokens <= 0 or a.start < 0:
        raise UserError("--samples and --max-new-tokens must be positive, --start not negative")
    runs = configurations(a.base, a.grid, a.point, a.max_new_tokens)  # every one checked before the models load
    needs_draft = any(s.uses_draft for _, s in runs)
    pair = api.load(a.target, a.draft, **model_options(a), load_draft=needs_draft)
    pair.warmup()
    prompts = load_prompts(a.data, a.lengths, a.start + a.samples, pair.tokenizer, not a.no_chat)[a.start:]
    # One prefill per prompt serves every configuration: the draft's too when any of them drafts.
    prefill = Settings(method="sd" if needs_draft else "ar", attention="efficient", max_new_tokens=a.max_new_tokens)
    bar = tqdm(total=len(prompts) * (len(runs) + 1), file=sys.stderr, desc="sweep")
    rows = []
    for i, ids in enumerate(prompts, a.start):
        bar.set_postfix_str(f"prompt {i}: prefill {len(ids)} tokens")
        state = pair.prefill(ids, prefill)
        bar.update()
        for row in decode_all(pair, state, runs, bar, sample=i):
            rows.append(row)
            if a.out:
                append_jsonl(Path(a.out), row)
        del state
    bar.close()
    print(table(rows, [p for p, _ in runs]))
    return 0


def configurations(base: list[str], grid: list[str], points: list[str], max_new_tokens: int
                   ) -> list[tuple[dict[str, Any], Settings]]:
    """(point, resolved settings) of every run: `ar` first (the reference), then base + each point."""
    common = parse_assignments(base, "--base", refused=REFUSED)
    runs = [({"method": "ar"}, Settings(method="ar", max_new_tokens=max_new_tokens).resolved())]
    for p in parse_grid(grid) + parse_points(points) or [{}]:
        runs.append((p, Settings(**{**common, **p, "max_new_tokens": max_new_tokens}).resolved()))
    return runs


def decode_all(pair: Any, state: Any, runs: list[tuple[dict[str, Any], Settings]], bar: Any, sample: int
               ) -> Iterator[dict[str, Any]]:
    """One row per configuration, each decoded from the same prefilled prompt; `ar` comes first."""
    ar = None
    for point, s in runs:
        bar.set_postfix_str(f"prompt {sample}: {describe(point)}")
        t = time.perf_counter()
        state.forget_draft()  # each configuration computes the draft's prompt KV it reads, as alone
        r = pair.decode(state, s)
        wall = time.perf_counter() - t
        ar = ar or r
        yield {"sample": sample, "prompt_tokens": r.prompt_tokens, "point": point, "tok_s": r.decode_tokens_per_s,
               "tau": r.accepted_per_step, "steps": r.steps, "new_tokens": r.new_tokens, "phases": r.phases,
               "wall_s": wall, "speedup": r.decode_tokens_per_s / ar.decode_tokens_per_s,
               "matches_ar": r.token_ids == ar.token_ids, "extra": r.extra}
        bar.update()


def report(path: Path) -> int:
    """The table of a finished (or resumed) run's rows, configurations in first-seen order."""
    if not path.is_file():
        raise UserError(f"cannot read sweep rows from {path}: no such file")
    rows = read_rows(path)
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
    return mean([r[key] if key in r else r["phases"].get(key, 0.0) for r in rows]) or 0.0


if __name__ == "__main__":
    sys.exit(main())
