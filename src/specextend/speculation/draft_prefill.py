"""The draft's KV of the prompt, computed where a draft policy reads it.

A full draft prefill costs a third of the target's on a long prompt, yet under Cross-model
Retrieval the draft attends only to a budget of chosen chunks and the newest tokens. So the
draft store's prompt slots start empty and `DraftPrompt.ensure` computes the ones a policy is
about to read: in one causal pass of the draft over the missing slots' tokens, at their original
positions, attending to the attention-sink tokens and to each other in prompt order (never to
the slots it skips). A chunk chosen later is computed then, once; its KV differs from what a
full prefill would give, which changes proposals only, never the output (verification decides).

Every computed slot keeps the seconds it cost (its share of the pass that computed it), and a
decode is *charged* the cost of the slots it asked for, whether it computed them or found them
computed: a benchmark that decodes one prompt with several methods reports each one's own
draft prefill. A slot loaded from the prefix cache costs nothing (it was not computed for this
prompt). The seconds spent computing are reported to `on_compute`, so the decode's clock can
count them as prefill rather than as the phase they interrupted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..runtime.attention import Backend
from ..runtime.kv_cache import KVCache
from ..runtime.transformer import Transformer

PASS_TOKENS = 512  # tokens per draft forward of a pass (bounded memory, as the model's prefill)


class DraftPrompt:
    """The prompt's slots of a draft store [0, n): which are computed, what each cost."""

    def __init__(self, draft: Transformer, store: KVCache, prompt_ids: Sequence[int], backend: Backend,
                 sink_tokens: int) -> None:
        self.draft, self.store, self.backend = draft, store, backend
        self.ids = torch.tensor(list(prompt_ids), dtype=torch.long)
        self.n = len(prompt_ids)
        self.sinks = min(sink_tokens, self.n)
        self.computed = torch.zeros(self.n, dtype=torch.bool)
        self.cost = torch.zeros(self.n, dtype=torch.float64)  # seconds per computed slot
        self.charged = torch.zeros(self.n, dtype=torch.bool)  # slots the current decode asked for
        self.on_compute: Callable[[float], None] | None = None
        self.passes: list[torch.Tensor] = []  # positions of every pass, in order (tests, statistics)
        self.seconds = 0.0  # all computing so far
        if store.length < self.n:
            store.length = self.n  # the prompt's slots exist; `computed` says which hold KV

    # ----------------------------------------------------------------- what is there

    @property
    def complete(self) -> bool:
        return bool(self.computed.all())

    def missing(self, ranges: Sequence[tuple[int, int]]) -> int:
        """How many prompt slots of `ranges` are not computed yet."""
        return int((~self.computed[self._mask(ranges)]).sum())

    def forget(self) -> None:
        """Nothing computed any more: the next decode computes (and pays for) its own prompt KV."""
        self.computed.zero_()
        self.cost.zero_()

    def loaded(self, computed: torch.Tensor) -> None:
        """The first len(computed) slots were loaded from a cached prefix: these hold KV, at no cost."""
        m = int(computed.numel())
        self.computed[:m] = computed.to(torch.bool)
        self.cost[:m] = 0.0

    # ----------------------------------------------------------------- one decode's account

    def begin_decode(self) -> None:
        self.charged.zero_()

    @property
    def charged_s(self) -> float:
        """Seconds the current decode's slots cost to compute: its own draft prefill."""
        return float(self.cost[self.charged].sum())

    @property
    def charged_tokens(self) -> int:
        return int(self.charged.sum())

    # ----------------------------------------------------------------- computing

    def ensure(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Make the prompt slots of `ranges` ([start, end), clipped to the prompt) hold KV."""
        want = self._mask(ranges)
        self.charged |= want
        todo = torch.nonzero(want & ~self.computed).flatten()
        if todo.numel() == 0:
            return
        # The sinks come first in every pass: the draft's softmax leans on them (StreamingLLM).
        head = torch.arange(self.sinks)
        todo = torch.cat([head[~self.computed[: self.sinks]], todo[todo >= self.sinks]])
        self.charged[todo] = True
        context = head[self.computed[: self.sinks]]
        start = time.perf_counter()
        self._compute(todo, context)
        if self.store.k.device.type == "cuda":
            torch.cuda.synchronize()  # the pass's kernels belong to its time
        seconds = time.perf_counter() - start
        self.computed[todo] = True
        self.cost[todo] = seconds / todo.numel()
        self.passes.append(todo)
        self.seconds += seconds
        if self.on_compute is not None:
            self.on_compute(seconds)

    def _compute(self, todo: torch.Tensor, context: torch.Tensor) -> None:
        """One causal pass over the prompt tokens at `todo` (their own positions), after the
        already computed slots `context`, written into the store at `todo`."""
        c = int(context.numel())
        scratch = self.draft.new_cache(c + int(todo.numel()))
        if c:
            scratch.copy_slots_from(self.store, context, 0)
            scratch.length = c
        for s in range(0, int(todo.numel()), PASS_TOKENS):
            pos = todo[s : s + PASS_TOKENS]
            self.draft(self.ids[pos], pos, scratch, None, self.backend, logits_rows=slice(0, 0))
            scratch.commit()
        self.store.put_slots(scratch, torch.arange(c, c + int(todo.numel())), todo)

    def _mask(self, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
        m = torch.zeros(self.n, dtype=torch.bool)
        for a, b in ranges:
            a, b = max(0, a), min(self.n, b)
            if b > a:
                m[a:b] = True
        return m
