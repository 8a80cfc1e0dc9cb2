"""CUDA: the fused kernels behind Hybrid Tree Attention, and the whole engine on a GPU.

Every test here skips without a CUDA device (CI has none); they ran on an H100 when one was lent.
"""

from __future__ import annotations

import pytest
import torch

from specextend.common.settings import Settings
from specextend.models.loader import load_model
from specextend.runtime.attention import _prefix_attention, attend, hybrid_tree_attention
from specextend.speculation.decoder import SpecEngine

from test_attention import random_tree_mask, sdpa_reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("prefix", [0, 1, 100, 5000])
@pytest.mark.parametrize("heads", [(12, 2), (8, 8)])
def test_hybrid_matches_reference(dtype, prefix, heads):
    h, hkv = heads
    gen = torch.Generator().manual_seed(prefix + h)
    t = 17
    q = torch.randn(h, t, 64, generator=gen)
    k = torch.randn(hkv, prefix + t, 64, generator=gen)
    v = torch.randn(hkv, prefix + t, 64, generator=gen)
    tree = random_tree_mask(t, t, gen)
    ref = sdpa_reference(q.double(), k.double(), v.double(), tree)
    got = hybrid_tree_attention(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), tree.cuda())
    assert got.dtype == dtype
    assert (got.double().cpu() - ref).abs().max() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("keys", [300, 3000, 20001])
def test_prefix_kernel_log_sum_exp(dtype, keys):
    """The log-sum-exp the fused (and split-KV) kernels return is the true one: the merge needs it."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(12, 9, 128, generator=gen)
    k = torch.randn(2, keys, 128, generator=gen)
    v = torch.randn(2, keys, 128, generator=gen)
    _, lse = _prefix_attention(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype))
    s = torch.matmul(q.double().reshape(2, 6 * 9, 128), k.double().transpose(-1, -2)) / 128**0.5
    ref = torch.logsumexp(s, -1).reshape(12, 9)
    assert (lse.double().cpu() - ref).abs().max() <= (1e-9 if dtype == torch.float64 else 2e-2)


def test_efficient_and_eager_agree_at_every_length():
    gen = torch.Generator().manual_seed(2)
    for prefix in (0, 2047, 2048, 9000):
        q = torch.randn(12, 8, 128, generator=gen).cuda().half()
        k = torch.randn(2, prefix + 8, 128, generator=gen).cuda().half()
        v = torch.randn(2, prefix + 8, 128, generator=gen).cuda().half()
        tree = random_tree_mask(8, 8, gen).cuda()
        a = attend(q, k, v, tree, "efficient").float()
        b = attend(q, k, v, tree, "eager").float()
        assert (a - b).abs().max() <= 1e-2


PROMPT = torch.randint(0, 63, (70,), generator=torch.Generator().manual_seed(3)).tolist()
SMALL = dict(chunk_size=4, top_k_chunks=3, retrieve_every=2, tree_budget=6, tree_depth=4, tree_topk=2)


@pytest.mark.parametrize("method", [dict(method="sd"), dict(method="sd", attention="efficient"),
                                    dict(method="specextend"), dict(method="sd", draft_cache="streaming")])
def test_greedy_equals_ar_on_cuda_float64(tiny_dir, method):
    """Lossless on the GPU too: float64 makes the comparison exact, as on CPU."""
    target = load_model(tiny_dir("qwen2", 0), torch.float64, "cuda")
    draft = load_model(tiny_dir("qwen2", 5, layers=1), torch.float64, "cuda")
    eng = SpecEngine(target, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=40))
    r = eng.generate(PROMPT, Settings(max_new_tokens=40, **SMALL, **method))
    assert r.token_ids == ar.token_ids


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_specextend_runs_in_half_precision(tiny_dir, dtype):
    target = load_model(tiny_dir("llama", 0), dtype, "cuda")
    draft = load_model(tiny_dir("llama", 5, layers=1), dtype, "cuda")
    eng = SpecEngine(target, draft, eos_ids=[])
    r = eng.generate(PROMPT, Settings(method="specextend", max_new_tokens=30, **SMALL))
    assert len(r.token_ids) == 30
    assert r.phases["retrieval_s"] > 0
    assert all(0 <= t < 64 for t in r.token_ids)
