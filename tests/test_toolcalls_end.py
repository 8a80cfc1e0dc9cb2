"""Tool calls that end, and `auto` calls written as bare JSON (issue 47): the parser fed scripted
answers (a call repeated, calls cut by max_tokens, fenced JSON, prose with JSON examples), then
the same scripts said by a tiny model forced by a grammar to say them, through the real server,
streamed and not: a repeated call ends the answer and is not sent, a cut call is dropped and the
complete ones kept, the markup never reaches `content`, speculation gives `ar`'s calls."""

from __future__ import annotations

import json

import pytest

from specextend.api import load
from specextend.requests.callparser import CallParser
from specextend.requests.toolcalls import CLOSE, OPEN, ToolSpec
from specextend.sampling.grammar import GrammarSpec
from specextend.serve.app import Server

import loopback as http
from test_serve import SMALL, client, running
from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")

# Names, keys and values without "he" or " t": the tiny tokenizer's merges. Then every character of
# a script is one token, whichever way a grammar lets the model spell it, and max_tokens cuts it at
# a known character.
FORECAST = {"type": "function", "function": {
    "name": "forecast", "description": "The forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"], "additionalProperties": False}}}
FLIGHTS = {"type": "function", "function": {
    "name": "find_flights", "parameters": {"type": "object", "properties": {
        "from": {"type": "string"}, "dest": {"type": "string"}}, "required": ["from", "dest"]}}}
TOOLS = [FORECAST, FLIGHTS]
SPEC = ToolSpec.parse(TOOLS)


def markup(name: str, args: dict) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{CLOSE}"


A = markup("find_flights", {"from": "Lisbon", "dest": "Oslo"})
B = markup("forecast", {"city": "Oslo", "days": 2})
C = markup("find_flights", {"from": "Lisbon", "dest": "Oslo" + " and back" * 20})
REPEAT = f"{A}\n{B}\n{A}\n{B}\n{A}"
CUT = f"{A}\n{B}\n{C}"
CALL_A = ("find_flights", {"from": "Lisbon", "dest": "Oslo"})
CALL_B = ("forecast", {"city": "Oslo", "days": 2})

BARE = {
    "plain": '{"name": "forecast", "arguments": {"city": "Oslo"}}',
    "fenced": '```json\n{\n  "name": "forecast",\n  "arguments": {\n    "city": "Oslo"\n  }\n}\n```',
    "fence without a language": '```\n{"name": "forecast", "arguments": {"city": "Oslo"}}\n```\n',
    "parameters": ' {"name": "forecast", "parameters": {"city": "Oslo"}}',
    "function object": '{"type": "function", "function": {"name": "forecast", '
                       '"arguments": "{\\"city\\": \\"Oslo\\"}"}}',
    "function name": '{"function": "forecast", "arguments": {"city": "Oslo"}}',
    "a list": '[{"name": "forecast", "arguments": {"city": "Oslo"}}, '
              '{"name": "find_flights", "arguments": {"from": "Lisbon", "dest": "Oslo"}}]',
    "tool_calls": '{"tool_calls": [{"name": "forecast", "arguments": {"city": "Oslo"}}]}',
}
NOT_CALLS = {
    "prose": "Oslo is cold in March: bring a coat.",
    "a JSON example": '```json\n{"name": "John", "age": 30, "city": "Oslo"}\n```',
    "a JSON example with a form's keys": '{"name": "Ada", "arguments": {"city": "Oslo"}}',
    "prose around a call": 'Here is a call:\n```json\n{"name": "forecast", "arguments": {"city": "Oslo"}}\n```',
    "a call then prose": '```json\n{"function": "forecast", "arguments": {"city": "Oslo"}}\n```\nThat is the call.',
    "arguments not valid": '{"name": "forecast", "arguments": {"city": "Oslo", "days": 9}}',
    "arguments missing": '{"name": "find_flights", "arguments": {"from": "Lisbon"}}',
    "an unknown key": '{"name": "forecast", "arguments": {"city": "Oslo"}, "why": "cold"}',
    "a list of numbers": "[1, 2, 3]",
    "unclosed, not yet a function's call": '```json\n{"name": "for',
    "an empty list": "[]",
    "text that starts like markup": "<tool is what I would use",
}


