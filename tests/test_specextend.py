"""SpecExtend: greedy output equals `ar` under every draft-cache policy and ablation, and the CMR
working cache holds exactly the chunks it chose, at the documented positions."""

from __future__ import annotations

import pytest
import torch

from specextend.common.settings import Settings
from specextend.models.loader import load_model
from specextend.speculation.decoder import SpecEngine
from specextend.speculation.draft_policy import CMRPolicy, StreamingPolicy, make_policy

from conftest import ARCHS, WatchedEngine

SMALL = dict(chunk_size=4, top_k_chunks=3, retrieve_every=2, tree_budget=6, tree_depth=4, tree_topk=2)
ABLATIONS = {
    "sd": dict(method="sd"),
    "sd+efficient": dict(method="sd", attention="efficient"),
    "sd+streaming": dict(method="sd", draft_cache="streaming"),
    "sd+cmr": dict(method="sd", draft_cache="cmr"),
    # The draft starts at once (draft_gate off) so that retrieval runs whatever the cost model
    # says; the gated default, which may never start the draft here, is its own case.
    "specextend": dict(method="specextend", draft_gate=False),
    "specextend+gated": dict(method="specextend"),
    "specextend+full-prefill": dict(method="specextend", draft_gate=False, draft_prefill="full"),
    "specextend+original": dict(method="specextend", draft_gate=False, positions="original"),
    "specextend+adaptive": dict(method="specextend", draft_gate=False, adaptive_refresh=True),
    "specextend+overlap+path": dict(method="specextend", draft_gate=False, chunk_overlap=2, retrieval_query="path"),
    "specextend+layers": dict(method="specextend", draft_gate=False, retrieval_layer=0, retrieval_layers_mean=1),
    "specextend+mean2": dict(method="specextend", draft_gate=False, retrieval_layers_mean=2),
    "specextend+chain": dict(method="specextend", draft_gate=False, tree="chain", chain_length=3),
}

PROMPT = torch.randint(0, 63, (70,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(ABLATIONS))
def test_greedy_equals_ar(tiny_dir, arch, name):
    target = load_model(tiny_dir(arch, 0), torch.float64)
    draft = load_model(tiny_dir(arch, 5, layers=1), torch.float64)
    eng = WatchedEngine(target, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=40))
    seen = {"refresh": 0}

    def hook(tcache, policy, out, todo):
        if isinstance(policy, CMRPolicy | StreamingPolicy):
            seen["refresh"] = policy.rebuilds
            w = policy.working.length
            assert w <= policy.budget + 2 * policy.s.chunk_size + 16 + 8 * policy.s.chunk_overlap

    eng.step_hook = hook
    r = eng.generate(PROMPT, Settings(max_new_tokens=40, **SMALL, **ABLATIONS[name]))
    assert r.token_ids == ar.token_ids
    if "cmr" in name or (name.startswith("specextend") and name != "specextend+gated"):
        assert seen["refresh"] > 2  # eviction and refresh paths ran


def test_specextend_with_draft_equal_target_accepts_long_runs(tiny_dir):
    """Even with the draft reduced to retrieved chunks, a draft equal to the target agrees often."""
    target = load_model(tiny_dir("qwen2", 0), torch.float64)
    eng = SpecEngine(target, target, eos_ids=[])
    r = eng.generate(PROMPT, Settings(method="sd", max_new_tokens=30, **SMALL))
    assert r.accepted_per_step > 1.5


def store_with_prompt(draft, n):
    store = draft.new_cache(n + 64)
    draft.prefill(torch.randint(0, 63, (n,), generator=torch.Generator().manual_seed(1)), store)
    return store


