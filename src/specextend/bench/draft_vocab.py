"""The trimmed draft vocabulary measured: the draft's one-row step cost and its acceptance per
head size (draft_vocab.py), on long documents and on code.

    python -m specextend.bench.draft_vocab [--data FILE.jsonl] [--samples 2] [--sizes 0,8192,32768]
                                           [--code-length 2048] [--max-new-tokens 64] [--context 1024]

Size 0 is the full vocabulary. Each prompt is prefilled once and decoded once per size with the
draft always running and no prompt lookup (`specextend` with lookup, the cost model and the
draft's gate off), so `accepted_per_step` is the draft's own tokens accepted per draft step.
The step cost is a one-row draft forward over a `--context`-token cache, the sizes interleaved
and each the best of `--repeats`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from .. import api
from ..common.settings import Settings
from ..options import OneLineParser
from ..speculation import draft_vocab
from .data import builtin_code_inputs, encode_samples, load_jsonl_inputs


def _trim(draft: Any, size: int, eos: list[int], prompt: list[int] | None = None) -> None:
    draft.output_head = None
    if size:
        draft_vocab.enable(draft, eos, size)
        if prompt is not None:
            draft.output_head.cover(prompt)


def step_costs(pair: Any, sizes: list[int], context: int, repeats: int) -> dict[str, float]:
    """Best seconds of a one-row draft forward per head size (prompt extras: none)."""
    draft, eos = pair.draft, list(pair.spec.eos_ids)
    cache = draft.new_cache(context + 8)
    draft.prefill(torch.randint(0, 30000, (context,)), cache)
    tok, pos = torch.tensor([7]), torch.tensor([context])
    heads = {}
    for size in sizes:
        _trim(draft, size, eos)
        heads[size] = draft.output_head
    best = dict.fromkeys(sizes, float("inf"))
    for _ in range(repeats):
        for size in sizes:
            draft.output_head = heads[size]
            t = time.perf_counter()
            draft(tok, pos, cache)
            best[size] = min(best[size], time.perf_counter() - t)
            cache.discard()
    draft.output_head = None
    return {str(s): v for s, v in best.items()}


def acceptance(pair: Any, samples: list[Any], sizes: list[int], max_new: int) -> list[dict[str, Any]]:
    """Per prompt and size: draft tokens accepted per draft step, draft seconds, output equality."""
    s = Settings(method="specextend", lookup=False, cost_model=False, draft_gate=False, max_new_tokens=max_new)
    eos, rows = list(pair.spec.eos_ids), []
    for sample in samples:
        state = pair.prefill(sample.prompt_ids, s)
        ref = None
        for size in sizes:
            _trim(pair.draft, size, eos, sample.prompt_ids)
            r = pair.decode(state, s)
            ref = r.token_ids if ref is None else ref
            rows.append({"data": sample.data, "sample": sample.sample, "prompt_tokens": len(sample.prompt_ids),
                         "size": size, "scored": pair.draft.output_head.size if size else pair.draft.cfg.vocab_size,
                         "accepted_per_step": r.accepted_per_step, "steps": r.steps, "decode_s": r.decode_s,
                         "phases": r.phases, "same_output": r.token_ids == ref})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    pair.draft.output_head = None
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="", help="JSONL prompts (field `text`), a file or a data set's name, e.g. "
                    "../shared/data/govreport/govreport_2K.jsonl (empty: the built-in code prompts only)")
    ap.add_argument("--samples", type=int, default=2, help="prompts per data set")
    ap.add_argument("--code-length", type=int, default=2048, help="built-in code prompts of this length (0: none)")
    ap.add_argument("--sizes", default="0,8192,16384,32768", help="draft vocabulary sizes (0: the full head)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt and size")
    ap.add_argument("--context", type=int, default=1024, help="cache length the draft step is timed at")
    ap.add_argument("--repeats", type=int, default=20, help="timed draft steps per size (the best counts)")
    a: argparse.Namespace = ap.parse_args(argv)
    sizes = [int(v) for v in a.sizes.split(",")]
    pair = api.load()
    res: dict[str, Any] = {"step_s": step_costs(pair, sizes, a.context, a.repeats), "context": a.context}
    print(json.dumps(res), file=sys.stderr, flush=True)
    samples = load_jsonl_inputs([a.data], a.samples) if a.data else []
    if a.code_length:
        samples += builtin_code_inputs(pair.spec.tokenizer, [a.code_length], a.samples)
    encode_samples([x for x in samples if not x.prompt_ids], pair.spec.tokenizer)
    res["acceptance"] = acceptance(pair, samples, sizes, a.max_new_tokens)
    json.dump(res, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
