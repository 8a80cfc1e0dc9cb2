"""The trimmed draft vocabulary (speculation/draft_vocab.py): a kept token's draft logit is the full head's bits
(the rows are regathered byte for byte), the others are -inf, and whatever the subset the output
is unchanged: greedy equals `ar` and sampling keeps the target's distribution, also when the
subset excludes exactly the tokens the target emits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from specextend.common.settings import Settings
from specextend.models.loader import load_model
from specextend.runtime import kernels, quant
from specextend.speculation import draft_vocab
from specextend.speculation.decoder import SpecEngine
from test_quant import random_blocks
from test_sampling import assert_counts_follow, two_token_marginals

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")

SEGMENTS = {
    "q4k": lambda: quant.quantize(torch.randn(100, 224, generator=torch.Generator().manual_seed(1)), 4),
    "q8": lambda: quant.quantize(torch.randn(100, 96, generator=torch.Generator().manual_seed(2)), 8),
    "q6k": lambda: quant.QWeight(256, [quant.from_gguf_blocks("Q6_K", random_blocks("Q6_K", 100, 256, seed=3),
                                                               100, 256)]),
    "q4_K": lambda: quant.QWeight(512, [quant.from_gguf_blocks("Q4_K", random_blocks("Q4_K", 100, 512, seed=4),
                                                                100, 512)]),
    **{kind: (lambda kind=kind, k=k: quant.QWeight(k, [quant.from_gguf_blocks(kind, random_blocks(kind, 100, k, seed=5),
                                                                           100, k)]))
       for kind, k in (("Q5_K", 512), ("IQ4_XS", 256), ("Q5_1", 64), ("IQ4_NL", 96), ("Q4_0", 96),
                       ("Q5_0", 64), ("Q3_K", 512), ("Q2_K", 512),
                       ("F16", 160), ("BF16", 96), ("MXFP4", 64), ("IQ3_S", 256),
                       ("IQ3_XXS", 256), ("IQ2_XXS", 256), ("IQ1_S", 512), ("IQ2_XS", 256), ("IQ2_S", 512),
                       ("IQ1_M", 256))},
}


@needs_kernels
@pytest.mark.parametrize("kind", list(SEGMENTS))
def test_gathered_rows_are_the_same_bytes(kind):
    w = SEGMENTS[kind]()
    ids = np.array([99, 0, 5, 17, 16, 33, 34, 35, 80, 81, 2, 3, 64, 65, 66, 98, 7, 7, 50, 51, 52, 53, 54, 55, 56, 57,
                    58, 59, 60, 61, 62, 63])
    sub = draft_vocab.gather_rows(w.segments[0], ids)
    assert torch.equal(sub.dequantize(), w.segments[0].dequantize(torch.from_numpy(ids)))
    x = torch.randn(3, w.k)
    full = quant.qlinear(x, w)
    assert torch.equal(quant.qlinear(x, quant.QWeight(w.k, [sub])), full[:, ids])


PROMPT = [5, 9, 14, 3, 3, 9, 5, 21, 40, 2, 9, 14]
SMALL = dict(tree_budget=6, tree_depth=4, tree_topk=2, chunk_size=4, top_k_chunks=3, retrieve_every=2,
             cmr_min_ratio=0.0)


def trimmed_engine(tiny_dir, excluded: set[int], dtype=torch.float64, weights: str | None = None, vocab: int = 96):
    kw = {} if weights is None else {"weights": weights}
    target = load_model(tiny_dir("qwen2", 0, vocab=vocab, layers=2), dtype, **kw)
    draft = load_model(tiny_dir("qwen2", 3, vocab=vocab, layers=1), dtype, **kw)
    draft.output_head = draft_vocab.VocabTrim(draft, [i for i in range(vocab) if i not in excluded])
    return SpecEngine(target, draft, eos_ids=[]), target, draft


@pytest.mark.parametrize("method", [dict(method="sd"), dict(method="specextend", draft_gate=False)])
def test_greedy_output_is_unchanged_without_the_targets_tokens(tiny_dir, method):
    eng, _, _ = trimmed_engine(tiny_dir, set())
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=30)).token_ids
    excluded = set(ar) - set(PROMPT)  # the prompt's tokens come back with the prompt (cover)
    assert len(excluded) >= 5
    eng, _, draft = trimmed_engine(tiny_dir, excluded)
    r = eng.generate(PROMPT, Settings(max_new_tokens=30, **SMALL, **method))
    assert r.token_ids == ar
    kept = set(draft.output_head.ids.tolist())
    assert len(kept) < 96 and not kept & excluded
    logits = draft(torch.tensor([5]), torch.tensor([0]), draft.new_cache(4))
    assert torch.isinf(logits[0, sorted(excluded)]).all() and torch.isfinite(logits[0, PROMPT]).all()


@needs_kernels
def test_kept_draft_logits_are_the_full_heads_bits(tiny_dir):
    _, _, draft = trimmed_engine(tiny_dir, set(range(40, 70)), dtype=torch.float32, weights="int4")
    ids = torch.tensor(PROMPT)
    trimmed = draft(ids, torch.arange(len(ids)), draft.new_cache(len(ids)))
    keep = draft.output_head.ids
    draft.output_head = None
    full = draft(ids, torch.arange(len(ids)), draft.new_cache(len(ids)))
    assert torch.equal(trimmed[:, keep], full[:, keep])
    assert torch.isinf(trimmed[:, 40:70]).all()


def test_sampling_keeps_the_targets_distribution_without_its_likeliest_tokens(tiny_dir):
    """test_sampling's end-to-end check with the draft unable to propose the target's two
    likeliest first tokens: the target still emits them as often as it should."""
    target = load_model(tiny_dir("qwen2", 0, vocab=8, layers=1), torch.float64)
    prompt, temperature, top_p = [1, 2, 3], 0.9, 1.0
    p1, p2 = two_token_marginals(target, prompt, temperature, top_p)
    likely = [int(i) for i in torch.argsort(p1, descending=True) if int(i) not in prompt][:2]
    draft = load_model(tiny_dir("qwen2", 3, vocab=8, layers=1), torch.float64)
    draft.output_head = draft_vocab.VocabTrim(draft, [i for i in range(8) if i not in likely])
    eng = SpecEngine(target, draft, eos_ids=[])
    s = Settings(method="sd", max_new_tokens=2, temperature=temperature, top_p=top_p, tree_budget=4,
                 tree_depth=3, tree_topk=2).resolved()
    state = eng.prefill(prompt, s)
    counts = torch.zeros(2, 8)
    n = 800
    for seed in range(n):
        out = eng.decode(state, replace(s, seed=seed)).token_ids
        counts[0, out[0]] += 1
        counts[1, out[1]] += 1
    assert counts[0, likely].sum() > 0.2 * n * float(p1[likely].sum())
    assert_counts_follow(counts, (p1, p2), n)


def test_enable_keeps_the_frequent_tokens_and_skips_small_vocabularies(tiny_dir):
    draft = load_model(tiny_dir("qwen2", 3, vocab=96, layers=1), torch.float64)
    draft_vocab.enable(draft, [95], size=64)
    assert draft.output_head is None  # 96 < 2 x 64: nothing worth trimming
    draft_vocab.enable(draft, [95], size=16)
    assert draft.output_head.ids.tolist() == [*range(16), 95, *[95] * 15]
    draft.output_head.cover([3, 40, 41, 40])
    assert set(draft.output_head.ids.tolist()) == {*range(16), 95, 40, 41}
