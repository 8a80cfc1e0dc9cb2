"""A thinking model's reasoning kept apart from its answer: Qwen3, SmolLM3 and DeepSeek-R1's
distills think in a block before they answer (Magistral in `[THINK]...[/THINK]`),

    <think>
    The user wants the weather; I should call get_weather.
    </think>

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and their chat templates name `</think>` (to drop an earlier turn's thoughts), which is how
`markers_of` tells them. As llama.cpp's server does by default, `ThinkParser` sends the block to
`reasoning_content` (an extension of OpenAI's chat answer, the field harmony.py fills for gpt-oss)
and the rest to the answer's own parser: content, or the calls (callparser.CallParser), so a call
made after thinking is a call. Where the template's generation prompt opens the block itself
(`opens`: DeepSeek-R1's, Qwen3's thinking-only models), the answer starts inside it.

`thought_rules` give the tool-call grammar the same optional block before the calls, so a model
that thinks first may still call.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from typing import Any, Protocol

from jinja2 import TemplateError

from .harmony import CHANNEL_MARK, REASONING, held, merged

OPEN, CLOSE = "<think>", "</think>"
# A thought's markers, by the closer a template names: `<think>` blocks, Magistral's [THINK], Command R7B's plan
# before its calls, and Seed-OSS's.
THOUGHTS = ((OPEN, CLOSE), ("[THINK]", "[/THINK]"), ("<|START_THINKING|>", "<|END_THINKING|>"),
            ("<seed:think>", "</seed:think>"))


class AnswerParser(Protocol):
    """What reads an answer's text (callparser.CallParser): deltas as it streams, then the whole."""

    @property
    def ended(self) -> bool: ...

    def push(self, text: str) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]: ...

    def tool_calls(self) -> list[dict[str, Any]]: ...

    def finish_reason(self, reason: str) -> str: ...


def markers_of(template: str | None) -> tuple[str, str] | None:
    """The (opener, closer) of the thought blocks a chat template's model writes (the template
    names the closer, to drop an earlier turn's thought); None where it shows none."""
    return next((pair for pair in THOUGHTS if template is not None and pair[1] in template), None)


def describe(template: str | None) -> str:
    """One line on where a chat template's model reasons (`models inspect`)."""
    if not template:
        return "none: the file has no chat template"
    if CHANNEL_MARK in template:
        return "harmony's analysis channel (gpt-oss), answered as reasoning_content"
    markers = markers_of(template)
    if markers is not None:
        return f"{markers[0]} blocks, answered as reasoning_content"
    return "none: its chat template shows no thinking"


_OPENS: weakref.WeakKeyDictionary[Any, tuple[Any, bool]] = weakref.WeakKeyDictionary()


