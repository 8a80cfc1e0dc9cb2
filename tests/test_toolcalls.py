"""Tool calls: `tools` / `tool_choice` checked (clear 400s), the answer parsed into calls (streamed
deltas add up to the whole answer's calls), forced calls valid for their schema, speculation's
calls equal `ar`'s on float64 tiny models, the `openai` client's tool calling against the
server, and the default pair's chat template rendering calls and results back."""

from __future__ import annotations

import functools
import json

import pytest

from specextend.api import load
from specextend.common.errors import UserError
from specextend.requests.callparser import CallParser
from specextend.requests.toolcalls import CLOSE, OPEN, ToolError, ToolSpec, template_messages

import loopback as http
from test_serve import SMALL, client, running
from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]}},
        "required": ["city", "days", "unit"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {
    "name": "book", "parameters": {"type": "object", "properties": {
        "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 28},
                                                  "late": {"type": "boolean"}},
                 "required": ["day", "late"], "additionalProperties": False},
        "seats": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["when", "seats"], "additionalProperties": False}}}
TOOLS = [WEATHER, BOOK]
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


def valid(call: dict) -> bool:
    """A call's arguments against the two schemas above (by hand: no schema library needed)."""
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        return (set(args) == {"city", "days", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 6
                and type(args["days"]) is int and 1 <= args["days"] <= 7 and args["unit"] in ("c", "f"))
    when = args.get("when", {})
    return (call["function"]["name"] == "book" and set(args) == {"when", "seats"} and set(when) == {"day", "late"}
            and type(when["day"]) is int and 1 <= when["day"] <= 28 and isinstance(when["late"], bool)
            and len(args["seats"]) <= 2 and set(args["seats"]) <= {"a", "b"})


# --------------------------------------------------------------------------- checking tools


BAD_TOOLS = [
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": {"get_weather": {}}}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOLS, ids=[p for _, p in BAD_TOOLS])
def test_bad_tools_are_refused_naming_their_field(fields, param):
    with pytest.raises(ToolError) as e:
        ToolSpec.parse(fields.get("tools"), fields.get("tool_choice"), fields.get("parallel_tool_calls"))
    assert e.value.param == param and str(e.value)


def test_tool_choices():
    assert ToolSpec.parse(None) is None and ToolSpec.parse(TOOLS, "none") is None
    auto = ToolSpec.parse(TOOLS)
    assert auto.choice == "auto" and auto.parallel and [t.name for t in auto.called] == ["get_weather", "book"]
    named = ToolSpec.parse(TOOLS, {"type": "function", "function": {"name": "book"}}, False)
    assert named.choice == "book" and [t.name for t in named.called] == ["book"] and not named.parallel
    assert named.template_tools()[1]["function"]["name"] == "book"  # every tool is described, one is called


# --------------------------------------------------------------------------- parsing the answer


CALL = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "a}}\\"{{", "days": 2, "unit": "c"}}}}\n{CLOSE}'
TWO = f'{CALL}\n{OPEN}\n{{"name": "book", "arguments": {{"when": {{"day": 3, "late": true}}, "seats": []}}}}\n{CLOSE}'


@pytest.mark.parametrize("text", [CALL, TWO, "Just text, no call.", "<tool", "<tool_cal>l"])
def test_streamed_deltas_add_up_to_the_whole_answer(text):
    whole = CallParser()
    content, calls = whole.answer(text)
    for size in (1, 3, 7):
        p = CallParser()
        deltas = [d for i in range(0, len(text), size) for d in p.push(text[i:i + size])] + p.finish()
        got_text = "".join(d.get("content", "") for d in deltas)
        streamed: dict[int, dict] = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                s = streamed.setdefault(c["index"], {"name": "", "arguments": ""})
                s["name"] += c.get("function", {}).get("name", "")
                s["arguments"] += c["function"].get("arguments", "")
        assert [(s["name"], s["arguments"]) for s in streamed.values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert got_text == (content or "")
    if text.startswith(OPEN):
        assert content is None and whole.finish_reason("stop") == "tool_calls"
        assert json.loads(calls[0]["function"]["arguments"])["city"] == 'a}"{'
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    else:
        assert content == text and calls == [] and whole.finish_reason("stop") == "stop"


def test_a_call_cut_by_max_tokens_is_dropped_not_text():
    # More cases (the complete calls before the cut kept) in test_toolcalls_end.py.
    p = CallParser()
    assert p.answer(CALL[:40]) == (None, []) and p.finish_reason("length") == "length"


def test_messages_with_calls_are_made_ready_for_the_template():
    msgs = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = template_messages(msgs)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and out[1]["content"] == ""
    assert out[2] == msgs[2]
    msgs[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(UserError, match="not JSON"):
        template_messages(msgs)


# --------------------------------------------------------------------------- generating calls


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("toolcalls")
    return {"target": save_tiny_model(root / "target", seed=0),
            "draft": save_tiny_model(root / "draft", seed=1, layers=1)}


@pytest.fixture(scope="module")
def pair(folders):
    p = load(folders["target"], folders["draft"], dtype="float64", progress=False)
    p.step_costs()  # measured here, not in the server's start (which a test waits for with a deadline)
    return p


@pytest.fixture(scope="module")
def url(pair, folders):
    with running(pair, folders, max_new_tokens=160) as u:
        yield u


def ask(url: str, method: str, stream: bool = False, **fields) -> dict:
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 160, "method": method, **SMALL, **fields}
    if not stream:
        r = http.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    events = []
    with http.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return _accumulate(events)


def _accumulate(events: list[dict]) -> dict:
    """The message that streamed chunks add up to (as the openai client's helpers do)."""
    # The first delta carries the role, as OpenAI's: a call's with content null, never "".
    first = events[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and all(e["choices"][0]["delta"].get("role") is None for e in events[1:])
    if first.get("tool_calls"):
        assert first["content"] is None
    content, calls, finish = "", {}, None
    for e in events:
        choice = e["choices"][0]
        d = choice["delta"]
        content += d.get("content") or ""
        for c in d.get("tool_calls") or []:
            s = calls.setdefault(c["index"], {"id": c.get("id"), "type": "function",
                                              "function": {"name": "", "arguments": ""}})
            s["function"]["name"] += c.get("function", {}).get("name") or ""
            s["function"]["arguments"] += c.get("function", {}).get("arguments") or ""
        finish = choice["finish_reason"] or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": message, "finish_reason": finish}


def _calls(choice: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_forced_calls_are_valid_and_speculation_equals_ar(url, choice):
    # One call: the grammar then ends the answer (random weights would otherwise call on to max_tokens).
    ask = functools.partial(globals()["ask"], parallel_tool_calls=False)
    ar = ask(url, "ar", tool_choice=choice)
    assert ar["finish_reason"] == "tool_calls" and ar["message"]["content"] is None
    calls = ar["message"]["tool_calls"]
    assert calls and all(valid(c) for c in calls)
    if isinstance(choice, dict):
        assert [c["function"]["name"] for c in calls] == ["book"]
    for method in ("sd", "specextend"):
        assert _calls(ask(url, method, tool_choice=choice)) == _calls(ar), method
    streamed = ask(url, "specextend", stream=True, tool_choice=choice)
    assert _calls(streamed) == _calls(ar) and streamed["finish_reason"] == "tool_calls"


def test_auto_answers_text_or_calls_the_same_under_speculation(url):
    ar = ask(url, "ar")
    assert (ar["finish_reason"] == "tool_calls") == bool(ar["message"].get("tool_calls"))
    assert all(valid(c) for c in ar["message"].get("tool_calls") or [])
    if ar["message"]["content"] is not None:
        assert OPEN not in ar["message"]["content"]
    for method in ("sd", "specextend"):
        got = ask(url, method)
        assert (got["message"]["content"], _calls(got)) == (ar["message"]["content"], _calls(ar)), method


def test_parallel_calls_go_on_until_the_model_stops(url):
    # Random weights: call after call until max_tokens (or a repeated call); the complete ones are kept.
    ar = ask(url, "ar", tool_choice="required")
    assert ar["finish_reason"] in ("length", "tool_calls") and ar["message"]["content"] is None
    calls = ar["message"]["tool_calls"]
    assert calls and all(valid(c) for c in calls)
    assert len({(c["function"]["name"], c["function"]["arguments"]) for c in calls}) == len(calls)
    got = ask(url, "specextend", tool_choice="required")
    assert (_calls(got), got["finish_reason"], got["message"]["content"]) == (_calls(ar), ar["finish_reason"], None)
    streamed = ask(url, "specextend", stream=True, tool_choice="required")
    assert _calls(streamed) == _calls(ar) and streamed["finish_reason"] == ar["finish_reason"]
    assert streamed["message"]["content"] is None


def test_the_openai_client_calls_tools_streaming_or_not(url):
    c = client(url)
    extra = {"method": "specextend", **SMALL}
    r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160,
                                  parallel_tool_calls=False, extra_body=extra)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and all(valid(x.model_dump()) for x in calls)
    with c.chat.completions.stream(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160,
                                   parallel_tool_calls=False, extra_body=extra) as s:
        for _ in s:
            pass
        final = s.get_final_completion()
    got = final.choices[0].message.tool_calls
    assert [(x.function.name, x.function.arguments) for x in got] == [(x.function.name, x.function.arguments)
                                                                      for x in calls]
    # The results fed back: the conversation renders and the answer goes on.
    follow = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
              *({"role": "tool", "tool_call_id": x.id, "content": "sunny, 21 C"} for x in calls)]
    again = c.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, tool_choice="none", max_tokens=8,
                                      extra_body=extra)
    assert again.choices[0].message.content and again.choices[0].finish_reason == "length"


BAD_BODIES = [
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}}}]}, "tools"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0]"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0]"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_BODIES, ids=[p for _, p in BAD_BODIES])
def test_bad_tool_requests_get_400s(url, fields, param):
    r = http.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and "Traceback" not in r.text


