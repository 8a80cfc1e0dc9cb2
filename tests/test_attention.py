"""Hybrid Tree Attention and retrieval scores against independent references (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specextend.runtime.attention import (
    _blocked_attention_with_lse,
    attention_probs,
    eager_attention,
    hybrid_tree_attention,
)


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """The independent oracle: PyTorch's own masked SDPA with repeated K/V (causal without a tree)."""
    h, t, _ = q.shape
    n_kv, s, _ = k.shape
    local = tree_mask.to(q.device) if tree_mask is not None else torch.ones(t, t, dtype=torch.bool).tril_()
    allowed = torch.ones(t, s, dtype=torch.bool, device=q.device)
    allowed[:, s - local.shape[1] :] = local.to(q.device)
    rep = h // n_kv
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), attn_mask=allowed
    )


def random_tree_mask(t: int, m: int, gen: torch.Generator) -> torch.Tensor:
    """[t, m] mask: the last t of m tree nodes, each seeing itself and a random ancestor chain."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, m)]
    full = torch.zeros(m, m, dtype=torch.bool)
    for i in range(m):
        j = i
        while j >= 0:
            full[i, j] = True
            j = parents[j]
    return full[m - t :]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1), (12, 2)])
@pytest.mark.parametrize("prefix", [0, 1, 17, 300])
@pytest.mark.parametrize("shape", [(1, 1), (5, 5), (8, 13), (3, 30)])
def test_hybrid_equals_reference(heads, kv_heads, prefix, shape):
    t, m = shape
    gen = torch.Generator().manual_seed(heads * 1000 + prefix + t)
    d = 16
    q = torch.randn(heads, t, d, dtype=torch.float64, generator=gen)
    k = torch.randn(kv_heads, prefix + m, d, dtype=torch.float64, generator=gen)
    v = torch.randn(kv_heads, prefix + m, d, dtype=torch.float64, generator=gen)
    tree = random_tree_mask(t, m, gen)
    ref = sdpa_reference(q, k, v, tree)
    assert (hybrid_tree_attention(q, k, v, tree) - ref).abs().max() <= 1e-10
    assert (eager_attention(q, k, v, tree) - ref).abs().max() <= 1e-10


@pytest.mark.parametrize("prefix", [0, 40])
def test_causal_chunk_equals_reference(prefix):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(4, 9, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(2, prefix + 9, 8, dtype=torch.float64, generator=gen)
    v = torch.randn(2, prefix + 9, 8, dtype=torch.float64, generator=gen)
    ref = sdpa_reference(q, k, v, None)
    assert (hybrid_tree_attention(q, k, v, None) - ref).abs().max() <= 1e-10


def test_blocked_lse_path_matches_flash():
    """The CUDA fallback (online softmax over key blocks) agrees with the CPU flash kernel."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(2, 50, 8, dtype=torch.float64, generator=gen)
    v = torch.randn(2, 50, 8, dtype=torch.float64, generator=gen)
    out, lse = _blocked_attention_with_lse(q, k, v, block=7)
    ref_out, ref_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, False
    )
    assert (out - ref_out[0]).abs().max() <= 1e-10
    assert (lse - ref_lse[0]).abs().max() <= 1e-10


def test_attention_probs_equal_reference_softmax():
    gen = torch.Generator().manual_seed(5)
    h, kvh, s, d = 6, 2, 33, 8
    q = torch.randn(h, 2, d, dtype=torch.float64, generator=gen)
    k = torch.randn(kvh, s, d, dtype=torch.float64, generator=gen)
    kr = k.repeat_interleave(h // kvh, 0)
    ref = torch.softmax(q @ kr.transpose(-1, -2) / d**0.5, -1).mean(dim=(0, 1))
    got = attention_probs(q, k)
    assert (got.double() - ref).abs().max() <= 1e-6  # scores are returned in float32
    assert abs(float(got.sum()) - 1.0) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_runs(dtype):
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(4, 5, 16, generator=gen).to(dtype)
    k = torch.randn(2, 70, 16, generator=gen).to(dtype)
    v = torch.randn(2, 70, 16, generator=gen).to(dtype)
    ref = sdpa_reference(q.double(), k.double(), v.double(), None)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert (hybrid_tree_attention(q, k, v, None).double() - ref).abs().max() <= tol


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_hybrid_matches_reference(dtype):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(12, 16, 128, generator=gen)
    k = torch.randn(2, 4096 + 16, 128, generator=gen)
    v = torch.randn(2, 4096 + 16, 128, generator=gen)
    tree = random_tree_mask(16, 16, gen)
    ref = sdpa_reference(q.double(), k.double(), v.double(), tree)
    got = hybrid_tree_attention(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), tree.cuda())
    assert (got.double().cpu() - ref).abs().max() <= 3e-2


@pytest.mark.parametrize("prefix", [0, 100, 2047, 2048, 3000])
@pytest.mark.parametrize("t", [1, 7])
def test_efficient_backend_dispatch_equals_reference(prefix, t):
    """Whichever kernel the efficient backend picks for a length, the result is the same."""
    from specextend.runtime.attention import attend

    gen = torch.Generator().manual_seed(prefix + t)
    q = torch.randn(6, t, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(2, prefix + t, 8, dtype=torch.float64, generator=gen)
    v = torch.randn(2, prefix + t, 8, dtype=torch.float64, generator=gen)
    tree = random_tree_mask(t, t, gen)
    ref = sdpa_reference(q, k, v, tree)
    assert (attend(q, k, v, tree, "efficient") - ref).abs().max() <= 1e-10
    assert (attend(q, k, v, None, "efficient") - sdpa_reference(q, k, v, None)).abs().max() <= 1e-10
