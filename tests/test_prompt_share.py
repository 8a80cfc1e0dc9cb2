"""Prompt KV shared inside a batch (batching/prompt_share.py): sequences whose prompts start alike compute
the shared start once, and each still gets the bits it gets alone (its KV slots, its tokens)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specextend.api import Pair, load
from specextend.batching.batch import Batch, Sequence
from specextend.batching.prompt_share import MIN_WAIT, common_prefix
from specextend.common.settings import Settings
from specextend.runtime import kernels

from tiny_tokenizer import quantized_pair, save_tiny_model

pytestmark = [pytest.mark.usefixtures("isolated_home"),
              pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
SMALL = dict(chunk_size=4, top_k_chunks=2, cmr_min_ratio=0.0, tree_budget=6, tree_depth=3)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return quantized_pair(tmp_path_factory.mktemp("share"), **SHAPE)


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def settings(**kw) -> Settings:
    return Settings(**{"max_new_tokens": 12, **SMALL, **kw}).resolved()


def run_batch(pair, prompts, s, budget, decode=True):
    """Every prompt through one batch (`budget` rows a step): each one's result, the prompt tokens
    the target's forwards computed, and each prompt's target KV after its prefill."""
    batch = Batch(pair.target, pair.draft)
    engine = batch.engine(pair.eos_ids, pair.step_costs())
    results, kv = {}, {}
    for i, p in enumerate(prompts):
        def run(i=i, p=p):
            gen = pair.generation(p, settings=s)
            out = gen.run(engine)
            results[i] = out.token_ids
        def prefill(i=i, p=p):
            state = engine.prefill(p, s)
            n = len(p)
            kv[i] = (state.target_cache.k[:, :, :n].clone(), state.target_cache.v[:, :, :n].clone())
        batch.add(Sequence(run if decode else prefill))
    computed = 0
    while batch.sequences:
        computed += batch.step(budget).prefill_rows
        for q in batch.reap():
            assert q.error is None, q.error
    return results, computed, kv


SYSTEM = ids(100, 40)  # a start every prompt shares, as a chat template's system turn
PROMPTS = [SYSTEM + ids(i, n) for i, n in enumerate((9, 17, 5, 30))]


@pytest.mark.parametrize("method", ["ar", "specextend"])
@pytest.mark.parametrize("budget", [256, 24])
def test_alike_prompts_compute_their_shared_start_once_and_answer_as_alone(pair, method, budget):
    s = settings(method=method, draft_gate=False)
    alone = [pair.generate(p, settings=s).token_ids for p in PROMPTS]
    results, computed, _ = run_batch(pair, PROMPTS, s, budget)
    assert [results[i] for i in range(len(PROMPTS))] == alone
    own = sum(len(p) - len(SYSTEM) for p in PROMPTS)
    assert computed == len(SYSTEM) + own  # the shared start once, then each prompt's own tokens


def test_copied_slots_are_the_bits_a_prompt_computes_alone(pair):
    s = settings(method="ar")
    prompts = [*PROMPTS, list(PROMPTS[1])]  # a duplicate: all but its last token copied
    _, computed, kv = run_batch(pair, prompts, s, 64, decode=False)
    assert computed == len(SYSTEM) + sum(len(p) - len(SYSTEM) for p in PROMPTS) + 1
    for i, p in enumerate(prompts):
        cache = pair.target.new_cache(len(p) + 1)
        pair.target.prefill(torch.tensor(p), cache)
        assert torch.equal(kv[i][0], cache.k[:, :, :len(p)]) and torch.equal(kv[i][1], cache.v[:, :, :len(p)]), i


def test_a_short_shared_start_is_not_worth_a_wait(pair):
    """Prompts sharing fewer than MIN_WAIT tokens all run in the first step (nobody sits it out)."""
    start = ids(7, MIN_WAIT - 1)
    prompts = [start + ids(20 + i, 30) for i in range(3)]
    batch = Batch(pair.target, pair.draft)
    engine = batch.engine(pair.eos_ids, pair.step_costs())
    s = settings(method="ar", max_new_tokens=2)
    for p in prompts:
        batch.add(Sequence(lambda p=p: pair.generation(p, settings=s).run(engine)))
    first = batch.step(512)
    assert first.prefill_rows == sum(len(p) for p in prompts)


def test_a_float_model_does_not_share(tmp_path):
    """Off the row-independent runtime a prompt's KV may depend on its chunks: nothing is copied."""
    target = save_tiny_model(tmp_path / "target", seed=0, **SHAPE)
    draft = save_tiny_model(tmp_path / "draft", seed=1, layers=1, **SHAPE)
    p = load(target, draft, dtype="float64", progress=False)
    p = Pair(replace(p.spec, eos_ids=()), p.target, p.draft)
    assert not p.target.batches_rows
    s = settings(method="ar", max_new_tokens=3)
    alone = [p.generate(q, settings=s).token_ids for q in PROMPTS[:2]]
    results, computed, _ = run_batch(p, PROMPTS[:2], s, 256)
    assert computed == sum(len(q) for q in PROMPTS[:2])
    assert [results[0], results[1]] == alone


def test_common_prefix():
    import numpy as np
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, a[:3]) == 3
    assert common_prefix(a, np.array([5])) == 0


def test_a_finished_request_leaves_nothing_for_later_ones(pair):
    """Sharing is between requests in flight: once a request has ended and nobody prefilling wants its
    slots, its cache is gone (its memory is back in the KV budget; the prefix cache is the one that
    remembers), so the same prompt later computes all of it."""
    batch = Batch(pair.target, pair.draft)
    engine = batch.engine(pair.eos_ids, pair.step_costs())
    s = settings(method="ar", max_new_tokens=3)
    computed = []
    for _ in range(2):
        batch.add(Sequence(lambda: pair.generation(PROMPTS[0], settings=s).run(engine)))
        n = 0
        while batch.sequences:
            n += batch.step(256).prefill_rows
            batch.reap()
        computed.append(n)
    assert computed == [len(PROMPTS[0])] * 2
    assert batch.ended == []
