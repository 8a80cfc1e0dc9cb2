"""Tool calls (OpenAI's function calling): a request's `tools` / `tool_choice` /
`parallel_tool_calls` checked, the conversation's calls and results made ready for the model's own
chat template, the grammar that constrains a call, and the answer parsed back into calls.

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

`CallParser` reads an answer back into content and calls, streamed or whole: each call is given
out once complete, a call that repeats an earlier one ends the answer (the generation stops
there), a call cut by max_tokens is dropped, and the markup never becomes content. Under `auto`
it also takes an answer that is nothing but a call written as bare JSON (the forms small models
write instead of the markup, checked against the function's schema) for that call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..common.errors import UserError
from ..sampling.grammar import JSON_OPTIONS, GrammarSpec
from . import gemmacalls, reasoning
from .callmarkup import HARMONY, HERMES, CallMarkup, markup_for, template_of
from .harmony import HarmonyParser, held
from .reasoning import ThinkParser

OPEN, CLOSE = HERMES.open, HERMES.close
CHOICES = ("auto", "none", "required")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128
# The start of a bare JSON call under `auto`: an optional ```json fence, then {"name": "<function>"
# with any spacing. Past it the grammar holds the answer to that call (`ToolSpec.grammar`).
BARE_HEAD = r'\s*(```(json|JSON)?[ \t]*\n)?\s*\{{\s*"name"\s*:\s*"({names})"'


def bare_head(names: Sequence[str]) -> str:
    """The regular expression (Python's and llguidance's alike) of the start of a bare JSON call
    of one of `names`."""
    return BARE_HEAD.format(names="|".join(re.escape(n) for n in names))


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

    def call_schema(self, key: str = "arguments") -> dict[str, Any]:
        """The JSON of one call of this tool: its name, then arguments matching its schema (under
        `key`: Llama 3's calls name them "parameters")."""
        return {"type": "object", "properties": {"name": {"const": self.name}, key: self.parameters},
                "required": ["name", key], "additionalProperties": False, "x-guidance": JSON_OPTIONS}


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
                              markup=markup)
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
    if markup.listed:  # the list as the templates' `tojson` writes it: ", " between items
        items = 'call ("," " " call)*' if several else "call"
        return [f'calls: {opener} {lead} "[" {items} "]"', f"call: {fns}"]
    closer = _literal(tokenizer, markup.close) if markup.close else ""
    body = f'(({fns}) | "[" ({fns}) ("," " " ({fns}))* "]")' if markup.lists and several else \
        f'(({fns}) | "[" ({fns}) "]")' if markup.lists else f"({fns})"
    return [f"calls: call ({sep} call)*" if several else "calls: call",
            f"call: {opener} {lead} {body} {trail} {closer}"]


def _call_rules(markup: CallMarkup, tokenizer: Any, fns: list[str], tools: Sequence[Tool]) -> list[str]:
    """One rule a function, `fns[i]` for `tools[i]`: its call's JSON (name and arguments), or where
    the markup writes the name outside the JSON (Mistral's `[ARGS]`), the name, the marker and the
    arguments' JSON."""
    if markup.gemma:  # FunctionGemma's syntax, not JSON: the name, then the arguments
        out = []
        for fn, t in zip(fns, tools, strict=True):
            rules = gemmacalls.Rules(f"{fn}_g", _literal(tokenizer, gemmacalls.ESCAPE))
            out += [f"{fn}: {json.dumps(t.name)} {rules.object(t.parameters)}", *rules.lines]
        return out
    if not markup.args:
        return [f"{fn}: %json {json.dumps(t.call_schema(markup.key))}" for fn, t in zip(fns, tools, strict=True)]
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


# --------------------------------------------------------------------------- the answer


FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n", re.IGNORECASE)  # a Markdown code fence's opening line
# The keys a bare call's object may begin with, in any of the recognised forms (`CallParser._form`).
FORM_KEYS = frozenset({"name", "arguments", "parameters", "function", "type", "id", "tool_calls"})
FIRST_KEY = re.compile(r'\[?\s*\{\s*"((?:[^"\\]|\\.)*)"')
FIRST_NAME = re.compile(r'\[?\s*\{\s*"(?:name|function)"\s*:\s*"((?:[^"\\]|\\.)*)"')


def json_end(text: str) -> int | None:
    """The index just past the JSON object or array that `text` opens with (its brackets counted
    outside strings); None while it is not closed."""
    depth, string, escape = 0, False, False
    for i, ch in enumerate(text):
        if string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                string = False
        elif ch == '"':
            string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass
