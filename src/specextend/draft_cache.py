"""What the draft model attends to: its KV cache policy.

- `full`: the whole context (standard speculative decoding).
- `streaming`: attention sinks + the most recent tokens (StreamingLLM), at CMR's token budget.
- `cmr`: Cross-model Retrieval (SpecExtend). The draft keeps every token's K/V in a *store*;
  its *working* cache holds only the top-k fixed-size chunks ranked by the target's attention
  (plus the newest tokens), rebuilt every few steps and whenever a new chunk opens.

The decoding loop sees only this interface: `extend` committed tokens, `run_tree`/`end_tree`
for proposing, and `wants_scores`/`refresh` for retrieval. It never touches the caches.

Positions in a working cache built from selected slots: by default they are re-indexed
compactly (slot i has position i), so a draft trained on short contexts stays inside its
trained range. Keys in the cache are already rotated by RoPE at the position they were
computed at; moving a key from position a to b is one more rotation by b - a, because RoPE
rotations compose. `positions="original"` keeps the true positions instead.
"""

from __future__ import annotations

import torch

from .attention import Backend
from .kv_cache import KVCache
from .model import Transformer, apply_rope
from .settings import Settings


class DraftCache:
    """Base: the working cache is the store itself (the `full` policy)."""

    name = "full"

    def __init__(self, draft: Transformer, store: KVCache, backend: Backend, settings: Settings) -> None:
        self.draft, self.store, self.backend, self.s = draft, store, backend, settings
        self.working = store
        self.next_pos = store.length  # draft position of the next committed token
        self.tree_base = 0  # working length before the current tree

    # --- proposing ---------------------------------------------------------------------------
    def extend(self, tokens: list[int]) -> torch.Tensor:
        """Feed newly committed tokens (a causal run); returns their draft logits."""
        n = len(tokens)
        pos = torch.arange(self.next_pos, self.next_pos + n)
        logits = self.draft(torch.tensor(tokens), pos, self.working, None, self.backend)
        self.working.commit()
        self._stored(n, pos)
        self.next_pos += n
        self.tree_base = self.working.length
        return logits

    def run_tree(self, tokens: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Feed draft tree nodes (depth 1 = child of the last committed token). The nodes stay in
        the working cache until `end_tree`, so deeper levels can attend to their ancestors."""
        pos = self.next_pos - 1 + depths
        logits = self.draft(tokens, pos, self.working, mask, self.backend)
        self.working.commit()
        return logits

    def end_tree(self) -> None:
        self.working.truncate(self.tree_base)

    # --- retrieval ---------------------------------------------------------------------------
    def observe(self, accepted: int) -> None:
        """Told after every verification how many draft tokens were accepted."""

    def wants_scores(self) -> bool:
        return False

    def refresh(self, scores: torch.Tensor | None) -> None:
        """Rebuild the working cache (scores: target attention over the stored tokens)."""

    def _stored(self, n: int, pos: torch.Tensor) -> None:
        """New tokens were committed to the working cache (here: the store itself)."""

    @property
    def working_tokens(self) -> int:
        return self.working.length


class SelectiveDraftCache(DraftCache):
    """A working cache made of selected store slots; subclasses choose the slots."""

    def __init__(self, draft: Transformer, store: KVCache, backend: Backend, settings: Settings) -> None:
        super().__init__(draft, store, backend, settings)
        c = draft.cfg
        self.working = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, store.capacity, store.k.dtype,
                               store.k.device)
        # The position at which each stored key was rotated (the prompt: its true positions).
        self.store_pos = torch.arange(store.capacity)
        self.compact = settings.positions == "compact"
        self.budget = settings.top_k_chunks * settings.chunk_size
        self.steps_since = 0
        self.chunks_seen = 0
        self.selected: list[tuple[int, int]] = []  # [start, end) store ranges in the working cache
        self.rebuilds = 0

    def start(self) -> None:
        """Build the first working cache (no target scores yet: the engine passes prefill's)."""

    def _stored(self, n: int, pos: torch.Tensor) -> None:
        w, s = self.working.length, self.store.length
        self.store.begin(n)
        self.store.copy_slots_from(self.working, torch.arange(w - n, w), s)
        self.store.commit()
        self.store_pos[s : s + n] = pos

    def rebuild(self, ranges: list[tuple[int, int]]) -> None:
        """Working cache := the given store ranges, in order, then re-rotated if compact."""
        ranges = _merge(ranges)
        slots = torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.long)
        n = int(slots.numel())
        self.working.reset()
        self.working.copy_slots_from(self.store, slots, 0)
        self.working.length = n
        if self.compact:
            new_pos = torch.arange(n)
            delta = new_pos - self.store_pos[slots]
            if bool((delta != 0).any()):
                cos, sin = self.draft.rope(delta)
                k = self.working.k[:, :, :n]
                self.working.k[:, :, :n] = apply_rope(k, cos.to(k.device), sin.to(k.device))
            self.next_pos = n
        else:
            self.next_pos = self.store.length
        self.selected = ranges
        self.tree_base = n
        self.steps_since = 0
        self.chunks_seen = self.store.length // self.s.chunk_size
        self.rebuilds += 1

    def observe(self, accepted: int) -> None:
        self.steps_since += 1


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class StreamingDraftCache(SelectiveDraftCache):
    """StreamingLLM: the first `sink_tokens` tokens plus the most recent ones, `budget` in all."""

    name = "streaming"

    def _window(self) -> list[tuple[int, int]]:
        n = self.store.length
        sinks = min(self.s.sink_tokens, n)
        return [(0, sinks), (max(sinks, n - (self.budget - sinks)), n)]

    def start(self) -> None:
        self.rebuild(self._window())

    def wants_scores(self) -> bool:
        return False

    def extend(self, tokens: list[int]) -> torch.Tensor:
        # Slide the window once it has grown a chunk past the budget (amortises the rebuild).
        if self.working.length + len(tokens) > self.budget + self.s.chunk_size:
            self.rebuild(self._window())
        return super().extend(tokens)


class CMRDraftCache(SelectiveDraftCache):
    """Cross-model Retrieval: the target's attention ranks fixed-size chunks of the context."""

    name = "cmr"

    def __init__(self, draft: Transformer, store: KVCache, backend: Backend, settings: Settings) -> None:
        super().__init__(draft, store, backend, settings)
        self.ema_accept: float | None = None
        self.drop = False
        self.force = True
        self.last_choice: set[int] = set()
        self.skipped = 0  # adaptive mode: scored but the choice had not moved, so no rebuild

    def keeps_all(self) -> bool:
        """A short context stays whole: selecting would save the draft little and cost acceptance."""
        return self.store.length <= self.s.cmr_min_ratio * self.budget

    def start(self) -> None:
        n = self.store.length
        if self.keeps_all():
            # The working cache is the whole context at its true positions; new tokens append
            # to it, and retrieval starts when a new chunk opens past the threshold.
            self.rebuild([(0, n)])
            self.force = False
            return
        # Before the first scores arrive, begin from the streaming view (sinks + recent).
        sinks = min(self.s.sink_tokens, n)
        self.rebuild([(0, sinks), (max(sinks, n - (self.budget - sinks)), n)])
        self.force = True

    def observe(self, accepted: int) -> None:
        super().observe(accepted)
        if self.ema_accept is not None:
            self.drop = accepted < 0.5 * self.ema_accept
        self.ema_accept = accepted if self.ema_accept is None else 0.8 * self.ema_accept + 0.2 * accepted

    def _new_chunk(self) -> bool:
        return self.store.length // self.s.chunk_size > self.chunks_seen

    def wants_scores(self) -> bool:
        if self.keeps_all():
            return False
        if self.force or self._new_chunk():
            return True  # first retrieval, or a new chunk opened since the last one
        if self.s.adaptive_refresh:
            # Scores for one query row at one layer are cheap; look often, rebuild only on change.
            return self.drop or self.steps_since >= max(1, self.s.retrieve_every // 4)
        return self.steps_since >= self.s.retrieve_every

    def choose_chunks(self, scores: torch.Tensor) -> list[int]:
        """Indices of the top-k complete chunks by mean attention.

        Two chunks are always kept, inside the k: the first (it holds the attention sink the
        draft's softmax leans on, when sink_tokens > 0) and the newest complete one (the
        immediate context, e.g. a question that just ended; the target may rank it low because
        the query token itself sits in the open chunk).
        """
        c = self.s.chunk_size
        n_chunks = min(self.store.length, scores.shape[0]) // c
        if n_chunks == 0:
            return []
        mean = scores[: n_chunks * c].view(n_chunks, c).mean(-1).clone()
        if self.s.sink_tokens > 0:
            mean[0] = float("inf")
        mean[n_chunks - 1] = float("inf")
        return sorted(torch.topk(mean, min(self.s.top_k_chunks, n_chunks)).indices.tolist())

    def refresh(self, scores: torch.Tensor | None) -> None:
        if scores is None or self.keeps_all():
            return
        c, ov = self.s.chunk_size, self.s.chunk_overlap
        chosen = self.choose_chunks(scores)
        if self.s.adaptive_refresh and not (self.force or self.drop or self._new_chunk()):
            common = len(self.last_choice & set(chosen))
            if common >= 0.75 * max(1, len(chosen)) and self.steps_since < 4 * self.s.retrieve_every:
                self.steps_since = 0
                self.skipped += 1
                return  # the target still reads the same chunks: keep the working cache
        open_start = (self.store.length // c) * c
        ranges = [(max(0, i * c - ov), min(open_start, (i + 1) * c + ov)) for i in chosen]
        ranges.append((open_start, self.store.length))  # the chunk still being filled
        self.last_choice = set(chosen)
        self.force = False
        self.rebuild(ranges)


def make_draft_cache(kind: str, draft: Transformer, store: KVCache, backend: Backend, settings: Settings) -> DraftCache:
    if kind == "full":
        return DraftCache(draft, store, backend, settings)
    if kind == "streaming":
        return StreamingDraftCache(draft, store, backend, settings)
    if kind == "cmr":
        return CMRDraftCache(draft, store, backend, settings)
    raise ValueError(f"unknown draft cache {kind!r}")
