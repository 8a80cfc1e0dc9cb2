"""The decoding loop: target-only (`ar`) and speculative (draft tree -> one target verification).

Parts are swappable and the loop knows none of their insides: a `Proposer` proposes
(propose.py: the draft through its tree builder and `DraftPolicy`, prompt lookup, and the sizer
that chooses the tree from the measured step costs), a verifier accepts (verify.py). A
speculative step is three calls: `proposer.propose`, `_verify`, `_retrieve`. Invariants between steps:

- the target cache holds every committed token except the newest one (`root`), which is the
  first token of the next verification forward;
- the draft store holds the committed tokens except those in the proposer's `backlog`, which
  the next drafting pass feeds first, and those the draft skipped (`DraftPolicy.skip`).

Prefill is separate from decoding and restorable, so a benchmark can prefill a prompt once and
decode it with several methods: decoding only ever appends after the prompt. Prefill can also
start from a `PrefixKV`, the caches of the prompt's first tokens from an earlier prefill (the
prefix cache), and then runs only the rest of the prompt. The draft's KV of the prompt is not
part of prefill: its policy computes the slots it reads when the draft starts (draft_prefill.py),
and with the cost model the draft starts only once it is expected to repay that (sizing.py), so
a request may finish without it. That time is reported as prefill (`prefill_s`, and
`extra.draft_prefill_s`), not as decoding. The engine belongs to a `Pair`
(api.py), its only caller in the package: settings arrive resolved (`Settings.resolved`) and are
taken as they are.

The callback given to decoding receives every batch of accepted tokens; a true return value
stops decoding after that batch (stop reason "stopped": a stop string, a client gone).

A decode may carry a `LogitsProcessor` (sampling/logits_process.py: a grammar, penalties, log-probabilities).
The loop hands it the target's rows before choosing or verifying (`row`, `tree`), the proposer
hands it the draft's rows and lookup's candidates, and every emitted batch is committed to it
with the rows its tokens came from. Without one the loop runs as it always did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from ..common.errors import ContextLengthExceeded, UserError
from ..common.plural import count
from ..common.settings import Settings
from ..runtime.attention import attention_probs
from ..runtime.config import ModelConfig
from ..runtime.costmodel import CostModel, cached_curve
from ..runtime.kv_cache import KVCache, PrefixKV, row_bytes
from ..runtime.transformer import PREFILL_CHUNK, Transformer
from ..sampling.logits_process import LogitsProcessor
from . import draft_vocab
from .draft_policy import DRAFT_POLICIES, DraftPolicy, make_policy, retrieval_layers, seeing_everything
from .draft_prefill import DraftPrompt
from .prompt_lookup import ContextIndex
from .propose import Proposer
from .tree import DraftTree, make_builder
from .verify import Verdict, best_token, sample, target_dist, verify_greedy, verify_sampling

# True: stop after this batch; an int k: stop after its first k tokens (the caller's text ended
# there: a stop string, a tool call that repeats one), the rest dropped, as one token at a time
# would have stopped, so a speculative answer ends where `ar`'s does.
TokensCallback = Callable[[list[int]], bool | int | None]
ProgressCallback = Callable[[int, int], None]  # a prefill's prompt tokens done so far, of all
TREE_HEADROOM = 256  # cache slots beyond prompt + new tokens, for tree nodes in flight


def cache_slots(prompt_tokens: int, new_tokens: int) -> int:
    """Slots a decode's caches need: the prompt, the new tokens, and room for a tree in flight."""
    return prompt_tokens + new_tokens + TREE_HEADROOM


def window_room(cfg: ModelConfig, new_tokens: int) -> int | None:
    """Slots beyond the window a target's windowed layers keep (kv_cache.py): a prefill chunk's, or
    the new tokens and a tree's, so that they slide only while the prompt fills and a decode can
    still be rewound to its prompt (`Prefilled.restore`) and snapshotted (`Prefilled.snapshot`).
    None (every token) where every layer is windowed: retrieval then scores with windowed layers
    over the whole prompt (`draft_policy.seeing_everything`)."""
    flags = cfg.cache_windows[0]
    if flags and all(flags):
        return None
    return max(PREFILL_CHUNK, new_tokens + TREE_HEADROOM)