# --------------------------------------------------------------------------- the Python API and generate


def test_the_python_api_takes_messages_and_tools(pair):
    convo = [*ASK, {"role": "assistant", "content": "Let me think."}, {"role": "user", "content": "Go on."}]
    runs = {m: pair.generate(convo, method=m, max_new_tokens=160, tools=TOOLS, parallel_tool_calls=False,
                             tool_choice={"type": "function", "function": {"name": "get_weather"}}, **SMALL)
            for m in ("ar", "specextend")}
    ar = runs["ar"]
    assert len(ar.tool_calls) == 1 and valid(ar.tool_calls[0]) and ar.to_json()["tool_calls"] == ar.tool_calls
    assert runs["specextend"].token_ids == ar.token_ids
    with pytest.raises(UserError, match="chat"):
        pair.generate("hi", tools=TOOLS)
    with pytest.raises(ToolError, match="not among the tools"):
        pair.generate(convo, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}})
    assert pair.generate(convo, max_new_tokens=4, tools=TOOLS, tool_choice="none").tool_calls is None


def test_generate_takes_a_tools_file(folders, tmp_path, capsys):
    from specextend.cli.main import main

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    base = ["generate", "--target", str(folders["target"]), "--draft", str(folders["draft"]), "--dtype", "float64",
            "--prompt", ASK[0]["content"], "--tools", str(tools), "--max-new-tokens", "160", "--chunk-size", "4",
            "--top-k-chunks", "2", "-q"]
    assert main([*base, "--tool-choice", "book", "--json", "--method", "sd"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["function"]["name"] for c in out["tool_calls"]] == ["book"] and valid(out["tool_calls"][0])
    assert main([*base, "--tool-choice", "fly"]) == 2
    err = capsys.readouterr().err
    assert "not among the tools" in err and len(err.strip().splitlines()) == 1


def test_langchain_binds_tools_and_runs_a_two_step_loop(url):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    chat = lc.ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="tiny", max_tokens=160, max_retries=0,
                         timeout=120, extra_body={"method": "specextend", **SMALL})
    forced = chat.bind_tools([WEATHER, BOOK], tool_choice="get_weather")
    history = [HumanMessage(ASK[0]["content"])]
    first = forced.invoke(history)
    assert [c["name"] for c in first.tool_calls] == ["get_weather"] and not first.invalid_tool_calls
    call = first.tool_calls[0]
    assert valid({"function": {"name": call["name"], "arguments": json.dumps(call["args"])}})
    history += [first, ToolMessage("sunny, 21 C", tool_call_id=call["id"])]
    second = chat.bind_tools([WEATHER, BOOK]).invoke(history)  # auto: text or calls, both well formed
    assert second.content or second.tool_calls
    assert not second.invalid_tool_calls


