"""Logits parity with transformers (float64) for every architecture and every way of feeding.

transformers' float64 models still normalise and take the softmax in float32, so they agree with
ours to about 1e-6; any real bug (a wrong rotation, mask or head mapping) moves logits by far more
than REF_TOL. Our own ways of feeding the same tokens must agree to float64 rounding (EXACT).
"""

from __future__ import annotations

import pytest
import torch

from specextend.models.loader import load_model

from conftest import ARCHS, FAMILY_ARCHS, make_tiny_hf

REF_TOL = 1e-5
EXACT = 1e-10


def ours_and_ref(tiny_dir, arch):
    d = tiny_dir(arch)
    ref = make_tiny_hf(arch)
    ours = load_model(d, torch.float64)
    return ours, ref


def ref_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ARCHS + FAMILY_ARCHS)
@pytest.mark.parametrize("backend", ["eager", "efficient"])
def test_prefill_one_call_and_pieces(tiny_dir, arch, backend):
    ours, ref = ours_and_ref(tiny_dir, arch)
    ids = torch.randint(0, 64, (37,)).tolist()
    expect = ref_logits(ref, ids)
    cache = ours.new_cache(64)
    got = ours(torch.tensor(ids), torch.arange(37), cache, backend=backend)
    cache.commit()
    assert torch.allclose(got, expect, atol=REF_TOL, rtol=0)
    expect = got
    # Same prompt appended in uneven pieces.
    cache = ours.new_cache(64)
    outs, s = [], 0
    for n in (5, 1, 13, 18):
        outs.append(ours(torch.tensor(ids[s : s + n]), torch.arange(s, s + n), cache, backend=backend))
        cache.commit()
        s += n
    assert torch.allclose(torch.cat(outs), expect, atol=EXACT, rtol=0)
    # Chunked prefill returns the last token's logits.
    cache = ours.new_cache(64)
    last = ours.prefill(torch.tensor(ids), cache, backend=backend, chunk=8)
    assert cache.length == 37
    assert torch.allclose(last, expect[-1], atol=EXACT, rtol=0)


def random_tree(n: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor, list[int]]:
    """Parents (root's is -1), the [n, n] ancestor mask, and depths."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = []
    for i in range(n):
        j, d = i, 0
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
            d += 1
        depth.append(d - 1)
    return parents, mask, depth


@pytest.mark.parametrize("arch", ARCHS + FAMILY_ARCHS)
@pytest.mark.parametrize("backend", ["eager", "efficient"])
def test_tree_mask_equals_path_feeding(tiny_dir, arch, backend):
    ours, ref = ours_and_ref(tiny_dir, arch)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (20,), generator=gen).tolist()
    n = 12
    parents, mask, depth = random_tree(n, gen)
    toks = torch.randint(0, 64, (n,), generator=gen).tolist()
    cache = ours.new_cache(64)
    ours.prefill(torch.tensor(prompt), cache)
    got = ours(torch.tensor(toks), torch.tensor(depth) + 20, cache, tree_mask=mask, backend=backend)
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.append(toks[j])
            j = parents[j]
        seq = prompt + path[::-1]
        c = ours.new_cache(64)
        one = ours(torch.tensor(seq), torch.arange(len(seq)), c, backend=backend)[-1]
        assert torch.allclose(got[i], one, atol=EXACT, rtol=0), i
    for i in (0, n - 1):
        path, j = [], i
        while j >= 0:
            path.append(toks[j])
            j = parents[j]
        expect = ref_logits(ref, prompt + path[::-1])[-1]
        assert torch.allclose(got[i], expect, atol=REF_TOL, rtol=0), i


@pytest.mark.parametrize("arch", ARCHS + FAMILY_ARCHS)
def test_compaction_equals_fresh_forward(tiny_dir, arch):
    ours, _ = ours_and_ref(tiny_dir, arch)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 64, (15,), generator=gen).tolist()
    n = 10
    parents, mask, depth = random_tree(n, gen)
    toks = torch.randint(0, 64, (n,), generator=gen).tolist()
    cache = ours.new_cache(64)
    ours.prefill(torch.tensor(prompt), cache)
    ours(torch.tensor(toks), torch.tensor(depth) + 15, cache, tree_mask=mask)
    leaf = n - 1
    path, j = [], leaf
    while j >= 0:
        path.append(j)
        j = parents[j]
    keep = path[::-1]
    cache.commit(keep)
    fresh = ours.new_cache(64)
    ours.prefill(torch.tensor(prompt + [toks[i] for i in keep]), fresh)
    assert cache.length == fresh.length
    L = cache.length
    assert torch.allclose(cache.k[:, :, :L], fresh.k[:, :, :L], atol=EXACT, rtol=0)
    assert torch.allclose(cache.v[:, :, :L], fresh.v[:, :, :L], atol=EXACT, rtol=0)
    # And the next token's logits agree.
    nxt = 5
    a = ours(torch.tensor([nxt]), torch.tensor([L]), cache)
    b = ours(torch.tensor([nxt]), torch.tensor([L]), fresh)
    assert torch.allclose(a, b, atol=EXACT, rtol=0)


def test_unsupported_architecture_is_refused(tmp_path):
    import json

    from specextend.common.errors import UserError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="GPT2LMHeadModel"):
        load_model(tmp_path)
