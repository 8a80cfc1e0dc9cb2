"""Greedy speculative decoding equals target-only decoding, token for token (float64)."""

from __future__ import annotations

import pytest
import torch

from specextend.common.settings import Settings
from specextend.models.loader import load_model
from specextend.speculation.decoder import SpecEngine

from conftest import ARCHS, WatchedEngine

TREES = {
    "chain": dict(tree="chain", chain_length=4),
    "wide": dict(tree="dynamic", tree_budget=12, tree_depth=2, tree_topk=6),
    "deep": dict(tree="dynamic", tree_budget=10, tree_depth=8, tree_topk=2),
    "budget1": dict(tree="dynamic", tree_budget=1, tree_depth=3, tree_topk=3),
}


def models(tiny_dir, arch, draft_seed):
    target = load_model(tiny_dir(arch, 0), torch.float64)
    # A draft of the same family but other weights (mostly disagrees), or the target itself.
    draft = target if draft_seed is None else load_model(tiny_dir(arch, draft_seed, layers=1), torch.float64)
    return target, draft


def prompt(n=40, seed=0):
    return torch.randint(0, 63, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_cache_invariants(target):
    """After each step the target cache must equal a fresh forward over the committed tokens."""

    def hook(tcache, policy, out, todo):
        committed = PROMPT + out[:-1]
        fresh = target.new_cache(len(committed) + 4)
        target.prefill(torch.tensor(committed), fresh)
        n = tcache.length
        assert n == len(committed)
        assert torch.allclose(tcache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-10, rtol=0)
        assert torch.allclose(tcache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-10, rtol=0)
        # The draft's store holds the committed tokens except the ones still to be fed.
        assert policy.draft_store.length == len(committed) + 1 - len(todo)

    return hook


PROMPT = prompt()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("draft_seed", [None, 7])
def test_greedy_sd_equals_ar(tiny_dir, arch, tree, draft_seed):
    target, draft = models(tiny_dir, arch, draft_seed)
    eng = WatchedEngine(target, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=30))
    assert ar.new_tokens == 30 and ar.stop_reason == "length"
    eng.step_hook = check_cache_invariants(target)
    for attention in ("eager", "efficient"):
        sd = eng.generate(PROMPT, Settings(method="sd", attention=attention, max_new_tokens=30, **TREES[tree]))
        assert sd.token_ids == ar.token_ids
        assert sd.steps == len(sd.accept_lengths) <= 30
    if draft_seed is None:  # the draft is the target: every drafted token on the argmax path is kept
        assert sd.accepted_per_step >= 1.0


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_eos_and_length_inside_an_accepted_run(tiny_dir, arch):
    target, _ = models(tiny_dir, arch, None)
    eng = SpecEngine(target, target, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=40)).token_ids
    # EOS = a token first appearing mid-way; the draft (= target) accepts long runs through it.
    idx = max(ar.index(t) for t in set(ar))
    assert idx >= 2, ar
    eng.eos = {ar[idx]}
    for method in ("ar", "sd", "specextend"):
        r = eng.generate(PROMPT, Settings(method=method, max_new_tokens=40, tree="chain", chain_length=6,
                                          chunk_size=4, top_k_chunks=2, retrieve_every=2))
        assert r.token_ids == ar[: idx + 1] and r.stop_reason == "eos", method
    eng.eos = set()
    for n in (1, 2, 7, 13):
        r = eng.generate(PROMPT, Settings(method="sd", max_new_tokens=n, tree="chain", chain_length=6))
        assert r.token_ids == ar[:n] and r.new_tokens == n


def test_context_limit_is_a_clear_error(tiny_dir):
    from specextend.common.errors import UserError

    target, _ = models(tiny_dir, "qwen2", None)
    eng = SpecEngine(target, target, eos_ids=[])
    with pytest.raises(UserError, match="exceeds the model's context of 512"):
        eng.generate(prompt(500), Settings(method="sd", max_new_tokens=20))
