"""The draft's prompt KV computed where its policy reads it, and started only when it pays.

- A chunk chosen after the start gets its draft KV computed once, at its original positions
  (the same K/V as a draft pass over the sinks and that chunk), and never again.
- A request whose `max_new_tokens` is too short for the draft to repay its start never runs the
  draft at all (zero draft forwards, zero draft prefill); a long one starts it; both equal `ar`.
- The prefix cache keeps the draft's computed slots: a second prompt over the same document
  computes none of them again, and is charged nothing for them.
"""

from __future__ import annotations

import torch

from specextend.common.settings import Settings
from specextend.models.loader import load_model
from specextend.speculation.decoder import SpecEngine
from specextend.speculation.draft_policy import make_policy
from specextend.speculation.draft_prefill import DraftPrompt
from specextend.speculation.sizing import tokens_left_to_repay
from test_sizing import Flipped, synthetic_costs

from conftest import generate


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 63, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_chunk_chosen_later_is_computed_once_at_its_positions(tiny_dir):
    draft = load_model(tiny_dir("llama", 5, layers=1), torch.float64)
    n, c = 64, 4
    ids = _ids(n)
    store = draft.new_cache(n + 16)
    prompt = DraftPrompt(draft, store, ids, "efficient", sink_tokens=4)
    s = Settings(chunk_size=c, top_k_chunks=4).resolved()  # budget 16: 64 tokens are selected from
    policy = make_policy("cmr", draft, store, "efficient", s, prompt)
    first = torch.full((n,), 1e-3)
    first[20:24] = 0.5
    first[8:12] = 0.3
    policy.start(lambda: first)
    # The start computes the chunks it chose (the sinks' chunk 0, the newest and the best
    # scored, k = 4 in all): nothing else.
    start = torch.zeros(n, dtype=torch.bool)
    for a, b in policy.selected:
        start[a:b] = True
    assert start[0:4].all() and start[8:12].all() and start[20:24].all() and start[60:64].all()
    assert torch.equal(prompt.computed, start) and len(prompt.passes) == 1
    assert prompt.charged_tokens == 16 and prompt.seconds > 0
    assert not bool(start[40:44].any())

    later = torch.full((n,), 1e-3)
    later[40:44] = 0.5
    later[8:12] = 0.3
    policy.refresh(later)
    assert len(prompt.passes) == 2 and prompt.passes[1].tolist() == [40, 41, 42, 43]
    # Its KV is a draft pass over the sinks and the chunk, at their original positions.
    ref = draft.new_cache(8)
    draft(torch.tensor(ids[0:4]), torch.arange(0, 4), ref, None)
    ref.commit()
    draft(torch.tensor(ids[40:44]), torch.arange(40, 44), ref, None)
    ref.commit()
    assert torch.allclose(store.k[:, :, 40:44], ref.k[:, :, 4:8], rtol=0, atol=1e-12)
    assert torch.allclose(store.v[:, :, 40:44], ref.v[:, :, 4:8], rtol=0, atol=1e-12)
    # Chosen again (and the first choice again): computed already, so no further pass.
    policy.refresh(later)
    policy.refresh(first)
    assert len(prompt.passes) == 2
    assert all(int((torch.cat(prompt.passes) == p).sum()) <= 1 for p in range(n))


def test_the_draft_starts_once_the_answer_has_run_long_enough_to_repay_it(tiny_dir):
    """The default horizon ("produced") counts on an answer as long again as it has run: where
    counting to the budget starts the draft at the first decision, it starts later, once the
    answer has run; a three-token answer starts it under neither. The output is `ar`'s either way."""
    eng, _ = _gated_engine(tiny_dir)
    eng.costs = synthetic_costs(draft_ms=1.0)  # a cheap draft: it repays a start within the answer
    prompt = _ids(300, seed=4)
    s = dict(method="specextend", chunk_size=4, top_k_chunks=8)
    ar = generate(eng, prompt, Settings(method="ar", max_new_tokens=60))
    started = {}
    for horizon in ("budget", "produced"):
        for max_new in (3, 60):
            r = generate(eng, prompt, Settings(max_new_tokens=max_new, draft_horizon=horizon, **s))
            assert r.token_ids == ar.token_ids[:max_new]
            started[horizon, max_new] = r.extra["draft_started_at"]
    assert started["produced", 3] == -1
    assert started["budget", 60] == 1 < started["produced", 60], started


