"""The same questions through `specextend serve`, with the official `openai` client.

    .venv/bin/specextend serve &             # the default pair at http://127.0.0.1:8000/v1
    .venv/bin/python examples/server_qa.py docs/serving.md \
        "How does the prefix cache decide what to reuse?" "What happens when the queue is full?"

It waits for the server to come up (--wait), then each answer streams as the server accepts its
tokens. The server keeps prompts' prefilled KV, so the second question about the same document
prefills only what follows the document: its usage line shows the cached prompt tokens and the
prefill seconds left. `usage.speculative` is this
server's extension of OpenAI's usage (docs/serving.md); `extra_body` carries any setting of the
Python API (here the method). `pip install openai` where the venv lacks it (`make setup` installs it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from openai import APIConnectionError, OpenAI, OpenAIError

PROMPT = "{document}\n\nAnswer from the document above, briefly: {question}"


def wait_for(client: OpenAI, seconds: float) -> None:
    """Until the server answers (it listens only once its models are loaded)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            client.models.list()
            return
        except APIConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def ask(client: OpenAI, document: str, question: str, method: str, max_tokens: int) -> None:
    stream = client.chat.completions.create(
        model="specextend", max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": PROMPT.format(document=document, question=question)}],
        extra_body={"method": method})
    print(f"Q: {question}\nA: ", end="", flush=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            spec = chunk.usage.model_extra["speculative"]
            print(f"\n   {chunk.usage.prompt_tokens} prompt tokens, {spec['cached_prompt_tokens']} of them from the "
                  f"cache; prefill {spec['prefill_s']:.2f} s, decode {spec['decode_s']:.2f} s for "
                  f"{chunk.usage.completion_tokens} tokens, {spec['accepted_per_step']:.2f} proposed tokens "
                  "accepted per step\n", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("document", type=Path, help="a text file")
    ap.add_argument("questions", nargs="+", help="one or more questions about it")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server (default: %(default)s)")
    ap.add_argument("--method", default="specextend", help="ar|sd|specextend|lookup (default: specextend)")
    ap.add_argument("--max-tokens", type=int, default=200, help="answer length at most (default: 200)")
    ap.add_argument("--wait", type=float, default=120, help="seconds to wait for the server to start (default: 120)")
    a = ap.parse_args(argv)
    try:
        document = a.document.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: cannot read {a.document}: {e}", file=sys.stderr)
        return 2
    client = OpenAI(base_url=a.base_url, api_key="unused")  # the server checks no key
    try:
        wait_for(client, a.wait)
        for question in a.questions:
            ask(client, document, question, a.method, a.max_tokens)
    except OpenAIError as e:  # the server's message (a 400 names the field), or why it was not reached
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
