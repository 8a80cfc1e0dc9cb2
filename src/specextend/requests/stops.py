"""Stop strings (OpenAI's `stop`): cut the streamed text before the first occurrence of any of them.

Text arrives in pieces, and a stop string may span pieces, so the tail that could still become
one is held back until the next piece shows whether it does.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit = False

    def push(self, piece: str) -> str:
        """The part of the text so far that is safe to send; sets `hit` at a stop string."""
        if self.hit:
            return ""
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            return text[: min(found)]
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                   default=0)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: what was held back was no stop string after all."""
        out, self.held = ("" if self.hit else self.held), ""
        return out
