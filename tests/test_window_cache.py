"""Sliding-window layers keep only their window (runtime/kv_cache.py): a long prompt through a cache
whose windowed layers slide gives transformers' logits, the bits of a cache that keeps every token
on every kernel path and in the whole-step call, speculative output equal to `ar`, and prefix KV
that the prefix cache, its files and a batch's prompt sharing serve only where it holds the window."""

from __future__ import annotations

import pytest
import torch

from specextend.common.settings import Settings
from specextend.models.loader import load_model
from specextend.requests import kv_file
from specextend.requests.prefix_cache import PrefixCache
from specextend.runtime import kernels
from specextend.runtime.kv_cache import KVCache, row_bytes
from specextend.speculation.decoder import SpecEngine, kv_bytes, window_room
from test_families import SMALL, WINDOW, converter, hf_logits, ref_tol, reference
from test_step import run

ROOM = 16  # slots beyond the window: a 16-row forward fits, and the 40-token prompts slide
LONG = 1024  # the context of the models the engine runs over prompts past the window and a prefill chunk
quantized = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return converter(tmp_path_factory)


def long_prompt(n: int, seed: int = 11) -> list[int]:
    return torch.randint(0, 95, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_long_prompt_through_a_sliding_cache_is_transformers(converted):
    """Gemma 3's 5 windowed layers to 1 global over 6 windows of prompt in chunks of 7: transformers'
    logits at every position, while the windowed layers hold window + room slots, not the prompt."""
    folder, stored = converted("gemma3")
    ours = load_model(folder, torch.float64, weights="float64")
    ids = long_prompt(6 * WINDOW)
    cache = ours.new_cache(len(ids), room=ROOM)
    got = []
    for s in range(0, len(ids), 7):
        piece = ids[s : s + 7]
        got.append(ours(torch.tensor(piece), torch.arange(s, s + len(piece)), cache))
        cache.commit()
    assert torch.allclose(torch.cat(got), hf_logits(reference("gemma3", stored), ids), atol=ref_tol("gemma3"), rtol=0)
    assert cache.k.shape[0] == 1 and cache.wk is not None and tuple(cache.wk.shape[:1]) == (5,)
    assert cache.wk.shape[2] == WINDOW + ROOM and cache.woffset > 0
    full = ours.new_cache(len(ids))
    assert full.wk is not None and full.wk.shape[2] == len(ids) and cache.nbytes < full.nbytes / 2


@quantized
@pytest.mark.parametrize("kv", ["bf16", "q8"])
@pytest.mark.parametrize("path", kernels.cpu_paths())
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_sliding_cache_gives_the_bits_of_one_keeping_every_token(converted, monkeypatch, arch, path, kv):
    """Prefill chunks, one-row steps, a tree level kept in part and a 16-row forward, per-layer and
    in the whole-step call (Gemma 2's capped attention keeps the per-layer kernels): the same logits
    and kept queries, and the windowed layers' last tokens equal to the full cache's."""
    monkeypatch.setenv(kernels.CPU_ENV, path)
    folder, _ = converted(arch, "Q8_0")
    model = load_model(folder, torch.float32, weights="gguf")
    model.kv_cache = kv
    for step_rows in (0, 16):
        full, sliding = run(model, step_rows), run(model, step_rows, room=ROOM)
        assert len(full) == len(sliding)
        *full_out, fk, fv, fwk, fwv = full
        *out, k, v, wk, wv = sliding
        for i, (a, b) in enumerate(zip(full_out, out, strict=True)):
            assert torch.equal(a, b), (step_rows, i)
        assert torch.equal(fk, k) and torch.equal(fv, v)
        assert wk.shape[2] < fwk.shape[2] <= WINDOW + 3 * ROOM + 40
        assert torch.equal(fwk[:, :, -wk.shape[2]:], wk) and torch.equal(fwv[:, :, -wv.shape[2]:], wv)


@quantized
@pytest.mark.parametrize("method", ["sd", "specextend"])
def test_speculation_over_a_document_longer_than_window_and_room_equals_ar(converted, method):
    """A 700-token prompt slides the target's windowed layers (window + a prefill chunk's room), the
    draft's store keeps every token (retrieval copies its slots), and the output is `ar`'s."""
    target = load_model(converted("gemma3", "Q8_0", context=LONG)[0], torch.float32, weights="gguf")
    draft = load_model(converted("gemma3", "Q8_0", seed=5, layers=1, context=LONG)[0], torch.float32, weights="gguf")
    eng = SpecEngine(target, draft, eos_ids=[])
    prompt = long_prompt(700, seed=3)
    settings = Settings(method=method, max_new_tokens=24, **SMALL, **({"draft_gate": False}
                                                                      if method == "specextend" else {}))
    ar = eng.generate(prompt, Settings(method="ar", max_new_tokens=24)).token_ids
    state = eng.prefill(prompt, settings.resolved())
    cache = state.target_cache
    assert cache.wk is not None and cache.wk.shape[2] == WINDOW + window_room(target.cfg, 24)
    assert cache.woffset > 0 and cache.k.shape[2] >= 700
    assert eng.decode(state, settings.resolved()).token_ids == ar
    assert state.draft_store is not None and state.draft_store.woffset == 0
    assert eng.decode(state, Settings(method="ar", max_new_tokens=24).resolved()).token_ids == ar  # restored


@quantized
def test_the_prefix_cache_and_its_files_serve_a_sliding_snapshot_where_it_holds_the_window(converted, tmp_path):
    model = load_model(converted("gemma3", "Q8_0", context=LONG)[0], torch.float32, weights="gguf")
    eng = SpecEngine(model, None, eos_ids=[])
    s = Settings(method="ar", max_new_tokens=8).resolved()
    prompt = long_prompt(700, seed=4)
    state = eng.prefill(prompt, s)
    snap = state.snapshot()
    target = snap.target_kv
    assert target.wk is not None and target.wfirst > 0 and snap.first_head == target.wfirst + WINDOW - 1
    assert snap.can_head(len(prompt)) and snap.can_head(snap.first_head) and not snap.can_head(snap.first_head - 1)
    with pytest.raises(IndexError, match="windowed layers"):
        snap.head(snap.first_head - 1)
    path = tmp_path / "p.kv"
    kv_file.write(path, prompt, snap, "fp", "bf16", None)
    header, back = kv_file.read(path)
    assert header.first_head == snap.first_head and back.first_head == snap.first_head
    assert back.target_kv.wk is not None and torch.equal(back.target_kv.wk, target.wk)
    cache = PrefixCache(1 << 30, "fp", tmp_path / "dir")
    cache.insert(prompt, snap, "bf16", None)
    again = PrefixCache(1 << 30, "fp", tmp_path / "dir")  # the file, indexed from its header
    for pc in (cache, again):
        longer = [*prompt, 1, 2, 3]
        hit = pc.lookup(longer, "bf16", None)
        assert hit is not None and hit.length == len(prompt)
        alone = eng.generate(longer, s).token_ids
        assert eng.decode(eng.prefill(longer, s, prefix=hit), s).token_ids == alone
        short = prompt[: snap.first_head - 1] + [95] * 20  # shares less than the window it holds
        assert pc.lookup(short, "bf16", None) is None
    assert cache.lookup(prompt[: snap.first_head] + [95] * 20, "bf16", None) is not None


@quantized
def test_a_sequence_takes_a_sliding_holders_prompt_kv_only_where_it_holds_the_window(converted):
    """Batch prompt sharing (`KVCache.take`): a cache given another's slots [length, reach) answers
    as one that prefilled them; a holder that slid past what the taker still needs gives nothing."""
    model = load_model(converted("gemma3", "Q8_0")[0], torch.float32, weights="gguf")
    prompt = long_prompt(120, seed=6)

    def filled(n: int) -> KVCache:
        c = model.new_cache(200, room=ROOM)
        model.prefill(torch.tensor(prompt[:n]), c, chunk=16)
        return c

    holder, alone = filled(119), filled(119)
    assert holder.woffset == 96  # slid at every chunk from 32 tokens on: it keeps [96, 119)
    for start in (10, 100):
        taker = filled(start)
        assert taker.can_take(holder, 119)  # 119 - window = 103: the taker needs nothing older
        taker.take(holder, 119)
        pos = torch.tensor([119])
        a = model(torch.tensor(prompt[119:]), pos, alone)
        b = model(torch.tensor(prompt[119:]), pos, taker)
        alone.discard()
        assert torch.equal(a, b)
    assert not filled(2).can_take(holder, 30)  # a row after 30 sees 15 on; the holder keeps 96 on


def test_a_sliding_cache_is_not_rewound_past_its_window():
    c = KVCache(2, 1, 32, 64, torch.float32, windowed=(True, False), window=8, room=4)
    for _ in range(5):
        c.begin(4)
        c.commit()
    assert c.length == 20 and c.woffset > 0 and c.wk is not None and c.wk.shape[2] == 12
    c.truncate(c.woffset + 7)  # what the next row can see is still there
    with pytest.raises(IndexError, match="windowed layers"):
        c.truncate(c.woffset + 6)
    c.reset()
    assert c.woffset == 0 and c.length == 0


def test_the_kv_budget_counts_the_window_not_the_prompt(converted):
    target = load_model(converted("gemma3")[0], torch.float32, weights="float32")
    s = Settings(method="ar", max_new_tokens=64).resolved()
    per_token = 2 * target.cfg.num_kv_heads * row_bytes(target.cfg.head_dim, target.kv_dtype)  # a layer's K and V
    room = window_room(target.cfg, 64)
    assert kv_bytes(target, None, 32_000, s) == per_token * (
        (32_000 + 64 + 256 + 32_000) + 5 * 2 * (WINDOW + room))
    every_layer = per_token * 6 * (32_000 + 64 + 256 + 32_000)
    assert kv_bytes(target, None, 32_000, s) < every_layer / 5  # one global layer of six, and the windows


@quantized
@pytest.mark.parametrize("method", ["ar", "specextend"])
def test_a_batch_of_long_prompts_answers_each_as_alone(converted, monkeypatch, method):
    """Four prompts sharing a 600-token start (copied between sliding caches, `prompt_share`) and one
    of their own, in one continuous batch of 256 rows a step, through the whole-step call: each
    gets the tokens it gets alone, and the shared start is computed once."""
    from specextend.batching.batch import Batch, Sequence
    from test_sizing import synthetic_costs

    target = load_model(converted("gemma3", "Q8_0", context=LONG)[0], torch.float32, weights="gguf")
    draft = load_model(converted("gemma3", "Q8_0", seed=5, layers=1, context=LONG)[0], torch.float32, weights="gguf")
    system = long_prompt(600, seed=21)
    prompts = [system + long_prompt(n, seed=30 + i) for i, n in enumerate((9, 40, 17, 3))] + [long_prompt(640, 40)]
    s = Settings(method=method, max_new_tokens=12, **SMALL, **({"draft_gate": False}
                                                                 if method == "specextend" else {})).resolved()
    eng = SpecEngine(target, draft, eos_ids=[])
    eng.costs = synthetic_costs()
    alone = [eng.generate(p, s).token_ids for p in prompts]
    taken = []  # the holders' oldest windowed token when others took their slots
    take = KVCache.take
    monkeypatch.setattr(KVCache, "take", lambda c, other, reach: taken.append(other.woffset) or take(c, other, reach))
    batch = Batch(target, draft)
    engine = batch.engine([], synthetic_costs())
    results: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        batch.add(Sequence(lambda i=i, p=p: results.__setitem__(i, engine.generate(p, s).token_ids)))
    computed = 0
    while batch.sequences:
        computed += batch.step(256).prefill_rows
        for q in batch.reap():
            assert q.error is None, q.error
    assert [results[i] for i in range(len(prompts))] == alone
    assert computed == sum(len(p) for p in prompts) - 3 * len(system)
    assert any(taken) and not all(taken)  # taken from holders that had slid, and before
