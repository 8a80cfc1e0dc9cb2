"""What the draft model attends to: its KV cache policy, one `DraftPolicy` per `--draft-cache` name.

- `full`: the whole context (standard speculative decoding).
- `streaming`: attention sinks + the most recent tokens (StreamingLLM), at CMR's token budget.
- `cmr`: Cross-model Retrieval (SpecExtend). The draft keeps every token's K/V in its
  *draft store*; its *working* cache holds only the top-k fixed-size chunks ranked by the
  target's attention (plus the newest tokens), rebuilt every few steps and whenever a new chunk
  opens.

`DRAFT_POLICIES` maps each name of `settings.DRAFT_CACHES` (the command line's choices) to its class. The
decoding loop (decoder.py) and the needle test see only the `DraftPolicy` interface:

- before decoding: `sees_every_position` (the context limit), `score_layers` (which target
  layers' queries to keep), `start_tokens` (how many prompt tokens' draft KV starting would
  compute), `start` (the first working cache, from the prompt's scores if the policy wants them);
- proposing: `extend` with committed tokens, `run_tree`/`end_tree` for a draft tree, `skip` for
  committed tokens the draft sat out (the engine decoded them without it);
- after each verification: `observe`, then `wants_scores`/`score_rows`/`refresh` for retrieval;
- `stats` for the result, `kept_ranges` for inspection.

The draft store's prompt slots hold KV only where the draft computed it (`DraftPrompt`,
draft_prefill.py): a policy asks for the slots it is about to read (`_ensure`), so `full` and a
context short enough to keep whole compute the whole prompt once, while `cmr` computes the
chunks the target's attention chooses (`draft_prefill="selected"`, the default; `"full"` computes
the whole prompt first, as a full draft prefill did) and a chunk chosen later when it is chosen.

Positions in a working cache built from selected slots: by default they are re-indexed
compactly (slot i has position i), so a draft trained on short contexts stays inside its
trained range. Keys in the cache are already rotated by RoPE at the position they were
computed at; moving a key from position a to b is one more rotation by b - a, because RoPE
rotations compose. `positions="original"` keeps the true positions instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..common.errors import UserError
from ..runtime.attention import Backend
from ..runtime.kv_cache import KVCache
from ..runtime.transformer import Transformer
from .draft_prefill import DraftPrompt

if TYPE_CHECKING:
    from ..common.settings import Settings

# Target attention of the last prompt token over the prompt (or None when no layer is scored),
# computed only if a policy asks for it.
PromptScores = Callable[[], torch.Tensor | None]


class DraftPolicy:
    """The interface, and the `full` policy: the working cache is the draft store itself."""

    def __init__(self, draft: Transformer, draft_store: KVCache, backend: Backend, settings: Settings,
                 prompt: DraftPrompt | None = None) -> None:
        self.draft, self.draft_store, self.backend, self.s = draft, draft_store, backend, settings
        self.prompt = prompt  # None: every prompt slot of the store holds KV already
        self.working = draft_store
        self.next_pos = draft_store.length  # draft position of the next committed token
        self.tree_base = 0  # working length before the current tree
        # Tokens the draft never saw (`skip`), and the true position of each stored slot: equal
        # to the slot until something is skipped.
        self.skipped = 0
        self.true_pos = torch.arange(draft_store.capacity)

    # --- before decoding ---------------------------------------------------------------------
    @classmethod
    def sees_every_position(cls, settings: Settings) -> bool:
        """Whether the draft attends at every true position, so the prompt and the new tokens
        must fit the draft's own context (a compact working cache stays within its budget)."""
        return True

    def score_layers(self, target_layers: int) -> list[int]:
        """Target layers whose attention this policy reads (their queries are kept in verification)."""
        return []

    def start_tokens(self) -> int:
        """How many prompt tokens' draft KV `start` would compute (the draft's start-up cost)."""
        return self.prompt.missing([(0, self.prompt.n)]) if self.prompt is not None else 0

    def start(self, prompt_scores: PromptScores | None = None) -> None:
        """Build the first working cache, from the prompt's scores if the policy wants them."""
        self._ensure([(0, self.draft_store.length)])

    def _ensure(self, ranges: list[tuple[int, int]]) -> None:
        """The store's prompt slots in `ranges` hold KV (computed now if they did not)."""
        if self.prompt is not None:
            self.prompt.ensure(ranges)

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

    def skip(self, n: int) -> None:
        """`n` committed tokens the draft will not see: it sat out the steps that produced them,
        and feeding them all now would cost a draft forward over every one. The store gets no
        slots for them; tokens after them keep their true positions where positions are true
        ones, and `true_pos` maps each stored slot to its position in the target's cache."""
        self.skipped += n
        self.true_pos[self.draft_store.length :] += n
        self._skip_positions(n)

    def _skip_positions(self, n: int) -> None:
        self.next_pos += n

    def run_tree(self, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
        """Feed draft tree nodes (depth 1 = child of the last committed token). The nodes stay in
        the working cache until `end_tree`, so deeper levels can attend to their ancestors."""
        pos = self.next_pos - 1 + depths
        logits = self.draft(tokens, pos, self.working, tree_mask, self.backend)
        self.working.commit()
        return logits

    def end_tree(self) -> None:
        self.working.truncate(self.tree_base)

    def _stored(self, n: int, pos: torch.Tensor) -> None:
        """New tokens were committed to the working cache (here: the draft store itself)."""

    # --- after each verification -------------------------------------------------------------
    def observe(self, accepted: int) -> None:
        """Told after every verification how many draft tokens were accepted."""

    def wants_scores(self) -> bool:
        return False

    def score_rows(self, path: list[int]) -> list[int]:
        """The verified tree's rows (its accepted path) whose attention the scores average."""
        return path[-1:]

    def refresh(self, scores: torch.Tensor | None) -> None:
        """Rebuild the working cache (scores: target attention over the stored tokens)."""

    # --- reporting ---------------------------------------------------------------------------
    @property
    def working_tokens(self) -> int:
        return self.working.length

    def kept_ranges(self) -> list[tuple[int, int]]:
        """[start, end) draft-store ranges that the working cache holds."""
        return [(0, self.draft_store.length)]

    def stats(self) -> dict[str, float]:
        """What the result's `extra` reports about this policy."""
        return {"draft_working_tokens": float(self.working_tokens)}


class FullPolicy(DraftPolicy):
    """`full`: the draft attends to the whole context (the base behaviour)."""


class SelectiveDraftPolicy(DraftPolicy):
    """A working cache made of selected draft-store slots; subclasses choose the slots."""

    def __init__(self, draft: Transformer, draft_store: KVCache, backend: Backend, settings: Settings,
                 prompt: DraftPrompt | None = None) -> None:
        super().__init__(draft, draft_store, backend, settings, prompt)
        self.working = draft.new_cache(draft_store.capacity, draft_store.k.dtype)
        # The position at which each stored key was rotated (the prompt: its true positions).
        self.store_pos = torch.arange(draft_store.capacity)
        self.compact = settings.positions == "compact"
        self.budget = settings.top_k_chunks * settings.chunk_size
        self.steps_since = 0
        self.chunks_seen = 0
        self.selected: list[tuple[int, int]] = []  # [start, end) store ranges in the working cache
        self.rebuilds = 0

    @classmethod
    def sees_every_position(cls, settings: Settings) -> bool:
        return settings.positions == "original"

    def _skip_positions(self, n: int) -> None:
        if not self.compact:  # compact positions simply close the gap
            self.next_pos += n

    def _stored(self, n: int, pos: torch.Tensor) -> None:
        w, s = self.working.length, self.draft_store.length
        self.draft_store.begin(n)
        self.draft_store.copy_slots_from(self.working, torch.arange(w - n, w), s)
        self.draft_store.commit()
        self.store_pos[s : s + n] = pos

    def sinks_and_recent(self) -> list[tuple[int, int]]:
        """StreamingLLM's view: the first `sink_tokens` tokens and the newest ones, `budget` in all."""
        n = self.draft_store.length
        sinks = min(self.s.sink_tokens, n)
        return [(0, sinks), (max(sinks, n - (self.budget - sinks)), n)]

    def rebuild(self, ranges: list[tuple[int, int]]) -> None:
        """Working cache := the given store ranges, in order, then re-rotated if compact."""
        ranges = _merge(ranges)
        self._ensure(ranges)
        slots = torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.long)
        n = int(slots.numel())
        self.working.reset()
        self.working.copy_slots_from(self.draft_store, slots, 0)
        self.working.length = n
        if self.compact:
            new_pos = torch.arange(n)
            delta = new_pos - self.store_pos[slots]
            if bool((delta != 0).any()):
                # each layer by its own rope (a family may mix bases, or leave some layers without)
                self.draft.rotate_keys(self.working, n, delta)
            self.next_pos = n
        else:
            self.next_pos = self.draft_store.length + self.skipped
        self.selected = ranges
        self.tree_base = n
        self.steps_since = 0
        self.chunks_seen = self.draft_store.length // self.s.chunk_size
        self.rebuilds += 1

    def observe(self, accepted: int) -> None:
        self.steps_since += 1

    def kept_ranges(self) -> list[tuple[int, int]]:
        return list(self.selected)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "retrievals": float(self.rebuilds)}


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class StreamingPolicy(SelectiveDraftPolicy):
    """`streaming` (StreamingLLM): the first `sink_tokens` tokens plus the most recent ones."""

    def start_tokens(self) -> int:
        return self.prompt.missing(self.sinks_and_recent()) if self.prompt is not None else 0

    def start(self, prompt_scores: PromptScores | None = None) -> None:
        self.rebuild(self.sinks_and_recent())

    def extend(self, tokens: list[int]) -> torch.Tensor:
        # Slide the window once it has grown a chunk past the budget (amortises the rebuild).
        if self.working.length + len(tokens) > self.budget + self.s.chunk_size:
            self.rebuild(self.sinks_and_recent())
        return super().extend(tokens)


