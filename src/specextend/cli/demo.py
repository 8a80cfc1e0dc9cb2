"""`specextend demo` (what `make demo` runs): one long input, three decoders, side by side.

The default pair summarises a long Python standard-library module (the bench's built-in long-code
set, ~2K tokens by default). The prompt is prefilled ONCE (target and draft, efficient attention)
and that prefill is reused by all three methods, so the demo spends its time on decoding:

- `ar` (target alone) and `sd` (speculative decoding with the full draft cache) first, with a
  progress line each. To share the prefill, `sd` decodes with the efficient attention backend here
  (the bench's `sd` uses eager attention; the draft-cache policy, the difference that matters on
  long inputs, is sd's). Going first, they also absorb any first-decode warm-up;
- then `specextend`, streamed to stdout as tokens are accepted: text from accepted proposed
  tokens (the draft's or prompt lookup's) is marked (green on a terminal, [in brackets]
  otherwise, line by line), text from the target's own token of each step is plain;
- finally a table: decode tokens/s, speedup vs ar, accepted proposed tokens per step, and whether
  each output equals ar's token for token (greedy decoding is lossless).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

from ..common.errors import UserError
from ..common.plural import count
from ..common.settings import Settings
from ..options import add_model_arguments, model_options
from ..requests.detokenize import Detokenizer

DEFAULT_LENGTH = "2K"
DEFAULT_NEW_TOKENS = 96
GREEN, RESET = "\033[32m", "\033[0m"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--length", default=DEFAULT_LENGTH,
                   help=f"input length in tokens, e.g. 1K, 2K, 4K (default: {DEFAULT_LENGTH})")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                   help=f"tokens each method generates (default: {DEFAULT_NEW_TOKENS})")
    p.add_argument("--no-color", action="store_true",
                   help="mark accepted proposed text with [brackets] instead of colour (also: NO_COLOR set, or "
                        "stdout not a terminal)")


# --------------------------------------------------------------------------- streaming


class MarkedStream:
    """Writes accepted tokens as text, marking the part that came from accepted proposed tokens.

    Each engine callback batch is the accepted proposed tokens (the draft's or prompt lookup's)
    followed by the target's own token.
    Text comes through a `Detokenizer`, so characters that span several tokens come out whole.
    """

    def __init__(self, decode: Callable[[list[int]], str], out: TextIO, color: bool) -> None:
        self.decode, self.out, self.color = decode, out, color
        self.pieces: list[str] = []
        self.detok = Detokenizer(decode, self.pieces.append)
        self.draft_tokens = 0

    def _text_of(self, ids: list[int]) -> str:
        """The text these tokens complete (possibly none yet)."""
        self.detok.push(ids)
        text = "".join(self.pieces)
        self.pieces.clear()
        return text

    def _mark(self, piece: str) -> str:
        # Line by line: a mark left open across a line break would wrap the next line's start.
        return "\n".join((f"{GREEN}{line}{RESET}" if self.color else f"[{line}]") if line else ""
                         for line in piece.split("\n"))

    def push(self, batch: list[int]) -> None:
        drafted, own = batch[:-1], batch[-1:]
        self.draft_tokens += len(drafted)
        marked = self._mark(self._text_of(drafted)) if drafted else ""
        self.out.write(marked + self._text_of(own))
        self.out.flush()

    def finish(self) -> None:
        self.detok.finish(self.decode(self.detok.ids))  # what was held back
        self.out.write("".join(self.pieces) + "\n")
        self.out.flush()


def use_color(args: argparse.Namespace, out: TextIO) -> bool:
    if args.no_color or os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty())


# --------------------------------------------------------------------------- the demo


def _settings(args: argparse.Namespace) -> dict[str, Settings]:
    base = Settings(max_new_tokens=args.max_new_tokens)
    return {
        "specextend": replace(base, method="specextend").resolved(),
        "ar": replace(base, method="ar", attention="efficient").resolved(),
        "sd": replace(base, method="sd", attention="efficient").resolved(),
    }


def _table(results: dict[str, Any]) -> str:
    ar = results["ar"]
    rows = [("method", "new tokens", "decode tok/s", "vs ar", "prefill s", "total s", "end to end vs ar",
             "accepted/step", "= ar", "draft/verify/retrieval s")]
    for name in ("ar", "sd", "specextend"):
        r = results[name]
        speed = r.decode_tokens_per_s / ar.decode_tokens_per_s if ar.decode_tokens_per_s else float("nan")
        e2e = ar.total_s / r.total_s if r.total_s else float("nan")  # same tokens, so a ratio of rates
        phases = "/".join(f"{r.phases.get(k, 0.0):.1f}" for k in ("draft_s", "verify_s", "retrieval_s"))
        rows.append((name, str(r.new_tokens), f"{r.decode_tokens_per_s:.2f}", f"{speed:.2f}x", f"{r.prefill_s:.1f}",
                     f"{r.total_s:.1f}", f"{e2e:.2f}x", f"{r.accepted_per_step:.2f}",
                     "yes" if r.token_ids == ar.token_ids else "no", phases))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`specextend demo`; returns the exit status (bad input raises UserError -> 2)."""
    from .. import api
    from ..bench.data import builtin_code_inputs, parse_length

    if args.max_new_tokens is None or args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    length = parse_length(args.length)
    settings = _settings(args)
    out = sys.stdout

    prepared = api.prepare(args.target, args.draft, **model_options(args))
    sample = builtin_code_inputs(prepared.tokenizer, [length], samples=1, chat=True)[0]
    for s in settings.values():
        prepared.check_fits(sample.input_tokens, s)
    pair = prepared.load()
    pair.warmup()  # kernel builds would otherwise land in the first method's timings

    module = sample.source.removeprefix("stdlib/")
    print(f"Summarising the start of Python's {module} ({sample.input_tokens:,} prompt tokens) with "
          f"{pair.target_path.name}, drafted by {pair.draft_path.name if pair.draft_path else '-'}.", file=out)
    print("Prefilling the prompt once for all three methods ...", file=out, flush=True)
    state = pair.prefill(sample.prompt_ids, settings["specextend"])
    print(f"prefill: target {state.target_s:.1f} s (each method's draft computes the prompt KV it reads)\n",
          file=out)

    results: dict[str, Any] = {}
    for name in ("ar", "sd"):
        print(f"{name} ...", end=" ", file=out, flush=True)
        t = time.perf_counter()
        state.forget_draft()  # each method computes the draft's prompt KV it reads, as alone
        results[name] = pair.decode(state, settings[name])
        print(f"{count(results[name].new_tokens, 'token')} in {time.perf_counter() - t:.1f} s", file=out, flush=True)

    color = use_color(args, out)
    legend = f"{GREEN}green{RESET}" if color else "[brackets]"
    print(f"\nspecextend, streaming (accepted proposed tokens, the draft's or prompt lookup's, in {legend}):\n",
          file=out, flush=True)
    stream = MarkedStream(pair.detokenize, out, color)
    state.forget_draft()
    results["specextend"] = pair.decode(state, settings["specextend"], on_tokens=stream.push)
    stream.finish()
    print("\n" + _table(results), file=out)
    print("\n(sd decodes with efficient attention here so all three share one target prefill; decode tok/s "
          "excludes the prefill; prefill s = the target's + the prompt KV the method's draft computed; total s = "
          "prefill + decode.)", file=out, flush=True)
    return 0
