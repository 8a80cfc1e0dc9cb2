"""Tree sizing: each step, the tree that maximises expected accepted tokens per second.

A candidate's *value* is the estimated probability that verification accepts it (and so its whole
path):

- a draft candidate: its parent's value times min(1, K_d * q), q the draft's conditional rank
  probability of it (`tree.pick_children`) and `K_d` the running calibration at its depth: how
  many draft nodes at depth d verification accepted when their parent was, over the conditional
  probability the draft put on them, in recent steps (EAGLE-2's path-probability value, corrected
  per level by what the target actually accepts; per level, so a calibration learnt at depth 1
  carries to deeper levels before they are ever grown);
- a lookup candidate: its parent's value times the running rate at which lookup tokens of its
  depth, match length and rank were accepted when their parent was; for the first token also
  the draft's calibrated probability of it when the draft ran (whichever says more). A bucket
  seen little leans on its prior: at the first depth a flat prior per match length, scaled by
  how this request's lookup tokens fare against their priors overall (text that repeats its
  context rarely gets low priors everywhere, code high); deeper, the rate of the depth above
  (so a depth never verified is expected to fare as the deepest one verified: a request whose
  chains of three lookup tokens were nearly always accepted tries a fourth).

Values never increase along a path, so every prefix of the candidates ordered by value is a tree.

The objective is Dinkelbach's form of a rate: with `lam` the rate to beat (tokens per second),

    F = E[tokens] - lam * E[seconds]
      = 1 + sum of kept values - lam * (draft seconds + verify(1 + kept) + overhead),

from the cost model's predictions (runtime/costmodel.py); a step that runs the draft also pays the draft
policy's retrieval after it, which counts as draft seconds. `lam` is the larger of plain decoding's rate
at this context and the engine's recent rate, so a tree wins over the bare root (an `ar` step)
only when it is expected to beat decoding alone. Three decisions per step use it, after one per
request:

0. start the draft or not (`draft_pays`, until it says yes): starting computes the prompt KV
   the draft reads (draft_prefill.py), worth it only if the draft's expected gain per step over
   the steps still to come repays it, the gain judged at a pessimistic calibration
   (START_CALIBRATION: the start is paid once, on a guess), the steps still to come those of an
   answer as long again as it has run (`tokens_left_to_repay`: nothing says when an answer will
   end); a short answer never starts it and runs lookup alone;

1. draft or not (`should_draft`): the best lookup-only tree against the best tree expected with
   the draft (the draft's usual rank probabilities, the current calibration, and the predicted
   cost of catching it up and of each level). Without a draft benefit the step verifies the
   lookup candidates worth their rows, or only the root. A *probe* runs the draft anyway after
   1, 2, 4, ... 128 idle steps (back to 1 once a probe's token is accepted) so that acceptance
   coming back is noticed, at a cost that vanishes as the interval grows;
2. one more draft level or not (`keep_going`): F with the level's expected children and its
   cost against F without;
3. the nodes kept (`choose`): the prefix by value that maximises F; a *lookup probe* verifies
   the first lookup candidate anyway after 1, 2, 4, ... 128 steps that offered lookup
   candidates and verified none (lookup's acceptance is learnt only from what is verified).

Monotone by construction: for a fixed state, cheaper verification rows raise F more for larger
trees, so they never choose a smaller one (tested). Lossless: sizing decides only what is
proposed. Under sampling nothing here looks at which tokens the draft drew, only at rank
probabilities and at the (deterministic) lookup tokens, which keeps the verifier exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..common.settings import Settings
from ..runtime.costmodel import ROWS, CostModel
from .tree import DRAFT, FORCED, LOOKUP, DraftTree, Pool

MAX_ROWS = ROWS[-1]  # the cost model is measured up to this many verification rows
PROBE_MAX = 128  # longest wait between draft probes, in steps
CAL_DECAY = 0.9  # per step: how fast the draft's calibration forgets
# The prior of a depth's calibration (the depth above's) weighs as much as this many steps of
# observations at that depth. Counted in steps, not in probability mass: a flat draft puts
# little mass per step, and a prior in mass units would then outweigh every observation.
CAL_PRIOR_STEPS = 2.0
LOOKUP_DECAY = 0.95  # per observation of a lookup bucket
RATE_WEIGHT = 0.1  # EMA weight of the engine's recent rate
RANK_WEIGHT = 0.1  # EMA weight of the draft's rank probabilities
# Lookup priors (acceptance of a token given its parent was accepted) per kind (`lookup_key`):
# by matched suffix length 1, 2, 3+, until observations take over; an alternative continuation
# (not its parent's first lookup child) starts at half. Flat in depth on purpose: priors set to
# the replayed rates by depth (bench/lookup_replay.py; higher deeper down) verified more rows for
# the same accepted tokens (docs/benchmarks.md, "Measured choices"). A depth below the first
# leans on the rate of the depth above instead (`Sizer.lookup_rate`), which is this table's
# value until the request has verified tokens there; these values still set what the request's
# verified tokens are expected to score (`lookup_seen`).
# Lookup tokens are counted by match length and depth up to these; longer ones count as these.
LOOKUP_KIND_NGRAM = 3
LOOKUP_KIND_DEPTH = 4
LOOKUP_PRIOR = {(n, d, alt): p * (0.5 if alt else 1.0) for n, p in {1: 0.3, 2: 0.45, LOOKUP_KIND_NGRAM: 0.6}.items()
                for d in range(1, LOOKUP_KIND_DEPTH + 1) for alt in (False, True)}
LOOKUP_PRIOR_WEIGHT = 2.0
# The request-wide scale of those priors starts at 1 with this weight, in tokens of prior expectation.
LOOKUP_SCALE_WEIGHT = 4.0
# When the draft has fallen behind by more than this many tokens (it sat out `ar` steps), it is
# fed only the newest ones: catching up costs a draft forward over every fed token, and the
# draft's guesses need the recent context more than all of it (see DraftPolicy.skip).
RESYNC_TOKENS = 16
# The calibration prior of the start decision (`draft_pays`), before the draft has run: its own rank
# probabilities at this share. Per-step choices may trust the draft at 1 (a step that guessed wrong
# is corrected within steps), but the start is paid once and never recovered: on a 12.3K-token
# GovReport document the default draft was accepted 1.67 tokens a step where the prior at 1 expected
# 1.8-2.4, and the answer took 1.03x `ar`'s time end to end (issue 66). At 0.8 the same state expects
# ~1.6 tokens a step and a third of the gain, so a start must repay its prompt KV three times over.
START_CALIBRATION = 0.8


def tokens_left_to_repay(produced: int, budget_left: int, horizon: str) -> int:
    """The tokens a draft started now may count on to repay its start (decision 0). "budget": every
    one still allowed. "produced": as many as the answer has run so far, capped by the budget: the
    start then waits until the gain it would have added so far covers its cost, the ski-rental rule
    (rent until the rent paid equals the price, then buy), which pays at most about twice what the
    best choice in hindsight would have, however long the answer turns out. Counting to the budget
    started drafts for answers that then ended early (docs/log/2026-12-end-to-end.md)."""
    if horizon == "budget":
        return budget_left
    return min(budget_left, produced)


def lookup_key(ngram: int, depth: int, alt: bool) -> tuple[int, int, bool]:
    """The kind a lookup token's acceptance is counted under: match length, depth, rank."""
    return min(ngram, LOOKUP_KIND_NGRAM), min(depth, LOOKUP_KIND_DEPTH), alt


