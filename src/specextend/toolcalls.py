"""Tool calls (OpenAI's function calling): a request's `tools` / `tool_choice` /
`parallel_tool_calls` checked, the conversation's calls and results made ready for the model's own
chat template, the grammar that constrains a call, and the answer parsed back into calls.

The calls are written as the default pair's chat template (Qwen2.5, the Hermes format) asks:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. Under a grammar (grammar.py) every call is
exact: `required` and a named function force an answer of calls only, each's JSON the
function's name and an `arguments` object matching its `parameters` schema; `auto` lets the
model choose between free text (which may not contain `<tool_call>`) and calls; `none` renders
no tools and constrains nothing. `<tool_call>` is the tokenizer's own token where it has one (as
Qwen2.5's has), else its text. The JSON has the fixed separators of structured outputs, so the
grammar forces the name, the keys and the punctuation, and a speculative method's calls equal
`ar`'s as its text does.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import UserError
from .grammar import JSON_OPTIONS, GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("auto", "none", "required")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128


class ToolError(UserError):
    """A bad `tools` or `tool_choice`: the message and the request field it names."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # a JSON schema of type object
    description: str | None = None

    def as_template(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's shape)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}

    def call_schema(self) -> dict[str, Any]:
        """The JSON of one call of this tool: its name, then arguments matching its schema."""
        return {"type": "object", "properties": {"name": {"const": self.name}, "arguments": self.parameters},
                "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_OPTIONS}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and how they may be called: `choice` is auto, none, required or the
    name of the one function to call; `parallel`: several calls in one answer."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    parallel: bool = True

    @classmethod
    def parse(cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolSpec | None:
        """The spec of OpenAI's fields, None when no tool may be called; ToolError otherwise."""
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
        parsed = _tools(tools)
        choice = _choice(tool_choice, parsed)
        if not parsed or choice == "none":
            return None
        return cls(parsed, choice, parallel_tool_calls is not False)

    @property
    def called(self) -> tuple[Tool, ...]:
        """The tools the answer may call."""
        return tuple(t for t in self.tools if self.choice in CHOICES or t.name == self.choice)

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.as_template() for t in self.tools]

    def grammar(self, tokenizer: Any) -> GrammarSpec:
        """The Lark grammar (llguidance's, with %json) of an answer under this spec."""
        opener, closer = (_literal(tokenizer, t) for t in (OPEN, CLOSE))
        fns = [f"fn{i}" for i in range(len(self.called))]
        several = self.parallel and self.choice in CHOICES  # a named function: one call of it
        lines = [
            "start: TEXT | calls" if self.choice == "auto" else "start: calls",
            'calls: call ("\\n" call)*' if several else "calls: call",
            f'call: {opener} "\\n" ({" | ".join(fns)}) "\\n" {closer}',
            *(f"{fn}: %json {json.dumps(t.call_schema())}" for fn, t in zip(fns, self.called, strict=True)),
            # Free text never holds the opener: once it is written, the answer is calls.
            f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{re.escape(OPEN)}(.|\\n)*/",
        ]
        return GrammarSpec("grammar", "\n".join(lines))


def _tools(tools: Any) -> tuple[Tool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"at most {MAX_TOOLS} tools per request, got {len(tools)}", "tools")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": '
                            '{...}}}}', where)
        unknown = set(t) - {"type", "function"}
        fn = t["function"]
        unknown |= {f"function.{k}" for k in set(fn) - {"name", "description", "parameters", "strict"}}
        if unknown:
            raise ToolError(f"{where} has an unknown field {sorted(unknown)[0]!r}", where)
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name is required: 1 to 64 letters, digits, _ or -",
                            f"{where}.function.name")
        if any(o.name == name for o in out):
            raise ToolError(f"{where}.function.name {name!r} is the name of an earlier tool", f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolError(f"{where}.function.parameters must be a JSON schema of type object",
                            f"{where}.function.parameters")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ToolError(f"{where}.function.strict must be true or false", f"{where}.function.strict")
        out.append(Tool(name, {"type": "object", **params}, desc))
    return tuple(out)


def _choice(tool_choice: Any, tools: tuple[Tool, ...]) -> str:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError(f"tool_choice must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}}, got {tool_choice!r}", "tool_choice")
        if tool_choice != "none" and not tools:
            raise ToolError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise ToolError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                        '{"name": ...}}', "tool_choice")
    if fn["name"] not in {t.name for t in tools}:
        raise ToolError(f"tool_choice names the function {fn['name']!r}, which is not among the tools",
                        "tool_choice")
    return str(fn["name"])


