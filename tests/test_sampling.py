"""Sampling keeps the target's distribution: tree drafting + recursive rejection sampling.

A chi-square goodness-of-fit test compares the empirical distribution of the first generated
positions with the exact target distribution; the same test must reject a deliberately broken
acceptance rule, which proves it can fail.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from specextend.speculation import verify
from specextend.speculation.tree import ChainBuilder, DynamicTreeBuilder, draft_dist
from specextend.speculation.verify import target_dist, verify_sampling

pytestmark = pytest.mark.long  # thousands of draws a test

V = 6
N = 10_000  # draws a test of a rule: its power against a bias
# The broken rules show at this many draws already, far past their bound of 1e-6 (p ~ 1e-197 and
# 1e-125): the test can fail, at a quarter of the draws the rules themselves are tested with.
N_BROKEN = 2_500
POSITIONS = 3


def markov_pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft next-token logits given the previous token (rows), quite different."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5, torch.randn(V, V, generator=g,
                                                                                     dtype=torch.float64) * 1.5


def exact_marginals(p_logits, root: int, temperature: float, top_p: float) -> list[torch.Tensor]:
    trans = torch.stack([target_dist(p_logits[a], temperature, top_p) for a in range(V)])
    dist = trans[root]
    out = [dist]
    for _ in range(POSITIONS - 1):
        dist = dist @ trans
        out.append(dist)
    return out


def simulate(builder, p_logits, q_logits, root: int, temperature: float, top_p: float, seed: int, n: int = N):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(POSITIONS, V)

    def run(tokens, depths, mask):
        return q_logits[tokens]

    for _ in range(n):
        out: list[int] = []
        r = root
        while len(out) < POSITIONS:
            tree = builder.build(r, draft_dist(q_logits[r], temperature), run, False, temperature, gen)
            verdict = verify_sampling(tree, p_logits[tree.tokens], temperature, top_p, gen)
            toks = tree.tokens.tolist()
            out += [toks[i] for i in verdict.path[1:]] + [verdict.bonus]
            r = out[-1]
        for pos in range(POSITIONS):
            counts[pos, out[pos]] += 1
    return counts


def min_pvalue(counts, marg) -> float:
    n = int(counts[0].sum())
    ps = []
    for pos in range(POSITIONS):
        expected = marg[pos].numpy() * n
        keep = expected > 0
        assert counts[pos][~torch.as_tensor(keep)].sum() == 0, "sampled a token the target cannot produce"
        ps.append(chisquare(counts[pos].numpy()[keep], expected[keep] * (counts[pos].sum().item() / n)).pvalue)
    return min(ps)


BUILDERS = {
    "chain": lambda: ChainBuilder(3),
    "tree": lambda: DynamicTreeBuilder(budget=6, depth=3, topk=3),
}


@pytest.mark.parametrize("builder,temperature,top_p", [("chain", 1.0, 1.0), ("tree", 1.0, 1.0), ("tree", 0.7, 0.8)])
def test_distribution_is_kept(builder, temperature, top_p):
    p_logits, q_logits = markov_pair()
    counts = simulate(BUILDERS[builder](), p_logits, q_logits, 2, temperature, top_p, seed=11)
    assert min_pvalue(counts, exact_marginals(p_logits, 2, temperature, top_p)) > 1e-3


def test_broken_rule_is_detected(monkeypatch):
    """Skipping the residual after a rejection biases the output; the test must notice."""
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    p_logits, q_logits = markov_pair()
    counts = simulate(BUILDERS["tree"](), p_logits, q_logits, 2, 1.0, 1.0, seed=11, n=N_BROKEN)
    assert min_pvalue(counts, exact_marginals(p_logits, 2, 1.0, 1.0)) < 1e-6


def two_token_marginals(target, prompt: list[int], temperature: float, top_p: float):
    """The target's exact distributions of the first and second new token (vocabulary of 8)."""

    def dist_after(ids):
        cache = target.new_cache(len(ids) + 1)
        return target_dist(target.prefill(torch.tensor(ids), cache), temperature, top_p)

    p1 = dist_after(prompt)
    return p1, sum(p1[a] * dist_after([*prompt, a]) for a in range(8))