def kv_bytes(target: Transformer, draft: Transformer | None, prompt_tokens: int, settings: Settings) -> int:
    """Bytes of the caches a generation allocates, before it allocates them (a server's KV
    budget): the target's cache (its windowed layers keep their window and room), and with a draft
    its store, its working cache and the scratch cache of its prompt passes (each at most as large
    as the store, every token), plus the copy of the prompt's KV that the prefix cache takes at the end."""
    s = _as_resolved(settings)
    slots = cache_slots(prompt_tokens, s.max_new_tokens)

    def cache(m: Transformer, tokens: int, room: int | None) -> int:
        return m.cfg.kv_bytes(tokens, room, row_bytes(m.cfg.head_dim, m.kv_dtype))

    room = window_room(target.cfg, s.max_new_tokens)
    total = cache(target, slots, room) + cache(target, prompt_tokens, room)
    if s.uses_draft and draft is not None:
        total += cache(draft, slots, None) * 3 + cache(draft, prompt_tokens, None)
    return total


@dataclass
class GenerationResult:
    token_ids: list[int]
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    total_s: float
    steps: int
    accepted_per_step: float
    phases: dict[str, float]
    stop_reason: str
    accept_lengths: list[int]
    settings: Settings
    extra: dict[str, Any] = field(default_factory=dict)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from a cached prefix, not prefill

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class Prefilled:
    """The prompt in both models' caches, restorable for several decodes."""

    prompt_ids: list[int]
    attention: str  # the backend that wrote the caches; decode may use another (same K and V)
    target_cache: KVCache
    first_logits: torch.Tensor
    draft_store: KVCache | None  # the draft's KV of every committed token (policies select from it)
    draft_prompt: DraftPrompt | None  # which of the store's prompt slots the draft has computed
    target_s: float
    room: int  # new tokens the caches have slots for: a decode may ask for at most this many
    last_q: dict[int, torch.Tensor]  # each target layer's query of the last prompt token
    cached_tokens: int = 0  # prompt tokens loaded from a PrefixKV instead of prefilled

    def snapshot(self) -> PrefixKV:
        """A compact copy of the prompt's KV (target, and the draft's slots computed so far), for
        the prefix cache. Decoding only appends after the prompt, so this is valid before or after
        a decode."""
        n = len(self.prompt_ids)
        target = self.target_cache.snapshot(n)
        dp = self.draft_prompt
        if self.draft_store is None or dp is None or not bool(dp.computed.any()):
            return PrefixKV(target, None)
        return PrefixKV(target, self.draft_store.snapshot(n), None if dp.complete else dp.computed.clone())

    def forget_draft(self) -> None:
        """Drop all of the draft's prompt KV (computed or loaded from a cached prefix), so that
        the next decode computes exactly what it reads, in its own passes, as it would alone (a
        benchmark timing each method's own draft prefill)."""
        if self.draft_prompt is not None:
            self.draft_prompt.forget()

    def restore(self) -> None:
        n = len(self.prompt_ids)
        self.target_cache.truncate(n)
        if self.draft_store is not None:
            self.draft_store.truncate(n)


@dataclass
class DraftAnswer:
    """The draft alone, answering greedily from one cache policy's working cache (needle
    retrieval: bench/needle.py): its tokens; the draft-store ranges the working cache held when it
    started, and its size then and at its largest; the seconds (and prompt tokens) of the prompt
    KV the policy computed, and the rest of the time."""

    tokens: list[int]
    kept: list[tuple[int, int]]
    working_tokens: int
    max_working_tokens: int
    prefill_s: float
    prefill_tokens: int
    decode_s: float


def check_fits(prompt_tokens: int, settings: Settings, target_context: int, draft_context: int | None,
               note: str = "") -> None:
    """The context limit: prompt + new tokens within the target's context, and within the
    draft's too when its policy attends at every true position (see `sees_every_position`).
    `settings` are resolved; `note` (`ModelConfig.context_note`) says how the target's could grow."""
    s = _as_resolved(settings)
    if prompt_tokens == 0:
        raise UserError("the prompt is empty")
    limit, whose = target_context, "the target's"
    if (s.uses_draft and draft_context is not None and draft_context < limit
            and DRAFT_POLICIES[s.draft_cache].sees_every_position(s)):
        limit, whose = draft_context, "the draft's, which sees every position"
    if prompt_tokens + s.max_new_tokens > limit:
        raise ContextLengthExceeded(
            f"a prompt of {count(prompt_tokens, 'token')} + {count(s.max_new_tokens, 'new token')} exceeds the "
            f"model's context of {limit} tokens ({whose})" + (f"; {note}" if note and whose == "the target's" else "")
        )


def _as_resolved(s: Settings) -> Settings:
    if not s.is_resolved:
        raise ValueError("the engine takes resolved settings (Settings.resolved())")
    return s


