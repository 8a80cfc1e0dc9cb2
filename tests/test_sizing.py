"""Tree sizing from the cost model: never slower than decoding alone, lossless, monotone.

- A draft that never agrees: the engine settles into `ar` steps (its draft forwards stop but for
  rare probes) and its output equals `ar`'s; when the draft starts agreeing, drafting resumes.
- Lookup candidates that are wrong never change the output (greedy here; sampling in
  test_sampling.py); a context that repeats a span lets lookup alone reach tau > 1.
- The choice is monotone: with cheaper verification rows (same first row, same state) the sizer
  never chooses a smaller tree, never drafts less, never grows fewer levels.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from specextend.common.settings import Settings
from specextend.models.loader import load_model
from specextend.runtime.costmodel import CostModel, ForwardCurve
from specextend.speculation import propose
from specextend.speculation.decoder import SpecEngine
from specextend.speculation.prompt_lookup import ContextIndex, Continuation
from specextend.speculation.sizing import LOOKUP_PRIOR, Sizer, lookup_key
from specextend.speculation.tree import LOOKUP, DynamicTreeBuilder, Pool, draft_dist

from conftest import ARCHS, WatchedEngine

SMALL = dict(chunk_size=4, top_k_chunks=3, retrieve_every=2)
PROMPT = torch.randint(0, 63, (40,), generator=torch.Generator().manual_seed(0)).tolist()


def synthetic_costs(verify_ms=(10.0, 10.5, 11.0, 13.0, 20.0, 35.0), draft_ms=4.0) -> CostModel:
    """A frozen cost model (no online refresh): decisions are reproducible. Verification of up
    to 4 rows costs about one row, as on the target CPU; a draft forward costs 40% of a step."""
    rows = [1, 2, 4, 8, 16, 32]
    target = ForwardCurve(rows, [0], [[v / 1000 for v in verify_ms]])
    draft = ForwardCurve(rows, [0], [[draft_ms / 1000 * (1 + r / 32) for r in rows]])
    return CostModel(target, draft, refresh=False)


def cheaper_rows(costs: CostModel, factor: float) -> CostModel:
    """The same model with every verification row beyond the first costing `factor` times as much."""
    t = costs.target_curve
    seconds = [[line[0] + factor * (x - line[0]) for x in line] for line in t.seconds]
    return CostModel(ForwardCurve(list(t.rows), list(t.contexts), seconds), costs.draft_curve, refresh=False)


class Flipped:
    """A draft that is the target with its logits times `sign`: -1 proposes the target's least
    likely tokens (never accepted), +1 agrees with the target. Counts its decode forwards."""

    def __init__(self, model) -> None:
        self.model, self.sign, self.calls = model, -1.0, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.sign * self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def per_step_draft_calls(eng: SpecEngine, draft: Flipped, flip_at: int | None = None) -> list[int]:
    calls: list[int] = []
    seen = [0]

    def hook(tcache, policy, out, backlog):
        calls.append(draft.calls - seen[0])
        seen[0] = draft.calls
        if flip_at is not None and len(calls) == flip_at:
            draft.sign = 1.0

    eng.step_hook = hook
    return calls


@pytest.mark.parametrize("arch", ARCHS)
def test_a_draft_that_never_agrees_settles_into_ar_steps(tiny_dir, arch):
    target = load_model(tiny_dir(arch, 0), torch.float64)
    draft = Flipped(target)
    eng = WatchedEngine(target, draft, eos_ids=[])
    eng.costs = synthetic_costs()
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=160))
    calls = per_step_draft_calls(eng, draft)
    r = eng.generate(PROMPT, Settings(method="specextend", lookup=False, max_new_tokens=160, **SMALL))
    assert r.token_ids == ar.token_ids
    assert sum(r.accept_lengths) == 0  # nothing the draft proposed was ever accepted
    drafted = [i for i, c in enumerate(calls) if c]
    # A few steps to learn the draft is useless, then only probes at doubling intervals.
    assert len(drafted) <= 14, drafted
    assert sum(1 for i in drafted if i >= len(calls) // 2) <= 1, drafted
    assert r.extra["ar_steps"] >= len(calls) - len(drafted)


def test_drafting_resumes_when_acceptance_returns(tiny_dir, monkeypatch):
    # The draft sees every committed token (full cache, no resync skipping), so once it agrees it
    # is the target itself: what is tested is that the sizer notices and drafts again.
    monkeypatch.setattr(propose, "RESYNC_TOKENS", 10**6)
    target = load_model(tiny_dir("qwen2", 0), torch.float64)
    draft = Flipped(target)
    eng = WatchedEngine(target, draft, eos_ids=[])
    eng.costs = synthetic_costs()
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=200))
    flip = 48
    calls = per_step_draft_calls(eng, draft, flip_at=flip)
    # The start counted to the budget: the draft starts at once, so what follows is about resuming.
    r = eng.generate(PROMPT, Settings(method="specextend", lookup=False, draft_cache="full", max_new_tokens=200,
                                      draft_horizon="budget"))
    assert r.token_ids == ar.token_ids
    before, after = r.accept_lengths[:flip], r.accept_lengths[flip:]
    assert sum(before) == 0
    # The next probe (at most the probe interval reached by then, 32 steps) finds the draft
    # agreeing, and from then on every step drafts and accepts, deeper as calibration grows.
    back = next(i for i, a in enumerate(after) if a > 0)
    assert back <= 40, after
    resumed = after[back:]
    assert min(resumed) >= 1 and sum(resumed) >= 1.5 * len(resumed), resumed
    assert all(calls[flip + back :]), calls[flip + back :]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["specextend", "lookup", "sd+lookup"])
def test_wrong_lookup_candidates_never_change_the_output(tiny_dir, arch, method, monkeypatch):
    target = load_model(tiny_dir(arch, 0), torch.float64)
    draft = load_model(tiny_dir(arch, 5, layers=1), torch.float64)
    eng = WatchedEngine(target, draft, eos_ids=[])
    eng.costs = synthetic_costs()
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=40))
    rng = random.Random(arch + method)

    def wrong(self, max_ngram, branches, length):
        return [Continuation(tuple(rng.randrange(64) for _ in range(rng.randint(1, length))), rng.randint(1, 4))
                for _ in range(branches)]

    monkeypatch.setattr(ContextIndex, "continuations", wrong)
    preset = method.partition("+")[0]
    s = Settings(method=preset, max_new_tokens=40, lookup=True, lookup_branches=3, **SMALL)
    r = eng.generate(PROMPT, s)
    assert r.token_ids == ar.token_ids
    assert r.extra["lookup_nodes_per_step"] > 0  # the wrong candidates were verified, and refused


@pytest.mark.parametrize("arch", ARCHS)
def test_lookup_alone_passes_one_token_per_step_on_a_repeating_context(tiny_dir, arch):
    """No draft model at all: the output's own earlier spans, or the prompt's, are the proposals."""
    # Seed 2: a random tiny model copies only when its greedy output falls into the context's
    # pattern or a loop of its own; at this seed every architecture does within 120 tokens.
    target = load_model(tiny_dir(arch, 2), torch.float64)
    eng = SpecEngine(target, None, eos_ids=[])
    eng.costs = synthetic_costs()
    # The target's own greedy continuation, repeated: the context repeats a span, and so does
    # what the target says next.
    span = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=24)).token_ids
    prompt = PROMPT + span + PROMPT + span + PROMPT
    ar = eng.generate(prompt, Settings(method="ar", max_new_tokens=120))
    r = eng.generate(prompt, Settings(method="lookup", max_new_tokens=120))
    assert r.token_ids == ar.token_ids
    assert r.accepted_per_step > 1.0, r.accept_lengths
    assert r.extra["draft_forwards"] == 0


def test_lookup_probes_find_candidates_the_prior_undervalues(tiny_dir, monkeypatch):
    """Candidates that are always right but that the prior says do not pay (a two-row step costs
    1.6 rows here): only verifying one shows they pass, and the probes do; without them every
    step stays a one-row step."""
    target = load_model(tiny_dir("qwen2", 0), torch.float64)
    eng = SpecEngine(target, None, eos_ids=[])
    eng.costs = synthetic_costs(verify_ms=(10.0, 16.0, 20.0, 25.0, 35.0, 60.0))
    truth = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=80)).token_ids
    n_prompt = len(PROMPT)

    def continuations(self, ngram, branches, length):  # the target's own next 4 tokens, 1-gram match
        done = self.length - n_prompt
        nxt = tuple(truth[done : done + 4])
        return [Continuation(nxt, 1)] if nxt else []

    monkeypatch.setattr(ContextIndex, "continuations", continuations)
    r = eng.generate(PROMPT, Settings(method="lookup", max_new_tokens=80))
    assert r.token_ids == truth
    assert r.extra["lookup_accepted"] > 40 and r.accepted_per_step > 1.0, r.accept_lengths


# --------------------------------------------------------------------------- monotone choices


def random_pool(seed: int, topk: int = 3, depth: int = 5) -> tuple[Pool, DynamicTreeBuilder]:
    """Draft candidates from a fake draft with random (peaked) distributions, and lookup branches."""
    g = torch.Generator().manual_seed(seed)
    vocab = 20
    pool = Pool()
    rng = random.Random(seed)
    for _ in range(rng.randint(0, 3)):
        pool.add_continuation([rng.randrange(vocab) for _ in range(rng.randint(1, 8))], rng.randint(1, 4))

    def run(tokens, depths, mask):
        return torch.randn(len(tokens), vocab, generator=g, dtype=torch.float64) * 3

    builder = DynamicTreeBuilder(budget=12, depth=depth, topk=topk)
    builder.grow(pool, draft_dist(torch.randn(vocab, generator=g, dtype=torch.float64) * 3, 0.0), run, True, 0.0, None)
    return pool, builder


def random_state(sizer: Sizer, seed: int) -> Sizer:
    rng = random.Random(seed)
    for d in range(1, len(sizer.cal_acc)):
        sizer.cal_pred[d] = rng.uniform(0.0, 5.0)
        sizer.cal_acc[d] = rng.uniform(0.0, 1.2) * sizer.cal_pred[d]
        sizer.cal_steps[d] = rng.uniform(1.0, 10.0)
    sizer.rank_prob = sorted((rng.uniform(0.01, 0.9) for _ in sizer.rank_prob), reverse=True)
    for key in [(n, d, a) for n in (1, 2, 3) for d in (1, 2, 3, 4) for a in (False, True)]:
        tries = rng.uniform(0.0, 10.0)
        sizer.lookup_stats[key] = [rng.uniform(0.0, 1.0) * tries, tries]
    sizer.rate_tokens, sizer.rate_seconds = rng.uniform(0.0, 4.0), rng.uniform(0.005, 0.05)
    sizer.drafted_once = True
    sizer.idle, sizer.probe_after = 0, 64
    return sizer


FACTORS = (1.5, 1.0, 0.7, 0.4, 0.2, 0.0)  # verification rows beyond the first, ever cheaper


@pytest.mark.parametrize("seed", range(40))
def test_cheaper_rows_never_choose_a_smaller_tree(seed):
    s = Settings(tree_budget=12, tree_depth=5, tree_topk=3).resolved()
    base = synthetic_costs(verify_ms=(10.0, 11.0, 12.5, 17.0, 28.0, 55.0), draft_ms=3.0)
    state = random_state(Sizer(base, s, has_draft=True), seed)
    pool, _ = random_pool(seed)
    lookup_only = Pool()
    for i in pool.of(LOOKUP):  # the same lookup candidates, before any draft ran
        lookup_only.add(pool.tokens[i], pool.parents[i], LOOKUP, ngram=pool.ngram[i], alt=pool.alt[i])
    sizes, drafts = [], []
    for f in FACTORS:
        sizer = copy.deepcopy(state)
        sizer.costs = cheaper_rows(base, f)
        sizer.begin(context=0, draft_context=0)
        drafts.append(sizer.should_draft(lookup_only, backlog=3))
        sizes.append(len(sizer.choose(pool)))
    assert sizes == sorted(sizes), sizes  # never smaller as rows get cheaper
    assert drafts == sorted(drafts), drafts  # False ... True: once worth drafting, it stays so


@pytest.mark.parametrize("seed", range(40))
def test_cheaper_rows_never_grow_fewer_levels(seed):
    """The whole step with a fake draft: levels grown and nodes kept never fall as rows get cheaper."""
    s = Settings(tree_budget=16, tree_depth=6, tree_topk=2).resolved()
    base = synthetic_costs(verify_ms=(10.0, 11.0, 12.5, 17.0, 28.0, 55.0), draft_ms=2.0)
    state = random_state(Sizer(base, s, has_draft=True), seed)
    levels, sizes = [], []
    for f in FACTORS:
        g = torch.Generator().manual_seed(seed)

        def run(tokens, depths, mask, g=g):
            return torch.randn(len(tokens), 20, generator=g, dtype=torch.float64) * 3

        sizer = copy.deepcopy(state)
        sizer.costs = cheaper_rows(base, f)
        sizer.begin(context=0, draft_context=0)
        sizer.caught_up(2)
        pool = Pool()
        root_q = draft_dist(torch.randn(20, generator=g, dtype=torch.float64) * 3, 0.0)
        DynamicTreeBuilder(16, 6, 2).grow(pool, root_q, run, True, 0.0, None, sizer.keep_going)
        levels.append(max(pool.depths))
        sizes.append(len(sizer.choose(pool)))
    assert levels == sorted(levels), levels
    assert sizes == sorted(sizes), sizes


# --------------------------------------------------------------------------- the cost cache


def test_cost_curves_are_cached_and_checked_on_read(tiny_dir, tmp_path, monkeypatch):
    from specextend.runtime import costmodel

    monkeypatch.setenv("SPECEXTEND_COST_CACHE", str(tmp_path))
    model = load_model(tiny_dir("qwen2", 0), torch.float64)
    measured = []
    fake = ForwardCurve([1, 2], [0, 64], [[1e-3, 2e-3], [2e-3, 3e-3]])
    monkeypatch.setattr(costmodel, "measure_curve", lambda *a, **k: measured.append(1) or fake)
    first = costmodel.cached_curve(model, "efficient", quiet=True)
    again = costmodel.cached_curve(model, "efficient", quiet=True)
    assert len(measured) == 1 and first.seconds == again.seconds == fake.seconds
    (path,) = tmp_path.glob("*.json")
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed
    path.write_text(path.read_text()[:-7])  # torn
    costmodel.cached_curve(model, "efficient", quiet=True)
    assert len(measured) == 2
    d = json.loads(path.read_text())
    d["parts"]["threads"] += 1  # measured for another set-up under the same name
    path.write_text(json.dumps(d))
    costmodel.cached_curve(model, "efficient", quiet=True)
    assert len(measured) == 3
    d = json.loads(path.read_text())
    d["curve"]["seconds"][0][0] = -1.0  # impossible
    path.write_text(json.dumps(d))
    costmodel.cached_curve(model, "efficient", quiet=True)
    assert len(measured) == 4


def test_a_slow_outlier_does_not_lift_the_curve():
    c = ForwardCurve([1, 2, 4], [0, 1000], [[0.5, 0.011, 0.012], [0.02, 0.021, 0.03]])
    assert c.seconds == [[0.011, 0.011, 0.012], [0.02, 0.021, 0.03]]
    assert c.predict(3, 500) <= c.predict(4, 500) <= c.predict(4, 2000)


def test_online_refresh_follows_observed_phase_times():
    costs = CostModel(ForwardCurve([1, 2], [0], [[0.01, 0.012]]), refresh=True)
    for _ in range(60):
        costs.observe_verify(1, 0, 0.02)  # the machine is twice as slow
    assert costs.target_s(1, 0) == pytest.approx(0.02, rel=0.02)


def test_tree_steps_do_not_move_the_one_row_cost():
    """Trees costing more than their curve say nothing about decoding alone, the rate every tree
    must beat: its cost stays the curve's until one-row steps measure it. Costs stay monotone."""
    costs = CostModel(ForwardCurve([1, 2, 4, 8], [0], [[0.010, 0.011, 0.012, 0.016]]), refresh=True)
    for _ in range(60):
        costs.observe_verify(4, 0, 0.018)  # wider verifications run 1.5x their curve
    assert costs.target_s(1, 0) == pytest.approx(0.010)
    assert costs.target_s(4, 0) == pytest.approx(0.018, rel=0.02)
    for _ in range(60):
        costs.observe_verify(1, 0, 0.025)  # and one row 2.5x
    assert costs.target_s(1, 0) == pytest.approx(0.025, rel=0.02)
    v = costs.verify_costs(0, 8)
    assert v[1] == pytest.approx(0.025, rel=0.02) and v == [0.0, *sorted(v[1:])]


