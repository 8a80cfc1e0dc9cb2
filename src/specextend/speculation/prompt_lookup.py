"""Draft candidates from the context itself (prompt lookup): free proposals for copied spans.

Summaries quote their source, code edits repeat the code, answers reuse the question's words.
When the last committed tokens occurred earlier in the prompt or the output, what followed them
there is a good guess for what follows now, and proposing it costs no draft forward, only
verification rows. `ContextIndex` holds the committed tokens and finds, for the longest suffix
that occurred before (up to `max_ngram` tokens), the continuations of its most recent
occurrences. The search is a vectorised scan (a few tensor comparisons over the context per
step), so nothing has to be built or kept in step with the cache.

The candidates are deterministic given the context: that is what lets the verifier treat them
as point-mass proposals and stay exact under sampling (verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# At most this many of the most recent occurrences of a suffix are read per n-gram length: a
# frequent one-token suffix can occur thousands of times, and older ones add little.
RECENT_OCCURRENCES = 16


@dataclass(frozen=True)
class Continuation:
    tokens: tuple[int, ...]  # what followed an earlier occurrence of the current suffix
    ngram: int  # how many suffix tokens matched there (longer matches are more reliable)


class ContextIndex:
    """The committed tokens (prompt, then output), searchable for earlier occurrences of a suffix."""

    def __init__(self, tokens: list[int], capacity: int) -> None:
        self.buf = torch.zeros(max(capacity, len(tokens)), dtype=torch.long)
        self.length = 0
        self.append(tokens)

    def append(self, tokens: list[int]) -> None:
        n = len(tokens)
        if self.length + n > self.buf.numel():
            grown = torch.zeros(2 * (self.length + n), dtype=torch.long)
            grown[: self.length] = self.buf[: self.length]
            self.buf = grown
        self.buf[self.length : self.length + n] = torch.tensor(tokens, dtype=torch.long)
        self.length += n

    def continuations(self, max_ngram: int, branches: int, length: int) -> list[Continuation]:
        """Up to `branches` distinct continuations (each up to `length` tokens) of the current
        suffix: longest matching suffix first, then most recent occurrence first."""
        found: list[Continuation] = []
        seen_starts: set[int] = set()
        seen: set[tuple[int, ...]] = set()
        buf, total = self.buf, self.length
        for n in range(min(max_ngram, total - 1), 0, -1):
            # Starts i of earlier occurrences: buf[i:i+n] equals the last n tokens and at least one
            # token follows them (i + n < total).
            key = buf[total - n : total]
            hit = buf[: total - n] == key[0]
            for j in range(1, n):
                hit &= buf[j : total - n + j] == key[j]
            starts = torch.nonzero(hit).flatten()[-RECENT_OCCURRENCES:].tolist()
            for i in reversed(starts):
                cont_start = i + n
                if cont_start in seen_starts:
                    continue  # the same occurrence already matched a longer suffix
                seen_starts.add(cont_start)
                cont = tuple(buf[cont_start : min(cont_start + length, total)].tolist())
                if cont and cont not in seen:
                    seen.add(cont)
                    found.append(Continuation(cont, n))
                    if len(found) >= branches:
                        return found
        return found
