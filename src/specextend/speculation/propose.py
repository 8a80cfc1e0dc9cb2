"""What a speculative step proposes: the draft's candidates and the context's, in one tree.

A `Proposer` owns the proposing side of a decode: the draft (through its `DraftPolicy`, which
decides what the draft attends to), the tree builder, the prompt-lookup index and the sizer.
The engine's loop asks it for a tree (`propose`) and tells it what verification accepted
(`verified`); it knows none of these parts' insides.

Each step:
1. lookup candidates (free: no forward) enter the candidate pool as a trie of continuations;
2. with the sizer (`cost_model` on): the draft starts once the sizer expects it to repay its
   start-up (`draft_gate`), then runs only if the sizer expects it to pay, is fed
   the tokens it has not seen (or, after a long stretch without it, only the newest of them),
   grows level by level while levels pay, and the sizer keeps the candidates that maximise
   expected tokens per second, possibly none (an `ar` step). Without the sizer: the draft's
   fixed-size tree (`sd`) plus every lookup candidate;
3. the kept candidates become one tree; a lookup and a draft candidate for the same token share
   a node (tree.assemble).

In a batch whose other sequences wait on this one's steps (`CostModel.shared`), proposing is
itself a cost: every step pays each sequence's lookup and sizing before the forward. After a step
whose tree was the bare root, the proposer rests (its next steps are plain `ar` steps, with no
lookup and no sizing) for 1, 2, 4, ... REST_MAX steps while that repeats, back to 1 once a tree
is proposed again; rests end when the batch stops being shared. A grammar's forced tokens are
never skipped: with a `LogitsProcessor` it does not rest.

With a `LogitsProcessor` (a grammar, penalties), the draft's rows are adjusted as the target's
will be, for each node's own path, so the draft proposes what the grammar admits; lookup's
continuations are cut where the grammar stops admitting them; and the tokens the grammar forces
after the committed output, and after each lookup continuation (a schema's next key, closing
punctuation), join the pool as free candidates (`FORCED`: deterministic, like lookup's, verified
as point-mass proposals).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..common.settings import Settings
from ..runtime.costmodel import CostModel
from ..sampling.logits_process import LogitsProcessor
from .draft_policy import DraftPolicy
from .prompt_lookup import ContextIndex
from .sizing import RESYNC_TOKENS, Sizer, tokens_left_to_repay
from .tree import FORCED, LOOKUP, DraftTree, Pool, TreeBuilder, assemble, draft_dist
from .verify import Verdict

REST_MAX = 8  # the longest rest, in steps (see the module's docstring)


class Proposer:
    """`policy` arrives unstarted, with `start` to start it (its first working cache, and the
    prompt KV the draft reads): at the first step, or with the sizer and `draft_gate`, at the
    first step where starting is expected to pay over the tokens still to generate. Until then
    the step proposes lookup candidates alone (the draft's backlog grows, and a late start
    feeds it only the newest tokens, as after any stretch without the draft)."""

    def __init__(self, s: Settings, policy: DraftPolicy | None, builder: TreeBuilder | None,
                 index: ContextIndex | None, costs: CostModel | None, rng: torch.Generator,
                 start: Callable[[], None] | None = None, processor: LogitsProcessor | None = None) -> None:
        self.s, self.policy, self.builder, self.index, self.rng = s, policy, builder, index, rng
        self.proc = processor
        self.costs = costs
        self.sizer = Sizer(costs, s, has_draft=policy is not None) if costs is not None else None
        self._start = start
        self.started = policy is not None and start is None
        self.gated = self.sizer is not None and s.draft_gate
        self._startup_s: float | None = None  # predicted seconds of the start's prompt KV
        self.produced = 0  # output tokens so far
        self.backlog: list[int] = []  # committed tokens the draft has not been fed yet
        self.drafted = False  # whether the draft ran in the last step
        # The last step's pool and choice, for `verified`.
        self._pool = Pool()
        self._keep: list[int] = []
        self._node_of: dict[int, int] = {}
        self._raw_draft_s = 0.0  # the cost curve's unscaled prediction of this step's draft forwards
        self._step_start: float | None = None
        self._phases_s = 0.0
        self.counts: dict[str, float] = {"draft_steps": 0, "draft_forwards": 0, "ar_steps": 0, "lookup_nodes": 0,
                       "lookup_accepted": 0, "skipped_tokens": 0, "rested_steps": 0}
        if processor is not None:
            self.counts.update(forced_nodes=0, forced_accepted=0)
        if policy is not None:
            self.counts["draft_started_at"] = -1  # output tokens before the draft started (-1: never)
        self._rest = 0  # plain steps still to take before proposing again
        self._rest_next = 1
        self.resting = False  # whether this step rested

    # ----------------------------------------------------------------- the step

    def committed(self, tokens: list[int]) -> None:
        """Tokens are now part of the output (the first one, or a step's accepted run + bonus)."""
        self.produced += len(tokens)
        if self.index is not None:
            self.index.append(tokens)
        if self.policy is not None:
            self.backlog.extend(tokens)

    def propose(self, root: int, context: int) -> DraftTree:
        """This step's tree below `root`, verified over `context` cached target tokens."""
        self.resting = self._rest > 0 and self.costs is not None and self.costs.shared
        if self.resting:
            self._rest -= 1
            self.counts["rested_steps"] += 1
            self.drafted, self._step_start = False, None  # a rest spans no step the overhead may time
            return assemble(root, Pool(), [])
        now = time.perf_counter()
        if self._step_start is not None and self.costs is not None:
            # What the last step cost beyond its draft, verify and retrieval phases: loop, emit.
            self.costs.observe_overhead(now - self._step_start - self._phases_s)
        self._step_start = now
        s, pool, proc = self.s, Pool(), self.proc
        if proc is not None:
            forced = proc.forced()
            if forced:
                pool.add_continuation(forced, 0, origin=FORCED)
        if self.index is not None:
            for cont in self.index.continuations(s.lookup_ngram, s.lookup_branches, s.lookup_length):
                tokens = cont.tokens if proc is None else cont.tokens[: proc.valid_prefix(cont.tokens)]
                if tokens:
                    pool.add_continuation(tokens, cont.ngram)
            if proc is not None:  # where a copied span ends, the grammar may force what follows
                for leaf in pool.leaves(LOOKUP):
                    pool.extend(leaf, proc.forced(pool.path(leaf)), FORCED)
        self.drafted = False
        self._raw_draft_s = 0.0
        sizer = self.sizer
        if sizer is None:
            if self.policy is not None:
                self._ensure_started()
                self._grow(pool, self._catch_up(resync=False), None)
                keep = self.builder.select(pool) + pool.of(LOOKUP) + pool.of(FORCED)
            else:
                keep = pool.of(LOOKUP) + pool.of(FORCED)
        else:
            sizer.begin(context, self.policy.working.length if self.started else 0)
            if self.policy is not None and not self.started and (not self.gated or self._draft_pays(pool)):
                self._ensure_started()
                sizer.begin(context, self.policy.working.length)
            if self.started and sizer.should_draft(pool, len(self.backlog)):
                self._grow(pool, self._catch_up(resync=True), sizer.keep_going)
            keep = sizer.choose(pool)
        self._node_of = {}
        tree = assemble(root, pool, keep, self._node_of)
        if self.drafted:
            self.policy.end_tree()
        self._pool, self._keep = pool, keep
        return tree

    def _draft_pays(self, pool: Pool) -> bool:
        assert self.sizer is not None and self.costs is not None and self.policy is not None
        budget_left = self.s.max_new_tokens - self.produced
        if self._startup_s is None:  # nothing computes the prompt KV before the start: ask once
            self._startup_s = self.costs.draft_prefill_s(self.policy.start_tokens())
            # How far the first decision is from starting the draft for an answer that runs to its
            # cap, for reports (bench, stats).
            factor = self.sizer.draft_break_even(pool, len(self.backlog), self._startup_s, budget_left)
            if factor is not None:
                self.counts["draft_break_even"] = factor
                draft_step = self.costs.draft_s(1, self.policy.start_tokens())
                self.counts["draft_cost_ratio"] = draft_step / self.sizer.verify_s[1]
        tokens_left = tokens_left_to_repay(self.produced, budget_left, self.s.draft_horizon)
        return self.sizer.draft_pays(pool, len(self.backlog), self._startup_s, tokens_left)

    def _ensure_started(self) -> None:
        if not self.started:
            assert self._start is not None
            self._start()
            self.started = True
            self.counts["draft_started_at"] = self.produced

    def _catch_up(self, resync: bool) -> torch.Tensor:
        """Feed the draft what it has not seen; returns its distribution for the next token."""
        feed = self.backlog
        if resync and len(feed) > RESYNC_TOKENS:
            self.policy.skip(len(feed) - RESYNC_TOKENS)
            self.counts["skipped_tokens"] += len(feed) - RESYNC_TOKENS
            feed = feed[-RESYNC_TOKENS:]
        context = self.policy.working.length
        logits = self.policy.extend(feed)
        if self.proc is not None:
            logits = self.proc.draft_rows([[]], logits[-1:])
        self._forward(len(feed), context)
        if self.sizer is not None:
            self.sizer.caught_up(len(feed))
        self.backlog = []
        self.drafted = True
        return draft_dist(logits[-1], self.s.temperature)

    def _grow(self, pool: Pool, root_q: torch.Tensor, keep_going: Any) -> None:
        def run(tokens: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            self._forward(int(tokens.shape[0]), self.policy.working.length)
            logits = self.policy.run_tree(tokens, depths, mask)
            if self.proc is not None:  # the level's nodes are the last ones the builder expanded
                logits = self.proc.draft_rows([pool.path(i) for i in pool.expanded[-int(tokens.shape[0]):]], logits)
            return logits

        self.builder.grow(pool, root_q, run, self.s.greedy, self.s.temperature, self.rng, keep_going)

    def _forward(self, rows: int, context: int) -> None:
        self.counts["draft_forwards"] += 1
        if self.costs is not None and self.costs.draft_curve is not None:
            self._raw_draft_s += self.costs.draft_curve.predict(rows, context)

    def verified(self, tree: DraftTree, verdict: Verdict, new: list[int], context: int, draft_s: float,
                 verify_s: float) -> None:
        """What verification accepted (`new`: the accepted run and the bonus token) and what the
        step's phases took; `context` is the target's cached length the tree attended to."""
        self.committed(new)
        self.counts["draft_steps"] += self.drafted
        self.counts["ar_steps"] += tree.size == 1
        self.counts["lookup_nodes"] += sum(1 for o in tree.origin if o & LOOKUP)
        self.counts["lookup_accepted"] += sum(1 for n in verdict.path[1:] if tree.origin[n] == LOOKUP)
        if "forced_nodes" in self.counts:
            self.counts["forced_nodes"] += sum(1 for o in tree.origin if o & FORCED)
            self.counts["forced_accepted"] += sum(1 for n in verdict.path[1:] if tree.origin[n] & FORCED)
        self._phases_s = draft_s + verify_s
        if self.costs is not None:
            self.costs.observe_verify(tree.size, context, verify_s)
            if self.drafted:
                self.costs.observe("draft", self._raw_draft_s, draft_s)
        if self.resting:
            return
        if self.sizer is not None:
            self.sizer.observe(self._pool, self._keep, self._node_of, tree, verdict.path, self.drafted, len(new))
        self._plan_rest(tree)

    def _plan_rest(self, tree: DraftTree) -> None:
        """After a proposing step: rest if it proposed nothing while others wait on the steps."""
        if self.costs is not None and self.costs.shared and self.proc is None and tree.size == 1 and not self.drafted:
            self._rest = self._rest_next
            self._rest_next = min(2 * self._rest_next, REST_MAX)
        else:
            self._rest, self._rest_next = 0, 1

    def retrieved(self, seconds: float) -> None:
        """What the draft policy's bookkeeping and retrieval took after this step's verification."""
        self._phases_s += seconds
        if self.costs is not None and self.drafted:
            self.costs.observe_retrieval(seconds)

    def stats(self, steps: int) -> dict[str, float]:
        out: dict[str, float] = {k: float(v) for k, v in self.counts.items()}
        out["lookup_nodes_per_step"] = out.pop("lookup_nodes") / max(1, steps)
        if self.costs is not None:
            out.update(self.costs.stats())
        if self.sizer is not None:
            out.update(self.sizer.stats())
        if self.policy is not None and self.started:
            out.update(self.policy.stats())
        return out

