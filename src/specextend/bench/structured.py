"""JSON extraction over long reports: structured outputs under speculation, measured.

    python -m specextend.bench.structured --data .../govreport_2K.jsonl .../govreport_8K.jsonl --samples 8 --out DIR

Each report (the record's text after its own instruction) is put under an extraction instruction
as a chat turn, prefilled once, then decoded by every method twice: constrained by the JSON schema
of `ReportFacts` (7 fields) and unconstrained. Per row: the decode speed, whether the output
equals `ar`'s under the same constraint token for token, whether a constrained output parses and
validates against the schema (with pydantic, independently of the grammar engine), the grammar's
forced tokens proposed and accepted, and the logits processor's seconds (grammar masks for every
verified row, lookup cuts, forced tokens). `DIR/results.jsonl` (resumable), `DIR/summary.md`
and `DIR/summary.json`: per data set and method, decode tok/s and its ratio to `ar` with and
without the schema, and the grammar's work per step as a share of a one-row target step (the
unconstrained `ar` step of the same prompt).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError
from tqdm import tqdm

from ..api import Pair, load
from ..common.errors import UserError
from ..common.jsonl import finite_json
from ..runtime.kernels import path as kernel_path
from .data import data_name, load_jsonl_inputs, resolve_data_path

INSTRUCTION = ("Read the report below and extract its key facts as one JSON object with the fields title, "
               "agencies, topic, year, key_findings, has_recommendations and summary.\n\n### Report:\n\n")


class ReportFacts(BaseModel):
    """What the benchmark extracts: 7 fields, with bounds that keep an answer within the budget."""

    title: str = Field(max_length=120)
    agencies: list[str] = Field(max_length=4)
    topic: str = Field(max_length=80)
    year: int = Field(ge=1990, le=2030)
    key_findings: list[str] = Field(max_length=3)
    has_recommendations: bool
    summary: str = Field(max_length=300)


def schema() -> dict[str, Any]:
    s = ReportFacts.model_json_schema()
    s["additionalProperties"] = False
    # Bound each list item too (pydantic's max_length above bounds the item counts).
    s["properties"]["agencies"]["items"]["maxLength"] = 80
    s["properties"]["key_findings"]["items"]["maxLength"] = 160
    return s


def response_format() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "ReportFacts", "schema": schema(), "strict": True}}


def report_text(text: str) -> str:
    """The report itself: GovReport records start with their own summarisation instruction."""
    marker = "### Text:"
    return text.split(marker, 1)[1].strip() if marker in text else text.strip()


def valid(text: str) -> bool:
    try:
        ReportFacts.model_validate_json(text, strict=True)
    except ValidationError:
        return False
    return True


def run_sample(pair: Pair, ids: list[int], methods: list[str], max_new: int, constrained: list[bool],
               extra: dict[str, Any]) -> list[dict[str, Any]]:
    rf = pair.grammar(response_format())
    state = pair.prefill(ids, method="specextend", max_new_tokens=max_new)
    rows = []
    for c in constrained:
        ar_ids = None
        for m in methods:
            state.forget_draft()  # each method computes the draft KV it reads, as it would alone
            r = pair.decode(state, method=m, max_new_tokens=max_new, response_format=rf if c else None,
                            **(extra if m != "ar" else {}))
            if m == "ar":
                ar_ids = r.token_ids
            rows.append({
                "method": m, "constrained": c, "new_tokens": r.new_tokens, "decode_s": r.decode_s,
                "decode_tokens_per_s": r.decode_tokens_per_s, "steps": r.steps,
                "accepted_per_step": r.accepted_per_step, "stop_reason": r.stop_reason,
                "matches_ar": r.token_ids == ar_ids, "valid": valid(r.text) if c else None,
                "processor_s": r.extra.get("processor_s", 0.0), "forced_nodes": r.extra.get("forced_nodes", 0.0),
                "forced_accepted": r.extra.get("forced_accepted", 0.0),
                "lookup_accepted": r.extra.get("lookup_accepted", 0.0),
                "draft_started_at": r.extra.get("draft_started_at"), "prompt_tokens": r.prompt_tokens,
                "prefill_s": r.prefill_s, "text": r.text, "cpu_kernels": r.cpu_kernels,
            })
    return rows


def summarise(rows: list[dict[str, Any]], methods: list[str]) -> tuple[str, list[dict[str, Any]]]:
    key = {(r["data"], r["sample"], r["method"], r["constrained"]): r for r in rows}
    datas = sorted({r["data"] for r in rows}, key=lambda d: (len(d), d))
    table, out = [], []
    for d in datas:
        samples = sorted({r["sample"] for r in rows if r["data"] == d})
        ar_step = {i: key[(d, i, "ar", False)]["decode_s"] / max(1, key[(d, i, "ar", False)]["steps"])
                   for i in samples if (d, i, "ar", False) in key}
        for m in methods:
            cell: dict[str, Any] = {"data": d, "method": m, "samples": len(samples)}
            for c, tag in ((True, "json"), (False, "free")):
                got = [(i, key[(d, i, m, c)], key.get((d, i, "ar", c))) for i in samples if (d, i, m, c) in key]
                if not got:
                    continue
                cell[f"{tag}_tok_s"] = statistics.mean(r["decode_tokens_per_s"] for _, r, _ in got)
                cell[f"{tag}_ratio"] = statistics.mean(r["decode_tokens_per_s"] / a["decode_tokens_per_s"]
                                                       for _, r, a in got if a is not None)
                cell[f"{tag}_matches_ar"] = sum(bool(r["matches_ar"]) for _, r, _ in got)
                cell[f"{tag}_tau"] = statistics.mean(r["accepted_per_step"] for _, r, _ in got)
                cell[f"{tag}_tokens"] = statistics.mean(r["new_tokens"] for _, r, _ in got)
                if c:
                    cell["valid"] = sum(bool(r["valid"]) for _, r, _ in got)
                    cell["forced_accepted_per_step"] = statistics.mean(
                        r["forced_accepted"] / max(1, r["steps"]) for _, r, _ in got)
                    cell["grammar_ms_per_step"] = 1e3 * statistics.mean(r["processor_s"] / max(1, r["steps"])
                                                                        for _, r, _ in got)
                    shares = [r["processor_s"] / max(1, r["steps"]) / ar_step[i] for i, r, _ in got if i in ar_step]
                    cell["grammar_share_of_ar_step"] = statistics.mean(shares) if shares else None
            out.append(cell)
            table.append(cell)
    lines = ["| data | method | prompts | valid JSON | = ar (json) | json tok/s | json ×ar | free tok/s | free ×ar "
             "| τ json | τ free | forced acc./step | grammar ms/step | share of ar step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in table:
        def f(k: str, fmt: str = "{:.2f}", c: dict[str, Any] = c) -> str:
            v = c.get(k)
            return "-" if v is None else fmt.format(v)

        lines.append(f"| {c['data']} | {c['method']} | {c['samples']} | {c.get('valid', '-')}/{c['samples']} | "
                     f"{c.get('json_matches_ar', '-')}/{c['samples']} | {f('json_tok_s')} | {f('json_ratio')} | "
                     f"{f('free_tok_s')} | {f('free_ratio')} | {f('json_tau')} | {f('free_tau')} | "
                     f"{f('forced_accepted_per_step')} | {f('grammar_ms_per_step', '{:.3f}')} | "
                     f"{f('grammar_share_of_ar_step', '{:.2%}')} |")
    return "\n".join(lines) + "\n", out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specextend.bench.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model reference (default: the default pair's)")
    p.add_argument("--draft", help="draft model reference (default: the default pair's)")
    p.add_argument("--data", nargs="+", required=True, help="JSONL files (field `text`), e.g. GovReport 2K and 8K")
    p.add_argument("--samples", type=int, default=8, help="prompts per file, the first ones (default: 8)")
    p.add_argument("--methods", default="ar,specextend,lookup", help="comma-separated, ar first (default: "
                   "ar,specextend,lookup)")
    p.add_argument("--max-new-tokens", type=int, default=384, help="tokens per answer at most (default: 384)")
    p.add_argument("--no-free", action="store_true", help="skip the unconstrained decodes")
    p.add_argument("--out", required=True, help="results folder (re-running with it resumes)")
    args = p.parse_args(argv)
    try:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if methods[0] != "ar":
            raise UserError("--methods must start with ar (every row is compared with it)")
        files = [resolve_data_path(d) for d in args.data]
        samples = [s for s in load_jsonl_inputs([str(f) for f in files], limit=args.samples)]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        results = out / "results.jsonl"
        done = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
        seen = {(r["data"], r["sample"]) for r in done}
        pair = load(args.target, args.draft)
        pair.warmup()
        constrained = [True] if args.no_free else [True, False]
        todo = [s for s in samples if (s.data, s.sample) not in seen]
        for s in tqdm(todo, desc="prompts", file=sys.stderr):
            ids = pair.encode_chat([{"role": "user", "content": INSTRUCTION + report_text(s.text)}])
            rows = run_sample(pair, ids, methods, args.max_new_tokens, constrained, {})
            with results.open("a") as f:
                for r in rows:
                    f.write(json.dumps(finite_json({"data": s.data, "sample": s.sample, **r})) + "\n")
            done += [{"data": s.data, "sample": s.sample, **r} for r in rows]
        md, cells = summarise(done, methods)
        meta = {"kernels": kernel_path(), "methods": methods, "max_new_tokens": args.max_new_tokens,
                "data": [data_name(f) for f in files]}
        (out / "summary.md").write_text(md)
        (out / "summary.json").write_text(json.dumps(finite_json({"meta": meta, "cells": cells}), indent=1))
        print(md)
    except UserError as e:
        print(f"specextend: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
