"""FunctionGemma's calls (requests/gemmacalls.py): its value syntax read and written, its answers
parsed into calls whole and streamed alike, and the grammar a function's schema becomes: the
calls it takes and the ones it refuses. (Tiny models writing them under `required`, and the
server: test_callmarkup.py's families.)"""

from __future__ import annotations

import json

import pytest

from specextend.common.errors import UserError
from specextend.requests import gemmacalls, schema_rules
from specextend.requests.callmarkup import FUNCTIONGEMMA, written
from specextend.requests.callparser import CallParser
from specextend.requests.gemmacalls import Incomplete, parse, write
from specextend.requests.toolcalls import ToolSpec
from test_callmarkup import grammar_takes, markup_tokenizer, streamed

VALUE = "{location:<escape>Tokyo, {Japan}: \"a\"<escape>,days:2,flags:[true,null,-1.5e3],sub:{a:<escape><escape>}}"
WANT = {"location": 'Tokyo, {Japan}: "a"', "days": 2, "flags": [True, None, -1500.0], "sub": {"a": ""}}


def test_a_value_is_read_and_written_back():
    assert parse(VALUE) == (WANT, len(VALUE))
    assert parse(write(WANT)) == (WANT, len(write(WANT)))


def test_a_value_cut_anywhere_is_incomplete_and_a_wrong_one_is_refused():
    for cut in range(len(VALUE)):
        with pytest.raises(Incomplete):
            parse(VALUE[:cut])
    for bad in ("{a:tru}", "{a:1..2}", "{a b}", "{:1}", "[1,]", "{a:<escape>x<escape>;b:1}", "x"):
        with pytest.raises(ValueError):
            parse(bad)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}}
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"seats": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                                     "note": {"type": "object"}},
    "required": ["seats"]}}}
PLAN = {"type": "function", "function": {"name": "plan", "parameters": {
    "type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                     "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                                     "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d+$"},
                                     "tags": {"type": "array", "items": {"type": "string", "pattern": "x|^/"},
                                              "minItems": 2, "maxItems": 40}},
    "required": ["year", "code", "tags"]}}}
A = ("get_weather", {"city": "Oslo, {N}", "days": 2})
B = ("book", {"seats": ["a", "b"], "note": {"x": 1}})
ANSWER = "".join(f"<start_function_call>call:{n}{write(a)}<end_function_call>" for n, a in (A, B))


def test_calls_are_read_whole_and_streamed_alike():
    calls = [{"function": {"name": n, "arguments": a}} for n, a in (A, B)]
    assert written(FUNCTIONGEMMA, calls) == ANSWER  # as an earlier turn shows them
    content, got = CallParser(markup=FUNCTIONGEMMA).answer(ANSWER)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [A, B]
    for size in (1, 3, 7):
        assert streamed(CallParser(markup=FUNCTIONGEMMA), ANSWER, size) == ("", [A, B])
    for at in (ANSWER.index("book") + 2, ANSWER.rindex("x:")):  # cut in the second call: the first kept
        assert [c["function"]["name"] for c in CallParser(markup=FUNCTIONGEMMA).answer(ANSWER[:at])[1]] == [
            "get_weather"]
    again = CallParser(markup=FUNCTIONGEMMA)
    assert len(again.answer(ANSWER + ANSWER)[1]) == 2 and again.ended  # a repeat ends the answer
    assert CallParser(markup=FUNCTIONGEMMA).answer("Sure: " + ANSWER) == ("Sure: " + ANSWER, [])


@pytest.fixture(scope="module")
def tokenizer():
    tok = markup_tokenizer(["<start_function_call>", "<end_function_call>", "<escape>"], "functiongemma")
    assert tok.get_added_vocab()["<escape>"]  # the marker is its own token, as in FunctionGemma's file
    return tok


