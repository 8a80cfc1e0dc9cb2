"""Tool calls (OpenAI's function calling): a request's `tools` / `tool_choice` /
`parallel_tool_calls` checked, the conversation's calls and results made ready for the model's own
chat template, the grammar that constrains a call, and the parser its answer is read with.

The calls are written in the markup the model's own chat template shows (callmarkup.py): the
default pair's (Qwen2.5, the Hermes format) asks for

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline; Phi-4-mini's blocks have other markers and
may hold a list of calls, Granite's and Mistral's answer is one opener and a JSON list of every
call, and Mistral's later models write each call's name outside its JSON. Under a grammar
(sampling/grammar.py) every call is exact: `required` and a named function force an answer of
calls only, each's JSON the function's name and an `arguments` object matching its `parameters`
schema; `auto` lets the model choose between free text (which may not contain the opener) and
calls; `none` renders no tools and constrains nothing. A marker is the tokenizer's own token
where it has one (as Qwen2.5's `<tool_call>` is), else its text. The JSON has the fixed
separators of structured outputs, so the grammar forces the name, the keys and the punctuation,
and a speculative method's calls equal `ar`'s as its text does.

The answer is read back into content and calls by callparser.py's `CallParser` (`ToolSpec.parser`,
`answer_parser`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..common.errors import FieldError, UserError
from ..sampling.grammar import JSON_OPTIONS, GrammarSpec
from . import gemmacalls, pycalls, reasoning, xmlcalls
from .callmarkup import HARMONY, HERMES, CallMarkup, markup_for, template_of
from .callparser import NAME, CallParser, bare_head
from .harmony import HarmonyParser
from .reasoning import ThinkParser

OPEN, CLOSE = HERMES.open, HERMES.close
CHOICES = ("auto", "none", "required")
MAX_TOOLS = 128
class ToolError(FieldError):
    """A bad `tools` or `tool_choice`: the message and the request field it names."""


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

    def call_schema(self, key: str = "arguments", name_key: str = "name", id_key: str = "") -> dict[str, Any]:
        """The JSON of one call of this tool: its name, then arguments matching its schema (under
        `key`: Llama 3's calls name them "parameters"; the name under `name_key`), after an id the
        model numbers where the markup has one (`id_key`: Command R7B's)."""
        ids = {id_key: {"type": "string", "pattern": "^[0-9]{1,3}$"}} if id_key else {}
        return {"type": "object", "properties": {**ids, name_key: {"const": self.name}, key: self.parameters},
                "required": [*ids, name_key, key], "additionalProperties": False, "x-guidance": JSON_OPTIONS}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and how they may be called: `choice` is auto, none, required or the
    name of the one function to call; `parallel`: several calls in one answer."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    parallel: bool = True
    recover: bool = True  # `auto`: an answer that is nothing but a bare JSON call is a call (CallParser)

    @classmethod
    def parse(cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None,
              tool_call_recovery: Any = None) -> ToolSpec | None:
        """The spec of OpenAI's fields (and this server's `tool_call_recovery`), None when no tool
        may be called; ToolError otherwise."""
        for name, value in (("parallel_tool_calls", parallel_tool_calls), ("tool_call_recovery", tool_call_recovery)):
            if value is not None and not isinstance(value, bool):
                raise ToolError(f"{name} must be true or false", name)
        parsed = _tools(tools)
        choice = _choice(tool_choice, parsed)
        if not parsed or choice == "none":
            return None
        return cls(parsed, choice, parallel_tool_calls is not False, tool_call_recovery is not False)

    def parser(self, markup: CallMarkup = HERMES) -> CallParser | HarmonyParser:
        """A parser of an answer whose calls are in `markup` (callmarkup.markup_for the tokenizer):
        bare JSON calls recognised where the choice is the model's (`auto`) and recovery is on.
        HARMONY: the answer is in gpt-oss's format (harmony.py), a call a message addressed to
        `functions.NAME` with the arguments as its body."""
        if markup.bare:  # the calls are bare JSON: one call, read as auto's recovery reads one
            return CallParser(self.called, several=False, markup=markup)
        if markup is not HARMONY:
            return CallParser(self.tools if self.choice == "auto" and self.recover else (), several=self.parallel,
                              markup=markup, schemas={t.name: t.parameters for t in self.called})
        calls, names = CallParser(), {t.name for t in self.called}

        def call(name: str, body: str) -> dict[str, Any] | None:
            try:
                args = json.loads(body)
            except ValueError:  # cut by max_tokens: dropped, as a markup call cut short is
                return None
            return calls.record(name, args) if name in names and isinstance(args, dict) else None

        return HarmonyParser(call)

    @property
    def called(self) -> tuple[Tool, ...]:
        """The tools the answer may call."""
        return tuple(t for t in self.tools if self.choice in CHOICES or t.name == self.choice)

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.as_template() for t in self.tools]

    def grammar(self, tokenizer: Any) -> GrammarSpec | None:
        """The Lark grammar (llguidance's, with %json) of an answer under this spec (None: free)."""
        markup = markup_for(tokenizer)
        if markup is HARMONY:
            return self._harmony_grammar(tokenizer)
        fns = [f"fn{i}" for i in range(len(self.called))]
        several = self.parallel and self.choice in CHOICES and not markup.bare  # a named function: one call of it
        recover = self.choice == "auto" and self.recover and not markup.bare  # the markup's calls are bare already
        # Free text never holds the opener (once it is written, the answer is calls), nor a bare call's start.
        text = "/(.|\\n)+/"
        if markup.open:
            text += f" & ~/(.|\\n)*{re.escape(markup.open)}(.|\\n)*/"
        if recover or markup.bare:
            text += f" & ~/{bare_head([t.name for t in self.called])}(.|\\n)*/"
        body = ("TEXT | calls | bare" if recover else "TEXT | calls") if self.choice == "auto" else "calls"
        lines = [f"start: {body}"]
        thought = reasoning.markers_of(template_of(tokenizer))
        if thought is not None:  # a thinking model may think first (reasoning.py)
            literals = (_literal(tokenizer, thought[0]), _literal(tokenizer, thought[1]))
            lines = reasoning.thought_rules(thought, literals, reasoning.opens(tokenizer), body, text)
        lines += [
            *_markup_rules(markup, tokenizer, several, " | ".join(fns)),
            *(_call_rules(markup, tokenizer, fns, self.called)),
            f"TEXT: {text}",
        ]
        if recover:
            # Once free text has begun a bare JSON call of a function (BARE_HEAD), it is free text no
            # more: the rest is that call, its arguments valid for the schema, and nothing after it.
            heads = [f"bare{i}: BARE{i} BARE_ARGS {fn}_args BARE_END" for i, fn in enumerate(fns)]
            lines += [
                f"bare: {' | '.join(f'bare{i}' for i in range(len(fns)))}",
                *heads,
                *(f"BARE{i}: /{bare_head([t.name])}/" for i, t in enumerate(self.called)),
                *(f"{fn}_args: %json {json.dumps({**t.parameters, 'x-guidance': {'whitespace_flexible': True}})}"
                  for fn, t in zip(fns, self.called, strict=True)),
                'BARE_ARGS: /\\s*,\\s*"(arguments|parameters)"\\s*:\\s*/',
                "BARE_END: /\\s*\\}\\s*(```\\s*)?/",
            ]
        return GrammarSpec("grammar", "\n".join(lines))


    def _harmony_grammar(self, tokenizer: Any) -> GrammarSpec | None:
        """gpt-oss's answer under `required` or a named function: at once a message addressed to
        one of the functions, its body JSON valid for that function's schema (the answer then ends:
        <|call|> is an end token). Under `auto` the model chooses, unconstrained, and its calls are
        read from its messages."""
        if self.choice == "auto":
            return None
        channel, constrain, message = (_literal(tokenizer, m) for m in ("<|channel|>", "<|constrain|>", "<|message|>"))
        fns = [f"fn{i}" for i in range(len(self.called))]
        lines = [
            "start: call",
            f'call: {channel} "commentary to=functions." ({" | ".join(fns)})',
            *(f'{fn}: {json.dumps(t.name + " ")} {constrain} "json" {message} {fn}_args'
              for fn, t in zip(fns, self.called, strict=True)),
            *(f"{fn}_args: %json {json.dumps({**t.parameters, 'x-guidance': JSON_OPTIONS})}"
              for fn, t in zip(fns, self.called, strict=True)),
        ]
        return GrammarSpec("grammar", "\n".join(lines))


def answer_parser(tokenizer: Any, tools: ToolSpec | None) -> CallParser | HarmonyParser | ThinkParser | None:
    """The parser of a chat answer of `tokenizer`'s model: its calls (`tools`) in its template's
    markup, gpt-oss's messages (harmony.py), behind a thought block where the model thinks
    (reasoning.py); None: the answer is its text as it is."""
    markup = markup_for(tokenizer)
    parser = tools.parser(markup) if tools is not None else None
    if markup is HARMONY:
        return parser if parser is not None else HarmonyParser()
    thought = reasoning.markers_of(template_of(tokenizer))
    if thought is not None:
        return ThinkParser(parser, reasoning.opens(tokenizer), thought)
    return parser


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


def _markup_rules(markup: CallMarkup, tokenizer: Any, several: bool, fns: str) -> list[str]:
    """The grammar's `calls` in `markup`: blocks of one call each, or one opener and a JSON list
    (one item where the answer makes one call); `fns` the alternatives of a call's JSON."""
    if markup.bare:
        return ["calls: call", f"call: {fns}"]
    opener = _literal(tokenizer, markup.open)
    lead, trail, sep = (json.dumps(t) if t else "" for t in (markup.lead, markup.trail, markup.sep))
    closer = _literal(tokenizer, markup.close) if markup.close else ""
    if markup.listed:  # the list as the template writes it (`tojson`'s ", " between items, or one call a line)
        start, between, end = (json.dumps(t) for t in markup.items)
        items = f"call ({between} call)*" if several else "call"
        return [f"calls: {opener} {lead} {start} {items} {end} {closer}", f"call: {fns}"]
    body = f'(({fns}) | "[" ({fns}) ("," " " ({fns}))* "]")' if markup.lists and several else \
        f'(({fns}) | "[" ({fns}) "]")' if markup.lists else f"({fns})"
    return [f"calls: call ({sep} call)*" if several else "calls: call",
            f"call: {opener} {lead} {body} {trail} {closer}"]


def _call_rules(markup: CallMarkup, tokenizer: Any, fns: list[str], tools: Sequence[Tool]) -> list[str]:
    """One rule a function, `fns[i]` for `tools[i]`: its call's JSON (name and arguments), or where
    the markup writes the name outside the JSON (Mistral's `[ARGS]`), the name, the marker and the
    arguments' JSON."""
    if markup.python:  # LFM2's NAME(key=value, ...)
        out = []
        for fn, t in zip(fns, tools, strict=True):
            rules = pycalls.Rules(f"{fn}_p")
            out += [f"{fn}: {rules.call(t.name, t.parameters)}", *rules.lines]
        return out
    if markup.xml:  # Qwen3-Coder's <function=NAME> of <parameter=KEY> values
        out = []
        for fn, t in zip(fns, tools, strict=True):
            rules = xmlcalls.Rules(f"{fn}_x")
            out += [f"{fn}: {rules.block(t.name, t.parameters)}", *rules.lines]
        return out
    if markup.gemma:  # FunctionGemma's syntax, not JSON: the name, then the arguments
        out = []
        for fn, t in zip(fns, tools, strict=True):
            rules = gemmacalls.Rules(f"{fn}_g", _literal(tokenizer, gemmacalls.ESCAPE))
            out += [f"{fn}: {json.dumps(t.name)} {rules.object(t.parameters)}", *rules.lines]
        return out
    if not markup.args:
        return [f"{fn}: %json {json.dumps(t.call_schema(markup.key, markup.name_key, markup.id_key))}"
                for fn, t in zip(fns, tools, strict=True)]
    args = _literal(tokenizer, markup.args)
    return [rule for fn, t in zip(fns, tools, strict=True) for rule in (
        f"{fn}: {json.dumps(t.name)} {args} {fn}_named",
        f"{fn}_named: %json {json.dumps({**t.parameters, 'x-guidance': JSON_OPTIONS})}")]


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