def retrieval_layers(settings: Settings, target_layers: int) -> list[int]:
    """The target layers whose attention ranks chunks: `retrieval_layers_mean` layers ending at
    `retrieval_layer` (negative counts from the last)."""
    n, s = target_layers, settings
    if s.retrieval_layer >= n or s.retrieval_layer < -n:
        raise UserError(f"--retrieval-layer {s.retrieval_layer} outside the target's {n} layers")
    last = s.retrieval_layer % n
    first = max(0, last - s.retrieval_layers_mean + 1)
    return list(range(first, last + 1))


def seeing_everything(layers: list[int], windowed: tuple[bool, ...]) -> list[int]:
    """The layers to score chunks with in place of `layers`: a windowed layer attends only to its
    window (and the target's cache keeps no more of its keys), so the nearest layer below it that
    attends to the whole context stands in (else the nearest above), once. Where every layer is
    windowed, the target's cache keeps every token (`decoder.window_room`) and they score as given."""
    full = [i for i, w in enumerate(windowed) if not w]
    if not any(windowed) or not full:
        return layers
    out: list[int] = []
    for i in layers:
        j = i if not windowed[i] else max((f for f in full if f < i), default=min(full))
        if j not in out:
            out.append(j)
    return out


def chunk_scores(scores: torch.Tensor, tokens: int, chunk: int) -> torch.Tensor:
    """Mean attention of each complete chunk among the first `tokens` scored tokens."""
    n_chunks = min(tokens, scores.shape[0]) // chunk
    return scores[: n_chunks * chunk].view(n_chunks, chunk).mean(-1)


