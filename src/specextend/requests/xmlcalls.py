"""Qwen3-Coder's calls (and the templates that took its format): XML-like blocks, not JSON,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

a call a block, blocks a newline apart. Each argument's text stands between its tags: a string as it
is (it may span lines, and cannot hold a newline followed by the closing tag), any other value as
JSON (the template writes objects and lists with `tojson`). `parse` reads a block's function
(streamed text may stop inside one: `Incomplete`), typing each argument by the function's schema
as Qwen's own parser does; `Rules` turns a function's schema into Lark rules of the block, so the
grammar forces the name, the parameters (required ones always, in the schema's order) and each
value's type: a string's text, its enum, length and pattern; numbers, booleans, null, objects and
arrays as JSON under their own schema.
"""

from __future__ import annotations

import json
from typing import Any

from ..sampling.grammar import JSON_OPTIONS
from .gemmacalls import Incomplete
from .schema_rules import ANY_TEXT, RuleSet, length_and_pattern

FUNCTION, PARAMETER, END_PARAMETER, END_FUNCTION = "<function=", "<parameter=", "</parameter>", "</function>"
VALUE_END = "\n" + END_PARAMETER  # what ends a value's text
SPACE = " \t\n"


def parse(text: str, schemas: dict[str, dict[str, Any]]) -> tuple[tuple[str, dict[str, Any]], int]:
    """The function block `text` opens with, as (name, arguments), and the index past its closing
    tag; `schemas` type its arguments (a function they do not name: each as JSON where it is, else
    text). Incomplete where the text ends first, ValueError where it is no such block."""
    if not text.startswith(FUNCTION):
        raise Incomplete if FUNCTION.startswith(text) else ValueError(f"not a function block: {text[:20]!r}")
    at = text.find(">", len(FUNCTION))
    name = text[len(FUNCTION):at if at >= 0 else len(text)]
    if "\n" in name or "<" in name:
        raise ValueError(f"not a function name: {name[:20]!r}")
    if at < 0:
        raise Incomplete
    props = (schemas.get(name) or {}).get("properties") or {}
    args: dict[str, Any] = {}
    i = at + 1
    while True:
        while i < len(text) and text[i] in SPACE:
            i += 1
        rest = text[i:]
        if rest.startswith(END_FUNCTION):
            return (name, args), i + len(END_FUNCTION)
        if not rest.startswith(PARAMETER):
            if not rest or END_FUNCTION.startswith(rest) or PARAMETER.startswith(rest):
                raise Incomplete
            raise ValueError(f"not a parameter: {rest[:20]!r}")
        key_end = text.find(">", i)
        if key_end < 0:
            raise Incomplete
        key = text[i + len(PARAMETER):key_end]
        start = key_end + 2 if text.startswith("\n", key_end + 1) else key_end + 1
        end = text.find(VALUE_END, start)
        if end < 0:
            raise Incomplete
        args[key] = typed(text[start:end], props.get(key))
        i = end + len(VALUE_END)


def typed(text: str, schema: Any) -> Any:
    """An argument's text as the value its schema says: a string as it is, else JSON (with
    Python's True, False and None read as well); text that is no JSON stays text."""
    if _stringly(schema):
        return text
    value = text.strip()
    python = {"True": True, "False": False, "None": None}
    if value in python:
        return python[value]
    try:
        return json.loads(value)
    except ValueError:
        return text


def write(name: str, args: dict[str, Any]) -> str:
    """A function block (without the <tool_call> tags) as the template writes it."""
    params = "".join(f"{PARAMETER}{k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                     f"{VALUE_END}\n" for k, v in args.items())
    return f"{FUNCTION}{name}>\n{params}{END_FUNCTION}"


def _stringly(schema: Any) -> bool:
    """Whether a schema admits strings alone (its text is then the value as it is)."""
    if not isinstance(schema, dict):
        return False
    if "const" in schema:
        return isinstance(schema["const"], str)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return all(isinstance(v, str) for v in schema["enum"])
    return schema.get("type") == "string"


# A string value's text with the tag that ends it, up to its first such tag: one lexeme, so that a lexer that takes
# the longest match stops where the value does (a value's terminal followed by the tag as a literal would run past it).
END_RE = "\\n<\\/parameter>"
STRING_END = f"/{ANY_TEXT}{END_RE}/ & ~/{ANY_TEXT}{END_RE}(.|\\n)+/"


class Rules(RuleSet):
    """Lark rules of one function's block (`block` names its rule)."""

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix)
        self.lines.append(f"{self.terminal}_STR: {STRING_END}")

    def block(self, name: str, schema: dict[str, Any]) -> str:
        """`<function=NAME>` and the parameters in the schema's order, each required one present."""
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = set(schema.get("required") or ())
        params = []
        for key, sub in props.items():
            rule = self._rule(f"{json.dumps(f'{PARAMETER}{key}>')} \"\\n\" {self.ended(sub)} \"\\n\"")
            params.append(rule if key in required else f"{rule}?")
        return self._rule(f'{json.dumps(f"{FUNCTION}{name}>")} "\\n" {" ".join(params)} {json.dumps(END_FUNCTION)}')

    def ended(self, schema: Any) -> str:
        """A value's text and the tag that ends it: a string's own text (its enum's, length and
        pattern held), anything else as JSON under its schema."""
        end = json.dumps(VALUE_END)
        if _stringly(schema):
            if "const" in schema or isinstance(schema.get("enum"), list):
                values = [schema["const"]] if "const" in schema else schema["enum"]
                return self._rule(" | ".join(json.dumps(v + VALUE_END) for v in values))
            return self._string(schema)
        body = schema if isinstance(schema, dict) else {}
        return self._rule(f"%json {json.dumps({**body, 'x-guidance': JSON_OPTIONS})} {end}")

    def _string(self, schema: dict[str, Any]) -> str:
        """The terminal of a string's text and its end: within minLength and maxLength, matching the
        pattern."""
        parts = length_and_pattern(schema, END_RE)
        return self._terminal(f"{' & '.join(parts)} & {STRING_END}") if parts else f"{self.terminal}_STR"