def _literal(tokenizer: Any, text: str) -> str:
    """`text` in the Lark grammar: the tokenizer's own token for it (`<[id]>`, as the model
    writes it) where it has one, else the quoted text."""
    added = getattr(tokenizer, "get_added_vocab", dict)()
    return f"<[{added[text]}]>" if text in added else json.dumps(text)


# --------------------------------------------------------------------------- the conversation


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's messages as chat templates take them: an assistant's `tool_calls` with their
    arguments as objects (OpenAI sends them as JSON text; templates write them with `tojson`),
    and a tool result's `tool_call_id` kept. UserError for arguments that are not JSON."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if not calls:
            out.append(dict(m))
            continue
        rendered = []
        for j, c in enumerate(calls):
            fn = c["function"]
            args = fn["arguments"]
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise UserError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
            rendered.append({"id": c.get("id"), "type": "function",
                             "function": {"name": fn["name"], "arguments": args}})
        out.append({**m, "content": m.get("content") or "", "tool_calls": rendered})
    return out


# --------------------------------------------------------------------------- the answer


HEADER = re.compile(r'\n\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""
    closed: bool = False  # its block ended with CLOSE


@dataclass
class CallParser:
    """An answer's text, as it arrives, parsed into content and calls. `push` returns the new
    deltas in OpenAI's streaming shape ({"content": ...} or {"tool_calls": [...]}); the whole
    answer's content and calls are then `content` and `tool_calls()` (one parser for a stream
    and for a whole answer, so both give the same calls)."""

    buf: str = ""
    mode: str = "undecided"  # "text" or "calls" once the first characters tell
    calls: list[_Call] = field(default_factory=list)
    content: str = ""
    _depth: int = 0  # the arguments' JSON: nesting, and whether inside a string (after an escape)
    _string: bool = False
    _escape: bool = False

    def push(self, text: str) -> list[dict[str, Any]]:
        self.buf += text
        if self.mode == "undecided":
            if OPEN.startswith(self.buf):
                return []
            self.mode = "calls" if self.buf.startswith(OPEN) else "text"
        if self.mode == "text":
            piece, self.buf = self.buf, ""
            self.content += piece
            return [{"content": piece}] if piece else []
        return self._calls()

    def finish(self) -> list[dict[str, Any]]:
        """Deltas of what was held back (text that began like a call but was not)."""
        if self.mode == "undecided" and self.buf:
            self.mode = "text"
            return self.push("")
        return []

    def tool_calls(self) -> list[dict[str, Any]]:
        """The complete calls, in OpenAI's message shape; [] if any is incomplete (an answer cut
        by max_tokens: then its text is the content)."""
        if not self.calls or not all(c.closed for c in self.calls):
            return []
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls]

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole answer (after any pushes of its start): its content and calls."""
        if self.mode == "undecided" and not self.buf:  # nothing pushed yet
            self.push(text)
        self.finish()
        calls = self.tool_calls()
        return (None if calls else text), calls

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.tool_calls() else reason

    def _calls(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            current = self.calls[-1] if self.calls else None
            if current is None or current.closed:
                start = OPEN if current is None else "\n" + OPEN
                m = HEADER.match(self.buf, len(start)) if self.buf.startswith(start) else None
                if m is None:
                    return out
                call = _Call(f"call_{uuid.uuid4().hex[:24]}", m.group(1))
                self.calls.append(call)
                self.buf = self.buf[m.end():]
                self._depth, self._string, self._escape = 0, False, False
                out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
                continue
            if self._depth > 0 or not current.arguments:
                n = self._scan()
                if n:
                    piece, self.buf = self.buf[:n], self.buf[n:]
                    current.arguments += piece
                    out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})
                if self._depth > 0 or not current.arguments:
                    return out
            tail = "}\n" + CLOSE
            if not self.buf.startswith(tail):
                return out
            current.closed = True
            self.buf = self.buf[len(tail):]

    def _scan(self) -> int:
        """How many characters of `buf` belong to the arguments' JSON (up to its closing brace)."""
        for i, ch in enumerate(self.buf):
            if self._string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._string = False
            elif ch == '"':
                self._string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return len(self.buf)
