"""Streaming detokenisation: accepted token batches in, text pieces out (the API's `stream`, the demo)."""

from __future__ import annotations

from collections.abc import Callable

# Detokenised text ends in U+FFFD while a multi-byte character is still split across tokens.
REPLACEMENT = "\ufffd"


class Detokenizer:
    """Turns accepted token batches into text pieces whose concatenation is the final text.

    Decoding token by token breaks characters that span several tokens (and SentencePiece's
    leading spaces), so each push decodes a window of the last tokens and emits what its text adds,
    holding back trailing U+FFFD until the rest of the character arrives. The window starts
    `WINDOW` to `2 * WINDOW` tokens back (moved once all it can say is emitted): a push
    costs the same at the thousandth token as at the first (a push a token, as a generation that
    watches for a stop string makes, would otherwise decode the whole answer each time).
    """

    WINDOW = 8

    def __init__(self, decode: Callable[[list[int]], str], on_text: Callable[[str], None]) -> None:
        self.decode = decode
        self.on_text = on_text
        self.ids: list[int] = []
        self.emitted = ""
        self._start = 0  # the window: ids[_start:]
        self._shown = ""  # the window's text emitted so far

    def push(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.decode(self.ids[self._start:])
        shown = text.rstrip(REPLACEMENT)
        if len(shown) > len(self._shown) and shown.startswith(self._shown):
            self._say(shown[len(self._shown):])
            self._shown = shown
        if shown == self._shown and len(self.ids) - self._start >= 2 * self.WINDOW:
            self._start = len(self.ids) - self.WINDOW  # all it could say is out: the window moves on
            self._shown = self.decode(self.ids[self._start:]).rstrip(REPLACEMENT)

    def finish(self, final_text: str) -> None:
        """Flush what was held back (a genuinely invalid byte sequence stays U+FFFD)."""
        # A decoder that rewrites earlier text would break the concatenation; then nothing more.
        if len(final_text) > len(self.emitted) and final_text.startswith(self.emitted):
            self._say(final_text[len(self.emitted):])

    def _say(self, piece: str) -> None:
        self.emitted += piece
        self.on_text(piece)