def test_rows_a_tree_adds_never_look_free():
    """One-row steps measured far above their curve (what every step of this decode pays) and
    wider ones near it: the rows beyond the first still cost at least their increment on the
    curve, so a lookup candidate worth less than that increment is not verified."""
    curve = ForwardCurve([1, 2, 4, 8], [0], [[0.050, 0.066, 0.100, 0.160]])
    costs = CostModel(curve, refresh=True)
    for _ in range(60):
        costs.observe_verify(1, 0, 0.070)  # one row 1.4x its curve
        costs.observe_verify(3, 0, 0.090)  # three rows 1.08x
    v = costs.verify_costs(0, 8)
    assert v[1] == pytest.approx(0.070, rel=0.02)
    raw = curve.row_costs(0, 8)
    assert all(v[n] - v[n - 1] >= raw[n] - raw[n - 1] for n in range(2, 9))

    sizer = Sizer(costs, Settings(method="lookup").resolved(), has_draft=False)
    sizer.begin(0, 0)
    pool = Pool()
    pool.add_continuation([5, 6], ngram=1)
    sizer.lookup_stats[(1, 1, False)] = [5.0, 50.0]  # one in ten of lookup's tokens accepted here
    sizer.lookup_stats[(1, 2, False)] = [5.0, 50.0]
    # worth ~0.1 token against ~0.25 token of the second row's time: the root alone
    assert 0.05 < sizer.lookup_rate(1, 1, False) < 0.2 and sizer.choose(pool) == []