def streamed(parser: CallParser, text: str, size: int) -> tuple[str | None, list[tuple[str, dict]], list[dict]]:
    """The content and calls that `text`'s deltas add up to (pushed `size` characters at a time)."""
    deltas = [d for i in range(0, len(text), size) for d in parser.push(text[i:i + size])] + parser.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for d in deltas for c in d.get("tool_calls", [])]
    return (content or None), calls, deltas


def whole(parser: CallParser, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parser.answer(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# --------------------------------------------------------------------------- the parser


def test_a_repeated_call_ends_the_answer_and_is_not_given():
    for size in (1, 5, 1000):
        p = SPEC.parser()
        content, calls, _ = streamed(p, REPEAT, size)
        assert content is None and calls == [CALL_A, CALL_B] and p.ended, size
        assert p.finish_reason("stop") == "tool_calls"
    # Ended at the repeat: what a generation says after it is not read.
    p = SPEC.parser()
    p.push(f"{A}\n{B}\n{A}")
    assert p.ended and p.push(f"\n{markup('forecast', {'city': 'Rome'})}") == []
    # The same function with other arguments is another call; the same arguments in another order are not.
    other = markup("find_flights", {"from": "Oslo", "dest": "Lisbon"})
    reordered = f"{OPEN}\n" + '{"name": "find_flights", "arguments": {"dest": "Oslo", "from": "Lisbon"}}' + f"\n{CLOSE}"
    p = SPEC.parser()
    assert len(p.answer(f"{A}\n{other}\n{reordered}\n{B}")[1]) == 2 and p.ended


CALL_C = ("find_flights", json.loads(C[len(OPEN) + 1:-len(CLOSE) - 1])["arguments"])
CUTS = {"in the third call": (len(A) + 1 + len(B) + 30, [CALL_A, CALL_B]),
        "before the third's close": (len(CUT) - len(CLOSE) - 1, [CALL_A, CALL_B, CALL_C]),
        "in the first call": (12, []),
        "before the first's close": (len(A) - len(CLOSE) - 1, [CALL_A])}


@pytest.mark.parametrize(("cut", "expect"), CUTS.values(), ids=CUTS)
def test_calls_cut_by_max_tokens_keep_the_complete_ones(cut, expect):
    text = CUT[:cut]
    for size in (1, 7):
        content, calls, deltas = streamed(SPEC.parser(), text, size)
        assert content is None and calls == expect
        assert all(json.loads(c["function"]["arguments"]) for d in deltas for c in d["tool_calls"])
    p = SPEC.parser()
    assert whole(p, text) == (None, expect) and p.finish_reason("length") == "length"


@pytest.mark.parametrize("text", BARE.values(), ids=BARE)
def test_auto_takes_a_bare_json_call(text):
    p = SPEC.parser()
    content, calls = whole(p, text)
    assert content is None and calls and all(name in ("forecast", "find_flights") for name, _ in calls)
    assert p.finish_reason("stop") == "tool_calls"
    for size in (1, 4):
        p = SPEC.parser()
        got = streamed(p, text, size)
        assert got[:2] == (content, calls)
        # Held back until the answer ends (it could still turn into prose), then sent as calls only.
        assert all("content" not in d for d in got[2])
    # Off (the request's tool_call_recovery: false), or not `auto`: it stays text.
    off = ToolSpec.parse(TOOLS, "auto", tool_call_recovery=False).parser()
    assert off.answer(text) == (text, [])
    assert ToolSpec.parse(TOOLS, "required").parser().answer(text) == (text, [])


@pytest.mark.parametrize("text", NOT_CALLS.values(), ids=NOT_CALLS)
def test_anything_else_stays_text(text):
    assert SPEC.parser().answer(text) == (text, [])
    for size in (1, 3):
        content, calls, _ = streamed(SPEC.parser(), text, size)
        assert (content, calls) == (text, [])


def test_a_bare_call_cut_by_max_tokens_is_dropped():
    # Past {"name": "<a function>" the grammar holds the answer to the call (below): cut, it is no text.
    for text in ('```json\n{"name": "forecast", "arguments": {"city": "Os', '{ "name" :"forecast"'):
        p = SPEC.parser()
        assert p.answer(text) == (None, []) and p.finish_reason("length") == "length"
        assert streamed(SPEC.parser(), text, 3)[:2] == (None, [])


def test_the_auto_grammar_holds_a_bare_call_to_its_schema(folders):
    from specextend.api import prepare

    prepared = prepare(folders["target"], folders["draft"], dtype="float64", progress=False)

    def valid_prefix(spec: ToolSpec, text: str) -> str:
        ids = prepared.tokenizer.encode(text, add_special_tokens=False)
        state = prepared.grammar(spec.grammar(prepared.tokenizer)).start()
        n = state.valid_prefix(ids)
        if n < len(ids):
            return prepared.tokenizer.decode(ids[:n])
        for t in ids:
            state.consume(t)
        return text if state.accepting else f"{text} (not an end)"

    # Every bare call, the markup, and free text are said whole; a bare call's start binds the rest.
    refused = {"arguments not valid", "arguments missing", "an unknown key"}
    for key, text in [*BARE.items(), *NOT_CALLS.items(), ("markup", A)]:
        got = valid_prefix(SPEC, text)
        if key in refused:
            assert len(got) < len(text), key
        else:
            assert got == text, key
    bad = '```json\n{\n  "name": "forecast",\n  "arguments": {"city": "Oslo", "days": 9}}\n```'
    assert valid_prefix(SPEC, bad) == bad[:bad.index("9")]  # the schema's maximum is 7
    then_prose = '{"name": "forecast", "arguments": {"city": "Oslo"}} Done.'
    assert valid_prefix(SPEC, then_prose) == then_prose[:-len("Done.")]
    cut = '{"name": "forecast", "arguments": {"city": "Os'
    assert valid_prefix(SPEC, cut) == f"{cut} (not an end)"
    # Recovery off: that is free text again.
    off = ToolSpec.parse(TOOLS, tool_call_recovery=False)
    assert valid_prefix(off, bad) == bad and valid_prefix(off, then_prose) == then_prose


def test_text_is_held_only_while_it_can_still_be_a_call():
    # Prose goes out at its first character; a JSON example as soon as its first key (or the
    # function's name) says that it is not a call.
    p = SPEC.parser()
    assert p.push("Sure") == [{"content": "Sure"}]
    p = SPEC.parser()
    assert p.push('```json\n{"na') == []
    assert p.push('me": "Jo') == []
    assert p.push('hn", ') == [{"content": '```json\n{"name": "John", '}]
    p = SPEC.parser()
    assert p.push('{"age"') == [{"content": '{"age"'}]
    # A call in a form the grammar does not hold is sent when the answer ends: prose may follow.
    p = SPEC.parser()
    assert p.push('{"function": "forecast", "arguments": {"city": "Oslo"}}') == []
    assert p.push("\nIt will") == [{"content": '{"function": "forecast", "arguments": {"city": "Oslo"}}\nIt will'}]
    # One the grammar holds ({"name": "<a function>" first) is sent the moment its JSON closes.
    p = SPEC.parser()
    assert p.push('```json\n{"name": "forecast", "arguments": {"city": "Oslo"') == []
    (delta,) = p.push("}}")
    assert delta["tool_calls"][0]["function"] == {"name": "forecast", "arguments": '{"city": "Oslo"}'}
    assert p.push("\n```\n") == [] and p.answer("") == (None, p.tool_calls())
    # (The grammar lets nothing follow it; a scripted answer's rest is not read, whole or streamed.)
    then = '{"name": "forecast", "arguments": {"city": "Oslo"}} Done.'
    expect = (None, [("forecast", {"city": "Oslo"})])
    assert whole(SPEC.parser(), then) == streamed(SPEC.parser(), then, 2)[:2] == expect


def test_one_call_only_without_parallel_tool_calls():
    one = ToolSpec.parse(TOOLS, parallel_tool_calls=False).parser()
    assert one.answer(BARE["a list"]) == (BARE["a list"], [])
    assert whole(ToolSpec.parse(TOOLS, parallel_tool_calls=False).parser(), BARE["plain"])[1] == \
        [("forecast", {"city": "Oslo"})]


def test_an_unreadable_schema_recovers_no_call():
    spec = ToolSpec.parse([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": 12}}}}}])
    text = '{"name": "f", "arguments": {"x": 1}}'
    assert spec.parser().answer(text) == (text, [])


def test_tool_call_recovery_must_be_a_boolean():
    from specextend.requests.toolcalls import ToolError

    with pytest.raises(ToolError) as e:
        ToolSpec.parse(TOOLS, tool_call_recovery="no")
    assert e.value.param == "tool_call_recovery"


# --------------------------------------------------------------------------- scripts said through the server


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("toolcalls_end")
    return {"target": save_tiny_model(root / "target", seed=0),
            "draft": save_tiny_model(root / "draft", seed=1, layers=1)}


@pytest.fixture(scope="module")
def pair(folders):
    p = load(folders["target"], folders["draft"], dtype="float64", progress=False)
    p.step_costs()
    return p


@pytest.fixture(scope="module")
def url(pair, folders):
    with running(pair, folders, max_new_tokens=400) as u:
        yield u


@pytest.fixture
def says(monkeypatch):
    """Make the server's model say a script: its tools' grammar replaced by one that admits only
    the script (then the end token), so the answer is exactly the script, cut by max_tokens."""

    def script(text: str) -> None:
        grammar = GrammarSpec("grammar", f"start: {json.dumps(text)}")
        monkeypatch.setattr(Server, "_grammar", lambda self, req: self.encoder.grammar(grammar))

    return script


def ask(url: str, stream: bool, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": "Lisbon to Oslo: will I need a coat?"}], "tools": TOOLS,
            "max_tokens": 400, **SMALL, **fields}
    if not stream:
        r = http.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
        return {**out, "usage": r.json()["usage"]}
    events = []
    with http.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    content, calls, finish = "", {}, None
    for e in events:
        d = e["choices"][0]["delta"]
        content += d.get("content") or ""
        for c in d.get("tool_calls") or []:
            s = calls.setdefault(c["index"], {"id": c.get("id"), "type": "function",
                                              "function": {"name": "", "arguments": ""}})
            s["function"]["name"] += c.get("function", {}).get("name") or ""
            s["function"]["arguments"] += c.get("function", {}).get("arguments") or ""
        finish = e["choices"][0]["finish_reason"] or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": message, "finish_reason": finish}


def calls_of(choice: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"].get("tool_calls") or []]


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "find_flights"}}],
                         ids=["required", "auto", "named"])
def test_a_model_that_calls_on_in_a_loop_is_stopped_at_the_repeat(url, says, choice):
    says(REPEAT)
    ar = ask(url, False, method="ar", tool_choice=choice)
    assert calls_of(ar) == [CALL_A, CALL_B] and ar["finish_reason"] == "tool_calls"
    assert ar["message"]["content"] is None
    # The generation itself stopped once the repeat's JSON was complete (one character is one token here).
    assert ar["usage"]["completion_tokens"] == len(f"{A}\n{B}\n{A}") - len(f"\n{CLOSE}")
    for method in ("sd", "specextend"):
        got = ask(url, False, method=method, tool_choice=choice)
        assert calls_of(got) == calls_of(ar) and got["finish_reason"] == "tool_calls", method
        assert got["usage"]["completion_tokens"] < len(REPEAT)
    for method in ("ar", "specextend"):
        got = ask(url, True, method=method, tool_choice=choice)
        assert calls_of(got) == calls_of(ar) and got["finish_reason"] == "tool_calls"
        assert got["message"]["content"] is None, method


@pytest.mark.parametrize("cut", [len(A) + 1 + len(B) + 40, 30])
def test_calls_cut_by_max_tokens_through_the_server(url, says, cut):
    says(CUT)
    expect = [CALL_A, CALL_B] if cut > 30 else []
    for stream in (False, True):
        for method in ("ar", "specextend"):
            got = ask(url, stream, method=method, tool_choice="required", max_tokens=cut)
            assert got["finish_reason"] == "length" and got["message"]["content"] is None, (stream, method)
            assert calls_of(got) == expect, (stream, method)


@pytest.mark.parametrize("text", [BARE["fenced"], BARE["a list"], NOT_CALLS["a JSON example"],
                                  NOT_CALLS["prose around a call"]], ids=["fenced", "list", "example", "prose"])
def test_auto_recovers_bare_json_calls_through_the_server(url, says, text):
    says(text)
    expect = whole(SPEC.parser(), text)
    for stream in (False, True):
        got = ask(url, stream, method="specextend")
        assert (got["message"]["content"], calls_of(got)) == expect, stream
        assert got["finish_reason"] == ("tool_calls" if expect[1] else "stop")
        off = ask(url, stream, method="specextend", tool_call_recovery=False)
        assert (off["message"]["content"], calls_of(off)) == (text, []) and off["finish_reason"] == "stop"


def test_the_openai_client_reads_recovered_calls(url, says):
    says(BARE["fenced"])
    c = client(url)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Oslo?"}], tools=TOOLS,
                                  max_tokens=400, extra_body={"method": "specextend", **SMALL})
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert (call.function.name, json.loads(call.function.arguments)) == ("forecast", {"city": "Oslo"})
    with c.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": "Oslo?"}], tools=TOOLS,
                                   max_tokens=400, extra_body={"method": "specextend", **SMALL}) as s:
        for _ in s:
            pass
        final = s.get_final_completion()
    assert [(x.function.name, x.function.arguments) for x in final.choices[0].message.tool_calls] == \
        [(call.function.name, call.function.arguments)]