def opens(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s chat template ends its generation prompt inside an open thought
    block (rendered once per tokenizer and template)."""
    template = getattr(tokenizer, "chat_template", None)
    with contextlib.suppress(TypeError):
        known = _OPENS.get(tokenizer)
        if known is not None and known[0] is template:
            return known[1]
    markers = markers_of(template if isinstance(template, str) else None)
    text: Any = ""
    if markers is not None:  # a template without thoughts opens none: not rendered
        with contextlib.suppress(TemplateError, AttributeError, TypeError, ValueError):
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                 tokenize=False)
    found = markers is not None and isinstance(text, str) and text.rstrip().endswith(markers[0])
    with contextlib.suppress(TypeError):
        _OPENS[tokenizer] = (template, found)
    return found


class ThinkParser:
    """An answer that may open with a thought block -> `reasoning_content` deltas, then the
    deltas of `inner` (the calls' parser; None: content), streamed or whole. It has CallParser's
    interface (push, finish, answer, finish_reason, tool_calls, ended), so the server runs it where
    it runs that one. Whitespace around the thought and before the answer is not sent."""

    def __init__(self, inner: AnswerParser | None = None, opened: bool = False,
                 markers: tuple[str, str] = (OPEN, CLOSE)) -> None:
        self.inner = inner
        self.open, self.close = markers
        self._state = "thought" if opened else "start"  # start, thought, gap (after the block), answer
        self._lead = True  # the thought's leading whitespace not yet passed
        self._buf = ""
        self._thought: list[str] = []
        self.reasoning: str | None = None  # the whole answer's thought, after `answer`

    def push(self, text: str) -> list[dict[str, Any]]:
        self._buf += text
        out: list[dict[str, Any]] = []
        if self._state == "start":
            s = self._buf.lstrip()
            if self.open.startswith(s):  # nothing yet, or the opener's first characters
                return out
            if s.startswith(self.open):
                self._state, self._buf = "thought", s[len(self.open):]
            else:
                self._state = "answer"
        if self._state == "thought":
            if self._lead:
                self._buf = self._buf.lstrip()
                self._lead = not self._buf
            end = self._buf.find(self.close)
            keep = len(self._buf) - end if end >= 0 else held(self._buf, (self.close,))
            self._say(self._buf[:len(self._buf) - keep], out)
            if end < 0:
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            self._state, self._buf = "gap", self._buf[end + len(self.close):]
        if self._state == "gap":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return out
            self._state = "answer"
        piece, self._buf = self._buf, ""
        return out + self._answer(piece)

    def finish(self) -> list[dict[str, Any]]:
        """What was held back: a thought cut by max_tokens is reasoning; text that only began like
        the opener is the answer's."""
        out: list[dict[str, Any]] = []
        if self._state == "thought":
            self._say(self._buf, out)
        elif self._state == "start":
            out += self._answer(self._buf)
        self._buf = ""
        out += self.inner.finish() if self.inner is not None else []
        return merged(out)

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A whole answer: its content (None where it made calls, or where it is only a thought)
        and its calls (None without tools); the thought is left in `reasoning`."""
        parts = self.push(text) + self.finish()
        self.reasoning = "".join(self._thought) or None
        if self.inner is not None:
            content, calls = self.inner.answer("")  # all of it pushed and finished: its content and calls
            return (content or None) if self.reasoning else content, calls
        content = "".join(d.get("content", "") for d in parts)
        return content or (None if self.reasoning else content), None

    @property
    def ended(self) -> bool:
        return self.inner is not None and self.inner.ended

    def tool_calls(self) -> list[dict[str, Any]]:
        return self.inner.tool_calls() if self.inner is not None else []

    def finish_reason(self, reason: str) -> str:
        return self.inner.finish_reason(reason) if self.inner is not None else reason

    def _say(self, text: str, out: list[dict[str, Any]]) -> None:
        if text:
            self._thought.append(text)
            out.append({REASONING: text})

    def _answer(self, text: str) -> list[dict[str, Any]]:
        if self.inner is not None:
            return self.inner.push(text)
        return [{"content": text}] if text else []


def thought_rules(markers: tuple[str, str], literals: tuple[str, str], opened: bool, body: str,
                  text: str) -> list[str]:
    """The grammar's start with an optional thought before `body` (the answer's alternatives, free
    text among them as TEXT, whose regex is `text`); where the prompt opened the block, the thought
    is the start. `markers`: the thought's opener and closer; `literals`: the same as the grammar
    writes them (the tokenizer's own tokens, `<[id]>`, where it has them). A thought is one greedy
    lexeme, so it must end where the closer begins: before the closer's token, or (a closer written
    as text) including it, the only one it holds. Free text, which could run on and hold the lexer
    past a marker, does not begin with the opener (before a thought) nor with whitespace (after
    one: the gap is its own lexeme, which ends where a call's opener starts)."""
    opener, closer = literals
    start, close = (re.escape(m).replace("/", "\\/") for m in markers)  # in a Lark regex
    if closer.startswith("<["):
        thought = [f"think_body: THOUGHT? {closer}", f"THOUGHT: /(.|\\n)+/ & ~/(.|\\n)*{close}(.|\\n)*/"]
    else:
        thought = ["think_body: THOUGHT", f"THOUGHT: /(.|\\n)*{close}/ & ~/(.|\\n)*{close}(.|\\n)+/"]
    texts = [f"TEXT_FIRST: {text} & ~/{start}(.|\\n)*/", f"TEXT_AFTER: {text} & ~/[ \\t\\r\\n](.|\\n)*/"]
    return ["start: think GAP? after" if opened else "start: body | think GAP? after",
            f"body: {body.replace('TEXT', 'TEXT_FIRST')}",
            f"after: {body.replace('TEXT', 'TEXT_AFTER')}",
            "think: think_body" if opened else f"think: {opener} think_body",
            *thought,
            "GAP: /[ \\t\\r\\n]+/",
            *(texts if "TEXT" in body else [])]
