"""Streaming detokenisation: accepted token batches in, text pieces out (the API's `stream`, the demo)."""

from __future__ import annotations

from collections.abc import Callable

# Detokenised text ends in U+FFFD while a multi-byte character is still split across tokens.
REPLACEMENT = "\ufffd"


class Detokenizer:
    """Turns accepted token batches into text pieces whose concatenation is the final text.

    Decoding token by token breaks characters that span several tokens (and SentencePiece's
    leading spaces), so each push decodes the whole generated sequence and emits the new suffix,
    holding back trailing U+FFFD until the rest of the character arrives.
    """

    def __init__(self, decode: Callable[[list[int]], str], on_text: Callable[[str], None]) -> None:
        self.decode = decode
        self.on_text = on_text
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        self._emit_upto(self.decode(self.ids).rstrip(REPLACEMENT))

    def finish(self, final_text: str) -> None:
        """Flush what was held back (a genuinely invalid byte sequence stays U+FFFD)."""
        self._emit_upto(final_text)

    def _emit_upto(self, text: str) -> None:
        # A decoder that rewrites earlier text would break the concatenation; wait until the
        # text again extends what was already emitted.
        if len(text) > len(self.emitted) and text.startswith(self.emitted):
            piece = text[len(self.emitted) :]
            self.emitted = text
            self.on_text(piece)