def test_the_tokens_a_start_counts_on():
    assert [tokens_left_to_repay(p, 256 - p, "produced") for p in (0, 1, 50, 128, 200, 255)] == [0, 1, 50, 128, 56, 1]
    assert [tokens_left_to_repay(p, 256 - p, "budget") for p in (0, 1, 50, 255)] == [256, 255, 206, 1]


def _gated_engine(tiny_dir):
    target = load_model(tiny_dir("qwen2", 0), torch.float64)
    draft = Flipped(load_model(tiny_dir("qwen2", 0), torch.float64))  # the target itself: it always agrees
    draft.sign = 1.0
    eng = SpecEngine(target, draft, eos_ids=[])
    eng.costs = synthetic_costs()
    return eng, draft


def test_a_short_answer_never_starts_the_draft_and_a_long_one_does(tiny_dir):
    eng, draft = _gated_engine(tiny_dir)
    prompt = _ids(300, seed=4)
    s = dict(method="specextend", chunk_size=4, top_k_chunks=8)
    for max_new in (2, 3):
        ar = generate(eng, prompt, Settings(method="ar", max_new_tokens=max_new))
        draft.calls = 0
        r = generate(eng, prompt, Settings(max_new_tokens=max_new, **s))
        assert r.token_ids == ar.token_ids
        assert draft.calls == 0, max_new  # no draft prefill, no draft forward
        assert r.extra["draft_started_at"] == -1 and r.extra["draft_prefill_s"] == 0.0
        # How much cheaper the draft would have had to be is reported with the refusal.
        assert 0.0 <= r.extra.get("draft_break_even", 0.0) < 1.0 and r.extra.get("draft_cost_ratio", 1.0) > 0.0
        assert r.prefill_s == r.total_s - r.decode_s
    ar = generate(eng, prompt, Settings(method="ar", max_new_tokens=120))
    draft.calls = 0
    r = generate(eng, prompt, Settings(max_new_tokens=120, draft_horizon="budget", **s))
    assert r.token_ids == ar.token_ids
    assert draft.calls > 0 and r.extra["draft_started_at"] >= 0 and r.extra["draft_prefill_s"] > 0.0
    # The draft computed the chunks it reads, not the whole prompt.
    assert 0 < r.extra["draft_prompt_tokens"] < len(prompt)
    # Without the gate the draft starts at once, whatever the length.
    draft.calls = 0
    r = generate(eng, prompt, Settings(max_new_tokens=2, draft_gate=False, **s))
    assert draft.calls > 0 and r.extra["draft_started_at"] == 1


def test_the_prefix_cache_keeps_the_drafts_computed_slots(tiny_dir):
    target = load_model(tiny_dir("llama", 0), torch.float64)
    draft = load_model(tiny_dir("llama", 5, layers=1), torch.float64)
    eng = SpecEngine(target, draft, eos_ids=[])
    doc = _ids(200, seed=7)
    s = Settings(method="specextend", draft_gate=False, chunk_size=4, top_k_chunks=6, max_new_tokens=20).resolved()
    first = eng.prefill([*doc, 5, 6, 7], s)
    eng.decode(first, s)
    snap = first.snapshot()
    assert snap.draft_kv is not None and snap.draft_computed is not None
    kept = snap.draft_computed[:200].clone()
    assert 0 < int(kept.sum()) < 200  # the chunks the first question read

    question = [9, 10, 11, 12]
    second = eng.prefill(doc + question, s, prefix=snap.head(200))
    assert second.draft_prompt is not None and torch.equal(second.draft_prompt.computed[:200], kept)
    r = eng.decode(second, s)
    assert r.token_ids == generate(eng, doc + question, Settings(method="ar", max_new_tokens=20)).token_ids
    recomputed = torch.cat(second.draft_prompt.passes) if second.draft_prompt.passes else torch.zeros(0)
    assert not bool(kept[recomputed[recomputed < 200].long()].any())  # none of the kept slots again
    assert second.draft_prompt.cost[:200][kept].sum() == 0.0  # and no cost for them