def assert_counts_follow(counts, marginals, n: int) -> None:
    """Sampled token counts per position put no mass outside each marginal's support and pass
    a chi-square test against it."""
    for pos, p in enumerate(marginals):
        keep = (p * n) > 0
        assert counts[pos][~keep].sum() == 0
        assert chisquare(counts[pos][keep].numpy(), (p[keep] * n).numpy()).pvalue > 1e-3


def test_engine_sampling_matches_target_distribution(tiny_dir):
    """End to end through the engine with tiny transformer models (8-token vocabulary): the first
    two generated tokens of `sd` follow the target's own sampling distribution (temperature and
    top-p applied), checked over 8 000 generations against the exact marginals (the rule itself
    is checked with more draws above; this is the wiring: seeds, temperature, top-p)."""
    from specextend.common.settings import Settings
    from specextend.models.loader import load_model
    from specextend.speculation.decoder import SpecEngine

    target = load_model(tiny_dir("qwen2", 0, vocab=8, layers=1), torch.float64)
    draft = load_model(tiny_dir("qwen2", 3, vocab=8, layers=1), torch.float64)
    eng = SpecEngine(target, draft, eos_ids=[])
    prompt = [1, 2, 3]
    temperature, top_p = 0.9, 0.95

    p1, p2 = two_token_marginals(target, prompt, temperature, top_p)
    s = Settings(method="sd", max_new_tokens=2, temperature=temperature, top_p=top_p, tree_budget=4,
                 tree_depth=3, tree_topk=2).resolved()
    state = eng.prefill(prompt, s)
    counts = torch.zeros(2, 8)
    n = 8_000
    for seed in range(n):
        out = eng.decode(state, replace(s, seed=seed)).token_ids
        counts[0, out[0]] += 1
        counts[1, out[1]] += 1
    assert_counts_follow(counts, (p1, p2), n)


def simulate_with_lookup(p_logits, q_logits, root: int, temperature: float, seed: int, n: int = N):
    """As `simulate`, with deterministic lookup branches (a function of the root, mostly wrong,
    often equal to a draft child: one merged node) fused into each tree."""
    from specextend.speculation.tree import LOOKUP, Pool, assemble

    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(POSITIONS, V)
    builder = DynamicTreeBuilder(budget=6, depth=3, topk=3)

    def run(tokens, depths, mask):
        return q_logits[tokens]

    for _ in range(n):
        out: list[int] = []
        r = root
        while len(out) < POSITIONS:
            pool = Pool()
            pool.add_continuation([(r + 1) % V, (r * 2) % V, 3], ngram=2)
            pool.add_continuation([(r + 4) % V], ngram=1)
            builder.grow(pool, draft_dist(q_logits[r], temperature), run, False, temperature, gen)
            tree = assemble(r, pool, builder.select(pool) + pool.of(LOOKUP))
            verdict = verify_sampling(tree, p_logits[tree.tokens], temperature, 1.0, gen)
            toks = tree.tokens.tolist()
            out += [toks[i] for i in verdict.path[1:]] + [verdict.bonus]
            r = out[-1]
        for pos in range(POSITIONS):
            counts[pos, out[pos]] += 1
    return counts


def test_lookup_candidates_keep_the_distribution():
    p_logits, q_logits = markov_pair(1)
    counts = simulate_with_lookup(p_logits, q_logits, 2, 1.0, seed=5)
    assert min_pvalue(counts, exact_marginals(p_logits, 2, 1.0, 1.0)) > 1e-3


def test_broken_point_mass_rule_is_detected(monkeypatch):
    """Keeping p after rejecting a lookup token (no residual) biases the output; noticed."""
    monkeypatch.setattr(verify, "without", lambda p, x: p)
    p_logits, q_logits = markov_pair(1)
    counts = simulate_with_lookup(p_logits, q_logits, 2, 1.0, seed=5, n=N_BROKEN)
    assert min_pvalue(counts, exact_marginals(p_logits, 2, 1.0, 1.0)) < 1e-6