@pytest.mark.parametrize("seed", range(10))
def test_retrieval_after_a_drafted_step_counts_against_drafting(seed):
    """What the draft policy spends after a drafted step is the draft's cost: when it grows, the
    sizer drafts no more often (and, once it outweighs a step, not at all)."""
    s = Settings(tree_budget=12, tree_depth=5, tree_topk=3).resolved()
    state = random_state(Sizer(synthetic_costs(), s, has_draft=True), seed)
    state.rank_prob = [0.8, 0.1, 0.05]
    for d in range(1, len(state.cal_acc)):  # a well calibrated draft: drafting pays when it is free
        state.cal_acc[d] = state.cal_pred[d]
    state.rate_tokens = state.rate_seconds = 0.0  # the rate to beat: plain decoding's
    decisions = []
    for retrieval_ms in (0.0, 2.0, 8.0, 30.0, 200.0):
        sizer = copy.deepcopy(state)
        sizer.costs.retrieval_s = retrieval_ms / 1000
        sizer.begin(context=0, draft_context=0)
        decisions.append(sizer.should_draft(Pool(), backlog=1))
    assert decisions[0] and not decisions[-1], decisions
    assert decisions == sorted(decisions, reverse=True), decisions


@pytest.mark.parametrize("seed", range(6))
def test_the_break_even_factor_is_where_starting_the_draft_flips(seed):
    """draft_break_even answers "how much cheaper would the draft have to be to start here":
    with every draft cost scaled a little below the factor the start decision says yes, a little
    above it no; the sizer's costs are left as they were."""
    s = Settings(tree_budget=12, tree_depth=5, tree_topk=3).resolved()
    sizer = random_state(Sizer(synthetic_costs(), s, has_draft=True), seed)
    sizer.begin(context=0, draft_context=0)
    startup_s, tokens_left = 0.5, 200
    factor = sizer.draft_break_even(Pool(), 1, startup_s, tokens_left)
    assert factor is not None and sizer.draft_scale == 1.0
    before = sizer.draft_pays(Pool(), 1, startup_s, tokens_left)
    assert before == (factor >= 1.0), (factor, before)

    def pays_at(f: float) -> bool:
        scaled = copy.deepcopy(sizer)
        scaled.draft_scale = f
        return scaled.draft_pays(Pool(), 1, f * startup_s, tokens_left)

    if 0.0 < factor < 16.0:
        assert pays_at(factor * 0.98) and not pays_at(factor * 1.05), factor
    elif factor == 0.0:
        assert not pays_at(2.0**-10)
    assert sizer.draft_break_even(Pool(), 1, startup_s, 1) is None  # no tokens left: nothing to say


