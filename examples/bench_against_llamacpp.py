"""Benchmark your own GGUF pair against llama.cpp on the same files and the same prompt tokens.

    make peers                               # once: llama.cpp's llama-server, built for this CPU
    .venv/bin/python examples/bench_against_llamacpp.py my-target.gguf my-draft.gguf \
        --data my-prompts.jsonl --samples 3 --out results/my-pair

Runs `specextend bench` with our `ar` (the target alone) and `specextend` beside llama.cpp's
plain decoding (`llamacpp-ar`), its draft-model speculation with the same draft (`llamacpp-sd`)
and its n-gram speculation (`llamacpp-lookup`), every method on the same prompts, one after
the other, with nothing else running (do not time on a busy machine). Then prints each method's
decode and end-to-end speed as ratios to `llamacpp-ar`, and how many of its outputs equal our
`ar`'s token for token (llama.cpp's arithmetic differs from ours, so its text parts from ours
after a near-tie; `ar prefix` is how many leading tokens agree). The bench's own summary (ratios
to `ar`) and plots are in --out; running again with the same --out resumes. `--data` takes
JSONL files with a `text` field (one prompt each) or `stdlib`, the built-in long-code set
(`--lengths 2K,8K`). With `SPECEXTEND_CPU=avx2` both sides run AVX2 (`make peers PEER_CPU=avx2`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specextend.cli.main import main as specextend

METHODS = "ar,specextend,llamacpp-ar,llamacpp-sd,llamacpp-lookup"
REFERENCE = "llamacpp-ar"


def bench_args(a: argparse.Namespace) -> list[str]:
    args = ["bench", "--target", a.target, "--draft", a.draft, "--data", *a.data, "--samples", str(a.samples),
            "--max-new-tokens", str(a.max_new_tokens), "--methods", a.methods, "--prefill", "shared",
            "--out", str(a.out)]
    return args + (["--lengths", a.lengths] if a.lengths else [])


def latest_rows(path: Path) -> list[dict]:
    """The results file's rows, the last one written per (data, sample, method)."""
    rows: dict[tuple, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r["data"], r["sample"], r["method"])] = r
    return list(rows.values())


def table(rows: list[dict], methods: list[str]) -> str:
    """Per method: total new tokens over total decode seconds, and over prefill + decode seconds."""
    stats = {}
    for m in methods:
        sel = [r for r in rows if r["method"] == m]
        if sel:
            tokens = sum(r["new_tokens"] for r in sel)
            stats[m] = (tokens / sum(r["decode_s"] for r in sel), tokens / sum(r["total_s"] for r in sel),
                        sum(bool(r.get("matches_ar")) for r in sel), len(sel),
                        sum(r.get("ar_prefix_match") or 0 for r in sel) / len(sel))
    ref = stats.get(REFERENCE)
    lines = [f"| method | decode tok/s | x {REFERENCE} | end to end tok/s | x {REFERENCE} | = ar | ar prefix |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for m, (dec, e2e, same, n, prefix) in stats.items():
        ratio = (f"{dec / ref[0]:.2f}x", f"{e2e / ref[1]:.2f}x") if ref else ("-", "-")
        shown_prefix = "-" if m == "ar" else f"{prefix:.0f}"
        lines.append(f"| {m} | {dec:.2f} | {ratio[0]} | {e2e:.2f} | {ratio[1]} | {same}/{n} | {shown_prefix} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", help="the target's .gguf file (or a folder holding one)")
    ap.add_argument("draft", help="the draft's .gguf file, with the target's tokenizer")
    ap.add_argument("--data", nargs="+", default=["stdlib"], help="JSONL prompt files, or stdlib (default: stdlib)")
    ap.add_argument("--lengths", help="the built-in set's input lengths, e.g. 2K,8K (default: the bench's)")
    ap.add_argument("--samples", type=int, default=3, help="prompts per data set (default: 3)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default: 128)")
    ap.add_argument("--methods", default=METHODS, help=f"bench methods (default: {METHODS})")
    ap.add_argument("--out", type=Path, default=Path("results/my-pair"), help="results folder (default: %(default)s)")
    a = ap.parse_args(argv)
    rc = specextend(bench_args(a))  # a missing llama.cpp build is refused here, naming `make peers`
    if rc != 0:
        return rc
    print(f"\nAgainst llama.cpp's plain decoding ({REFERENCE}), from {a.out / 'results.jsonl'}:")
    print(table(latest_rows(a.out / "results.jsonl"), a.methods.split(",")))
    print(f"\nfull summary: {a.out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
