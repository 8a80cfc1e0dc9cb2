"""FunctionGemma's calls (Gemma 3 270M trained for function calling): not JSON, but

    <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:2}<end_function_call>

a call a block, blocks back to back for parallel calls; keys bare, every string between two
`<escape>` markers (so a string may hold any character but that marker), numbers, `true`,
`false`, `null`, `[...]` and `{...}` as in JSON. `parse` reads such a value (streamed text may
stop inside one: `Incomplete`); `value_rules` turns a function's JSON schema into Lark rules of
that syntax, so the grammar forces the names, the keys (required ones always, in the schema's
order), the types, the enums, strings' lengths and patterns, numbers' bounds and arrays' lengths a
call may have (what a schema says beyond these the grammar does not hold).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..common.errors import UserError
from ..sampling.grammar import JSON_OPTIONS
from .schema_rules import ANY_TEXT, RuleSet, length_and_pattern

ESCAPE = "<escape>"
KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
WORD = re.compile(r"[-+.0-9A-Za-z]+")  # a number's or a literal's characters, up to a "," "}" or "]"
NUMBER_START = re.compile(r"-?[0-9][0-9.eE+-]*|-")
LITERAL = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null")
INTEGER = r"/-?(0|[1-9][0-9]*)/"
NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class Incomplete(Exception):
    """The text ends inside the value."""


def parse(text: str, i: int = 0) -> tuple[Any, int]:
    """The value that starts at `text[i]` and the index past it; Incomplete where the text ends
    first, ValueError where it is not such a value."""
    if text.startswith(ESCAPE, i):
        end = text.find(ESCAPE, i + len(ESCAPE))
        if end < 0:
            raise Incomplete
        return text[i + len(ESCAPE):end], end + len(ESCAPE)
    if i >= len(text) or ESCAPE.startswith(text[i:]):
        raise Incomplete
    if text[i] in "{[":
        return _container(text, i)
    word = WORD.match(text, i)
    end = word.end() if word is not None else i
    if end >= len(text):  # a number or a word that may go on, or one that never can be a value
        if word is None or any(w.startswith(word.group()) for w in ("true", "false", "null")) \
                or NUMBER_START.fullmatch(word.group()):
            raise Incomplete
        raise ValueError(f"not a value at {text[i:i + 20]!r}")
    if word is None or not LITERAL.fullmatch(word.group()):
        raise ValueError(f"not a value at {text[i:i + 20]!r}")
    return json.loads(word.group()), end


def _container(text: str, i: int) -> tuple[Any, int]:
    keyed, close = text[i] == "{", "}" if text[i] == "{" else "]"
    out: Any = {} if keyed else []
    i += 1
    if i >= len(text):
        raise Incomplete
    if text[i] == close:
        return out, i + 1
    while True:
        if keyed:
            m = KEY.match(text, i)
            if m is None or m.end() >= len(text):
                if m is not None or i >= len(text):
                    raise Incomplete
                raise ValueError(f"not a key at {text[i:i + 20]!r}")
            if text[m.end()] != ":":
                raise ValueError(f"no ':' after the key {m.group()!r}")
            value, i = parse(text, m.end() + 1)
            out[m.group()] = value
        else:
            value, i = parse(text, i)
            out.append(value)
        if i >= len(text):
            raise Incomplete
        if text[i] == close:
            return out, i + 1
        if text[i] != ",":
            raise ValueError(f"no ',' or {close!r} at {text[i:i + 20]!r}")
        i += 1


def write(value: Any) -> str:
    """`value` (JSON's) in FunctionGemma's syntax (an earlier call shown to the model)."""
    if isinstance(value, str):
        return f"{ESCAPE}{value}{ESCAPE}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{write(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(write(v) for v in value) + "]"
    return json.dumps(value)


class Rules(RuleSet):
    """Lark rules of values in FunctionGemma's syntax, one rule per schema node (`value` names the
    rule of a schema); `escape` is the marker as the grammar writes it (its token where it has one)."""

    def __init__(self, prefix: str, escape: str) -> None:
        super().__init__(prefix)
        self.escape = escape
        self.lines.append(f"{self.terminal}_STR: /(.|\\n)*/ & ~/(.|\\n)*{ESCAPE}(.|\\n)*/")

    def string(self, text: str) -> str:
        return f"{self.escape} {json.dumps(text)} {self.escape}"

    def value(self, schema: Any) -> str:
        """The rule of a value the schema admits (any value where it says too little to narrow it)."""
        if not isinstance(schema, dict):
            return self._any()
        if "const" in schema:
            return self._rule(self._literal(schema["const"]))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self._rule(" | ".join(self._literal(v) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self._rule(" | ".join(self.value(s) for s in schema[key]))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self._rule(" | ".join(self.value({**schema, "type": k}) for k in kind))
        if kind == "string":
            return self._rule(f"{self.escape} {self._string(schema)} {self.escape}")
        if kind in ("integer", "number"):
            bounds = {k: schema[k] for k in BOUNDS if _number(schema.get(k))}
            if bounds:  # a number is written as JSON writes it: llguidance's JSON schema holds the bounds
                return self._rule(f"%json {json.dumps({'type': kind, **bounds, 'x-guidance': JSON_OPTIONS})}")
            return self._rule(INTEGER if kind == "integer" else NUMBER)
        if kind == "boolean":
            return self._rule('"true" | "false"')
        if kind == "null":
            return self._rule('"null"')
        if kind == "array":
            return self._array(schema)
        if kind == "object" or "properties" in schema:
            return self.object(schema)
        return self._any()

    def object(self, schema: dict[str, Any]) -> str:
        """`{key:value,...}`: the schema's properties in its order, each required one present (a
        schema without properties: any keys)."""
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return self._any_object()
        required = set(schema.get("required") or ())
        items = self.keyed(props, required, lambda n: f'{json.dumps(n)} ":"', self.value, '","')
        return self._rule(f'"{{" {items} "}}"')

    def _array(self, schema: dict[str, Any]) -> str:
        """`[item,...]` with minItems to maxItems items."""
        item = self.value(schema.get("items", {}))
        lo, hi = schema.get("minItems"), schema.get("maxItems")
        lo = lo if isinstance(lo, int) and not isinstance(lo, bool) and lo > 0 else 0
        hi = hi if isinstance(hi, int) and not isinstance(hi, bool) and hi >= 0 else None
        if hi is not None and hi < lo:
            raise UserError(f"a tool's array schema admits no array: minItems {lo} is above maxItems {hi}")
        if hi == 0:
            return self._rule('"[" "]"')
        more = f'("," {item}){{{max(lo - 1, 0)},{"" if hi is None else hi - 1}}}'
        return self._rule(f'"[" {item} {more} "]"' if lo else f'"[" ({item} {more})? "]"')

    def _string(self, schema: dict[str, Any]) -> str:
        """The terminal of a string's text: any text without the marker, within the schema's
        minLength and maxLength, matching its pattern."""
        parts = length_and_pattern(schema)
        if not parts:
            return f"{self.terminal}_STR"
        return self._terminal(f"{' & '.join(parts)} & ~/{ANY_TEXT}{ESCAPE}{ANY_TEXT}/")

    def _literal(self, value: Any) -> str:
        return self.string(value) if isinstance(value, str) else json.dumps(write(value))

    def _any(self) -> str:
        p, t = self.prefix, self.terminal
        if not any(line.startswith(f"{p}_any:") for line in self.lines):
            self.lines += [f"{p}_any: {self.escape} {t}_STR {self.escape} | {NUMBER} | \"true\" | \"false\" | \"null\""
                           f' | "[" ({p}_any ("," {p}_any)*)? "]" | {p}_obj',
                           f'{p}_obj: "{{" ({t}_KEY ":" {p}_any ("," {t}_KEY ":" {p}_any)*)? "}}"',
                           f"{t}_KEY: /[A-Za-z_][A-Za-z0-9_.-]*/"]
        return f"{p}_any"

    def _any_object(self) -> str:
        self._any()
        return f"{self.prefix}_obj"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
