"""Tool calling through real clients against `specextend serve`: the `openai` client, LangChain and
the OpenAI Agents SDK.

    python -m specextend.bench.tools --start "" --methods ar,specextend --out results/tools
    python -m specextend.bench.tools --start "" --api-key sk-bench --out results/tools-keyed

`--start ARGS` starts `specextend serve --port 0 -q --cache-mb 0 ARGS` for the run (its log goes
to DIR/server.log), so that no method reuses another's prefill; `--url URL` uses a server already
running. With `--api-key KEY` every client sends the key (and a started server requires it,
through its environment, not its command line); the report then also has the status of a request
without a key and with a wrong one.

The suite (bench/tool_suite.py, >= 20 requests) goes through `client.chat.completions.create`, each
request once per method of `--methods` (the `method` extension field), streamed for the cases
that stream (the tool-call deltas reassembled as the OpenAI SDK's docs describe). Each call's
arguments are validated against its function's JSON schema (`jsonschema`). Then two frameworks
run a two-step loop (the model calls a tool, the result goes back, the model answers), with the
last method of `--methods`: LangChain's `ChatOpenAI(...).bind_tools(...)` and the Agents SDK's
`Agent` on `OpenAIChatCompletionsModel`.
DIR/tools.json holds every answer; DIR/summary.md the table: forced calls schema-valid, what
`auto` chose, finish reasons, the same calls per method, and wall seconds per method with the
ratio to the first method (sums over the suite; one untimed request per method first, and the
method that goes first turns from request to request). The exit status is 1 when a forced call is
invalid, the methods' calls differ, or a framework check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field
from tqdm import tqdm

from . import tool_suite as ts
from .report import write_text_atomic
from .serve import started

DEFAULT_METHODS = "ar,specextend"
Unit = Literal["m", "km", "mi", "ft", "kg", "lb", "c", "f", "l", "gal"]  # the suite's units (tool_suite.UNITS)


# --------------------------------------------------------------------------- checking calls


def schema_errors(name: str, arguments: str, allowed: tuple[str, ...]) -> str | None:
    """Why a call is not valid (its name not allowed, its arguments not JSON or not matching the
    function's schema), None when it is."""
    import jsonschema

    if name not in allowed:
        return f"{name!r} is not among the callable functions {list(allowed)}"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as e:
        return f"arguments are not JSON: {e}"
    schema = ts.TOOLS[name]["function"]["parameters"]
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(args))
    return None if error is None else f"{'/'.join(map(str, error.absolute_path)) or '(root)'}: {error.message}"


