"""The batch step: rows of several sequences in one forward are each sequence's own bits.

On the quantized runtime every kernel is row-independent, so a sequence's logits and KV must not
depend on which other sequences share its forward, nor on how its prompt was cut into prefill
chunks. Checked on every kernel path this CPU runs, with tiny quantized models.
"""

from __future__ import annotations

import pytest
import torch

from specextend.models.loader import load_model
from specextend.runtime import fused_step, kernels
from specextend.runtime.layers import Rows
from specextend.speculation import draft_vocab

from conftest import make_tiny_hf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab=96)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"batch-{request.param}")
    make_tiny_hf(request.param, 0, dtype=torch.float32, layers=2, **SHAPE).save_pretrained(d)
    m = load_model(d, torch.float32, weights="int4")
    assert m.batches_rows
    return m


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 95, (n,), generator=torch.Generator().manual_seed(seed))


def _tree_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if i:
            m[i] = m[parents[i]]
        m[i, i] = True
    return m


def _sequences(model):
    """Three sequences with different histories, each with its next forward: a prefill chunk in the
    middle of a prompt, one decode row, a verification tree (mask, depths as positions, kept queries)."""
    seqs = []
    for n, seed in ((40, 1), (75, 2), (9, 3)):
        cache = model.new_cache(200)
        model.prefill(_ids(n, seed), cache)
        seqs.append(cache)
    parents = [-1, 0, 0, 1, 2, 3]
    depths = torch.tensor([0, 1, 1, 2, 2, 3])
    p0, p1, p2 = (c.length for c in seqs)
    return seqs, [
        dict(tokens=_ids(33, 4), positions=torch.arange(p0, p0 + 33), logits_rows=slice(-1, None)),
        dict(tokens=_ids(1, 5), positions=torch.tensor([p1])),
        dict(tokens=_ids(6, 6), positions=p2 + depths, tree_mask=_tree_mask(parents), keep_q={0: None, 1: None}),
    ]


@pytest.mark.parametrize("path", kernels.cpu_paths())
def test_rows_of_several_sequences_are_each_sequence_alone(model, monkeypatch, path):
    monkeypatch.setenv(kernels.CPU_ENV, path)
    caches, calls = _sequences(model)
    alone_caches, alone_calls = _sequences(model)
    batched = model.forward_many([Rows(cache=c, **call) for c, call in zip(caches, calls, strict=True)])
    for i, (cache, call) in enumerate(zip(alone_caches, alone_calls, strict=True)):
        logits = model(cache=cache, **call)
        assert torch.equal(logits, batched[i]), i
        end = cache.length + cache.pending
        assert caches[i].pending == cache.pending
        assert torch.equal(caches[i].k[:, :, :end], cache.k[:, :, :end]), i
        assert torch.equal(caches[i].v[:, :, :end], cache.v[:, :, :end]), i
        if call.get("keep_q"):
            assert all(torch.equal(calls[i]["keep_q"][k], call["keep_q"][k]) for k in call["keep_q"])


@pytest.mark.parametrize("path", kernels.cpu_paths())
def test_prefill_chunks_do_not_change_the_bits(model, monkeypatch, path):
    """A prompt prefilled in chunks of any size leaves the same KV and last logits (chunked prefill
    in the server, and the prefix cache, rely on it)."""
    monkeypatch.setenv(kernels.CPU_ENV, path)
    ids = _ids(150, 7)
    ref_cache = model.new_cache(160)
    ref = model.prefill(ids, ref_cache)
    for chunk in (1, 13, 64, 149):
        cache = model.new_cache(160)
        logits = model.prefill(ids, cache, chunk=chunk)
        assert torch.equal(logits, ref), chunk
        assert torch.equal(cache.k[:, :, :150], ref_cache.k[:, :, :150]), chunk
        assert torch.equal(cache.v[:, :, :150], ref_cache.v[:, :, :150]), chunk


def test_float_models_run_the_parts_one_by_one(tmp_path):
    """Float weights are not batched (their GEMMs may differ by row count): each part alone."""
    make_tiny_hf("qwen2", 0, layers=1).save_pretrained(tmp_path)
    m = load_model(tmp_path, torch.float64, weights="float64")
    assert not m.batches_rows
    a, b = m.new_cache(20), m.new_cache(20)
    out = m.forward_many([Rows(_ids(5, 1) % 60, torch.arange(5), a), Rows(_ids(3, 2) % 60, torch.arange(3), b)])
    ref = m(_ids(5, 1) % 60, torch.arange(5), m.new_cache(20))
    assert torch.equal(out[0], ref) and out[1].shape == (3, 64)