@pytest.mark.parametrize(("text", "taken"), [
    (ANSWER, True),
    ("<start_function_call>call:get_weather{city:<escape>Oslo<escape>}<end_function_call>", True),
    ("<start_function_call>call:get_weather{city:<escape>Oslo<escape>,unit:<escape>celsius<escape>,days:7}"
     "<end_function_call>", True),
    ("<start_function_call>call:book{seats:[]}<end_function_call>", True),
    ("<start_function_call>call:get_weather{days:2}<end_function_call>", False),  # city is required
    ("<start_function_call>call:get_weather{city:<escape>Oslo<escape>,unit:<escape>kelvin<escape>}"
     "<end_function_call>", False),  # not in the enum
    ("<start_function_call>call:get_weather{city:<escape>Oslo<escape>,days:8}<end_function_call>", False),  # > 7
    ("<start_function_call>call:get_weather{city:<escape>Oslo and far beyond<escape>}<end_function_call>",
     False),  # maxLength
    ("<start_function_call>call:get_weather{city:Oslo}<end_function_call>", False),  # a string unescaped
    ("<start_function_call>call:book{seats:[<escape>a<escape>,<escape>b<escape>,<escape>c<escape>]}"
     "<end_function_call>", False),  # maxItems
    ("<start_function_call>call:send{to:1}<end_function_call>", False),  # no such function
])
def test_the_grammar_holds_a_call_to_its_schema(tokenizer, text, taken):
    assert grammar_takes(ToolSpec.parse([WEATHER, BOOK], "required"), tokenizer, text) == taken


def plan(year="2024", ratio=",ratio:0.5", code="ABC-12", tags=("axb", "/u")) -> str:
    items = ",".join(f"<escape>{t}<escape>" for t in tags)
    return (f"<start_function_call>call:plan{{year:{year}{ratio},code:<escape>{code}<escape>,tags:[{items}]}}"
            "<end_function_call>")


@pytest.mark.parametrize(("text", "taken"), [
    (plan(), True),
    (plan(year="1900", ratio="", tags=("x",) * 40), True),
    (plan(year="1899"), False), (plan(year="2101"), False), (plan(year="20240"), False),  # a wide range's ends
    (plan(ratio=",ratio:1"), True), (plan(ratio=",ratio:0"), False), (plan(ratio=",ratio:1.5"), False),
    (plan(code="ABC-12x"), False), (plan(code="xABC-1"), False),  # anchored at both ends
    (plan(tags=("x",)), False), (plan(tags=("x",) * 41), False),  # minItems, maxItems
    (plan(tags=("ab", "x")), False), (plan(tags=("a/", "x")), False),  # "x" anywhere, or "/" first
])
def test_the_grammar_holds_bounds_patterns_and_lengths_past_small_ones(tokenizer, text, taken):
    assert grammar_takes(ToolSpec.parse([PLAN], "required"), tokenizer, text) == taken


def test_a_pattern_matches_anywhere_unless_anchored():
    assert schema_rules.searched("ab") == "(.|\\n)*(?:ab)(.|\\n)*"
    assert schema_rules.searched("^a(b|c)$") == "(?:a(b|c))"
    assert schema_rules.searched("^a|[|$]b") == "(?:(?:a)(.|\\n)*|(.|\\n)*(?:[|$]b)(.|\\n)*)"
    assert schema_rules.searched("a\\$") == "(.|\\n)*(?:a\\$)(.|\\n)*"
    assert schema_rules.searched("a/b").count("\\/") == 1


def test_an_array_no_length_admits_is_refused():
    with pytest.raises(UserError, match="minItems 3 is above maxItems 2"):
        gemmacalls.Rules("x", '"<escape>"').value({"type": "array", "minItems": 3, "maxItems": 2})


def test_rules_of_a_schema_without_properties_take_any_value():
    rules = gemmacalls.Rules("x", '"<escape>"')
    assert rules.value({"type": "object"}) == "x_obj" and rules.value({}) == "x_any"
