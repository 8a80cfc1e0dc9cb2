"""LFM2's calls (Liquid AI's models): a Python list of calls with keyword arguments, not JSON,

    <|tool_call_start|>[get_weather(city="Paris", days=2), book(seats=["a"])]<|tool_call_end|>

the arguments Python literals (strings, numbers, True, False, None, lists and dicts). `call_end`
finds where a call closes in streamed text (brackets counted outside strings), `parse` reads one
through Python's own parser, `write` writes calls as the model does, and `Rules` turns a function's
JSON schema into Lark rules of its call, so the grammar forces the name, the keywords (required
ones always, in the schema's order) and each value: strings, numbers, objects and arrays written as
JSON under their schema (JSON's strings, numbers, lists and objects are Python's too), booleans
and null as Python's True, False and None.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from ..sampling.grammar import JSON_OPTIONS
from .schema_rules import RuleSet, closed_at

LITERALS = {"True": True, "False": False, "None": None}


def call_end(text: str) -> int | None:
    """The index just past the call `text` opens with (`name(...)`: its parentheses and brackets
    counted outside strings, quoted either way); None while it is not closed."""
    return closed_at(text, "\"'", "([{", ")]}")


def parse(text: str) -> tuple[str, dict[str, Any]] | None:
    """The name and keyword arguments of one call `name(key=value, ...)`; None where it is not one
    (positional arguments, a value that is no literal)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = _literal(text.strip(), kw.value)
        except ValueError:
            return None
    return node.func.id, args


def _literal(source: str, node: ast.expr) -> Any:
    """A value node's literal: its text as JSON where it is (the grammar's strings and containers),
    else as Python (True, False, None, quotes either way)."""
    segment = ast.get_source_segment(source, node) or ""
    if segment in LITERALS:
        return LITERALS[segment]
    try:
        return json.loads(segment)
    except ValueError:
        return ast.literal_eval(node)


def write(name: str, args: dict[str, Any]) -> str:
    """One call as the model writes it."""
    return f"{name}({', '.join(f'{k}={_python(v)}' for k, v in args.items())})"


def _python(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "True", False: "False", None: "None"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{json.dumps(str(k), ensure_ascii=False)}: {_python(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return json.dumps(value, ensure_ascii=False)


class Rules(RuleSet):
    """Lark rules of one function's call (`call` names its rule)."""

    def call(self, name: str, schema: dict[str, Any]) -> str:
        """`name(key=value, ...)`: the schema's properties in its order, each required one present."""
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = set(schema.get("required") or ())
        keywords = self.keyed(props, required, lambda n: json.dumps(n + "="), self.value, '", "') if props else ""
        return self._rule(f'{json.dumps(name + "(")} {keywords} ")"')

    def value(self, schema: Any) -> str:
        """A value: True / False / None where the schema is boolean or null, else JSON under it."""
        if isinstance(schema, dict) and schema.get("type") == "boolean":
            return self._rule('"True" | "False"')
        if isinstance(schema, dict) and schema.get("type") == "null":
            return self._rule('"None"')
        body = schema if isinstance(schema, dict) else {}
        return self._rule(f"%json {json.dumps({**body, 'x-guidance': JSON_OPTIONS})}")