@pytest.mark.parametrize("shown", [
    # GLM-4.5's: XML arguments inside Hermes's own tags
    "<tool_call>{{ c.function.name }}\n{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v }}</arg_value>\n{% endfor %}</tool_call>",
    # Kimi's
    "<|tool_calls_section_begin|>{{ c.function.name }}<|tool_calls_section_end|>",
    # Seed-OSS's (Qwen3-Coder's XML in tags of its own)
    "<seed:tool_call>\n<function={{ c.function.name }}>\n</function>\n</seed:tool_call>"])
def test_a_call_format_not_read_here_is_refused_tools_not_held_to_another(tmp_path, shown):
    """A template that offers tools but shows its calls in a format no markup here reads (GLM-4.5's XML inside
    <tool_call>, Kimi's sections) is refused tools in one line naming that format, not held to Hermes's
    JSON blocks; `models inspect` says so; the conversation without tools is answered."""
    from specextend.api import prepare
    from specextend.requests import callmarkup

    from tiny_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = ("{% if tools %}tools: {{ tools | tojson }}{% endif %}{% for m in messages %}"
                         "<|{{ m['role'] }}|>{% for c in m.tool_calls or [] %}" + shown +
                         "{% endfor %}{{ m['content'] }}<|endoftext|>{% endfor %}")
    plain = prepare(save_tiny_model(tmp_path / "target", tokenizer=tok), load_draft=False, progress=False)
    with pytest.raises(ToolError, match="which this server does not read") as refused:
        plain.prompt_ids(ASK, tools=ToolSpec.parse(TOOLS))
    assert refused.value.param == "tools" and callmarkup.unread(tok.chat_template) in str(refused.value)
    assert callmarkup.describe(tok.chat_template).startswith("none: its chat template shows ")
    assert plain.prompt_ids(ASK)