class _Clock:
    """Phase timer; on CUDA it synchronises so each phase owns its kernels' time."""

    def __init__(self, device: torch.device) -> None:
        self.sync = device.type == "cuda"
        self.totals = {"draft_s": 0.0, "verify_s": 0.0, "retrieval_s": 0.0}
        self.excluded = 0.0
        self.t = self.now()

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self, phase: str) -> float:
        """Close the current lap, counted as `phase`; returns its seconds."""
        t = self.now()
        lap = t - self.t
        self.totals[phase] += lap
        self.t = t
        return lap

    def skip(self) -> None:
        self.t = self.now()

    def exclude(self, seconds: float) -> None:
        """`seconds` of the running lap belong to no phase (the draft's prompt KV: prefill)."""
        self.t += seconds
        self.excluded += seconds


class LoopOutput(NamedTuple):
    """What a decoding loop returns."""

    tokens: list[int]
    accepts: list[int]  # draft tokens accepted per step (0 for a step without a tree)
    stop: str  # the stop reason: "eos", "length" or "stopped"
    extra: dict[str, float]  # the loop's statistics


class SpecEngine:
    def __init__(self, target: Transformer, draft: Transformer | None, eos_ids: Sequence[int]) -> None:
        self.target, self.draft = target, draft
        self.eos = set(eos_ids)
        draft_vocab.enable(draft, eos_ids)  # the draft scores its frequent tokens and the prompts'
        # The measured step costs the tree sizing reads, refreshed online while decoding (one per
        # engine: the online refresh carries over between generations). Tests set a synthetic one.
        self.costs: CostModel | None = None

    def warmup(self, max_rows: int = 16) -> None:
        """Run every forward shape decoding will use once, untimed.

        oneDNN builds a kernel per matrix shape on first use; without this, whichever method
        decodes first after loading pays those builds inside its timings.
        """
        for model in (self.target, self.draft):
            if model is None:
                continue
            cache = model.new_cache(2 * max_rows + 2)
            for t in range(1, max_rows + 1):
                model(torch.zeros(t, dtype=torch.long), torch.arange(t), cache, None, "eager")
                cache.discard()

    # --- prefill -------------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, s: Settings) -> None:
        check_fits(prompt_len, s, self.target.cfg.max_position,
                   self.draft.cfg.max_position if self.draft is not None else None, self.target.cfg.context_note())

    def prefill(self, prompt_ids: list[int], settings: Settings, prefix: PrefixKV | None = None,
                on_progress: ProgressCallback | None = None) -> Prefilled:
        """Both models' caches over the prompt, with room for `settings.max_new_tokens`. With
        `prefix` (the KV of the prompt's first tokens, at least one token short of the whole
        prompt so the last token's logits and queries are computed here), only the remaining
        tokens are prefilled. `settings` are resolved. `on_progress(done, total)` hears the
        target's prompt tokens in the cache (the cached prefix's included) after each chunk."""
        s = _as_resolved(settings)
        self.check_fits(len(prompt_ids), s)
        uses_draft = s.uses_draft and self.draft is not None
        n = 0
        if prefix is not None:
            n = prefix.length
            if not 0 < n < len(prompt_ids):
                raise ValueError(f"a cached prefix of {n} tokens for a prompt of {len(prompt_ids)}")
        cap = cache_slots(len(prompt_ids), s.max_new_tokens)
        rest = torch.tensor(prompt_ids[n:], dtype=torch.long)
        t0 = time.perf_counter()
        tcache = self.target.new_cache(cap, room=window_room(self.target.cfg, s.max_new_tokens))
        tcache.prompt = np.asarray(prompt_ids, dtype=np.int64)
        if prefix is not None:
            tcache.load(prefix.target_kv)
        last_q: dict[int, torch.Tensor] = {}
        total = len(prompt_ids)
        on_chunk = (lambda done: on_progress(n + done, total)) if on_progress is not None else None
        first = self.target.prefill(rest, tcache, s.attention, last_q=last_q, on_chunk=on_chunk)
        t1 = time.perf_counter()
        draft_store = draft_prompt = None
        if uses_draft:
            assert self.draft is not None
            if isinstance(self.draft.output_head, draft_vocab.VocabTrim):
                self.draft.output_head.cover(prompt_ids)  # the draft can propose the prompt's own tokens
            draft_store = self.draft.new_cache(cap)
            mask = prefix.draft_mask() if prefix is not None else None
            if prefix is not None and prefix.draft_kv is not None:
                draft_store.load(prefix.draft_kv)
            draft_prompt = DraftPrompt(self.draft, draft_store, prompt_ids, s.attention, s.sink_tokens)
            if mask is not None:
                draft_prompt.loaded(mask)
        return Prefilled(list(prompt_ids), s.attention, tcache, first, draft_store, draft_prompt, t1 - t0,
                         s.max_new_tokens, last_q, cached_tokens=n)

    # --- decode --------------------------------------------------------------------------------
    def decode(self, state: Prefilled, settings: Settings, on_tokens: TokensCallback | None = None,
               processor: LogitsProcessor | None = None) -> GenerationResult:
        """Decode after the prefilled prompt (restored first, so any number of decodes can share it).
        `settings` are resolved; `processor`, if given, is this decode's own (it keeps state)."""
        s = _as_resolved(settings)
        if s.max_new_tokens > state.room:
            raise ValueError("decode asks for more new tokens than the prefill made room for")
        if s.uses_draft and state.draft_store is None:
            raise UserError(f"method {s.method!r} needs a draft model")
        state.restore()
        if s.cost_model:
            self.cost_model(s)  # measured (once per machine) before the decode clock starts
        rng = torch.Generator().manual_seed(s.seed)
        clock = _Clock(self.target.device)
        dp = state.draft_prompt if s.uses_draft else None
        if dp is not None:
            dp.begin_decode()
            dp.on_compute = clock.exclude  # the draft's prompt KV is prefill, whenever it is computed
        t_start = clock.t
        loop = self._ar_loop if s.method == "ar" else self._spec_loop
        try:
            proc = processor if processor is not None and processor.active else None
            out, accepts, stop, extra = loop(state, s, rng, clock, on_tokens, proc)
        finally:
            if dp is not None:
                dp.on_compute = None
        decode_s = clock.now() - t_start - clock.excluded
        phases = dict(clock.totals)
        phases["other_s"] = max(0.0, decode_s - sum(phases.values()))
        steps = len(accepts)
        draft_prefill_s = dp.charged_s if dp is not None else 0.0
        if dp is not None:
            extra = {**extra, "draft_prefill_s": draft_prefill_s, "draft_prompt_tokens": float(dp.charged_tokens)}
        prefill_s = state.target_s + draft_prefill_s
        return GenerationResult(
            token_ids=out,
            prompt_tokens=len(state.prompt_ids),
            new_tokens=len(out),
            prefill_s=prefill_s,
            decode_s=decode_s,
            total_s=prefill_s + decode_s,
            steps=steps,
            accepted_per_step=(sum(accepts) / steps) if steps and s.method != "ar" else 0.0,
            phases=phases,
            stop_reason=stop,
            accept_lengths=accepts,
            settings=s,
            extra=extra,
            cached_prompt_tokens=state.cached_tokens,
        )

    def cost_model(self, s: Settings) -> CostModel:
        """The engine's cost model, measuring (or reading the cached) curves it still lacks."""
        if self.costs is None:
            self.costs = CostModel(cached_curve(self.target, s.attention))
        if s.uses_draft and self.draft is not None and self.costs.draft_curve is None:
            self.costs.draft_curve = cached_curve(self.draft, s.attention)
        return self.costs

    def _choose(self, logits: torch.Tensor, s: Settings, rng: torch.Generator) -> int:
        if s.greedy:
            return best_token(logits)
        return sample(target_dist(logits, s.temperature, s.top_p), rng)

    def _emit(self, out: list[int], new: list[int], s: Settings, cb: TokensCallback | None,
              proc: LogitsProcessor | None = None, rows: torch.Tensor | None = None) -> str | None:
        """Append new tokens, cut at EOS or the length limit; returns the stop reason if any.
        `rows`: the (processed) target rows the new tokens were chosen from, for `proc`."""
        stop = None
        room = s.max_new_tokens - len(out)
        for i, t in enumerate(new[:room]):
            if t in self.eos or (proc is not None and proc.ends(t)):
                new, stop = new[: i + 1], "eos"
                break
        else:
            new = new[:room]
        if proc is not None:
            proc.commit(new, rows)
        out.extend(new)
        verdict = cb(new) if cb is not None and new else None
        if verdict is not None and not isinstance(verdict, bool) and 0 < verdict < len(new):
            drop = len(new) - int(verdict)
            del out[len(out) - drop:]
            if proc is not None:
                proc.drop(drop)
        halt = bool(verdict)
        if stop is None and len(out) >= s.max_new_tokens:
            stop = "length"
        if stop is None and halt:
            stop = "stopped"
        return stop

    def _ar_loop(self, state: Prefilled, s: Settings, rng: torch.Generator, clock: _Clock,
                 cb: TokensCallback | None, proc: LogitsProcessor | None) -> LoopOutput:
        tcache = state.target_cache
        row = proc.row(state.first_logits) if proc is not None else state.first_logits
        x = self._choose(row, s, rng)
        out: list[int] = []
        accepts: list[int] = []
        stop = self._emit(out, [x], s, cb, proc, row[None])
        while stop is None:
            clock.skip()
            logits = self.target(torch.tensor([x]), torch.tensor([tcache.length]), tcache, None, s.attention)
            tcache.commit()
            row = proc.row(logits[0]) if proc is not None else logits[0]
            x = self._choose(row, s, rng)
            clock.lap("verify_s")
            accepts.append(0)
            stop = self._emit(out, [x], s, cb, proc, row[None])
        return LoopOutput(out, accepts, stop, {})

    def _spec_loop(self, state: Prefilled, s: Settings, rng: torch.Generator, clock: _Clock,
                   cb: TokensCallback | None, proc: LogitsProcessor | None) -> LoopOutput:
        tcache = state.target_cache
        proposer, layers = self._start_proposer(state, s, rng, clock, proc)
        row = proc.row(state.first_logits) if proc is not None else state.first_logits
        root = self._choose(row, s, rng)
        out: list[int] = []
        accepts: list[int] = []
        stop = self._emit(out, [root], s, cb, proc, row[None])
        proposer.committed([root])
        n_verified = 0
        while stop is None:
            clock.skip()
            context = tcache.length
            tree = proposer.propose(root, context)  # lookup, and the draft where it pays
            draft_s = clock.lap("draft_s")
            verdict, new, queries, rows = self._verify(tree, tcache, layers, s, rng, proc)
            n_verified += tree.size
            verify_s = clock.lap("verify_s")
            accepts.append(len(verdict.path) - 1)
            # Told before the stop check, so the last step counts in the proposer's statistics.
            proposer.verified(tree, verdict, new, context, draft_s, verify_s)
            stop = self._emit(out, new, s, cb, proc, rows)
            if stop is not None:
                break
            root = verdict.bonus
            if proposer.drafted:  # a draft that sat this step out has nothing to retrieve for
                self._retrieve(proposer.policy, tcache, queries, verdict.path)
            proposer.retrieved(clock.lap("retrieval_s"))
        extra = {"verified_nodes_per_step": n_verified / max(1, len(accepts)), **proposer.stats(len(accepts))}
        return LoopOutput(out, accepts, stop, extra)

    def _start_proposer(self, state: Prefilled, s: Settings, rng: torch.Generator, clock: _Clock,
                        proc: LogitsProcessor | None = None) -> tuple[Proposer, list[int]]:
        """The step's proposing parts, and the target layers the draft policy scores with. The
        proposer starts the draft policy when it chooses to (see `Proposer`)."""
        policy, layers, start = self._policy(state, s, clock) if s.uses_draft else (None, [], None)
        index = None
        if s.lookup:
            index = ContextIndex(state.prompt_ids, cache_slots(len(state.prompt_ids), s.max_new_tokens))
        costs = self.cost_model(s) if s.cost_model else None
        builder = make_builder(s) if policy is not None else None
        return Proposer(s, policy, builder, index, costs, rng, start, proc), layers

    def _policy(self, state: Prefilled, s: Settings, clock: _Clock
                ) -> tuple[DraftPolicy, list[int], Callable[[], None]]:
        """The draft policy over the draft store, the target layers it scores with, and how to
        start it: its first working cache, from the prompt's scores (computing the prompt KV it
        reads, which the clock counts as prefill; the rest is retrieval's time)."""
        assert self.draft is not None and state.draft_store is not None
        policy = make_policy(s.draft_cache, self.draft, state.draft_store, s.attention, s, state.draft_prompt)
        layers = seeing_everything(policy.score_layers(self.target.cfg.num_layers), self.target.cfg.cache_windows[0])

        def start() -> None:
            clock.lap("draft_s")
            policy.start(lambda: prompt_scores(state, layers))
            clock.lap("retrieval_s")

        return policy, layers, start

    # --- the draft alone (needle retrieval) -----------------------------------------------------
    def retrieval(self, state: Prefilled, settings: Settings) -> torch.Tensor:
        """What the last prompt token attends to in the target layers CMR scores with
        (`retrieval_layer`, `retrieval_layers_mean`): the scores of its first retrieval."""
        layers = retrieval_layers(settings, self.target.cfg.num_layers)
        scores = prompt_scores(state, seeing_everything(layers, self.target.cfg.cache_windows[0]))
        assert scores is not None
        return scores

    def draft_alone(self, state: Prefilled, policy: str, settings: Settings, scores: torch.Tensor,
                    max_new_tokens: int) -> DraftAnswer:
        """The draft alone, greedy, from the working cache of `policy` started with `scores` (as
        in decoding), after a prefill that used the draft. The store is cut to the prompt less its
        last token first, and the policy computes the prompt KV it reads from nothing: the
        answer's first token comes from that last token through the working cache, so no answer
        token has seen more than the policy keeps. The store is left as it found it (the prompt),
        so each policy can answer from the same prefill."""
        s = _as_resolved(settings)
        store = state.draft_store
        assert self.draft is not None and store is not None, "the prefill did not use the draft"
        t0 = time.perf_counter()
        n = len(state.prompt_ids) - 1
        store.truncate(n)
        prompt = DraftPrompt(self.draft, store, state.prompt_ids[:-1], state.attention, s.sink_tokens)
        working = make_policy(policy, self.draft, store, state.attention, s, prompt)
        working.start(lambda: scores)
        kept, size = working.kept_ranges(), working.working_tokens
        tokens: list[int] = []
        largest, x = size, state.prompt_ids[-1]
        while len(tokens) < max_new_tokens:
            logits = working.extend([x])
            largest = max(largest, working.working_tokens)
            x = best_token(logits[-1])
            tokens.append(x)
            if x in self.eos:
                break
        store.truncate(n)
        return DraftAnswer(tokens, kept, size, largest, prompt.seconds, int(prompt.computed.sum()),
                           time.perf_counter() - t0 - prompt.seconds)

    def _verify(self, tree: DraftTree, tcache: KVCache, layers: list[int], s: Settings, rng: torch.Generator,
                proc: LogitsProcessor | None = None
                ) -> tuple[Verdict, list[int], dict[int, torch.Tensor] | None, torch.Tensor | None]:
        """Verify the whole tree in one target forward and commit the accepted path. Returns the
        verdict, the new tokens (accepted run + bonus), the queries of `layers`, the target
        layers the draft policy scores with (None if none), and the rows the new tokens were
        chosen from (the accepted path's, processed by `proc`)."""
        queries = dict.fromkeys(layers) if layers else None
        positions = tcache.length + tree.depths
        # A lone root is an `ar` step: the causal path sees the same keys and costs less.
        mask = tree.mask() if tree.size > 1 else None
        logits = self.target(tree.tokens, positions, tcache, mask, s.attention, keep_q=queries)
        if proc is not None:
            logits = proc.tree(tree.tokens.tolist(), tree.parents, logits)
        if s.greedy:
            verdict = verify_greedy(tree, logits)
        else:
            verdict = verify_sampling(tree, logits, s.temperature, s.top_p, rng)
        tcache.commit(verdict.path)
        tokens = tree.tokens.tolist()
        rows = logits[verdict.path] if proc is not None else None
        return verdict, [tokens[i] for i in verdict.path[1:]] + [verdict.bonus], queries, rows

    def _retrieve(self, policy: DraftPolicy, tcache: KVCache, queries: dict[int, torch.Tensor] | None,
                  path: list[int]) -> None:
        """Tell the draft policy how the step went; score the accepted rows if it asks."""
        policy.observe(len(path) - 1)
        if policy.wants_scores():
            policy.refresh(retrieval_scores(tcache, queries, policy.score_rows(path)))


def prompt_scores(state: Prefilled, layers: list[int]) -> torch.Tensor | None:
    """The first retrieval's scores: what the last prompt token attends to in the target's `layers`."""
    return retrieval_scores(state.target_cache, {i: state.last_q[i] for i in layers}, [0])


def retrieval_scores(cache: KVCache, keep_q: dict | None, rows: list[int]) -> torch.Tensor | None:
    """Target attention of the accepted query row(s) over every committed token, averaged
    over heads (and over layers when several are kept). Only these rows are scored."""
    if not keep_q:
        return None
    n = cache.length
    total = None
    for layer, q in keep_q.items():
        p = attention_probs(q[:, rows], cache.keys(layer, n))
        total = p if total is None else total + p
    return (total / len(keep_q)).cpu()