def test_retrieval_is_observed_only_after_drafted_steps():
    costs = CostModel(ForwardCurve([1, 2], [0], [[0.01, 0.012]]), refresh=True)
    proposer = propose.Proposer(Settings().resolved(), None, None, None, costs, torch.Generator())
    proposer.drafted = False
    proposer.retrieved(0.5)
    assert costs.retrieval_s == 0.0
    proposer.drafted = True
    for _ in range(60):
        proposer.retrieved(0.02)
    assert costs.retrieval_s == pytest.approx(0.02, rel=0.02)


def test_lookup_priors_follow_how_this_requests_lookup_fares():
    """A bucket of lookup candidates never verified yet starts at its prior scaled by how the
    request's verified lookup tokens fared against theirs: low where the text rarely repeats
    its context, high (at most certain) where it does; one miss or hit hardly moves it."""
    def rate(accepted: float, expected: float) -> float:
        sizer = Sizer(synthetic_costs(), Settings(method="lookup").resolved(), has_draft=False)
        sizer.lookup_seen = [accepted, expected]
        return sizer.lookup_rate(3, 2, False)

    prior = rate(0.0, 0.0)
    assert rate(2.0, 12.0) < 0.5 * prior < prior < rate(12.0, 6.0) <= 1.0
    assert rate(0.0, 0.6) > 0.85 * prior and rate(1.0, 0.6) < 1.15 * prior