def accumulate(chunks: Any) -> dict[str, Any]:
    """The message that streamed chat chunks add up to, as the OpenAI SDK's docs reassemble tool
    calls: each delta's `tool_calls[i]` extends the call at its `index` (the id and name come in
    its first delta, the arguments' text in pieces); content deltas concatenate."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish, usage = None, None
    for chunk in chunks:
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage.model_dump()
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            content.append(delta.content)
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "type": "function",
                                               "function": {"name": "", "arguments": ""}})
            call["id"] = tc.id or call["id"]
            if tc.function is not None:
                call["function"]["name"] += tc.function.name or ""
                call["function"]["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": "".join(content) or None, "tool_calls": [calls[i] for i in sorted(calls)],
            "finish_reason": finish, "usage": usage}


# --------------------------------------------------------------------------- the suite


def ask(client: Any, model: str, case: ts.Case, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """One case through the `openai` client with one method: the answer, its calls checked, its time."""
    fields = {**case.fields(), "model": model, "max_tokens": args.max_tokens, "temperature": 0,
              "extra_body": {"method": method, **args.fields}}
    t0 = time.perf_counter()
    if case.stream:
        stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **fields)
        answer = accumulate(stream)
    else:
        r = client.chat.completions.create(**fields)
        msg = r.choices[0].message
        answer = {"content": msg.content, "tool_calls": [c.model_dump() for c in msg.tool_calls or []],
                  "finish_reason": r.choices[0].finish_reason, "usage": r.usage.model_dump() if r.usage else None}
    wall = time.perf_counter() - t0
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"],
              "error": schema_errors(c["function"]["name"], c["function"]["arguments"], case.callable)}
             for c in answer["tool_calls"]]
    usage = answer["usage"] or {}
    return {"method": method, "wall_s": wall, "finish_reason": answer["finish_reason"], "content": answer["content"],
            "calls": calls, "valid": bool(calls) and all(c["error"] is None for c in calls),
            "chose": "call" if calls else "text", "completion_tokens": usage.get("completion_tokens"),
            "prompt_tokens": usage.get("prompt_tokens"), "speculative": usage.get("speculative")}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["content"], [(c["name"], c["arguments"]) for c in r["calls"]], r["finish_reason"]

    return key(a) == key(b)


def warm_up(client: Any, model: str, args: argparse.Namespace) -> None:
    """One short untimed request per method: first-use costs (buffers, the methods' first steps)
    are not the suite's."""
    for m in args.methods:
        client.chat.completions.create(model=model, messages=[ts.user("Say hello.")], max_tokens=4, temperature=0,
                                       extra_body={"method": m, **args.fields})


def run_suite(client: Any, model: str, cases: tuple[ts.Case, ...], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case once per method, with errors recorded per answer. The method that goes first
    turns from case to case: the server compiles a tool set's grammar once and serves it from a
    cache after, which would otherwise favour the methods that come later."""
    import openai

    rows = []
    bar = tqdm(total=len(cases) * len(args.methods), desc="tool requests", file=sys.stderr, disable=args.quiet)
    for i, case in enumerate(cases):
        row: dict[str, Any] = {"case": case.name, "choice": case.choice or "(auto, unset)",
                               "parallel": case.parallel, "stream": case.stream, "forced": case.forced, "runs": {}}
        k = i % len(args.methods)
        for m in args.methods[k:] + args.methods[:k]:
            try:
                row["runs"][m] = ask(client, model, case, m, args)
            except openai.OpenAIError as e:
                row["runs"][m] = {"method": m, "error": f"{type(e).__name__}: {e}"}
            bar.update()
        row["runs"] = {m: row["runs"][m] for m in args.methods}
        ok = [r for r in row["runs"].values() if "error" not in r]
        row["same_calls"] = len(ok) == len(args.methods) and all(_same(ok[0], r) for r in ok[1:])
        rows.append(row)
    bar.close()
    return rows


def summarise(rows: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    """Counts over the suite: forced calls valid (and cut by max_tokens), auto's choices, finish
    reasons, answers equal across methods, errors, and wall seconds per method with the ratio to
    the first method."""
    first = methods[0]
    runs = [r["runs"][m] for r in rows for m in methods]
    forced = [r["runs"][m] for r in rows if r["forced"] for m in methods if "error" not in r["runs"][m]]
    autos = [r for r in rows if not r["forced"] and r["choice"] != ts.NONE]
    wall = {m: sum(r["runs"][m].get("wall_s", 0.0) for r in rows) for m in methods}
    return {
        "requests": len(rows), "methods": methods, "errors": sum("error" in r for r in runs),
        "forced_answers": len(forced), "forced_valid": sum(r["valid"] for r in forced),
        "forced_cut_by_length": sum(r["finish_reason"] == "length" for r in forced),
        "calls_checked": sum(len(r.get("calls", [])) for r in runs),
        "calls_invalid": sum(c["error"] is not None for r in runs for c in r.get("calls", [])),
        "auto_chose": {r["case"]: r["runs"][first].get("chose") for r in autos},
        "finish_reasons": dict(Counter(str(r.get("finish_reason")) for r in runs)),
        "same_calls": sum(r["same_calls"] for r in rows),
        "wall_s": wall, "wall_ratio": {m: wall[m] / wall[first] if wall[first] else None for m in methods},
    }


# --------------------------------------------------------------------------- frameworks


WEATHER_RESULT = {"city": "Paris", "condition": "light rain", "high_c": 12, "low_c": 7}


def langchain_loop(url: str, key: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """LangChain: `bind_tools` with the weather function forced, the result back as a ToolMessage,
    then the model answers (tools offered, `auto`)."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    method = args.methods[-1]
    chat = ChatOpenAI(base_url=f"{url}/v1", api_key=key, model=model, max_tokens=args.max_tokens, temperature=0,
                      max_retries=0, timeout=args.timeout, extra_body={"method": method, **args.fields})
    tools = [ts.TOOLS["get_weather"], ts.TOOLS["convert_units"]]
    history: list[Any] = [HumanMessage("What's the weather in Paris today, in Celsius?")]
    first = chat.bind_tools(tools, tool_choice="get_weather").invoke(history)
    calls = [{"name": c["name"], "arguments": json.dumps(c["args"]),
              "error": schema_errors(c["name"], json.dumps(c["args"]), ("get_weather",))} for c in first.tool_calls]
    out: dict[str, Any] = {"method": method, "calls": calls, "invalid_tool_calls": len(first.invalid_tool_calls)}
    if not first.tool_calls:
        return {**out, "ok": False, "why": "no tool call"}
    history += [first, *(ToolMessage(json.dumps(WEATHER_RESULT), tool_call_id=c["id"]) for c in first.tool_calls)]
    second = chat.bind_tools(tools).invoke(history)
    out |= {"answer": second.content, "uses_result": str(WEATHER_RESULT["high_c"]) in str(second.content),
            "answer_calls": [c["name"] for c in second.tool_calls],
            "answer_invalid_tool_calls": len(second.invalid_tool_calls),
            "finish_reason": second.response_metadata.get("finish_reason")}
    out["why"] = ("invalid arguments" if any(c["error"] for c in calls) or first.invalid_tool_calls
                  else "invalid calls in the answer" if second.invalid_tool_calls
                  else "empty answer" if not (second.content or second.tool_calls) else None)
    return {**out, "ok": out["why"] is None}


def agents_loop(url: str, key: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The OpenAI Agents SDK: an `Agent` with one function tool on `OpenAIChatCompletionsModel`
    (tracing off), the first turn forced to call it (the SDK resets tool_choice to auto after a call), run
    until the final answer; each call's raw arguments validated against the tool's schema."""
    import asyncio

    import agents
    import openai

    agents.set_tracing_disabled(True)
    method = args.methods[-1]
    seen: list[dict[str, Any]] = []

    @agents.function_tool
    def convert_units(value: Annotated[float, Field(ge=-1e9, le=1e9)], from_unit: Unit, to_unit: Unit) -> str:
        """Convert a quantity between units."""
        seen.append({"value": value, "from_unit": from_unit, "to_unit": to_unit})
        # A fixed answer (what the question's conversion gives), so the final answer can be checked for it.
        return json.dumps({"value": 42.16, "unit": to_unit})

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=args.timeout)
    settings = agents.ModelSettings(tool_choice="convert_units", parallel_tool_calls=False, temperature=0,
                                    max_tokens=args.max_tokens, extra_body={"method": method, **args.fields})
    agent = agents.Agent(
        name="units", instructions="You convert units. Use the convert_units tool, then answer in one sentence.",
        tools=[convert_units], model=agents.OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=settings)
    result = asyncio.run(agents.Runner.run(agent, "How many kilometres is 26.2 miles?", max_turns=4))
    schema = convert_units.params_json_schema
    calls = []
    for item in result.new_items:
        if isinstance(item, agents.ToolCallItem):
            raw = item.raw_item
            calls.append({"name": raw.name, "arguments": raw.arguments, "error": _against(schema, raw.arguments)})
    final = result.final_output
    why = ("no tool call" if not calls else "invalid arguments" if any(c["error"] for c in calls)
           else "the tool did not run" if not seen else "no final answer" if not final else None)
    return {"method": method, "calls": calls, "tool_ran": len(seen), "answer": final,
            "uses_result": "42.16" in str(final), "ok": why is None, "why": why}


def _against(schema: dict[str, Any], arguments: str) -> str | None:
    import jsonschema

    try:
        jsonschema.validate(json.loads(arguments), schema, cls=jsonschema.Draft202012Validator)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return str(e).splitlines()[0]
    return None


def framework(name: str, check: Any, *a: Any) -> dict[str, Any]:
    """A framework's loop, its failure recorded (a missing package, an error) rather than raised."""
    try:
        return check(*a)
    except ImportError as e:
        return {"ok": False, "why": f"not installed: {e}"}
    except Exception as e:
        return {"ok": False, "why": f"{type(e).__name__}: {e}"}


# --------------------------------------------------------------------------- keys, report, main


def auth_statuses(url: str, key: str) -> dict[str, int]:
    """GET /v1/models without a key, with a wrong one and with the right one: their HTTP statuses."""
    out = {}
    for label, sent in (("no_key", None), ("wrong_key", key + "-wrong"), ("right_key", key)):
        req = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {sent}"} if sent else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                out[label] = r.status
        except urllib.error.HTTPError as e:
            out[label] = e.code
    return out


def _headline(result: dict[str, Any]) -> list[str]:
    s, methods = result["summary"], result["summary"]["methods"]
    walls = [f"{m} {s['wall_s'][m]:.2f}" + (f" ({s['wall_ratio'][m]:.3f}x {methods[0]})"
                                            if m != methods[0] and s["wall_ratio"][m] is not None else "")
             for m in methods]
    frameworks = [f"- {k} ({v.get('method', '-')}): " + (f"ok; the answer quotes the tool's result: {v['uses_result']}"
                                                         if v.get("ok") else f"FAILED {v.get('why', '')}")
                  for k, v in result["frameworks"].items()]
    share = f" ({100 * s['forced_valid'] / s['forced_answers']:.1f}%)" if s["forced_answers"] else ""
    return [f"Tool calls through the `openai` client: {s['requests']} requests x {len(methods)} methods "
            f"({', '.join(methods)}), {s['errors']} errors.", "",
            f"- forced calls schema-valid: {s['forced_valid']}/{s['forced_answers']}{share} "
            f"({s['forced_cut_by_length']} cut by max_tokens); calls invalid overall: "
            f"{s['calls_invalid']}/{s['calls_checked']}",
            f"- same answer (text, calls, finish) under every method: {s['same_calls']}/{s['requests']}",
            f"- wall seconds (sum over the suite): {', '.join(walls)}",
            f"- finish reasons: {json.dumps(s['finish_reasons'])}",
            f"- auto chose ({methods[0]}): {json.dumps(s['auto_chose'])}",
            *frameworks, *([f"- keys (GET /v1/models): {json.dumps(result['auth'])}"] if result.get("auth") else [])]


def markdown(result: dict[str, Any]) -> str:
    """summary.md: the headline counts, then one row per request."""
    methods = result["summary"]["methods"]
    lines = [*_headline(result), "",
             "| request | tool_choice | stream | " + " | ".join(f"{m} finish | {m} calls | {m} s" for m in methods)
             + " | same |", "|---|---|---|" + "---|---|---|" * len(methods) + "---|"]
    for r in result["rows"]:
        cells = []
        for m in methods:
            run = r["runs"][m]
            if "error" in run:
                cells.append(f"error | {run['error'][:60]} | -")
                continue
            calls = ", ".join(c["name"] + ("" if c["error"] is None else " (INVALID)") for c in run["calls"]) or "text"
            cells.append(f"{run['finish_reason']} | {calls} | {run['wall_s']:.2f}")
        lines.append(f"| {r['case']} | {r['choice']} | {'yes' if r['stream'] else ''} | " + " | ".join(cells)
                     + f" | {'yes' if r['same_calls'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def failed(result: dict[str, Any]) -> bool:
    s = result["summary"]
    return (s["forced_valid"] < s["forced_answers"] - s["forced_cut_by_length"] or s["errors"] > 0
            or s["same_calls"] < s["requests"] or not all(v.get("ok") for v in result["frameworks"].values()))


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The suite and the frameworks against the server at `url`."""
    import openai

    key = args.api_key or "none"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=args.timeout)
    model = client.models.list().data[0].id
    warm_up(client, model, args)
    rows = run_suite(client, model, ts.pick(args.cases), args)
    frameworks = {}
    if not args.no_frameworks:
        frameworks["langchain"] = framework("langchain", langchain_loop, url, key, model, args)
        frameworks["openai-agents"] = framework("openai-agents", agents_loop, url, key, model, args)
    return {"url": url, "model": model, "server": args.start, "fields": args.fields, "max_tokens": args.max_tokens,
            "auth": auth_statuses(url, args.api_key) if args.api_key else None,
            "summary": summarise(rows, args.methods), "frameworks": frameworks, "rows": rows}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specextend.bench.tools", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's base URL (http://127.0.0.1:8000)")
    where.add_argument("--start", metavar="ARGS", help="start `specextend serve --port 0 -q --cache-mb 0 ARGS`")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, the first the reference "
                   f"(default: {DEFAULT_METHODS})")
    p.add_argument("--api-key", default=None, metavar="KEY", help="the key the clients send (and a started "
                   "server requires)")
    p.add_argument("--max-tokens", type=int, default=256, help="per answer (default: 256)")
    p.add_argument("--cases", default=None, metavar="NAMES", help="comma-separated case names (default: all)")
    p.add_argument("--request-fields", default="{}", metavar="JSON", help="more extension fields in every request")
    p.add_argument("--no-frameworks", action="store_true", help="skip the LangChain and Agents SDK loops")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--out", type=Path, required=True, help="folder for tools.json and summary.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        args.fields = json.loads(args.request_fields)
        ts.pick(args.cases)
    except ValueError as e:
        print(f"specextend: {e}", file=sys.stderr)
        return 2
    if not args.methods or not isinstance(args.fields, dict) or args.max_tokens < 1:
        print("specextend: --methods needs a method, --request-fields a JSON object, --max-tokens >= 1",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.start is not None:
        if args.api_key:  # through the environment: a key on a command line shows in `ps`
            os.environ["SPECEXTEND_API_KEY"] = args.api_key
        with started(f"--cache-mb 0 {args.start}", args.out / "server.log") as (url, _):
            result = measure(url, args)
    else:
        result = measure(args.url.rstrip("/"), args)
    write_text_atomic(args.out / "tools.json", json.dumps(result, indent=1) + "\n")
    md = markdown(result)
    write_text_atomic(args.out / "summary.md", md)
    print(md, flush=True)
    return 1 if failed(result) else 0


if __name__ == "__main__":
    raise SystemExit(main())
