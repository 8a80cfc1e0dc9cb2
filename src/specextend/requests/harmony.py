"""gpt-oss's chat format (OpenAI's harmony): the answer's reasoning kept apart from its final text.

A gpt-oss turn is a run of messages, each a header and a body between special tokens:

    <|channel|>analysis<|message|>The user asks ...<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>

(the prompt ends in `<|start|>assistant`, so the answer opens with the first message's channel).
The `analysis` channel is the model's reasoning, `final` (and `commentary`, its preambles) the
text for the user. `HarmonyParser` reads the generated text, whole or streamed, into deltas of
`content` and `reasoning_content` (an extension of OpenAI's chat answer, as other servers name it)
and never lets the markup through. It has `CallParser`'s interface (push, finish, answer,
finish_reason, tool_calls), so the server runs it where it runs that one. A message addressed to a
function (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`) is a
tool call: given whole to the `call` callback when the message ends (toolcalls.py makes it a call
delta; a body cut by max_tokens is dropped), never as content.

The markup needs the special tokens' text: a harmony tokenizer (`is_harmony`) is decoded with its
markers kept (callmarkup.decode), and this parser removes them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=functions\.([A-Za-z0-9_.-]+)")
CALL = "call"  # the field of a message addressed to a function: its body is a call's arguments
REASONING = "reasoning_content"  # the answer's field for the analysis channel
CHANNEL_MARK = "<|channel|>"


def is_harmony(tokenizer: Any) -> bool:
    """Whether `tokenizer` writes harmony's markup (gpt-oss's: its `<|channel|>` and `<|message|>`
    tokens among the added ones, a small table, so asking at every decode costs little)."""
    try:
        added = tokenizer.get_added_vocab()
    except (AttributeError, TypeError):
        return False
    return CHANNEL_MARK in added and "<|message|>" in added


def held(text: str, markers: Sequence[str] = MARKERS) -> int:
    """How many trailing characters of `text` could begin a marker (held until the next piece)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


# (function name, the message's body) -> the call's delta, or None (not a call: dropped).
CallSink = Callable[[str, str], "dict[str, Any] | None"]


class HarmonyParser:
    """An answer in harmony's markup -> content, reasoning and tool-call deltas, streamed or whole."""

    def __init__(self, call: CallSink | None = None) -> None:
        self._call = call
        self._function = ""  # the function the current message is addressed to
        self._body = ""  # that message's body so far
        self.calls: list[dict[str, Any]] = []  # the calls made, in OpenAI's message shape
        self._buf = ""
        self._header = ""  # the current message's header so far (None channel: in a header)
        self._field: str | None = None  # where the current message's body goes; None: in a header
        self._messages = 0  # bodies opened so far
        self.reasoning: str | None = None  # the whole answer's reasoning, after `answer`

    def push(self, text: str) -> list[dict[str, Any]]:
        """New text -> the deltas it completes ({"content": ...} or {"reasoning_content": ...})."""
        self._buf += text
        out: list[dict[str, Any]] = []
        while (m := _MARKER.search(self._buf)) is not None:
            self._text(self._buf[: m.start()], out)
            self._marker(m.group(), out)
            self._buf = self._buf[m.end() :]
        keep = held(self._buf)
        self._text(self._buf[: len(self._buf) - keep], out)
        self._buf = self._buf[len(self._buf) - keep :]
        return merged(out)

    def finish(self) -> list[dict[str, Any]]:
        """The text held back at the end; an answer without any message (no markup) is content."""
        out: list[dict[str, Any]] = []
        self._text(self._buf, out)
        self._buf = ""
        self._end_message(out)  # a call's body ends with the answer (its <|call|> is an end token)
        if self._field is None and self._messages == 0 and self._header.strip():
            out.append({"content": self._header})
        self._header = ""
        return merged(out)

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A whole answer: its content (None where it has none or made calls) and its calls (None
        where it may make none); the reasoning is left in `reasoning`."""
        parts = self.push(text) + self.finish()
        content = "".join(d.get("content", "") for d in parts)
        reasoning = "".join(d.get(REASONING, "") for d in parts)
        self.reasoning = reasoning or None
        if self._call is not None:
            return content or None, self.tool_calls()
        return content or (None if reasoning else content), None

    @property
    def ended(self) -> bool:
        return False  # <|call|> ends the generation itself (an end token)

    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.calls)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _text(self, s: str, out: list[dict[str, Any]]) -> None:
        if not s:
            return
        if self._field is None:
            self._header += s
        elif self._field == CALL:
            self._body += s
        else:
            out.append({self._field: s})

    def _marker(self, m: str, out: list[dict[str, Any]]) -> None:
        if m == "<|message|>":
            found, to = _CHANNEL.search(self._header), _RECIPIENT.search(self._header)
            if to is not None and self._call is not None:
                self._field, self._function, self._body = CALL, to.group(1), ""
            else:
                self._field = REASONING if found and found.group(1) == "analysis" else "content"
            self._header = ""
            self._messages += 1
        elif m in ("<|channel|>", "<|constrain|>"):
            if self._field is None:
                self._header += m
        else:  # <|start|>, <|end|>, <|return|>, <|call|>: a message ends, the next header begins
            self._end_message(out)
            self._field = None
            self._header = ""

    def _end_message(self, out: list[dict[str, Any]]) -> None:
        if self._field == CALL and self._call is not None:
            delta = self._call(self._function, self._body)
            if delta is not None:
                self.calls += [{k: v for k, v in c.items() if k != "index"} for c in delta["tool_calls"]]
                out.append(delta)
            self._field, self._body = None, ""


def merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent deltas of one text field joined (one chunk a field and push)."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1].keys() == d.keys() and "tool_calls" not in d:
            key = next(iter(d))
            out[-1] = {key: out[-1][key] + d[key]}
        else:
            out.append(d)
    return out


def split(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole harmony answer."""
    p = HarmonyParser()
    content, _ = p.answer(text)
    return p.reasoning, content
