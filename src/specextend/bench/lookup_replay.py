"""Prompt lookup replayed over recorded answers: how often each kind of lookup token is right.

    python -m specextend.bench.lookup_replay RESULTS_DIR [RESULTS_DIR ...] [--no-chat] [--json]

The sizer values a lookup token by the rate at which tokens of its kind (matched suffix length,
depth in the lookup trie, first or alternative branch: `sizing.lookup_key`) were accepted when
their parent was, learnt per request and starting from `sizing.LOOKUP_PRIOR`. This measures those
rates with no model run, from the `ar` rows of bench runs (the target's own greedy answers): at
every position of an answer it builds the trie the proposer would offer there (the same
`ContextIndex` and `Pool.add_continuation`, with the run's lookup settings) and counts, for each
token whose parent is right, whether it is right too. The prompts are rebuilt from the rows'
data sets and checked against their recorded token counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..common.errors import UserError
from ..common.jsonl import read_rows
from ..common.settings import Settings
from ..models.loader import load_tokenizer
from ..speculation.prompt_lookup import ContextIndex
from ..speculation.sizing import LOOKUP_KIND_DEPTH, LOOKUP_KIND_NGRAM, LOOKUP_PRIOR, lookup_key
from ..speculation.tree import Pool
from .data import builtin_code_inputs, data_length, encode_prompt, is_builtin, load_jsonl_inputs
from .report import latest_rows

Key = tuple[int, int, bool]
ROW_FIELDS = ("target", "data", "sample", "source", "prompt_tokens", "token_ids", "config")
LOOKUP_SETTINGS = ("lookup_ngram", "lookup_branches", "lookup_length")  # a run's own, else the defaults


def replay(prompt: list[int], answer: list[int], ngram: int, branches: int, length: int,
           counts: dict[Key, list[int]]) -> None:
    """Add to `counts[key] = [right, offered]` the lookup tokens offered along `answer`."""
    index = ContextIndex(prompt, len(prompt) + len(answer))
    for t in range(len(answer)):
        pool = Pool()
        for c in index.continuations(ngram, branches, length):
            pool.add_continuation(c.tokens, c.ngram)
        right: list[bool] = []  # per pool node; parents come before their children
        for i in range(len(pool)):
            up = pool.parents[i]
            at = t + pool.depths[i] - 1  # the answer position this token proposes
            counted = (up < 0 or right[up]) and at < len(answer)
            right.append(counted and pool.tokens[i] == answer[at])
            if counted:
                c = counts[lookup_key(pool.ngram[i], pool.depths[i], pool.alt[i])]
                c[0] += right[i]
                c[1] += 1
        index.append([answer[t]])


class Prompts:
    """Prompt ids of bench rows, rebuilt from their data sets with the run's tokenizer."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.tokenizers: dict[str, Any] = {}
        self.sets: dict[tuple[str, str], list[list[int]]] = {}

    def of(self, row: dict[str, Any]) -> list[int]:
        tok = self.tokenizers.get(row["target"])
        if tok is None:
            tok = self.tokenizers[row["target"]] = load_tokenizer(Path(row["target"]))
        data, sample = row["data"], row["sample"]
        ids = self.sets.setdefault((row["target"], data), [])
        if sample >= len(ids):
            if is_builtin(row["source"].split("/")[0]):  # "stdlib/argparse.py": the built-in code set
                n = data_length(data)
                found = builtin_code_inputs(tok, [n], sample + 1, self.chat) if n else []
                ids[:] = [s.prompt_ids for s in found]
            else:
                found = load_jsonl_inputs([row["source"]], limit=sample + 1)
                ids[:] = [encode_prompt(tok, s.text, self.chat) for s in found]
        if sample >= len(ids) or len(ids[sample]) != row["prompt_tokens"]:
            raise UserError(f"{data} sample {sample}: the rebuilt prompt is not the run's "
                            f"({row['prompt_tokens']} tokens); was the run made with{'' if self.chat else 'out'} "
                            "--no-chat, or has its data file changed?")
        return ids[sample]


def measure(dirs: list[Path], chat: bool = True) -> tuple[dict[Key, list[int]], int]:
    """Counts per lookup-token kind over every `ar` row of the runs, and how many answers."""
    prompts = Prompts(chat)
    counts: dict[Key, list[int]] = defaultdict(lambda: [0, 0])
    answers = 0
    for d in dirs:
        rows = [r for r in latest_rows(read_rows(d / "results.jsonl")) if r.get("method") == "ar"]
        if not rows:
            raise UserError(f"{d} has no ar rows (results.jsonl of a bench run with method ar)")
        for r in rows:
            missing = [k for k in ROW_FIELDS if k not in r]
            if missing:
                raise UserError(f"{d}: an ar row (sample {r.get('sample')}) lacks {', '.join(missing)}; "
                                "is it a bench run's results.jsonl?")
            s = Settings(**{k: v for k, v in r["config"].items() if k in LOOKUP_SETTINGS})
            replay(prompts.of(r), r["token_ids"], s.lookup_ngram, s.lookup_branches, s.lookup_length, counts)
            answers += 1
    return dict(counts), answers


def table(counts: dict[Key, list[int]], answers: int) -> str:
    lines = [f"lookup tokens offered along {answers} answers, right when their parent was right",
             "", "| match | depth | branch | right / offered | rate | prior |", "|---:|---:|---|---:|---:|---:|"]
    for key in sorted(counts):
        (n, d, alt), (right, offered) = key, counts[key]
        match, depth = f"{n}{'+' * (n == LOOKUP_KIND_NGRAM)}", f"{d}{'+' * (d == LOOKUP_KIND_DEPTH)}"
        lines.append(f"| {match} | {depth} | {'alt' if alt else 'first'} | {right} / {offered} "
                     f"| {right / offered:.2f} | {LOOKUP_PRIOR[key]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, metavar="RESULTS_DIR", help="bench output folders with ar rows")
    ap.add_argument("--no-chat", dest="chat", action="store_false", help="the runs were made with --no-chat")
    ap.add_argument("--json", action="store_true", help="print the counts as JSON")
    a = ap.parse_args(argv)
    try:
        counts, answers = measure(a.runs, a.chat)
    except UserError as e:
        print(f"specextend lookup_replay: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"answers": answers, "buckets": [
            {"match": k[0], "depth": k[1], "alt": k[2], "right": v[0], "offered": v[1], "prior": LOOKUP_PRIOR[k]}
            for k, v in sorted(counts.items())]}, indent=2))
    else:
        print(table(counts, answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
