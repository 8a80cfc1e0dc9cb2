"""What the call syntaxes that are not JSON share (gemmacalls.py, xmlcalls.py, pycalls.py): Lark rules built one a
JSON schema node (`RuleSet`), a string's length and pattern as regular expressions of its text
(`length_and_pattern`, `searched`), and where a bracketed value closes in streamed text (`closed_at`; JSON's too,
callparser.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

ANY_TEXT = "(.|\\n)*"


class RuleSet:
    """Lark rules of one function's call, one a schema node (`lines`); `prefix` keeps them apart from the other
    functions' (rules are lowercase, terminals uppercase: Lark's)."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.terminal = prefix, prefix.upper()
        self.lines: list[str] = []
        self._n = 0

    def _rule(self, body: str) -> str:
        self._n += 1
        name = f"{self.prefix}_{self._n}"
        self.lines.append(f"{name}: {body}")
        return name

    def keyed(self, props: dict[str, Any], required: set[str], head: Callable[[str], str],
              value: Callable[[Any], str], sep: str) -> str:
        """Some of `props`' items in their order, each `head(name)` and then `value(schema)`, `sep` between two,
        every required one present: a rule name, followed by "?" where none is required (nothing at all then)."""
        names = list(props)
        # run[i]: the items from the i-th on, one or more, every required one among them; after one comes `sep` and
        # the next run, or nothing where no later item is required
        run = [""] * (len(names) + 1)
        for i in range(len(names) - 1, -1, -1):
            rest_required = any(n in required for n in names[i + 1:])
            after = f"({sep} {run[i + 1]})" if i + 1 < len(names) else ""
            if after and not rest_required:
                after += "?"
            item = f"{head(names[i])} {value(props[names[i]])} {after}".strip()
            run[i] = self._rule(item if names[i] in required else f"{item} | {run[i + 1]}" if run[i + 1] else item)
        return f"{run[0]}{'' if required & set(names) else '?'}"

    def _terminal(self, body: str) -> str:
        self._n += 1
        name = f"{self.terminal}_S{self._n}"
        self.lines.append(f"{name}: {body}")
        return name


def length_and_pattern(schema: dict[str, Any], end: str = "") -> list[str]:
    """Regular expressions a string's text (followed by `end`, a regex) must match for the schema's minLength,
    maxLength and pattern (found anywhere in the text, as JSON schema reads a pattern, unless the pattern anchors
    itself); none where it sets none of them."""
    lo, hi, pattern = schema.get("minLength"), schema.get("maxLength"), schema.get("pattern")
    parts = []
    if isinstance(lo, int) or isinstance(hi, int):
        parts.append(f"/(.|\\n){{{lo if isinstance(lo, int) else 0},{hi if isinstance(hi, int) else ''}}}{end}/")
    if isinstance(pattern, str):
        parts.append(f"/(?:{searched(pattern)}){end}/")
    return parts


def searched(pattern: str) -> str:
    """A JSON schema pattern as a regex of the whole text: a pattern matches anywhere in a string
    unless `^` / `$` anchor it, and llguidance's regexes match whole lexemes. Each top-level
    alternative is anchored or widened on its own; `/` is escaped for Lark's /.../."""
    branches, depth, start, i, in_class = [], 0, 0, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            branches.append(pattern[start:i])
            start = i + 1
        i += 1
    branches.append(pattern[start:])
    out = []
    for b in branches:
        head = b[1:] if b.startswith("^") else b
        end = head.endswith("$") and not _escaped(head, len(head) - 1)
        body = head[:-1] if end else head
        out.append(("" if b.startswith("^") else ANY_TEXT) + f"(?:{body})" + ("" if end else ANY_TEXT))
    return re.sub(r"(?<!\\)/", r"\\/", out[0] if len(out) == 1 else "(?:" + "|".join(out) + ")")


def _escaped(text: str, at: int) -> bool:
    """Whether the character at `at` follows an odd run of backslashes."""
    n = 0
    while at - n - 1 >= 0 and text[at - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def closed_at(text: str, quotes: str = '"', opens: str = "{[", closes: str = "}]") -> int | None:
    """The index just past the bracketed value `text` opens with (its brackets counted outside strings, quoted by
    any of `quotes`, a backslash escaping); None while it is not closed."""
    depth, quote, escape = 0, "", False
    for i, ch in enumerate(text):
        if quote:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == quote:
                quote = ""
        elif ch in quotes:
            quote = ch
        elif ch in opens:
            depth += 1
        elif ch in closes:
            depth -= 1
            if depth == 0:
                return i + 1
    return None
