"""The server's step budget: how many target rows one batch step may carry, and why.

A step carries every decoding stream's rows, then prompt tokens (scheduler.py). How many prompt
tokens is the trade between two measured things, and this module is the one place that decides:

- A prefill chunk's cost per token falls with its size (`costmodel.measure_prefill`, measured
  once per machine, from an empty cache and at a long context): a step re-reads every weight
  however few rows it carries, the many-row kernels need enough rows to keep their tiles busy,
  and at a long context each chunk pays attention's per-chunk work. The *efficient* chunk at a
  context is the smallest whose cost per token there is within EFFICIENT_SLACK of the best
  measured there, up to the model's own prefill chunk (the memory bound). Below it a prompt
  prefills slower than `generate` would; it grows with the context a document has reached.
- The running streams' gap goal: while a stream decodes, each step is a wait between two of its
  chunks, so the prompt tokens beside it are as many as keep the step's predicted forward within
  STEP_SHARE of GAP_GOAL_S (the rest of the gap is the step's draft rounds, verification trees
  and the sequences' own work), at the context the chunk attends to.

With no stream decoding (one request alone, or only prompts prefilling) nobody waits on the
step's length, so the chunk is the efficient size: a lone request prefills as `generate` does.
A newcomer then waits at most one such chunk for its first step.

The prediction is refreshed online like the cost model's: each step that carried a prompt chunk
compares its wall time with the prediction, and a scale follows their ratio, so a busier machine
(or a step's own extras) shrinks the chunks beside streams within a few steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..runtime.costmodel import PREFILL_ROWS, ForwardCurve

GAP_GOAL_S = 1.0  # the running streams' gap goal (p95 of the waits between their chunks)
# A request that arrives while a document prefills alone waits for the chunk in flight: a chunk
# alone grows with the context only while its step is predicted within this.
NEWCOMER_WAIT_S = 2.0
STEP_SHARE = 0.5  # of the gap goal, what the step's target forward may take
# The efficient chunk: cost per token within this of the best measured, about the curve's own noise.
# A looser slack buys a newcomer a shorter wait for a dearer prefill, and a step costs more than the
# curve says by what it does outside the forward: at 2% the server prefilled an 8K document
# 1.05x slower than `generate` (docs/log/2026-11-server-steps.md, "Sixteen-row steps, alike prompts at once,
# and the chunk alone").
EFFICIENT_SLACK = 0.005
ROW_STEP = 16  # chunks beside streams are a multiple of this (the row kernels' tiles)
REFERENCE_CONTEXT = 2048  # the context `decoding_rows` reports in /health
REFRESH_WEIGHT = 0.2
SCALE_CLAMP = (0.5, 4.0)


@dataclass
class StepBudget:
    """Rows per step from the target's prefill curve (chunk size -> seconds, from an empty cache)
    and its step curve (rows x context: how much attending to the context adds per row)."""

    prefill: ForwardCurve
    steps: ForwardCurve
    gap_goal_s: float = GAP_GOAL_S
    refresh: bool = True
    scale: float = 1.0  # observed / predicted seconds of steps with a prompt chunk
    _memo: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    # ----------------------------------------------------------------- the rule

    def efficient_rows(self, context: int = 0) -> int:
        """The smallest measured chunk within EFFICIENT_SLACK of the best cost per token, for a
        chunk attending to `context` cached tokens."""
        per = [self.prefill.predict(n, context) / n for n in self.prefill.rows]
        best = min(per)
        return next(n for n, c in zip(self.prefill.rows, per, strict=True) if c <= best * (1 + EFFICIENT_SLACK))

    @property
    def alone_rows(self) -> int:
        """The chunk alone from an empty cache (it grows with the context: `rows(0, context)`)."""
        return self.efficient_rows(0)

    def predict(self, rows: int, context: int) -> float:
        """Seconds of a target forward of `rows` rows (a chunk and decode rows) attending to
        `context` cached tokens: the chunk's own cost plus what the context adds per row."""
        return self.scale * (self.prefill.predict(rows, 0) + rows * self._attention_per_row(context))

    def _attention_per_row(self, context: int) -> float:
        n = self.steps.rows[-1]
        lo = self.steps.contexts[0]
        return max(0.0, self.steps.predict(n, max(lo, context)) - self.steps.predict(n, lo)) / n

    def rows(self, decoders: int, context: int) -> int:
        """The step's rows: the efficient chunk at `context` while nothing decodes (no larger than
        the empty cache's where its step would keep a newcomer past NEWCOMER_WAIT_S); beside
        `decoders` streams, the largest multiple of ROW_STEP (at most that chunk, at least
        ROW_STEP) whose step at `context` is predicted within the gap goal's share, plus the
        streams' own rows."""
        # Contexts in 256-token buckets, each computed at its start: whichever context asks first,
        # a bucket's rows are the same (a context inside it could pick another chunk).
        key = (decoders, context // 256)
        if key in self._memo:
            return self._memo[key]
        context = key[1] * 256
        alone, base = self.efficient_rows(context), self.efficient_rows(0)
        while alone > base and self.predict(alone, context) > NEWCOMER_WAIT_S:
            alone = max(n for n in self.prefill.rows if n < alone)
        if decoders <= 0:
            self._memo[key] = alone
        else:
            goal = self.gap_goal_s * STEP_SHARE
            n = ROW_STEP
            while n + ROW_STEP <= alone and self.predict(decoders + n + ROW_STEP, context) <= goal:
                n += ROW_STEP
            self._memo[key] = decoders + n
        return self._memo[key]

    def observe(self, rows: int, context: int, seconds: float) -> None:
        """A step of `rows` rows (prompt tokens among them) that took `seconds`."""
        if not self.refresh or rows < PREFILL_ROWS[0] or seconds <= 0.0:
            return
        raw = self.predict(rows, context) / self.scale
        if raw <= 0.0:
            return
        ratio = min(max(seconds / raw, self.scale / 2), self.scale * 2)
        new = min(max((1 - REFRESH_WEIGHT) * self.scale + REFRESH_WEIGHT * ratio, SCALE_CLAMP[0]), SCALE_CLAMP[1])
        if abs(new - self.scale) > 1e-9:
            self.scale = new
            self._memo.clear()

    # ----------------------------------------------------------------- reporting

    def stats(self) -> dict[str, Any]:
        """For /health: the budgets chosen and what chose them."""
        eff, per = self.alone_rows, {n: self.prefill.predict(n, 0) / n for n in self.prefill.rows}
        beside = self.rows(1, REFERENCE_CONTEXT)
        far = self.prefill.contexts[-1]
        return {
            "alone_rows": eff, "decoding_rows": beside, "efficient_rows": eff,
            "alone_rows_by_context": {str(c): self.rows(0, c) for c in sorted({0, REFERENCE_CONTEXT, far, 2 * far})},
            "gap_goal_s": self.gap_goal_s, "step_goal_s": self.gap_goal_s * STEP_SHARE, "scale": round(self.scale, 3),
            "prefill_ms_per_token": {str(n): round(1e3 * c, 3) for n, c in per.items()},
            "why": (f"alone: chunks of {eff} prompt tokens, the smallest measured within "
                    f"{EFFICIENT_SLACK:.1%} of the best cost per token ({1e3 * min(per.values()):.2f} ms), "
                    f"larger where the document's context makes small chunks dearer; "
                    f"beside a decoding stream at a {REFERENCE_CONTEXT}-token context: {beside} rows, the "
                    f"most whose step is predicted within {self.gap_goal_s * STEP_SHARE:.2f} s "
                    f"({STEP_SHARE:.0%} of the {self.gap_goal_s:.1f} s gap goal)"),
        }