def _random_call(model, cache, g: torch.Generator) -> dict:
    """One sequence's next forward, drawn at random: a decode row, a draft tree (random parents,
    kept queries, logits of some nodes) or a prompt chunk (the last row's logits, or none)."""
    p, layers = cache.length, model.cfg.num_layers
    kind = int(torch.randint(0, 3, (1,), generator=g))
    if kind == 0:
        return dict(tokens=torch.randint(0, 95, (1,), generator=g), positions=torch.tensor([p]))
    if kind == 1:
        n = int(torch.randint(2, 14, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        some = torch.randperm(n, generator=g)[: int(torch.randint(1, n + 1, (1,), generator=g))].sort().values
        return dict(tokens=torch.randint(0, 95, (n,), generator=g), positions=p + torch.tensor(depth),
                    tree_mask=_tree_mask(parents), keep_q={0: None}, logits_rows=some)
    n = int(torch.randint(2, 40, (1,), generator=g))
    last = bool(torch.randint(0, 2, (1,), generator=g))
    return dict(tokens=torch.randint(0, 95, (n,), generator=g), positions=torch.arange(p, p + n),
                logits_rows=slice(-1, None) if last else slice(0, 0),
                keep_q=dict.fromkeys(range(layers)) if last else None)


def _alone_and_batched(model, seed: int, trim: bool = False) -> None:
    """Rounds of random mixes of four sequences, each round's forwards in one batched call against
    the same forwards of copies of the sequences, each alone: logits, kept queries and K/V."""
    g = torch.Generator().manual_seed(seed)
    batched, alone = [], []
    for i, n in enumerate((3, 30, 1, 17)):
        for caches in (batched, alone):
            caches.append(model.new_cache(400))
            model.prefill(_ids(n, 10 + i), caches[-1])
    for _ in range(5):
        who = torch.randperm(4, generator=g)[: int(torch.randint(2, 5, (1,), generator=g))].tolist()
        calls = {i: _random_call(model, batched[i], g) for i in who}
        copies = {i: {**c, "keep_q": dict(c["keep_q"]) if c.get("keep_q") else c.get("keep_q")}
                  for i, c in calls.items()}
        outs = model.forward_many([Rows(cache=batched[i], **calls[i]) for i in who])
        for i, out in zip(who, outs, strict=True):
            ref = model(cache=alone[i], **copies[i])
            assert torch.equal(out, ref), (i, calls[i]["tokens"].shape)
            end = alone[i].length + alone[i].pending
            assert batched[i].pending == alone[i].pending
            assert torch.equal(batched[i].k[:, :, :end], alone[i].k[:, :, :end]), i
            assert torch.equal(batched[i].v[:, :, :end], alone[i].v[:, :, :end]), i
            if calls[i].get("keep_q"):
                assert all(torch.equal(calls[i]["keep_q"][k], copies[i]["keep_q"][k]) for k in calls[i]["keep_q"])
            keep = [0] if calls[i].get("tree_mask") is not None else None  # a tree keeps its root
            batched[i].commit(keep)
            alone[i].commit(keep)


@pytest.mark.parametrize("path", kernels.cpu_paths())
def test_random_mixes_in_one_step_are_each_sequence_alone(model, monkeypatch, path):
    """Decode rows, draft trees and prompt chunks of several sequences in the batched C++ step
    (one call a round) give each sequence the bits it gets alone, its lone forwards taking the
    lone step (up to 16 rows) or the per-layer kernels (a longer chunk)."""
    monkeypatch.setenv(kernels.CPU_ENV, path)
    calls = []
    run = fused_step.run
    monkeypatch.setattr(fused_step, "run", lambda *a: calls.append(len(a[4])) or run(*a))
    _alone_and_batched(model, seed=len(path))
    assert any(n > 1 for n in calls)


def test_random_mixes_with_a_trimmed_head(model, monkeypatch):
    """The same with a draft's trimmed head (logits -inf outside its subset), which the step
    computes in place of the whole head."""
    monkeypatch.setattr(model, "output_head", draft_vocab.VocabTrim(model, range(0, 90, 3)))
    model.output_head.cover([1, 2, 4])
    _alone_and_batched(model, seed=11)
    monkeypatch.undo()
    assert model.output_head is None


def test_the_python_driven_batch_gives_the_same_bits(model, monkeypatch):
    """The batched step against the per-layer kernels driven from Python (step_rows 0)."""
    monkeypatch.setattr(model, "step_rows", 0)
    g = torch.Generator().manual_seed(4)
    caches = {}
    for mode in ("python", "step"):
        if mode == "step":
            monkeypatch.setattr(model, "step_rows", 16)
        cs = [model.new_cache(200) for _ in range(3)]
        for i, c in enumerate(cs):
            model.prefill(_ids(5 + i, i), c)
        g.manual_seed(4)
        calls = [_random_call(model, c, g) for c in cs]
        outs = model.forward_many([Rows(cache=c, **call) for c, call in zip(cs, calls, strict=True)])
        caches[mode] = (cs, outs, calls)
    for a, b in zip(caches["python"][1], caches["step"][1], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(caches["python"][0], caches["step"][0], strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
