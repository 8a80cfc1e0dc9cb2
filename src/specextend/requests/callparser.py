"""An answer's text, as it arrives, parsed into content and tool calls (`CallParser`): calls in the
markup of the model's own chat template (callmarkup.py), FunctionGemma's syntax (gemmacalls.py), or
under `auto` a bare JSON call as small models write one instead. Every call is given out once
complete, a call that repeats an earlier one ends the answer (the generation stops there), a call
cut by max_tokens is dropped, and the markup never becomes content. The request's side (which tools,
the grammar that constrains a call, the conversation) is toolcalls.py's.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import gemmacalls, pycalls, xmlcalls
from .callmarkup import HERMES, CallMarkup
from .harmony import held
from .schema_rules import closed_at

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
# The start of a bare JSON call under `auto`: an optional ```json fence, then {"name": "<function>"
# with any spacing. Past it the grammar holds the answer to that call (`ToolSpec.grammar`).
BARE_HEAD = r'\s*(```(json|JSON)?[ \t]*\n)?\s*\{{\s*"name"\s*:\s*"({names})"'


def bare_head(names: Sequence[str]) -> str:
    """The regular expression (Python's and llguidance's alike) of the start of a bare JSON call
    of one of `names`."""
    return BARE_HEAD.format(names="|".join(re.escape(n) for n in names))



class CalledTool(Protocol):
    """A tool whose bare JSON calls are recognised (toolcalls.Tool): its name and schema."""

    @property
    def name(self) -> str: ...

    @property
    def parameters(self) -> dict[str, Any]: ...


FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n", re.IGNORECASE)  # a Markdown code fence's opening line
# The keys a bare call's object may begin with, in any of the recognised forms (`CallParser._form`).
FORM_KEYS = frozenset({"name", "arguments", "parameters", "function", "type", "id", "tool_calls"})
FIRST_KEY = re.compile(r'\[?\s*\{\s*"((?:[^"\\]|\\.)*)"')
FIRST_NAME = re.compile(r'\[?\s*\{\s*"(?:name|function)"\s*:\s*"((?:[^"\\]|\\.)*)"')


def json_end(text: str) -> int | None:
    """The index just past the JSON object or array that `text` opens with (its brackets counted
    outside strings); None while it is not closed."""
    return closed_at(text)


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

    tools: Sequence[CalledTool] = ()  # tools whose bare JSON calls are recognised; (): markup only
    several: bool = True  # a bare answer may make several calls (parallel_tool_calls)
    markup: CallMarkup = HERMES  # the chat template's markup of calls (callmarkup.py)
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # the callable functions' parameters, by
    # name: how an XML call's argument texts are typed (xmlcalls.py)
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
        if self.markup.args or self.markup.gemma:
            return self._named()
        if self.markup.xml:
            return self._xml()
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
        """Calls that name their function outside their arguments, one after another: Mistral's
        `[TOOL_CALLS]NAME[ARGS]{...}` and FunctionGemma's `<start_function_call>call:NAME{...}
        <end_function_call>` (its own syntax, gemmacalls.py); each given out the moment its
        arguments close."""
        m = self.markup
        head, marker, closer = m.open + m.lead, m.args or "{", m.close
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
            if head.startswith(s):
                self.buf = s
                return out
            rest = s[len(head):] if s.startswith(head) else ""
            at = rest.find(marker)
            name = (rest[:at] if at >= 0 else rest[:len(rest) - held(rest, (marker,))]).strip()
            if not s.startswith(head) or not NAME.fullmatch(name or "x"):
                self.buf = ""  # text after calls (no grammar admits it), or no call: not read
                return out
            body = rest[at + len(m.args):].lstrip() if at >= 0 else ""
            try:
                args, end = self._arguments(body) if at >= 0 else (None, -1)
            except ValueError:
                self.buf = ""
                return out
            if end < 0:  # not yet complete
                self.buf = s
                return out
            self.buf, self._block_open = body[end:], bool(closer)
            if not self._give((name, args) if isinstance(args, dict) else None, out):
                return out
        return out

    def _xml(self) -> list[dict[str, Any]]:
        """Qwen3-Coder's blocks, `<tool_call>` around a `<function=NAME>` of `<parameter=KEY>` values
        (xmlcalls.py), one after another; each call given out the moment its function closes."""
        m = self.markup
        out: list[dict[str, Any]] = []
        while self.mode == "calls":
            s = self.buf.lstrip()
            if self._block_open:  # a call read: its closer next
                if m.close.startswith(s):
                    self.buf = s
                    return out
                self._block_open = False
                self.buf = s[len(m.close):] if s.startswith(m.close) else s
                continue
            if m.open.startswith(s):
                self.buf = s
                return out
            if not s.startswith(m.open):
                self.buf = ""  # text after calls (no grammar admits it): not read
                return out
            body = s[len(m.open):].lstrip()
            try:
                call, end = xmlcalls.parse(body, self.schemas)
            except xmlcalls.Incomplete:
                self.buf = s
                return out
            except ValueError:
                self.buf = ""
                return out
            self.buf, self._block_open = body[end:], True
            if not self._give(call, out):
                return out
        return out

    def _arguments(self, body: str) -> tuple[Any, int]:
        """The arguments `body` opens with and the index past them (-1 while they are not complete),
        in the markup's syntax; ValueError where they cannot be arguments."""
        if self.markup.gemma:
            try:
                return gemmacalls.parse(body)
            except gemmacalls.Incomplete:
                return None, -1
        if body[:1] not in ("", "{"):
            raise ValueError("not a JSON object")
        end = json_end(body)
        if end is None:
            return None, -1
        try:
            return json.loads(body[:end]), end
        except ValueError:
            return None, end  # read, but not a call

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
            elif not (s[0].isidentifier() if self.markup.python else s[0] == "{"):  # "]" (the list's end), or
                self._list, self.buf = "done", ""  # what no grammar admits
            else:
                end = pycalls.call_end(s) if self.markup.python else json_end(s)
                if end is None:
                    self.buf = s
                    return out
                self._list, self.buf = "after", s[end:]
                call = pycalls.parse(s[:end]) if self.markup.python else _markup_call(s[:end], self.markup)
                if not self._give(call, out):
                    return out
        self.buf = ""
        return out

    def _given(self, text: str, out: list[dict[str, Any]]) -> bool:
        """A markup call's JSON read: as `_give`."""
        return self._give(_markup_call(text, self.markup), out)

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

    def _valid(self, tool: CalledTool, args: dict[str, Any]) -> bool:
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


def _markup_call(text: str, markup: CallMarkup) -> tuple[str, dict[str, Any]] | None:
    """The name and arguments of a markup block's JSON (under the markup's keys); None if it is not a call."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name, args = obj.get(markup.name_key), obj.get(markup.key)
    return (name, args) if isinstance(name, str) and isinstance(args, dict) else None
