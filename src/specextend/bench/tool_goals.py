"""Issue 47's tool-call goals against a running server, through the `openai` client.

    python -m specextend.bench.tool_goals --url http://127.0.0.1:8000 --out results/tool-goals

1. The held-out request (tools `get_weather` and `find_flights`, a traveller's question,
   `max_tokens` 200) under `tool_choice` `required` (with `ar` and `specextend`), a named function
   and `auto`, streamed and not: the calls returned, whether each is valid for its schema
   (`jsonschema`), whether any call markup (`<tool_call>`, any family's) reached `content`, the finish reason.
2. `auto` with the one tool `get_weather`: four weather questions (a call is wanted) and two that
   need none (plain chat, "write a JSON example"): whether a call came back.

DIR/tool_goals.json holds every answer; the table goes to stdout and DIR/summary.md. The exit
status is 1 when a goal is missed (a call invalid or missing where one is forced, markup in
content, fewer than 3 of 4 weather questions called, a call on a question that needs none).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..requests.callmarkup import MARKUPS
from .report import write_text_atomic

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather (or the forecast for a date) in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "date": {"type": "string", "description": "A date, e.g. 2026-03-03; today when left out"}},
        "required": ["city"]}}}
FLIGHTS = {"type": "function", "function": {
    "name": "find_flights", "description": "Flights between two cities on a date.",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string"}, "destination": {"type": "string"},
        "date": {"type": "string", "description": "The day of the flight"},
        "passengers": {"type": "integer", "minimum": 1}},
        "required": ["origin", "destination", "date"]}}}
HELD_OUT = "I fly from Lisbon to Oslo on 3 March with my two kids. Will I need a coat there?"
CALL_WANTED = ("What's the weather in Oslo right now?", "Is it raining in Lisbon today?",
               "How warm is it in Tokyo at the moment?", "What's the temperature in Berlin right now?")
NO_CALL = ("Hi! How are you today?", "Write a JSON example of a user profile.")
MARKUP = tuple(m for markup in MARKUPS for m in markup.markers)  # every family's markers


def ask(client: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], choice: Any, stream: bool,
        method: str, max_tokens: int) -> dict[str, Any]:
    """One request: its content, calls, finish reason, completion tokens and wall seconds."""
    kw: dict[str, Any] = dict(model="default", messages=messages, tools=tools, max_tokens=max_tokens,
                              extra_body={"method": method})
    if choice is not None:
        kw["tool_choice"] = choice
    start = time.perf_counter()
    if stream:
        import openai

        with client.chat.completions.stream(**kw, stream_options={"include_usage": True}) as s:
            for _ in s:
                pass
            try:
                r = s.get_final_completion()
            except openai.LengthFinishReasonError as e:  # the helper refuses an answer cut by max_tokens
                r = e.completion
    else:
        r = client.chat.completions.create(**kw)
    choice0 = r.choices[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in choice0.message.tool_calls or []]
    return {"content": choice0.message.content, "tool_calls": calls, "finish_reason": choice0.finish_reason,
            "completion_tokens": r.usage.completion_tokens if r.usage else None,
            "seconds": round(time.perf_counter() - start, 2)}


def invalid(call: dict[str, Any], tools: list[dict[str, Any]]) -> str | None:
    """Why a call is not valid for the request's tools, None when it is."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if call["name"] not in schemas:
        return f"unknown function {call['name']!r}"
    try:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    except (ValueError, jsonschema.ValidationError) as e:
        return str(e).splitlines()[0]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specextend.bench.tool_goals", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the server's base URL (without /v1)")
    ap.add_argument("--api-key", default="none", help="the key the server asks for, if any")
    ap.add_argument("--out", type=Path, default=None, help="folder for tool_goals.json and summary.md")
    args = ap.parse_args(argv)
    import openai

    client = openai.OpenAI(base_url=f"{args.url.rstrip('/')}/v1", api_key=args.api_key, max_retries=0, timeout=900)
    both = [WEATHER, FLIGHTS]
    named = {"type": "function", "function": {"name": "get_weather"}}
    rows: list[dict[str, Any]] = []
    held = [("required", "required", "ar"), ("required", "required", "specextend"), ("named", named, "specextend"),
            ("auto", None, "specextend")]
    for label, choice, method in held:
        for stream in (False, True):
            got = ask(client, [{"role": "user", "content": HELD_OUT}], both, choice, stream, method, 200)
            errors = [e for e in (invalid(c, both) for c in got["tool_calls"]) if e]
            markup = any(m in (got["content"] or "") for m in MARKUP)
            ok = bool(got["tool_calls"]) and not errors and not markup
            rows.append({"case": f"held-out, {label}", "method": method, "stream": stream, **got, "errors": errors,
                         "markup_in_content": markup, "ok": ok})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for question in CALL_WANTED + NO_CALL:
        wanted = question in CALL_WANTED
        got = ask(client, [{"role": "user", "content": question}], [WEATHER], None, False, "specextend", 120)
        errors = [e for e in (invalid(c, [WEATHER]) for c in got["tool_calls"]) if e]
        called = bool(got["tool_calls"]) and not errors
        rows.append({"case": f"auto: {question}", "method": "specextend", "stream": False, **got, "errors": errors,
                     "markup_in_content": any(m in (got["content"] or "") for m in MARKUP),
                     "ok": called == wanted, "wanted": wanted})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    lines = ["| case | method | stream | calls (valid) | markup in content | finish | tokens | s |",
             "|---|---|---|---|---|---|---:|---:|"]
    for r in rows:
        names = ", ".join(c["name"] for c in r["tool_calls"]) or "none"
        lines.append(f"| {r['case']} | {r['method']} | {'yes' if r['stream'] else 'no'} | {names} "
                     f"({'valid' if not r['errors'] else 'INVALID'}) | {'YES' if r['markup_in_content'] else 'no'} | "
                     f"{r['finish_reason']} | {r['completion_tokens']} | {r['seconds']} |")
    weather = sum(1 for r in rows if r.get("wanted") and r["ok"])
    quiet = sum(1 for r in rows if r.get("wanted") is False and r["ok"])
    held_ok = sum(1 for r in rows if r["case"].startswith("held-out") and r["ok"])
    held_n = sum(1 for r in rows if r["case"].startswith("held-out"))
    lines += ["", f"held-out request: {held_ok}/{held_n} with valid calls and no markup; auto: calls on "
                  f"{weather}/{len(CALL_WANTED)} weather questions, none on {quiet}/{len(NO_CALL)} that need none"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.out / "tool_goals.json", json.dumps(rows, indent=1))
        write_text_atomic(args.out / "summary.md", text)
    met = held_ok == held_n and weather >= 3 and quiet == len(NO_CALL)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