def test_a_bad_tool_call_recovery_is_a_400(url):
    r = http.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "tools": TOOLS, "tool_call_recovery": "no", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_call_recovery"


def test_the_goals_bench_counts_calls_and_misses(url, says, tmp_path):
    from specextend.bench import tool_goals

    # Every answer the same valid call of get_weather: the forced cases and the weather questions
    # pass, and so the two questions that need no call miss their goal.
    says(f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}\n{CLOSE}')
    assert tool_goals.main(["--url", url, "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "tool_goals.json").read_text())
    assert len(rows) == 14 and all(r["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
                                   for r in rows)
    assert [r["ok"] for r in rows] == [True] * 12 + [False] * 2
    assert "8/8 with valid calls and no markup; auto: calls on 4/4 weather questions, none on 0/2" in \
        (tmp_path / "summary.md").read_text()


def test_the_server_default_for_tool_call_recovery_applies_where_a_request_is_silent():
    """`serve --no-tool-call-recovery` (the server's default, passed to protocol.parse): a request
    without the field gets it; one that sets it keeps its own."""
    from specextend.common.settings import Settings
    from specextend.serve import protocol

    body = {"messages": [{"role": "user", "content": "Oslo?"}], "tools": TOOLS}
    assert protocol.parse("chat", body, Settings()).tools.recover
    assert not protocol.parse("chat", body, Settings(), tool_call_recovery=False).tools.recover
    own = {**body, "tool_call_recovery": True}
    assert protocol.parse("chat", own, Settings(), tool_call_recovery=False).tools.recover


def test_serve_has_a_flag_for_the_default():
    import argparse

    from specextend.serve.command import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).tool_call_recovery is True
    assert p.parse_args(["--no-tool-call-recovery"]).tool_call_recovery is False