def test_a_lookup_depth_never_verified_is_expected_to_fare_as_the_depth_above():
    """Before any lookup token is verified every depth is the flat prior; once the depths a
    request has verified are accepted (or rejected) far from it, a deeper kind never verified
    yet starts at the deepest verified depth's rate, not at the flat prior: a request whose
    three-token lookup chains were all accepted otherwise never tried a fourth token."""
    sizer = Sizer(synthetic_costs(), Settings(method="lookup").resolved(), has_draft=False)
    flat = LOOKUP_PRIOR[lookup_key(3, 1, False)]
    assert all(sizer.lookup_rate(3, d, False) == pytest.approx(flat) for d in range(1, 6))
    for d in (1, 2, 3):
        sizer.lookup_stats[lookup_key(3, d, False)] = [9.5, 10.0]  # nearly always accepted
    sizer.lookup_seen = [28.5, 30 * flat]
    deep = sizer.lookup_rate(3, 4, False)
    assert deep == pytest.approx(sizer.lookup_rate(3, 3, False)) and deep > 0.9
    for d in (1, 2, 3):
        sizer.lookup_stats[lookup_key(3, d, False)] = [0.5, 10.0]  # nearly never
    sizer.lookup_seen = [1.5, 30 * flat]
    assert sizer.lookup_rate(3, 4, False) < 0.2
    assert sizer.lookup_rate(1, 4, False) < LOOKUP_PRIOR[lookup_key(1, 4, False)]  # untried: scaled down


