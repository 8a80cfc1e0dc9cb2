"""One request's logits processing: its grammar state, its penalties and its log-probabilities.

The decoding loop (speculation/decoder.py) and the proposer (speculation/propose.py) call a `LogitsProcessor` at a few
defined points and know nothing of grammars or penalties:

- `row(logits)`: the next token's logits after the committed output (`ar`, the first token);
- `tree(tokens, parents, logits)`: every row of a verification forward, each adjusted for the
  tokens on its own path (the grammar state and the counts *of that tree node*), so the verifier
  sees at every node exactly the distribution `ar` would see there;
- `draft_rows(paths, logits)`, `valid_prefix(tokens)`, `forced()`: the proposer masks the draft's
  rows and prompt lookup's continuations the same way, and proposes the tokens the grammar forces;
- `ends(token)`, `commit(tokens, rows)`: the output grows; `rows` are the adjusted rows the
  tokens were chosen from, whose log-probabilities are kept when asked for.

A row is adjusted in one order everywhere: penalties (penalties.py), then the grammar's mask
(tokens it does not admit get -inf). Temperature and top-p come after, in the verifier. A row
whose path the grammar does not admit is left as it is: its node cannot be accepted (its
parent's adjusted row gives it probability 0), so nothing reads it.

Log-probabilities are those of the adjusted row at temperature 1 (the distribution after
penalties and the grammar, before temperature and top-p), computed in float64 from whichever row
produced the token; a speculative tree row and `ar`'s row at the same position are the same
numbers wherever the target's rows are independent of each other (the quantized CPU runtime).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .grammar import Grammar, GrammarState
from .penalties import Penalties

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
F = TypeVar("F", bound=Callable[..., Any])


def _timed(method: F) -> F:
    """Count a call's wall time in the processor's `seconds` (its share of a step is reported)."""

    @functools.wraps(method)
    def wrapper(self: LogitsProcessor, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability and the most likely alternatives at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first; finite ones only


@functools.cache
def _neg_inf(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(float("-inf"), dtype=dtype)


class LogitsProcessor:
    """Per request: what shapes the target's distribution beyond temperature and top-p."""

    def __init__(self, *, grammar: Grammar | None = None, penalties: Penalties | None = None,
                 top_logprobs: int | None = None, eos_ids: Sequence[int] = ()) -> None:
        self.grammar = grammar
        self.state: GrammarState | None = grammar.start() if grammar is not None else None
        self.penalties = penalties if penalties is not None and penalties.active else None
        self.top_logprobs = top_logprobs
        self.logprobs: list[TokenLogprob] = []
        self.seconds = 0.0  # wall time spent in its calls
        # Every end-of-sequence id of the model stands for the grammar's own end token.
        self.stops = frozenset(eos_ids) | ({grammar.eos} if grammar is not None else frozenset())

    @property
    def active(self) -> bool:
        """Whether it changes or records anything (otherwise the loop need not call it)."""
        return self.state is not None or self.penalties is not None or self.top_logprobs is not None

    # ----------------------------------------------------------------- adjusting rows

    @_timed
    def row(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token's row after the committed output."""
        return self._next_row(logits)

    def _next_row(self, logits: torch.Tensor) -> torch.Tensor:
        out = self._adjust(logits, [])
        if out is None:
            raise RuntimeError(f"the grammar admits no next token: {self.state.error if self.state else ''}")
        return out

    @_timed
    def tree(self, tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Every row of a tree (node 0: the root, the newest committed token), each for the path
        from the root to its node."""
        if not (self.state is not None or self.penalties is not None):
            return logits
        out = torch.empty_like(logits)
        if self._adjust(logits[0], [], out[0]) is None:
            raise RuntimeError(f"the grammar admits no next token: {self.state.error if self.state else ''}")
        for i in range(1, len(tokens)):
            if self._adjust(logits[i], self._path(tokens, parents, i), out[i]) is None:
                out[i].copy_(logits[i])
        return out

    @_timed
    def draft_rows(self, paths: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        """The draft's rows, each after the committed output plus its path (the proposer's nodes)."""
        if not (self.state is not None or self.penalties is not None):
            return logits
        out = torch.empty_like(logits)
        for r, path in enumerate(paths):
            if self._adjust(logits[r], list(path), out[r]) is None:
                out[r].copy_(logits[r])
        return out

    @staticmethod
    def _path(tokens: Sequence[int], parents: Sequence[int], node: int) -> list[int]:
        path: list[int] = []
        while node > 0:
            path.append(int(tokens[node]))
            node = parents[node]
        return path[::-1]

    def _adjust(self, logits: torch.Tensor, path: list[int], out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Penalties, then the grammar's mask, for the position after `path`, into `out` (a new
        row if None); None if the grammar does not admit `path` (or nothing after it)."""
        allowed = None
        if self.state is not None:
            allowed = self._allowed_after(path)
            if allowed is None:
                return None
        src = self.penalties.apply(logits, path) if self.penalties is not None else logits
        if out is None:
            out = torch.empty_like(logits)
        if allowed is None:
            return out.copy_(src)
        # One pass over the row (a masked fill is slower on CPU), writing where the caller wants it.
        n = min(out.shape[-1], allowed.shape[0])
        torch.where(allowed[:n], src[:n], _neg_inf(src.dtype), out=out[:n])
        out[n:] = float("-inf")
        return out

    def _allowed_after(self, path: list[int]) -> torch.Tensor | None:
        st = self.state
        assert st is not None
        mapped = [self._g(t) for t in path]
        # Nothing follows the end of the output (and llguidance does not roll its end back).
        if (self.grammar is not None and self.grammar.eos in mapped) or st.valid_prefix(mapped) < len(mapped):
            return None
        for t in mapped:
            st.consume(t)
        try:
            allowed = st.allowed()
        finally:
            st.rollback(len(mapped))
        eos = self.grammar.eos if self.grammar is not None else -1
        if allowed is not None and 0 <= eos < allowed.shape[0] and bool(allowed[eos]):
            for t in self.stops:
                if 0 <= t < allowed.shape[0]:
                    allowed[t] = True
        return allowed

    def _g(self, token: int) -> int:
        """The grammar's token for a model token (every end-of-sequence id is the grammar's end)."""
        return self.grammar.eos if self.grammar is not None and token in self.stops else token

    # ----------------------------------------------------------------- proposals

    @_timed
    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of these tokens after the committed output the grammar admits, in order."""
        if self.state is None:
            return len(tokens)
        return self.state.valid_prefix([self._g(t) for t in tokens])

    @_timed
    def forced(self, after: Sequence[int] = ()) -> list[int]:
        """The tokens the grammar forces after the committed output and then `after` (none
        without a grammar, or if the grammar does not admit `after`)."""
        st = self.state
        if st is None or self.grammar is None:
            return []
        mapped = [self._g(t) for t in after]
        if self.grammar.eos in mapped or st.valid_prefix(mapped) < len(mapped):
            return []
        for t in mapped:
            st.consume(t)
        try:
            return [] if st.stopped else st.forced()
        finally:
            st.rollback(len(mapped))

    # ----------------------------------------------------------------- the output grows

    def ends(self, token: int) -> bool:
        """Whether the token ends the output under the grammar (its end-of-sequence)."""
        return self.state is not None and token in self.stops

    @_timed
    def commit(self, tokens: Sequence[int], rows: torch.Tensor | None) -> None:
        """The output grows by `tokens`, chosen from the adjusted `rows` (one per token)."""
        if self.top_logprobs is not None:
            assert rows is not None and rows.shape[0] >= len(tokens)
            for t, row in zip(tokens, rows, strict=False):
                self.logprobs.append(self._logprob(int(t), row))
        if self.state is not None:
            for t in tokens:
                if not self.state.consume(self._g(int(t))):
                    raise RuntimeError(f"the grammar refused an emitted token {t}: {self.state.error}")
        if self.penalties is not None:
            self.penalties.commit([int(t) for t in tokens])

    def drop(self, n: int) -> None:
        """The last `n` committed tokens are not the output's after all (its text ended before
        them, and the generation stops): their log-probabilities go and the grammar steps back.
        The penalties keep their counts: nothing is chosen after this."""
        if n <= 0:
            return
        if self.top_logprobs is not None:
            del self.logprobs[-n:]
        if self.state is not None:
            self.state.rollback(n)

    def _logprob(self, token: int, row: torch.Tensor) -> TokenLogprob:
        lp = torch.log_softmax(row.double(), dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if self.top_logprobs:
            vals, idx = torch.topk(lp, min(self.top_logprobs, lp.shape[-1]))
            top = tuple((int(i), float(v)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)
                        if v != float("-inf"))
        return TokenLogprob(token, float(lp[token]), top)
