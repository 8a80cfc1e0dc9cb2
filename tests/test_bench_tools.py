"""The tool-calling bench (bench/tools.py) end to end against a tiny pair's server with an API key:
the report's structure, forced calls valid for their schemas, the methods' calls equal, the
frameworks' loops run; and the streamed tool-call deltas reassembled into whole calls."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionChunk

from specextend.api import load
from specextend.bench import tool_suite as ts
from specextend.bench import tools as bench

from test_serve import SMALL, running
from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")

KEY = "sk-bench-key"
# Forced single calls (the grammar ends the answer after one; random weights would call on to
# max_tokens where parallel calls are allowed), named and required, one streamed; the results fed
# back; no call allowed. Cases whose short schemas random weights fill within max_tokens.
CASES = "convert-named,weather-required,stream-weather-required,fed-weather,none-weather"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-tools")
    # Room for a fed-back conversation (its tools named in the template) and 200 new tokens.
    room = dict(max_position_embeddings=1024)
    folders = {"target": save_tiny_model(root / "target", seed=0, **room),
               "draft": save_tiny_model(root / "draft", seed=1, layers=1, **room)}
    pair = load(folders["target"], folders["draft"], dtype="float64", progress=False)
    pair.step_costs()
    with running(pair, folders, api_keys=(KEY,), max_new_tokens=200) as u:
        yield u


def test_the_suite_is_held_out_style():
    cases = ts.SUITE
    assert len(cases) >= 20 and len({c.name for c in cases}) == len(cases)
    choices = {c.choice for c in cases}
    assert {None, ts.AUTO, ts.NONE, ts.REQUIRED} <= choices and choices & set(ts.TOOLS)
    assert any(c.parallel for c in cases) and any(c.stream for c in cases)
    assert any(m["role"] == "tool" for c in cases for m in c.messages)
    for c in cases:
        assert set(c.callable) <= set(c.tools) <= set(ts.TOOLS)
        for m in c.messages:
            for call in m.get("tool_calls", []):  # the conversations' own calls are valid
                assert bench.schema_errors(call["function"]["name"], call["function"]["arguments"], c.tools) is None
    with pytest.raises(ValueError, match="no case"):
        ts.pick("weather-named,fly")


def test_schema_errors_name_what_is_wrong():
    ok = json.dumps({"value": 1.5, "from_unit": "km", "to_unit": "mi"})
    assert bench.schema_errors("convert_units", ok, ("convert_units",)) is None
    assert "not among" in bench.schema_errors("convert_units", ok, ("get_weather",))
    assert "not JSON" in bench.schema_errors("convert_units", "{", ("convert_units",))
    bad = json.dumps({"value": 1.5, "from_unit": "parsec", "to_unit": "mi"})
    assert bench.schema_errors("convert_units", bad, ("convert_units",)).startswith("from_unit:")
    nested = {"title": "x", "start": {"date": "2026-12-01", "time": "9am"}, "duration_minutes": 30,
              "attendees": [{"email": "a@b.c", "optional": False}]}
    assert bench.schema_errors("book_meeting", json.dumps(nested), ("book_meeting",)).startswith("start/time:")


def _chunk(delta: dict, finish: str | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({
        "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_streamed_tool_call_deltas_are_reassembled():
    chunks = [
        _chunk({"role": "assistant", "content": None}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"location": {"ci'}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                "function": {"name": "convert_units", "arguments": '{"value": 1'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}, "units": "celsius"}'}}]}),
        _chunk({"tool_calls": [{"index": 1, "function": {"arguments": ', "from_unit": "c", "to_unit": "f"}'}}]}),
        _chunk({}, "tool_calls"),
    ]
    got = bench.accumulate(chunks)
    assert got["finish_reason"] == "tool_calls" and got["content"] is None
    assert [(c["id"], c["function"]["name"]) for c in got["tool_calls"]] == [("call_a", "get_weather"),
                                                                             ("call_b", "convert_units")]
    assert json.loads(got["tool_calls"][0]["function"]["arguments"])["location"] == {"city": "Oslo"}
    assert all(bench.schema_errors(c["function"]["name"], c["function"]["arguments"], tuple(ts.TOOLS)) is None
               for c in got["tool_calls"])
    text = bench.accumulate([_chunk({"content": "Sunny"}), _chunk({"content": " today."}, "stop")])
    assert text["content"] == "Sunny today." and text["tool_calls"] == [] and text["finish_reason"] == "stop"


def test_the_bench_runs_the_suite_and_the_frameworks_with_a_key(url, tmp_path):
    out = tmp_path / "out"
    code = bench.main(["--url", url, "--api-key", KEY, "--methods", "ar,specextend", "--cases", CASES,
                       "--max-tokens", "200", "--request-fields", json.dumps(SMALL), "-q", "--out", str(out)])
    result = json.loads((out / "tools.json").read_text())
    s = result["summary"]
    assert result["auth"] == {"no_key": 401, "wrong_key": 401, "right_key": 200}
    assert s["requests"] == 5 and s["errors"] == 0 and s["methods"] == ["ar", "specextend"]
    assert s["forced_answers"] == 6 and s["forced_valid"] == 6  # 3 forced cases x 2 methods
    assert s["same_calls"] == 5 and set(s["wall_ratio"]) == {"ar", "specextend"}
    assert set(s["auto_chose"]) == {"fed-weather"}
    rows = {r["case"]: r for r in result["rows"]}
    streamed = rows["stream-weather-required"]["runs"]
    assert [c["name"] for c in streamed["ar"]["calls"]] == ["get_weather"] and streamed["ar"]["valid"]
    assert streamed["specextend"]["finish_reason"] == "tool_calls"
    assert rows["none-weather"]["runs"]["specextend"]["chose"] == "text"
    assert all(v["ok"] for v in result["frameworks"].values()), result["frameworks"]
    assert "| convert-named |" in (out / "summary.md").read_text()
    assert code == 0


def test_bad_flags_get_one_line(tmp_path, capsys):
    assert bench.main(["--url", "http://127.0.0.1:1", "--cases", "fly", "--out", str(tmp_path)]) == 2
    assert bench.main(["--url", "http://127.0.0.1:1", "--request-fields", "[1]", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("specextend: ") for line in err)