def test_every_kind_of_lookup_token_has_a_prior_that_is_a_probability():
    """Any match length and depth the proposer can offer (`--lookup-ngram` and `--lookup-length`
    have no upper bound) maps to a kind with a prior: a missing one would fail a decode with a
    KeyError deep in the loop."""
    for n in range(1, 9):
        for depth in range(1, 65):
            for alt in (False, True):
                assert 0.0 < LOOKUP_PRIOR[lookup_key(n, depth, alt)] < 1.0


def long_context_costs() -> CostModel:
    """A long prompt's step costs: a 9-row verification ~1.9x a one-row step, a draft step 0.3x."""
    return synthetic_costs(verify_ms=(40.0, 44.0, 50.0, 76.0, 120.0, 200.0), draft_ms=12.0)


def test_the_draft_starts_only_where_its_prompt_kv_repays_itself_within_the_answer():
    """Decision 0 on fake costs: a longer answer starts the draft at least as readily, a dearer start
    (more prompt KV to compute) at most as readily; a one-token answer or a start dearer than any
    saving never starts it (lookup alone then), a cheap start over a long answer does."""
    s = Settings(method="specextend").resolved()
    sizer = Sizer(long_context_costs(), s, has_draft=True)
    sizer.begin(context=0, draft_context=0)
    by_length = [sizer.draft_pays(Pool(), 1, 1.0, n) for n in (1, 8, 32, 128, 512, 4096, 65536)]
    assert by_length == sorted(by_length) and not by_length[0] and by_length[-1], by_length
    by_cost = [sizer.draft_pays(Pool(), 1, c, 256) for c in (1e-4, 0.01, 0.1, 1.0, 10.0, 100.0)]
    assert by_cost == sorted(by_cost, reverse=True) and by_cost[0] and not by_cost[-1], by_cost


