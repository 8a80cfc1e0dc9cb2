"""Several generations advancing together, one batch step at a time (the worker of the server's
scheduler, vLLM's scheduler/worker split).

Each sequence runs the ordinary generation code (prefill from the prefix cache, the decoding loop,
the proposer and its draft policy) in a greenlet of its own, on the thread that runs the steps.
Its models are `Port`s: a forward asked of a port suspends the sequence with the request (a
`Call`), and the step runs every pending forward of one model together
(`Transformer.forward_many`), then resumes each sequence with its logits. One greenlet runs at a
time, so nothing needs a lock; the quantized kernels are row-independent and a prompt's KV does
not depend on how its prefill is cut into chunks, so every sequence's tokens are the bits it
gets alone. Each sequence keeps its own settings and random generator (they live in its
decoding loop), so per-request sampling parameters and logits processing plug in unchanged.

A step (`Batch.step`):
1. draft rounds: while a sequence waits on a draft forward, all pending draft forwards run in one
   call (a draft tree grows a level per round; a draft's prompt KV is computed in these rounds);
2. one target forward: every decode row and verification tree, then prompt tokens of sequences
   still prefilling, in the order and within the token budget the caller gives, so running
   requests keep streaming while a long prompt prefills a chunk per step.

Sequences inside a batch size their trees from `StepCosts`: a verification row costs what it adds
to this step's forward, weighed against the whole batch's rate, so speculation backs off as the
step fills (a row riding on a prefill chunk is nearly free; in a full batch it is not).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
from greenlet import greenlet

from ..runtime.costmodel import CostModel
from ..runtime.layers import Rows
from ..runtime.transformer import Transformer
from ..speculation.decoder import SpecEngine
from . import prompt_share


class Cancelled(Exception):
    """Thrown into a sequence whose request was withdrawn: it unwinds at its pending forward."""


@dataclass
class Call:
    """A forward a sequence waits on: `rows` of `model`. A prefill call holds all of a prompt's
    remaining tokens; the step may run only the first ones (a chunk) and asks again for the rest."""

    model: Transformer
    rows: Rows
    prefill: bool = False


def _suspend(call: Call) -> Any:
    parent = greenlet.getcurrent().parent
    if parent is None:
        raise RuntimeError("a batched model was called outside a batch's sequence")
    return parent.switch(call)


def _fills_kv_only(rows: Rows) -> bool:
    lr = rows.logits_rows
    return (rows.size > 1 and rows.tree_mask is None and rows.keep_q is None and isinstance(lr, slice)
            and lr == slice(0, 0))


class Port:
    """A model as a sequence in a batch sees it: the same attributes, but its forwards (and its
    prefill, chunk by chunk) run in the batch's steps."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any, tree_mask: torch.Tensor | None = None,
                 backend: Any = "efficient", logits_rows: torch.Tensor | slice | None = None,
                 keep_q: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        rows = Rows(tokens, positions, cache, tree_mask, logits_rows, keep_q, backend)
        if not _fills_kv_only(rows):
            return _suspend(Call(self.model, rows))
        # A causal pass that asks for no logits and no queries (a draft's prompt KV): the steps may
        # run it in chunks, which leave the same KV; the last chunk stays pending for the caller.
        done, n = 0, rows.size
        while True:
            part = Rows(tokens[done:], positions[done:], cache, None, logits_rows, None, backend)
            out, taken = _suspend(Call(self.model, part, prefill=True))
            done += taken
            if done == n:
                return out
            cache.commit()

    def prefill(self, tokens: torch.Tensor, cache: Any, backend: Any = "efficient", chunk: int = 512,
                last_q: dict[int, torch.Tensor] | None = None,
                on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
        """`Transformer.prefill`, in the chunks the steps grant (`chunk` is the step's to choose)."""
        start, n, done = cache.length, int(tokens.shape[0]), 0
        while True:
            keep = dict.fromkeys(range(self.model.cfg.num_layers)) if last_q is not None else None
            rows = Rows(tokens[done:], torch.arange(start + done, start + n), cache, None, slice(-1, None), keep,
                        backend)
            logits, taken = _suspend(Call(self.model, rows, prefill=True))
            cache.commit()
            done += taken
            if on_chunk is not None:
                on_chunk(done)
            if done == n:
                if keep is not None and last_q is not None:
                    last_q.update({i: q[:, -1:].clone() for i, q in keep.items()})
                return logits[-1]


class Sequence:
    """One generation in the batch: `run` (the request's whole generation, on its greenlet), the
    forward it waits on, and how it ended."""

    def __init__(self, run: Callable[[], Any], tag: Any = None) -> None:
        self.glet = greenlet(run)
        self.tag = tag  # the caller's (the scheduler's request)
        self.call: Call | None = None
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.prefilled = 0  # prompt tokens prefilled in steps (a call's first tokens count as they run)
        self.shared = 0  # prompt tokens copied from another sequence's cache, not yet told its prefill
        self.target_cache: Any = None  # its target KV cache, once a target call showed it

    @property
    def prefilling(self) -> bool:
        return self.call is not None and self.call.prefill

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens still to prefill (0 when not prefilling)."""
        return self.call.rows.size if self.prefilling else 0

    def resume(self, value: Any = None) -> None:
        """Run the sequence until its next forward: started, or given what its pending one returned."""
        started = bool(self.glet)  # a greenlet is true while it has started and not ended
        self._switch(lambda: self.glet.switch(value) if started else self.glet.switch())

    def fail(self, error: BaseException) -> None:
        """End the sequence with `error` (a step it was part of failed): unwound like a cancel."""
        self.cancel()
        self.done, self.error = True, error

    def cancel(self) -> None:
        """Unwind the sequence at its pending forward (its caches go with its frames)."""
        if self.done:
            return
        if not self.glet:  # never started
            self.done, self.error = True, Cancelled()
            return
        self._switch(lambda: self.glet.throw(Cancelled()))

    def _switch(self, go: Callable[[], Any]) -> None:
        self.call = None
        try:
            out = go()
        except BaseException as e:  # the sequence raised: it is over, the caller reports it
            self.done, self.error = True, e
            return
        if self.glet.dead:
            self.done, self.result = True, out
        else:
            assert isinstance(out, Call), "a batched sequence suspended without a forward"
            self.call = out


@dataclass
class StepReport:
    """What one step ran: for scheduling, /health and the cost view of the next step."""

    decode_rows: int = 0  # rows of decoding sequences in the target forward
    decoding: int = 0  # sequences with decode rows in it
    prefill_rows: int = 0  # prompt tokens prefilled
    prompt_left: int = 0  # prompt tokens still to prefill after it (target prompts)
    draft_rounds: int = 0
    drafting: int = 0  # sequences that ran the draft
    seconds: float = 0.0  # the step's wall time
    forward_s: float = 0.0  # of which in the models' forwards (the rest: the sequences' own work)

    @property
    def next_prefill_rows(self) -> int:
        """The prompt tokens the next step is expected to carry: as many as this one, unless fewer
        are left (a prompt whose last chunk ran here does not ride on the next step)."""
        return min(self.prefill_rows, self.prompt_left)


class Batch:
    """The sequences advancing together over one target (and draft) model, and the step."""

    def __init__(self, target: Transformer, draft: Transformer | None) -> None:
        self.target, self.draft = target, draft
        self.sequences: list[Sequence] = []
        self.last = StepReport()
        self.ended: list[Any] = []  # target caches of the sequences reaped since the last step
        # Per decoding sequence and step, what is not a forward (its loop, sampling, lookup,
        # retrieval, streaming), averaged over recent steps: the sizer's per-step overhead.
        self.overhead_s = 0.0

    def engine(self, eos_ids: Seq[int], costs: CostModel) -> SpecEngine:
        """A decoding engine for this batch's sequences: the models' forwards run in the steps
        (`Port`), and trees are sized for the step (`StepCosts` over the models' measured `costs`).
        Its `prefill` and `decode` must be called from a sequence of this batch."""
        engine = SpecEngine(Port(self.target), Port(self.draft) if self.draft is not None else None, eos_ids)
        engine.costs = StepCosts(costs, self)
        return engine

    def add(self, seq: Sequence) -> None:
        """Start a sequence: it runs until its first forward (or to its end; `reap` returns it)."""
        seq.resume()
        self.sequences.append(seq)

    def decoders(self) -> int:
        """Sequences waiting on a decode forward (a verification or a draft round), whose next
        tokens wait on the step's length; not those in a prompt pass, the target's or a draft's
        (a draft's, mid-answer, holds up only its own stream, which waits for the whole pass)."""
        return sum(1 for s in self.sequences if s.call is not None and not s.prefilling)

    def reap(self) -> list[Sequence]:
        """Remove and return the sequences that have ended."""
        done = [s for s in self.sequences if s.done]
        self.sequences = [s for s in self.sequences if not s.done]
        # Their prompts' KV for the next step, if a sequence still prefilling would copy from it
        # (prompt_share.py): a request that ended with its prefill (one token asked) may have led
        # others waiting on its prompt. No longer than that: the scheduler has already given the
        # caches' memory back to the KV budget.
        prefilling = [s.call.rows.cache for s in self.sequences if s.prefilling]  # type: ignore[union-attr]
        self.ended += [s.target_cache for s in done
                       if s.target_cache is not None and prompt_share.wanted(s.target_cache, prefilling)]
        for s in done:  # whoever keeps an ended sequence does not keep its KV
            s.target_cache = None
        return done

    def step(self, budget: int, prefill_order: Callable[[list[Sequence]], list[Sequence]] = list) -> StepReport:
        """Advance every sequence by one target forward (and the draft rounds before it).
        `budget`: rows per model in the step. Decode rows (and draft trees) always run; prompt
        tokens fill what is left after one row per decoding sequence (the rows a tree adds are
        priced by the sizer, `StepCosts`, and do not starve prefills), in `prefill_order`, at least
        one token so a prefill always progresses; a draft's prompt pass beyond the budget waits
        for the next step."""
        report = StepReport()
        t0 = time.perf_counter()
        drafted: set[int] = set()
        draft_left = budget
        while True:
            waiting = [s for s in self.sequences if s.call is not None and s.call.model is not self.target
                       and (draft_left > 0 or not s.call.prefill)]
            if not waiting:
                break
            drafted.update(id(s) for s in waiting)
            draft_left -= self._run(waiting[0].call.model, waiting, draft_left, report)  # type: ignore[union-attr]
            report.draft_rounds += 1
        report.drafting = len(drafted)
        ended, self.ended = self.ended, []
        ready = [s for s in self.sequences if s.call is not None and s.call.model is self.target]
        for s in ready:
            s.target_cache = s.call.rows.cache  # type: ignore[union-attr]
        decode = [s for s in ready if not s.call.prefill]  # type: ignore[union-attr]
        report.decoding = len(decode)
        report.decode_rows = sum(s.call.rows.size for s in decode)  # type: ignore[union-attr]
        prefilling = [s for s in ready if s.prefilling]
        if prefilling and self.target.batches_rows:  # row-independent: another cache's prompt slots are ours
            holders = [s.target_cache for s in self.sequences if s.target_cache is not None] + ended
            prefilling = prompt_share.share(prefilling, holders, {id(s): i for i, s in enumerate(self.sequences)})
        if decode or prefilling:  # sets report.prefill_rows (before the sequences resume: see _run)
            self._run(self.target, decode + prefill_order(prefilling), max(1, budget - report.decoding), report,
                      current=True)
        report.seconds = time.perf_counter() - t0
        if report.decoding:
            own = max(0.0, report.seconds - report.forward_s) / report.decoding
            self.overhead_s = own if self.overhead_s == 0.0 else 0.8 * self.overhead_s + 0.2 * own
        self.last = report
        return report

    def _run(self, model: Transformer, seqs: list[Sequence], left: int, report: StepReport,
             current: bool = False) -> int:
        """One forward of `model` over the sequences' pending calls: whole calls, and of prefill
        calls (in the order given) the first tokens, `left` in all. Each sequence resumes with
        its logits (a prefill call with its logits and how many tokens ran). Returns the prompt
        tokens that ran. `current`: the step's report becomes `last` before the sequences resume,
        so the trees they propose next are sized by this step (the best guess of the next one),
        not the one before (in the first step, none)."""
        parts, runs = [], []
        taken = 0
        for s in seqs:
            call = s.call
            assert call is not None
            rows, take = call.rows, None
            if call.prefill:
                if left - taken <= 0:
                    continue
                take = min(left - taken, rows.size)
                if take < rows.size:  # a chunk: no logits, no queries (they are the last token's)
                    rows = Rows(rows.tokens[:take], rows.positions[:take], rows.cache, None, slice(0, 0), None,
                                rows.backend)
                taken += take
            parts.append(rows)
            runs.append((s, take))
        t0 = time.perf_counter()
        outs = model.forward_many(parts)
        report.forward_s += time.perf_counter() - t0
        if current:
            report.prefill_rows = taken
            report.prompt_left = sum(s.waiting_tokens for s in self.sequences
                                     if s.prefilling and s.call.model is model) - taken  # type: ignore[union-attr]
            self.last = report
        for (s, take), out in zip(runs, outs, strict=True):
            if take is None:
                s.resume(out)
            else:
                s.prefilled += take
                shared, s.shared = s.shared, 0
                s.resume((out, take + shared))
        return taken


class StepCosts(CostModel):
    """The pair's cost model as a sequence inside a batch sees it.

    Frozen while others share the steps: a sequence's phase timings then include the other
    sequences' work, so they say nothing about its own forwards (alone, it refreshes the pair's).
    Priced against the batch decoding plainly: with `b` sequences decoding, each one's share of a
    plain decode step is T(b) / b, so the sizer's rate to beat is the batch's
    (b tokens per T(b)); with `p` prompt tokens in the step as well (as many as the last step
    carried, unless fewer are left: `StepReport.next_prefill_rows`), a tree of n rows adds
    T(b + p + n - 1) - T(b + p). A tree is kept only where its expected tokens beat what its rows
    cost every sequence in the step, so speculation backs off as the step fills, and rows riding
    on a prefill chunk pay only their own rows (never the prefill's), while a draft round, which
    delays the prefill too, is priced by all the rows it holds up. The per-step overhead
    is the batch's own (a sequence's work outside the forwards, `Batch.overhead_s`). A draft forward is
    shared by the sequences that draft in a round: each pays its share of a round as wide as the
    last step's drafters."""

    def __init__(self, base: CostModel, batch: Batch) -> None:
        super().__init__(base.target_curve, base.draft_curve, refresh=False)
        self.base, self.batch = base, batch

    def _alone(self) -> bool:
        """The sequence is the batch's only one and the last step carried nothing else."""
        last = self.batch.last
        return len(self.batch.sequences) <= 1 and last.decoding <= 1 and last.prefill_rows == 0

    # Alone, a sequence's phase timings are its own forwards', as in a generation alone: the pair's
    # cost model learns from them (and carries the scales to the next request, as `generate`'s
    # engine does between generations). Frozen scales were a lone request's one difference from
    # `generate` in how it sizes trees.
    def observe(self, model: str, predicted_raw: float, observed: float) -> None:
        if self._alone():
            self.base.observe(model, predicted_raw, observed)

    def observe_retrieval(self, seconds: float) -> None:
        if self._alone():
            self.base.observe_retrieval(seconds)

    def _sync(self) -> None:
        b = self.base
        self.draft_curve = b.draft_curve
        self.scale, self.retrieval_s = dict(b.scale), b.retrieval_s
        # The batch's measured per-sequence overhead once it has one (the pair's was measured alone).
        self.overhead_s = self.batch.overhead_s or b.overhead_s

    @property  # type: ignore[override]
    def shared(self) -> bool:
        """Other sequences decode in the same steps: no probes, and rests (see CostModel.shared)."""
        return self.batch.last.decoding > 1

    @property  # type: ignore[override]
    def settled(self) -> bool:
        """No prompt chunk shared the last step: the next one's costs are what the coming steps
        will cost. (Not the next step's expected chunk: a prompt's first decode step would then
        start the draft and its prompt pass, and hold back the first token.)"""
        return self.batch.last.prefill_rows == 0

    def verify_costs(self, context: int, max_rows: int) -> list[float]:
        self._sync()
        last = self.batch.last
        b = max(1, last.decoding)
        r = b + last.next_prefill_rows
        if r == 1:
            return super().verify_costs(context, max_rows)
        own = super().verify_costs(context, r + max_rows)
        share = own[b] / b
        return [0.0] + [share + own[r + n - 1] - own[r] for n in range(1, max_rows + 1)]

    def draft_s(self, rows: int, context: int) -> float:
        self._sync()
        last = self.batch.last
        drafting = max(1, last.drafting)
        # A draft round holds up the whole step, prompt chunks included: priced per row the step
        # carries, not only per decoding sequence (so it rarely runs while prompts prefill).
        held = (max(1, last.decoding) + last.next_prefill_rows) / max(1, last.decoding)
        return super().draft_s(rows * drafting, context) / drafting * held
