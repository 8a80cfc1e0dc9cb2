"""gpt-oss's chat format (OpenAI's harmony): the answer's reasoning kept apart from its final text.

A gpt-oss turn is a run of messages, each a header and a body between special tokens:

    <|channel|>analysis<|message|>The user asks ...<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>

(the prompt ends in `<|start|>assistant`, so the answer opens with the first message's channel).
The `analysis` channel is the model's reasoning, `final` (and `commentary`, its preambles) the
text for the user. `HarmonyParser` reads the generated text, whole or streamed, into deltas of
`content` and `reasoning_content` (an extension of OpenAI's chat answer, as other servers name it)
and never lets the markup through. It has `CallParser`'s interface (push, finish, answer,
finish_reason), so the server runs it where it runs that one. Tool calls in harmony's own form
(`commentary to=functions.NAME`) are given as content for now.

The markup needs the special tokens' text: a harmony tokenizer (`is_harmony`) is decoded with its
special tokens kept, and this parser removes them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
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


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The text of generated token ids: special tokens skipped, except a harmony tokenizer's markers,
    which `HarmonyParser` needs (and removes)."""
    ids = list(token_ids)
    if not is_harmony(tokenizer):
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    added = tokenizer.get_added_vocab()
    drop = set(tokenizer.all_special_ids) - {added[m] for m in MARKERS if m in added}
    return tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)


def _held(text: str) -> int:
    """How many trailing characters of `text` could begin a marker (held until the next piece)."""
    for n in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0


class HarmonyParser:
    """An answer in harmony's markup -> content and reasoning deltas, streamed or whole."""

    def __init__(self) -> None:
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
            self._marker(m.group())
            self._buf = self._buf[m.end() :]
        keep = _held(self._buf)
        self._text(self._buf[: len(self._buf) - keep], out)
        self._buf = self._buf[len(self._buf) - keep :]
        return _merged(out)

    def finish(self) -> list[dict[str, Any]]:
        """The text held back at the end; an answer without any message (no markup) is content."""
        out: list[dict[str, Any]] = []
        self._text(self._buf, out)
        self._buf = ""
        if self._field is None and self._messages == 0 and self._header.strip():
            out.append({"content": self._header})
        self._header = ""
        return _merged(out)

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A whole answer: its content (None where it has none) and no tool calls; the reasoning
        is left in `reasoning`."""
        parts = self.push(text) + self.finish()
        content = "".join(d.get("content", "") for d in parts)
        reasoning = "".join(d.get(REASONING, "") for d in parts)
        self.reasoning = reasoning or None
        return content or (None if reasoning else content), None

    @staticmethod
    def finish_reason(reason: str) -> str:
        return reason

    def _text(self, s: str, out: list[dict[str, Any]]) -> None:
        if not s:
            return
        if self._field is None:
            self._header += s
        else:
            out.append({self._field: s})

    def _marker(self, m: str) -> None:
        if m == "<|message|>":
            found = _CHANNEL.search(self._header)
            self._field = REASONING if found and found.group(1) == "analysis" else "content"
            self._header = ""
            self._messages += 1
        elif m in ("<|channel|>", "<|constrain|>"):
            if self._field is None:
                self._header += m
        else:  # <|start|>, <|end|>, <|return|>, <|call|>: a message ends, the next header begins
            self._field = None
            self._header = ""


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent deltas of one field joined (one chunk a field and push)."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1].keys() == d.keys():
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