@pytest.mark.parametrize("positions", ["compact", "original"])
def test_working_cache_holds_the_chosen_chunks(tiny_dir, positions):
    draft = load_model(tiny_dir("llama", 5, layers=1), torch.float64)
    n, c = 50, 4
    store = store_with_prompt(draft, n)
    s = Settings(chunk_size=c, top_k_chunks=4, positions=positions, sink_tokens=4).resolved()
    policy = make_policy("cmr", draft, store, "efficient", s)
    policy.start()
    scores = torch.full((n,), 1e-3)
    scores[20:24] = 0.5  # chunk 5 dominates
    scores[36:40] = 0.2  # then chunk 9
    policy.refresh(scores)
    # Chunk 0 (sink) and the newest complete chunk [44, 48) are always kept; the open chunk
    # [48, 50) follows; the two best-scored chunks fill the rest of the k = 4.
    assert policy.selected == [(0, 4), (20, 24), (36, 40), (44, 50)]
    slots = torch.tensor([*range(0, 4), *range(20, 24), *range(36, 40), *range(44, 50)])
    w = policy.working
    assert w.length == len(slots)
    # Values are position-free: copied exactly. Keys are re-rotated to the new positions.
    assert torch.equal(w.v[:, :, : w.length], store.v[:, :, slots])
    if positions == "original":
        assert torch.equal(w.k[:, :, : w.length], store.k[:, :, slots])
        assert policy.next_pos == n
    else:
        # A fresh forward of the same tokens at compact positions 0..len-1 gives the same keys.
        assert policy.next_pos == len(slots)
        ids = torch.randint(0, 63, (n,), generator=torch.Generator().manual_seed(1))
        ref = draft.new_cache(64)
        for i, slot in enumerate(slots.tolist()):  # keys depend only on the token and position
            draft(ids[slot : slot + 1], torch.tensor([i]), ref, None)
            assert torch.allclose(w.k[0, :, i], ref.k[0, :, 0], atol=1e-6), i
    # New tokens continue after the working cache, and land in the store as well.
    policy.extend([1, 2])
    assert w.length == len(slots) + 2 and store.length == n + 2


def test_planted_chunk_is_always_selected(tiny_dir):
    """Whatever else the scores say, a chunk holding most of the target's attention is chosen."""
    draft = load_model(tiny_dir("qwen2", 5, layers=1), torch.float64)
    n, c = 200, 8
    store = store_with_prompt(draft, n)
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        s = Settings(chunk_size=c, top_k_chunks=4).resolved()
        policy = make_policy("cmr", draft, store, "efficient", s)
        policy.start()
        scores = torch.rand(n, generator=gen) * 1e-2
        planted = int(torch.randint(1, n // c, (1,), generator=gen))
        scores[planted * c : (planted + 1) * c] += 0.3
        policy.refresh(scores / scores.sum())
        assert planted in policy.last_choice, trial
        assert any(a <= planted * c and (planted + 1) * c <= b for a, b in policy.selected)


def test_short_context_keeps_every_token_until_it_grows(tiny_dir):
    """Below cmr_min_ratio budgets of context the CMR working cache is the whole context (no
    retrieval); once a new chunk opens past it, selection starts, and output still equals ar."""
    target = load_model(tiny_dir("qwen2", 0), torch.float64)
    draft = load_model(tiny_dir("qwen2", 5, layers=1), torch.float64)
    eng = WatchedEngine(target, draft, eos_ids=[])
    prompt = PROMPT[:20]  # budget 4 x 3 = 12 tokens, threshold 2 x 12 = 24
    ar = eng.generate(prompt, Settings(method="ar", max_new_tokens=40))
    seen: list[tuple[int, int, bool]] = []

    def hook(tcache, policy, out, todo):
        seen.append((policy.draft_store.length, policy.rebuilds, policy.selected == [(0, policy.selected[-1][1])]))

    eng.step_hook = hook
    r = eng.generate(prompt, Settings(method="specextend", max_new_tokens=40, draft_gate=False, **SMALL))
    assert r.token_ids == ar.token_ids
    short = [s for s in seen if s[0] <= 24]
    assert short and all(rebuilds == 1 and whole for _, rebuilds, whole in short)  # only start()'s rebuild
    assert seen[-1][1] > 2 and not seen[-1][2]  # later: retrieval, and a cut context


@pytest.mark.parametrize(("ratio", "keeps_all"), [(2.0, True), (0.0, False)])
def test_cmr_min_ratio_decides_whether_chunks_are_selected(tiny_dir, ratio, keeps_all):
    draft = load_model(tiny_dir("llama", 5, layers=1), torch.float64)
    n, c = 50, 4
    store = store_with_prompt(draft, n)
    s = Settings(chunk_size=c, top_k_chunks=8, cmr_min_ratio=ratio).resolved()  # budget 32, 50 <= 64
    policy = make_policy("cmr", draft, store, "efficient", s)
    policy.start()
    assert policy.wants_scores() is not keeps_all
    scores = torch.full((n,), 1e-3)
    scores[20:24] = 0.5
    policy.refresh(scores)
    if keeps_all:
        assert policy.selected == [(0, n)] and policy.next_pos == n
        assert torch.equal(policy.working.k[:, :, :n], store.k[:, :, :n])
    else:
        assert policy.working.length < n
        assert any(a <= 20 and b >= 24 for a, b in policy.selected)  # the dominant chunk