def test_a_template_without_tools_is_refused_them_in_one_line(tmp_path):
    """A family whose chat template has no tool-call format (Gemma's, OLMo 2's) ignores `tools`:
    the model would never see them offered, so a request with tools is refused (a 400 naming
    `tools` through the server), while the same conversation without them is answered as before."""
    from specextend.api import prepare

    from tiny_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
    folders = {"target": save_tiny_model(tmp_path / "target", tokenizer=tok),
               "draft": save_tiny_model(tmp_path / "draft", seed=1, layers=1, tokenizer=tok)}
    plain = prepare(folders["target"], load_draft=False, progress=False)
    assert not plain.template_takes_tools()
    with pytest.raises(ToolError, match="does not describe tools") as refused:
        plain.prompt_ids(ASK, tools=ToolSpec.parse(TOOLS))
    assert refused.value.param == "tools" and "qwen2 family" in str(refused.value)
    assert plain.prompt_ids(ASK)  # no tools: as before
    offered = prepare(save_tiny_model(tmp_path / "offered"), load_draft=False, progress=False)
    assert offered.template_takes_tools() and offered.prompt_ids(ASK, tools=ToolSpec.parse(TOOLS))

    with running(load(folders["target"], folders["draft"], dtype="float64", progress=False), folders,
                 method="ar") as url:
        r = http.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        assert "does not describe tools" in r.json()["error"]["message"]
        ok = http.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
