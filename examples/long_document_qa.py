"""Questions about one long document, with the Python API: the document is prefilled once.

    .venv/bin/python examples/long_document_qa.py docs/serving.md \
        "How does the prefix cache decide what to reuse?" "What happens when the queue is full?"

Each question goes to the model as the document followed by the question, in one chat turn. The
pair's prefix cache keeps the KV of every prompt it has prefilled, so the second question
prefills only the tokens after the document (its line shows how many prompt tokens came from the
cache and the prefill seconds that were left). Without --target/--draft the default pair is used
(pulled on first use); any .gguf file or Hugging Face folder works, the two sharing a tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import specextend

PROMPT = "{document}\n\nAnswer from the document above, briefly: {question}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("document", type=Path, help="a text file")
    ap.add_argument("questions", nargs="+", help="one or more questions about it")
    ap.add_argument("--target", help="target model (default: the default pair's)")
    ap.add_argument("--draft", help="draft model (default: the default pair's)")
    ap.add_argument("--dtype", default="float32", help="float32|float64|bfloat16|float16 (default: float32)")
    ap.add_argument("--method", default="specextend", help="ar|sd|specextend|lookup (default: specextend)")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="answer length at most (default: 200)")
    ap.add_argument("--cache-mb", type=float, default=4096, help="the prefix cache's memory cap (default: 4096)")
    a = ap.parse_args(argv)
    try:
        document = a.document.read_text(encoding="utf-8")
        pair = specextend.load(a.target, a.draft, dtype=a.dtype)
        pair.enable_prefix_cache(a.cache_mb)
        for question in a.questions:
            res = pair.generate(PROMPT.format(document=document, question=question), chat=True, method=a.method,
                                max_new_tokens=a.max_new_tokens)
            print(f"Q: {question}\nA: {res.text.strip()}")
            print(f"   {res.prompt_tokens} prompt tokens, {res.cached_prompt_tokens} of them from the cache; "
                  f"prefill {res.prefill_s:.2f} s, decode {res.decode_tokens_per_s:.1f} tok/s, "
                  f"{res.accepted_per_step:.2f} proposed tokens accepted per step\n", flush=True)
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: cannot read {a.document}: {e}", file=sys.stderr)
        return 2
    except specextend.UserError as e:  # bad input or settings: one line, as the command line says it
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