@pytest.mark.parametrize("method", ["specextend", "lookup"])
def test_engine_sampling_with_wrong_lookup_candidates(tiny_dir, monkeypatch, method):
    """Through the engine (sized trees from a frozen synthetic cost model): lookup candidates
    drawn at random, mostly wrong, leave the first two tokens distributed as the target's own
    samples (3 000 generations: fewer than the test above, the engine step being slower)."""
    import random

    from specextend.common.settings import Settings
    from specextend.models.loader import load_model
    from specextend.runtime.costmodel import CostModel, ForwardCurve
    from specextend.speculation.decoder import SpecEngine
    from specextend.speculation.prompt_lookup import ContextIndex, Continuation

    target = load_model(tiny_dir("qwen2", 0, vocab=8, layers=1), torch.float64)
    draft = load_model(tiny_dir("qwen2", 3, vocab=8, layers=1), torch.float64)
    eng = SpecEngine(target, draft, eos_ids=[])
    rows = [1, 2, 4, 8, 16, 32]
    eng.costs = CostModel(ForwardCurve(rows, [0], [[0.010, 0.0102, 0.0105, 0.011, 0.015, 0.03]]),
                          ForwardCurve(rows, [0], [[0.001] * 6]), refresh=False)
    rng = random.Random(7)  # independent of the generator the verifier draws from
    monkeypatch.setattr(ContextIndex, "continuations", lambda self, m, b, n: [
        Continuation(tuple(rng.randrange(8) for _ in range(rng.randint(1, 3))), rng.randint(1, 3))
        for _ in range(2)])
    prompt = [1, 2, 3]
    temperature, top_p = 0.9, 0.95

    p1, p2 = two_token_marginals(target, prompt, temperature, top_p)
    # The draft starts at once (draft_gate off), so its proposals are verified beside lookup's.
    s = Settings(method=method, max_new_tokens=2, temperature=temperature, top_p=top_p, chunk_size=4,
                 top_k_chunks=2, draft_gate=False).resolved()
    state = eng.prefill(prompt, s)
    counts = torch.zeros(2, 8)
    n = 3_000
    lookup_nodes = drafted = 0.0
    for seed in range(n):
        r = eng.decode(state, replace(s, seed=seed))
        counts[0, r.token_ids[0]] += 1
        counts[1, r.token_ids[1]] += 1
        lookup_nodes += r.extra["lookup_nodes_per_step"]
        drafted += r.extra.get("draft_steps", 0.0)
    assert lookup_nodes > 0
    assert (drafted > 0) == (method == "specextend")
    assert_counts_follow(counts, (p1, p2), n)


# --------------------------------------------------------------------------- a node's sampled children


def ordered_pair_probs(q: torch.Tensor) -> torch.Tensor:
    """P(first child = i, second = j) of two draws without replacement from q: q_i q_j / (1 - q_i)."""
    pair = q[:, None] * q[None, :] / (1 - q[:, None])
    return pair.fill_diagonal_(0)


def child_pair_counts(q: torch.Tensor, n: int, pick=None) -> torch.Tensor:
    from specextend.speculation.tree import pick_children

    pick = pick or pick_children
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(len(q), len(q))
    for _ in range(n):
        first, second = pick(q, 2, False, gen)[0].tolist()
        counts[first, second] += 1
    return counts


@pytest.mark.parametrize("q", [[0.5, 0.25, 0.15, 0.1], [0.7, 0.0, 0.2, 0.1]], ids=["full", "with-a-zero"])
def test_sampled_children_are_two_draws_without_replacement_in_draw_order(q):
    """`pick_children`'s exponential race: the (first, second) child pairs follow the sequential
    draw's exact law over 20 000 trees, and a token of probability 0 is never drawn."""
    q = torch.tensor(q, dtype=torch.float64)
    exact = ordered_pair_probs(q).flatten()
    counts = child_pair_counts(q, 20_000).flatten()
    keep = exact > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep].numpy(), (exact[keep] * 20_000).numpy()).pvalue > 1e-3


def test_a_race_that_ignores_the_draw_order_is_detected():
    """The same check fails a race that keeps the right two tokens but sorts them by probability
    (a tree's sibling order is its draw order): the test can fail."""
    from specextend.speculation.tree import pick_children

    def sorted_pick(q, k, greedy, rng):
        idx, probs = pick_children(q, k, greedy, rng)
        return idx[torch.argsort(q[idx], descending=True)], probs

    q = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64)
    exact = ordered_pair_probs(q).flatten()
    counts = child_pair_counts(q, 5_000, sorted_pick).flatten()
    keep = exact > 0
    assert counts[~keep].sum() > 0 or chisquare(counts[keep].numpy(), (exact[keep] * 5_000).numpy()).pvalue < 1e-6