@dataclass
class Candidates:
    """Values of candidates for the objective: parents come before children (-1: the root)."""

    values: list[float]
    parents: list[int]
    draft: list[bool]


class Sizer:
    """Chooses each step's tree; one per decode (its statistics describe this generation)."""

    def __init__(self, costs: CostModel, s: Settings, has_draft: bool) -> None:
        self.costs = costs
        chain = s.tree == "chain"
        self.topk = 1 if chain else s.tree_topk
        self.max_depth = s.chain_length if chain else s.tree_depth
        self.max_draft = s.chain_length if chain else s.tree_budget  # draft nodes per tree, at most
        self.max_nodes = MAX_ROWS - 1
        self.has_draft = has_draft
        # Draft calibration per depth (decayed sums of accepted and predicted), 1-based.
        self.cal_acc = [0.0] * (self.max_depth + 2)
        self.cal_pred = [0.0] * (self.max_depth + 2)
        self.cal_steps = [0.0] * (self.max_depth + 2)  # decayed count of steps that observed each depth
        self.rank_prob = [0.6 * 0.3**j for j in range(self.topk)]
        self.lookup_stats: dict[tuple[int, int, bool], list[float]] = {}
        self.lookup_seen = [0.0, 0.0]  # decayed: lookup tokens accepted, and their priors' expectation
        self.rate_tokens = self.rate_seconds = 0.0
        self.idle = 0  # steps since the draft last ran
        self.probe_after = 1
        self.drafted_once = False
        self.lookup_idle = 0  # steps that offered lookup candidates and verified none
        self.lookup_probe_after = 1
        self.lookup_probe: int | None = None  # this step's forced lookup candidate
        # Per step (set by `begin`).
        self.verify_s: list[float] = []
        self.lam = 0.0
        self.draft_ctx = 0
        self.spent = 0.0  # predicted draft seconds of this step so far
        self.draft_scale = 1.0  # a factor on every draft cost (draft_break_even's what-if)
        self.cal_prior = 1.0  # the calibration of a depth not observed yet (START_CALIBRATION while starting)
        self.probing = False

    # ----------------------------------------------------------------- the step's constants

    def begin(self, context: int, draft_context: int) -> None:
        """A new step: verification over `context` cached tokens, the draft over `draft_context`."""
        self.verify_s = self.costs.verify_costs(context, self.max_nodes + 1)
        self.draft_ctx = draft_context
        self.spent = 0.0
        self.probing = False
        floor = 1.0 / (self.verify_s[1] + self.costs.overhead_s)  # plain decoding at this context
        recent = self.rate_tokens / self.rate_seconds if self.rate_seconds > 0 else 0.0
        self.lam = max(floor, recent)

    def draft_s(self, rows: int) -> float:
        return self.draft_scale * self.costs.draft_s(rows, self.draft_ctx)

    # ----------------------------------------------------------------- values

    def calibration(self, depth: int) -> float:
        k = self.cal_prior
        for d in range(1, min(depth, len(self.cal_acc) - 1) + 1):
            n, pred = self.cal_steps[d], self.cal_pred[d]
            if n <= 0.0 or pred <= 0.0:
                continue  # nothing observed here: the depth above's
            w = CAL_PRIOR_STEPS * pred / n  # the prior, as CAL_PRIOR_STEPS steps of mean predicted mass
            k = (self.cal_acc[d] + k * w) / (pred + w)
        return k

    def lookup_rate(self, ngram: int, depth: int, alt: bool) -> float:
        key = lookup_key(ngram, depth, alt)
        acc, tries = self.lookup_stats.get(key, (0.0, 0.0))
        if key[1] > 1:
            prior = self.lookup_rate(ngram, key[1] - 1, alt)
        else:
            accepted, expected = self.lookup_seen
            scale = (accepted + LOOKUP_SCALE_WEIGHT) / (expected + LOOKUP_SCALE_WEIGHT)
            prior = min(1.0, LOOKUP_PRIOR[key] * scale)
        return (acc + prior * LOOKUP_PRIOR_WEIGHT) / (tries + LOOKUP_PRIOR_WEIGHT)

    def values(self, pool: Pool) -> Candidates:
        cal = [self.calibration(d) for d in range(self.max_depth + 2)]
        root_q = pool.dists.get(-1)
        vals: list[float] = []
        for i in range(len(pool)):
            up = pool.parents[i]
            parent_v = vals[up] if up >= 0 else 1.0
            if pool.origin[i] == DRAFT:
                v = parent_v * min(1.0, self._conditional(pool, i) * cal[min(pool.depths[i], len(cal) - 1)])
            elif pool.origin[i] == FORCED:  # the grammar forces it: taken unless the target spells it otherwise
                v = parent_v
            else:
                v = parent_v * self.lookup_rate(pool.ngram[i], pool.depths[i], pool.alt[i])
                if up < 0 and root_q is not None:  # the draft's word on the first token, where it has one
                    v = max(v, cal[1] * float(root_q[pool.tokens[i]]))
            vals.append(min(v, parent_v))
        return Candidates(vals, list(pool.parents), [o == DRAFT for o in pool.origin])

    @staticmethod
    def _conditional(pool: Pool, i: int) -> float:
        """The draft's rank probability of candidate i given its parent (path scores are products)."""
        up = pool.parents[i]
        base = pool.score[up] if up >= 0 else 1.0
        return pool.score[i] / base if base > 0.0 else 0.0

    # ----------------------------------------------------------------- the objective

    def best(self, c: Candidates, spent: float, force: Sequence[int] = ()) -> tuple[float, list[int]]:
        """The kept prefix (by value) that maximises F, and F. `force`d candidates (root
        children) come first whatever their value."""
        first = set(force)
        order = sorted(range(len(c.values)), key=lambda i: (i not in first, -c.values[i], i))
        kept: list[int] = []
        in_tree: set[int] = set()
        n_draft = 0
        total = 1.0
        best_f = total - self.lam * (spent + self.verify_s[1] + self.costs.overhead_s)
        best_n = 0
        for i in order:
            if len(kept) >= self.max_nodes:
                break
            if (c.parents[i] >= 0 and c.parents[i] not in in_tree) or (c.draft[i] and n_draft >= self.max_draft):
                continue
            kept.append(i)
            in_tree.add(i)
            n_draft += c.draft[i]
            total += c.values[i]
            f = total - self.lam * (spent + self.verify_s[len(kept) + 1] + self.costs.overhead_s)
            if f > best_f or i in first:
                best_f, best_n = f, len(kept)
        return best_f, kept[:best_n]

    def _with_children(self, c: Candidates, expand: Sequence[int], depth: int) -> Candidates:
        """`c` plus the children the draft is expected to give `expand` at `depth`."""
        k = self.calibration(depth)
        out = Candidates(list(c.values), list(c.parents), list(c.draft))
        for e in expand:
            for p in self.rank_prob:
                out.values.append(c.values[e] * min(1.0, p * k))
                out.parents.append(e)
                out.draft.append(True)
        return out

    # ----------------------------------------------------------------- decisions

    def draft_pays(self, pool: Pool, backlog: int, startup_s: float, tokens_left: int) -> bool:
        """Whether to start the draft now (decision 0, asked each step until it says yes): the
        tokens per step it is expected to add over the lookup-only tree, net of the step's time
        (valued at the rate to beat), over the steps still to come, against what starting costs
        (`startup_s`: computing the prompt KV the draft reads, in tokens forgone at that rate).
        Before the draft has run, its acceptance is the prior (rank probabilities, calibration
        START_CALIBRATION: the start is a cost paid once on a guess); the lookup candidates' rates
        are this request's so far. No: lookup alone (or `ar` steps) for the rest of the answer."""
        if not self.has_draft or tokens_left <= 1 or not self.costs.settled:
            return False
        self.cal_prior = 1.0 if self.drafted_once else START_CALIBRATION
        try:
            lookup = self.values(pool)
            f_without, _ = self.best(lookup, 0.0)
            f_with, tokens = self._draft_tree(lookup, backlog)
        finally:
            self.cal_prior = 1.0
        gain = f_with - f_without
        if gain <= 0.0:
            return False
        return tokens_left / max(1.0, tokens) * gain > self.lam * startup_s

    def draft_break_even(self, pool: Pool, backlog: int, startup_s: float, tokens_left: int) -> float | None:
        """The factor on all the draft's costs (its forwards, its retrieval and its start) up to
        which `draft_pays` says yes in this state: >= 1 when it already does (16 at most), 0 when
        even a free draft would not (its expected tokens add nothing over lookup's), None when
        nothing can be said yet (no draft, no settled costs, no tokens left). The answer to "how
        much cheaper would the draft have to be to start here"."""
        if not self.has_draft or tokens_left <= 1 or not self.costs.settled:
            return None

        def pays(f: float) -> bool:
            self.draft_scale = f
            try:
                return self.draft_pays(pool, backlog, f * startup_s, tokens_left)
            finally:
                self.draft_scale = 1.0

        lo, hi = 2.0**-10, 16.0
        if not pays(lo):
            return 0.0
        if pays(hi):
            return hi
        for _ in range(12):  # F falls as the draft's costs rise: bisect the factor, in log
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if pays(mid) else (lo, mid)
        return lo

    def should_draft(self, pool: Pool, backlog: int) -> bool:
        """Whether this step runs the draft (decision 1); `pool` holds the lookup candidates."""
        if not self.has_draft:
            return False
        if (not self.drafted_once or self.idle >= self.probe_after) and not self.costs.shared:
            self.probing = self.drafted_once
            return True
        lookup = self.values(pool)
        f_without, _ = self.best(lookup, 0.0)
        f_with, _ = self._draft_tree(lookup, backlog)
        return f_with > f_without

    def _draft_tree(self, lookup: Candidates, backlog: int) -> tuple[float, float]:
        """F of the tree the draft is expected to grow over the lookup candidates, and its
        expected tokens: root children at the usual rank probabilities, then levels while they
        pay, judged as `keep_going` will judge them."""
        c = Candidates(list(lookup.values), list(lookup.parents), list(lookup.draft))
        scores = [0.0] * len(c.values)
        k1 = self.calibration(1)
        frontier = []
        for p in self.rank_prob:
            frontier.append(len(c.values))
            c.values.append(min(1.0, p * k1))
            c.parents.append(-1)
            c.draft.append(True)
            scores.append(p)
        # A step that runs the draft also pays its policy's retrieval afterwards.
        spent = self.draft_s(max(1, min(backlog, RESYNC_TOKENS))) + self.draft_scale * self.costs.retrieval_s
        f_with, kept = self.best(c, spent)
        for depth in range(2, self.max_depth + 1):
            expand = sorted(frontier, key=lambda i: (-scores[i], i))[: self.topk]
            level = self.draft_s(len(expand))
            grown = self._with_children(c, expand, depth)
            f_grown, kept_grown = self.best(grown, spent + level)
            if f_grown <= f_with:
                break
            frontier = list(range(len(c.values), len(grown.values)))
            scores += [scores[e] * p for e in expand for p in self.rank_prob]
            c, spent, f_with, kept = grown, spent + level, f_grown, kept_grown
        return f_with, 1.0 + sum(c.values[i] for i in kept)

    def caught_up(self, rows: int) -> None:
        """The draft was fed `rows` tokens this step (its first forward)."""
        self.spent += self.draft_s(rows)

    def keep_going(self, pool: Pool, expand: list[int], depth: int) -> bool:
        """Whether to run the next draft level, expanding `expand` to `depth` (decision 2)."""
        c = self.values(pool)
        f_now, _ = self.best(c, self.spent, self._forced(pool))
        level = self.draft_s(len(expand))
        f_next, _ = self.best(self._with_children(c, expand, depth), self.spent + level,
                              self._forced(pool))
        if f_next <= f_now:
            return False
        self.spent += level
        return True

    def choose(self, pool: Pool) -> list[int]:
        """The candidates to verify (decision 3). A lookup probe verifies the first lookup
        candidate whatever its value after 1, 2, 4, ... PROBE_MAX steps that offered lookup
        candidates and verified none: lookup's acceptance is learnt only from what is verified,
        so without probes a few early misses would keep it out for good."""
        forced = self._forced(pool)
        self.lookup_probe = None
        if not forced and self.lookup_idle >= self.lookup_probe_after and not self.costs.shared:
            first = [i for i in range(len(pool)) if pool.origin[i] == LOOKUP and pool.parents[i] < 0][:1]
            if first:
                forced, self.lookup_probe = first, first[0]
        _, keep = self.best(self.values(pool), self.spent, forced)
        return keep

    def _forced(self, pool: Pool) -> list[int]:
        """A probe verifies the draft's first guess whatever its value: that is what it measures."""
        if not self.probing:
            return []
        return [i for i in range(len(pool)) if pool.origin[i] == DRAFT and pool.parents[i] < 0][:1]

    # ----------------------------------------------------------------- learning from the step

    def observe(self, pool: Pool, keep: Sequence[int], node_of: dict[int, int], tree: DraftTree,
                path: Sequence[int], drafted: bool, new_tokens: int) -> None:
        """What verification accepted this step (`path`: tree nodes from the root)."""
        on_path = set(path)
        accepted_at = {int(tree.depths[n]): n for n in path}
        kept = set(keep)
        # Draft calibration per depth.
        if drafted:
            pred = [0.0] * len(self.cal_pred)
            for i in kept:  # draft candidates whose parent was accepted: their chance was real
                if pool.origin[i] == DRAFT and node_of[pool.parents[i]] in on_path:
                    pred[min(pool.depths[i], len(pred) - 1)] += self._conditional(pool, i)
            for d in range(1, len(pred)):
                self.cal_acc[d] *= CAL_DECAY
                self.cal_pred[d] *= CAL_DECAY
                self.cal_steps[d] *= CAL_DECAY
                if pred[d] > 0.0:
                    self.cal_steps[d] += 1.0
                    node = accepted_at.get(d)
                    self.cal_acc[d] += 1.0 if node is not None and tree.origin[node] & DRAFT else 0.0
                    self.cal_pred[d] += pred[d]
            self._observe_ranks(pool)
            draft_hit = any(tree.origin[n] & DRAFT for n in path[1:])
            if self.probing:
                self.probe_after = 1 if draft_hit else min(2 * self.probe_after, PROBE_MAX)
            self.idle = 0
            self.drafted_once = True
        else:
            self.idle += 1
        self._observe_lookup_probe(pool, kept, node_of, on_path)
        # Lookup acceptance, for tokens whose parent was accepted.
        for i in kept:
            if pool.origin[i] != LOOKUP:
                continue
            up = pool.parents[i]
            if up >= 0 and node_of[up] not in on_path:
                continue
            key = lookup_key(pool.ngram[i], pool.depths[i], pool.alt[i])
            stat = self.lookup_stats.setdefault(key, [0.0, 0.0])
            hit = 1.0 if node_of[i] in on_path else 0.0
            stat[0] = stat[0] * LOOKUP_DECAY + hit
            stat[1] = stat[1] * LOOKUP_DECAY + 1.0
            self.lookup_seen[0] = self.lookup_seen[0] * LOOKUP_DECAY + hit
            self.lookup_seen[1] = self.lookup_seen[1] * LOOKUP_DECAY + LOOKUP_PRIOR[key]
        # The engine's recent rate, in predicted seconds (steady, and reproducible in tests).
        seconds = (self.spent + self.verify_s[min(tree.size, len(self.verify_s) - 1)] + self.costs.overhead_s
                   + (self.costs.retrieval_s if drafted else 0.0))
        self.rate_tokens = (1 - RATE_WEIGHT) * self.rate_tokens + RATE_WEIGHT * new_tokens
        self.rate_seconds = (1 - RATE_WEIGHT) * self.rate_seconds + RATE_WEIGHT * seconds

    def _observe_lookup_probe(self, pool: Pool, kept: set[int], node_of: dict[int, int], on_path: set[int]) -> None:
        offered = [i for i in range(len(pool)) if pool.origin[i] == LOOKUP]
        verified = [i for i in offered if i in kept]
        if any(node_of[i] in on_path for i in verified):
            self.lookup_probe_after = 1  # lookup pays again: probe soon after the next idle step
        elif self.lookup_probe is not None:
            self.lookup_probe_after = min(2 * self.lookup_probe_after, PROBE_MAX)
        if verified:
            self.lookup_idle = 0
        elif offered:
            self.lookup_idle += 1

    def _observe_ranks(self, pool: Pool) -> None:
        """The draft's j-th largest probability at the nodes it expanded (child score / parent's)."""
        kids: dict[int, list[int]] = {}
        for i in range(len(pool)):
            if pool.origin[i] == DRAFT:
                kids.setdefault(pool.parents[i], []).append(i)  # in draw (= rank) order
        sums = [0.0] * self.topk
        count = 0
        for node in (-1, *pool.expanded):
            base = pool.score[node] if node >= 0 else 1.0
            if node not in kids or base <= 0.0:
                continue
            count += 1
            for j, i in enumerate(kids[node][: self.topk]):
                sums[j] += pool.score[i] / base
        if count:
            self.rank_prob = [(1 - RANK_WEIGHT) * r + RANK_WEIGHT * s / count
                              for r, s in zip(self.rank_prob, sums, strict=True)]

    def stats(self) -> dict[str, float]:
        return {"draft_calibration_1": self.calibration(1),
                "rate_to_beat": self.rate_tokens / self.rate_seconds if self.rate_seconds else 0.0}