class CallParser:
    """An answer's text, as it arrives, parsed into content and calls. `push` returns the new
    deltas in OpenAI's streaming shape ({"content": ...} or {"tool_calls": [...]}); the whole
    answer's content and calls are then `answer` / `tool_calls()` (one parser for a stream and
    for a whole answer, so both give the same calls).

    An answer is text, or calls in the template's markup, or (with `tools`: `auto`'s recovery) a
    bare JSON call as small models write one instead. Every call is given out whole, once it is
    complete: a call cut by max_tokens is never half sent, and the markup never reaches the
    content. A call identical to an earlier one of the answer (same name, same arguments) ends
    it (`ended`: the generation stops there, generation.py) and is not given out: a model that
    calls on in a loop has said what it had to say."""

    tools: tuple[Tool, ...] = ()  # tools whose bare JSON calls are recognised; (): markup only
    several: bool = True  # a bare answer may make several calls (parallel_tool_calls)
    markup: CallMarkup = HERMES  # the chat template's markup of calls (callmarkup.py)
    buf: str = ""  # text received and not yet given out
    mode: str = "undecided"  # "text", "calls" (markup or a bare call), "ended" (by a repeated call)
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    _seen: set[tuple[str, str]] = field(default_factory=set)
    _block_open: bool = False  # a markup block's JSON is read, its closer not yet
    _list: str = "opener"  # a listed markup: "opener" (before the "["), "item" (before one), "after" (one), "done"
    _validators: dict[str, Any] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        """A repeated call ended the answer: what follows is not read."""
        return self.mode == "ended"

    def push(self, text: str) -> list[dict[str, Any]]:
        if self.mode == "ended":
            return []
        self.buf += text
        if self.mode == "undecided":
            verdict, found = self._bare(self.buf)
            opener = self.markup.open
            if opener and self.buf.startswith(opener):
                self.mode = "calls"
            elif verdict == "calls" and self._held():
                return self._take(found)  # the grammar allows nothing after it but spaces and a fence
            elif (opener and opener.startswith(self.buf)) or verdict != "no":
                return []  # it may still be a call: held back
            else:
                self.mode = "text"
        if self.mode == "text":
            piece, self.buf = self.buf, ""
            self.content += piece
            return [{"content": piece}] if piece else []
        return self._blocks()

    def finish(self) -> list[dict[str, Any]]:
        """Deltas of what was held back: a bare call's calls, or text that began like a call but
        was not. A markup call left incomplete is dropped."""
        if self.mode != "undecided":
            return []
        verdict, found = self._bare(self.buf)
        if verdict == "maybe" and self._held():
            self.mode, self.buf = "calls", ""  # a bare call the grammar held to, cut by max_tokens: dropped
            return []
        if verdict != "calls":
            self.mode = "text"
            return self.push("")
        return self._take(found)

    def _take(self, found: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """A bare answer's calls, given out (a call repeated in it given once)."""
        self.mode, self.buf = "calls", ""
        return [d for d in (self.record(name, args) for name, args in found) if d is not None]

    def _held(self, text: str | None = None) -> bool:
        """The text (so far) begins a bare call of a function: the grammar holds the rest to it."""
        text = self.buf if text is None else text
        return bool(self.tools) and re.match(bare_head([t.name for t in self.tools]), text) is not None

    def tool_calls(self) -> list[dict[str, Any]]:
        """The complete calls, in OpenAI's message shape."""
        return list(self.calls)

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole answer (after any pushes of its start): its content (None when it was calls)
        and its calls."""
        if self.mode == "undecided" and not self.buf:  # nothing pushed yet
            self.push(text)
        self.finish()
        return (self.content if self.mode == "text" else None), self.tool_calls()

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.calls else reason

    # ----------------------------------------------------------------- the template's markup

    def _blocks(self) -> list[dict[str, Any]]:
        if self.markup.listed:
            return self._listed()
        if self.markup.args:
            return self._named()
        if self.markup.gemma:
            return self._gemma()
        opener, closer = self.markup.open, self.markup.close
        out: list[dict[str, Any]] = []
        while self.mode == "calls":
            s = self.buf.lstrip()  # blocks are separated by whitespace (Hermes's: a newline)
            if self._block_open:
                if closer.startswith(s):
                    self.buf = s
                    return out
                self._block_open = False
                if s.startswith(closer):
                    self.buf = s[len(closer):]
                    continue
            if opener.startswith(s):
                self.buf = s
                return out
            body = s[len(opener):].lstrip()
            if self.markup.lists and body.startswith("["):
                if not self._block_list(opener, body[1:], out):
                    return out
                continue
            if not s.startswith(opener) or body[:1] not in ("", "{"):
                self.buf = ""  # text after calls (no grammar admits it): not content, not a call
                return out
            end = json_end(body)
            if end is None:
                self.buf = s
                return out
            self.buf, self._block_open = body[end:], True
            if not self._given(body[:end], out):
                return out
        return out

    def _named(self) -> list[dict[str, Any]]:
        """Calls that name their function outside the JSON (Mistral's `[TOOL_CALLS]NAME[ARGS]{...}`),
        one after another: each given out the moment its arguments' JSON closes."""
        opener, marker = self.markup.open, self.markup.args
        out: list[dict[str, Any]] = []
        while self.mode == "calls":
            s = self.buf.lstrip()
            if opener.startswith(s):
                self.buf = s
                return out
            rest = s[len(opener):]
            at = rest.find(marker)
            name = (rest[:at] if at >= 0 else rest[:len(rest) - held(rest, (marker,))]).strip()
            body = rest[at + len(marker):].lstrip() if at >= 0 else ""
            if not s.startswith(opener) or not NAME.fullmatch(name or "x") or body[:1] not in ("", "{"):
                self.buf = ""  # text after calls (no grammar admits it), or no call: not read
                return out
            end = json_end(body) if body else None
            if end is None:
                self.buf = s
                return out
            self.buf = body[end:]
            try:
                args = json.loads(body[:end])
            except ValueError:
                args = None
            if not self._give((name, args) if isinstance(args, dict) else None, out):
                return out
        return out

    def _gemma(self) -> list[dict[str, Any]]:
        """FunctionGemma's calls, `<start_function_call>call:NAME{...}<end_function_call>` one after
        another: each given out the moment its arguments close (gemmacalls.py reads them)."""
        opener, lead, closer = self.markup.open, self.markup.lead, self.markup.close
        out: list[dict[str, Any]] = []
        while self.mode == "calls":
            s = self.buf.lstrip()
            if self._block_open:  # a call read: its closer next
                if closer.startswith(s):
                    self.buf = s
                    return out
                self._block_open = False
                self.buf = s[len(closer):] if s.startswith(closer) else s
                continue
            if opener.startswith(s) or (s.startswith(opener) and (opener + lead).startswith(s)):
                self.buf = s
                return out
            rest = s[len(opener + lead):] if s.startswith(opener + lead) else None
            brace = rest.find("{") if rest is not None else -1
            name = rest[:brace] if rest is not None and brace >= 0 else rest
            if rest is None or not NAME.fullmatch(name or "x"):
                self.buf = ""  # text after calls (no grammar admits it), or no call: not read
                return out
            if brace < 0:
                self.buf = s
                return out
            try:
                args, end = gemmacalls.parse(rest, brace)
            except gemmacalls.Incomplete:
                self.buf = s
                return out
            except ValueError:
                self.buf = ""
                return out
            self.buf, self._block_open = rest[end:], True
            if not self._give((name, args) if isinstance(args, dict) else None, out):
                return out
        return out

    def _block_list(self, opener: str, rest: str, out: list[dict[str, Any]]) -> bool:
        """A block's list of calls (Phi-4-mini's), after its "[": each call given out the moment it
        is complete (and dropped from the buffer, which keeps the rest of the block); True once
        the list has closed, False to wait for more text or at the answer's end."""
        rest = rest.lstrip()
        rest = rest[1:].lstrip() if rest.startswith(",") else rest  # the comma after a call given out
        while rest.startswith("{"):
            end = json_end(rest)
            if end is None:
                break
            if not self._given(rest[:end], out):
                return False
            rest = rest[end:].lstrip()
            rest = rest[1:].lstrip() if rest.startswith(",") else rest
        if rest.startswith("]"):
            self.buf, self._block_open = rest[1:], True
            return True
        self.buf = f"{opener}[{rest}" if rest[:1] in ("", "{") else ""  # else: not a list of calls
        return False

    def _listed(self) -> list[dict[str, Any]]:
        """One opener, then a JSON list of the calls (Granite's, Mistral's): each item given out
        the moment it is complete; anything after the list is not read."""
        out: list[dict[str, Any]] = []
        while self.mode == "calls" and self._list != "done":
            s = self.buf.lstrip()
            if self._list == "opener":
                rest = s[len(self.markup.open):].lstrip()
                if not rest:
                    self.buf = s
                    return out
                self._list, self.buf = ("item", rest[1:]) if rest[0] == "[" else ("done", "")
            elif not s:
                self.buf = s
                return out
            elif self._list == "after":
                self._list, self.buf = ("item", s[1:]) if s[0] == "," else ("done", "")
            elif s[0] != "{":  # "]" (the list's end), or what no grammar admits
                self._list, self.buf = "done", ""
            else:
                end = json_end(s)
                if end is None:
                    self.buf = s
                    return out
                self._list, self.buf = "after", s[end:]
                if not self._given(s[:end], out):
                    return out
        self.buf = ""
        return out

    def _given(self, text: str, out: list[dict[str, Any]]) -> bool:
        """A markup call's JSON read: as `_give`."""
        return self._give(_markup_call(text), out)

    def _give(self, call: tuple[str, dict[str, Any]] | None, out: list[dict[str, Any]]) -> bool:
        """A call read (None: it was not one): its delta added to `out`; False when it repeats an
        earlier call, which ends the answer."""
        delta = self.record(*call) if call is not None else {}
        if delta is None:
            self.mode, self.buf = "ended", ""
            return False
        if delta:
            out.append(delta)
        return True

    def record(self, name: str, args: dict[str, Any]) -> dict[str, Any] | None:
        """A new call's delta; None if the answer made the same call before."""
        key = (name, json.dumps(args, sort_keys=True))
        if key in self._seen:
            return None
        self._seen.add(key)
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
        self.calls.append(call)
        return {"tool_calls": [{"index": len(self.calls) - 1, **call}]}

    # ----------------------------------------------------------------- bare JSON calls (auto's recovery)

    def _bare(self, text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
        """Whether `text` is an answer that is nothing but calls written as JSON (optionally in a
        ```json fence): "calls" (with them), "maybe" (a prefix of one) or "no"."""
        if not self.tools:
            return "no", []
        s = text.lstrip()
        if s.startswith("```"):
            m = FENCE.match(s)
            if m is None:
                head = s[3:]
                return ("maybe" if "\n" not in head and "json".startswith(head.strip(" \t").lower()) else "no"), []
            s = s[m.end():].lstrip()
        elif "```".startswith(s):
            return "maybe", []
        if not s:
            return "maybe", []
        if s[0] not in "{[":
            return "no", []
        end = json_end(s)
        if end is None:
            return ("maybe" if self._may_be_call(s) else "no"), []
        # After it: a closing fence (or, as the grammar allows, a stray one); after a call the grammar
        # holds, nothing else can come (a scripted answer's rest is not read, as a stream's is not).
        if not "```".startswith(s[end:].strip()) and not self._held(text):
            return "no", []
        try:
            value = json.loads(s[:end])
        except ValueError:
            return "no", []
        found = self._calls_of(value)
        return ("calls", found) if found else ("no", [])

    def _may_be_call(self, s: str) -> bool:
        """An unfinished JSON value that can still become a call (its first key and, once
        written, the function's name tell early when it cannot)."""
        if re.match(r"\[\s*[^\s{]", s):
            return False
        key = FIRST_KEY.match(s)
        if key is not None and key.group(1) not in FORM_KEYS:
            return False
        name = FIRST_NAME.match(s)
        return name is None or any(t.name == name.group(1) for t in self.tools)

    def _calls_of(self, value: Any) -> list[tuple[str, dict[str, Any]]]:
        """The calls a JSON value makes in one of the recognised forms ([] if it is not one, or any
        call's arguments are not valid for its function's schema)."""
        if isinstance(value, dict) and set(value) == {"tool_calls"}:
            value = value["tool_calls"]
        items = value if isinstance(value, list) else [value]
        found = [self._form(item) for item in items]
        if not items or None in found or (len(found) > 1 and not self.several):
            return []
        return [c for c in found if c is not None]

    def _form(self, item: Any) -> tuple[str, dict[str, Any]] | None:
        """{"name": f, "arguments": {...}}, with "parameters" for "arguments", or the same inside
        {"function": {...}} (OpenAI's shape, with its "type" and "id"), or {"function": f,
        "arguments": {...}}; arguments may be given as JSON text."""
        if not isinstance(item, dict):
            return None
        item = dict(item)
        if item.pop("type", "function") != "function":
            return None
        item.pop("id", None)
        fn = item.pop("function", None)
        if isinstance(fn, dict) and not item:
            item = dict(fn)
        elif isinstance(fn, str) and "name" not in item:
            item["name"] = fn
        elif fn is not None:
            return None
        name = item.pop("name", None)
        if len(item) > 1 or not set(item) <= {"arguments", "parameters"}:
            return None
        args = next(iter(item.values()), {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        tool = next((t for t in self.tools if t.name == name), None)
        if tool is None or not isinstance(args, dict) or not self._valid(tool, args):
            return None
        return tool.name, args

    def _valid(self, tool: Tool, args: dict[str, Any]) -> bool:
        import jsonschema  # only a recovered call needs it

        if tool.name not in self._validators:
            try:
                cls = jsonschema.validators.validator_for(tool.parameters)
                cls.check_schema(tool.parameters)
                self._validators[tool.name] = cls(tool.parameters)
            except jsonschema.SchemaError:
                self._validators[tool.name] = None  # a schema it cannot read: no call recovered for it
        validator = self._validators[tool.name]
        return validator is not None and bool(validator.is_valid(args))


def _markup_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """The name and arguments of a markup block's JSON; None if it is not a call."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
        return None
    return obj["name"], obj["arguments"]