def test_the_start_is_judged_below_the_drafts_own_probabilities():
    """Before the draft has run, the start decision values its guesses at START_CALIBRATION of its
    own probabilities: it breaks even only at a cheaper draft than the same state would with the
    prior at 1 (the per-step choices' prior), and that prior is left as it was."""
    s = Settings(method="specextend").resolved()
    fresh = Sizer(long_context_costs(), s, has_draft=True)
    fresh.begin(context=0, draft_context=0)
    trusting = copy.deepcopy(fresh)
    trusting.drafted_once = True  # a run draft has calibration observations: the prior stays at 1
    startup_s, tokens_left = 0.3, 128
    cautious = fresh.draft_break_even(Pool(), 1, startup_s, tokens_left)
    optimistic = trusting.draft_break_even(Pool(), 1, startup_s, tokens_left)
    assert cautious is not None and optimistic is not None and 0.0 < cautious < optimistic, (cautious, optimistic)
    assert fresh.cal_prior == 1.0 and fresh.calibration(1) == 1.0
    # A start the trusting prior would take and the cautious one refuses: decoding goes on without it.
    f = (cautious * optimistic) ** 0.5
    scaled_fresh, scaled_trusting = copy.deepcopy(fresh), copy.deepcopy(trusting)
    scaled_fresh.draft_scale = scaled_trusting.draft_scale = f
    assert scaled_trusting.draft_pays(Pool(), 1, f * startup_s, tokens_left)
    assert not scaled_fresh.draft_pays(Pool(), 1, f * startup_s, tokens_left)