class CMRPolicy(SelectiveDraftPolicy):
    """`cmr`, Cross-model Retrieval: the target's attention ranks fixed-size chunks of the context."""

    def __init__(self, draft: Transformer, draft_store: KVCache, backend: Backend, settings: Settings,
                 prompt: DraftPrompt | None = None) -> None:
        super().__init__(draft, draft_store, backend, settings, prompt)
        self.ema_accept: float | None = None
        self.drop = False
        self.force = True
        self.last_choice: set[int] = set()

    def score_layers(self, target_layers: int) -> list[int]:
        return retrieval_layers(self.s, target_layers)

    def keeps_all(self) -> bool:
        """A short context stays whole: selecting would save the draft little and cost acceptance."""
        return self.draft_store.length <= self.s.cmr_min_ratio * self.budget

    def start_tokens(self) -> int:
        whole = super().start_tokens()
        if self.keeps_all() or self.s.draft_prefill == "full":
            return whole
        return min(whole, self.budget + self.s.chunk_size)  # the chosen chunks and the open one

    def start(self, prompt_scores: PromptScores | None = None) -> None:
        if self.keeps_all():
            # The working cache is the whole context at its true positions; new tokens append
            # to it, and retrieval starts when a new chunk opens past the threshold.
            self.rebuild([(0, self.draft_store.length)])
            self.force = False
            return
        if self.s.draft_prefill == "full":
            self._ensure([(0, self.draft_store.length)])
        self.force = True
        scores = prompt_scores() if prompt_scores is not None else None
        if scores is not None:  # first retrieval: what the prompt's last token attends to
            self.refresh(scores)
        else:  # no scores: the streaming view (sinks + recent) until they arrive
            self.rebuild(self.sinks_and_recent())
            self.force = True

    def observe(self, accepted: int) -> None:
        super().observe(accepted)
        if self.ema_accept is not None:
            self.drop = accepted < 0.5 * self.ema_accept
        self.ema_accept = accepted if self.ema_accept is None else 0.8 * self.ema_accept + 0.2 * accepted

    def _new_chunk(self) -> bool:
        return self.draft_store.length // self.s.chunk_size > self.chunks_seen

    def wants_scores(self) -> bool:
        if self.keeps_all():
            return False
        if self.force or self._new_chunk():
            return True  # first retrieval, or a new chunk opened since the last one
        if self.s.adaptive_refresh:
            # Scores for one query row at one layer are cheap; look often, rebuild only on change.
            return self.drop or self.steps_since >= max(1, self.s.retrieve_every // 4)
        return self.steps_since >= self.s.retrieve_every

    def score_rows(self, path: list[int]) -> list[int]:
        return path[-1:] if self.s.retrieval_query == "last" else path

    def choose_chunks(self, scores: torch.Tensor) -> list[int]:
        """Indices of the top-k complete chunks by mean attention.

        Two chunks are always kept, inside the k: the first (it holds the attention sink the
        draft's softmax leans on, when sink_tokens > 0) and the newest complete one (the
        immediate context, e.g. a question that just ended; the target may rank it low because
        the query token itself sits in the open chunk).
        """
        mean = chunk_scores(scores, self.draft_store.length, self.s.chunk_size).clone()
        n_chunks = mean.shape[0]
        if n_chunks == 0:
            return []
        if self.s.sink_tokens > 0:
            mean[0] = float("inf")
        mean[n_chunks - 1] = float("inf")
        return sorted(torch.topk(mean, min(self.s.top_k_chunks, n_chunks)).indices.tolist())

    def refresh(self, scores: torch.Tensor | None) -> None:
        if scores is None or self.keeps_all():
            return
        if self.skipped:  # scores are per target position; chunks are of stored slots
            scores = scores[self.true_pos[: self.draft_store.length]]
        c, ov = self.s.chunk_size, self.s.chunk_overlap
        chosen = self.choose_chunks(scores)
        if self.s.adaptive_refresh and not (self.force or self.drop or self._new_chunk()):
            common = len(self.last_choice & set(chosen))
            if common >= 0.75 * max(1, len(chosen)) and self.steps_since < 4 * self.s.retrieve_every:
                self.steps_since = 0
                return  # the target still reads the same chunks: keep the working cache
        open_start = (self.draft_store.length // c) * c
        ranges = [(max(0, i * c - ov), min(open_start, (i + 1) * c + ov)) for i in chosen]
        ranges.append((open_start, self.draft_store.length))  # the chunk still being filled
        self.last_choice = set(chosen)
        self.force = False
        self.rebuild(ranges)


# One class per `settings.DRAFT_CACHES` name (the names live there so that settings need no torch).
DRAFT_POLICIES: dict[str, type[DraftPolicy]] = {
    "full": FullPolicy,
    "streaming": StreamingPolicy,
    "cmr": CMRPolicy,
}


def make_policy(name: str, draft: Transformer, draft_store: KVCache, backend: Backend, settings: Settings,
                prompt: DraftPrompt | None = None) -> DraftPolicy:
    """The policy `name` over `draft_store`; with `prompt`, the store's prompt slots are computed
    as the policy reads them (without it they all hold KV already)."""
    if name not in DRAFT_POLICIES:
        raise ValueError(f"unknown draft cache {name!r}")
    return DRAFT_POLICIES[name](draft, draft_store, backend, settings, prompt)
