"""Attention kernels: eager (reference), efficient (flash prefill + Hybrid Tree Attention) and
the explicit attention scores that Cross-model Retrieval reads from one target layer.

Every function here works on one sequence (no batch) with grouped-query attention:

    q:         [H, T, D]      queries of the T new tokens (already rotated)
    k, v:      [Hkv, S, D]    the cache view: committed tokens, then the T new ones last
    tree_mask: [T, M] bool or None   what each new token may see among the LAST M keys (M >= T:
                              the new tokens and, when a draft tree grows level by level, the
                              tree nodes fed before them); None means causal over the T new tokens

Every new token sees all keys before those M in full (the committed prefix); within the last M
it sees what `tree_mask` allows (a draft tree's ancestry, or the causal triangle for prefill).
K/V are never repeated over the query groups: the group dimension is folded into the query rows.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

# "rowwise": the C++ kernel (csrc/attention.cpp) in which a token's output depends only on the
# keys it sees; the quantized CPU runtime runs every attention through it (see `attend`).
Backend = Literal["eager", "efficient", "rowwise"]

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_HALF = (torch.bfloat16, torch.float16)


def _group(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[H, T, D] -> [Hkv, g*T, D]: query heads that share a K/V head become extra query rows."""
    h, t, d = q.shape
    return q.reshape(n_kv, (h // n_kv) * t, d)


def _ungroup(o: torch.Tensor, h: int) -> torch.Tensor:
    n_kv, gt, d = o.shape
    return o.reshape(h, gt * n_kv // h, d)


def _tree_or_causal(tree_mask: torch.Tensor | None, t: int, device: torch.device) -> torch.Tensor:
    if tree_mask is not None:
        return tree_mask.to(device)
    return torch.ones(t, t, dtype=torch.bool, device=device).tril_()


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor | None = None,
    scale: float | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain masked attention that materialises the [H, T, P+T] score matrix (the reference).

    Only the last M columns can be masked, so only they are touched by the mask (a full
    [T, P+T] mask would cost as much memory traffic as the scores themselves). `scale`: the
    score scale (None: 1/sqrt(D)); `softcap`: scores become softcap * tanh(scores / softcap);
    `sinks` [H]: a logit a head that joins the softmax as a column with no value (gpt-oss).
    """
    h, t, d = q.shape
    n_kv, s, _ = k.shape
    local = _tree_or_causal(tree_mask, t, q.device)
    m = local.shape[1]
    scores = torch.matmul(_group(q, n_kv), k.transpose(-1, -2))
    scores.mul_(1.0 / math.sqrt(d) if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores.view(n_kv, h // n_kv, t, s)[..., s - m :].masked_fill_(~local, float("-inf"))
    # Half-precision scores are normalised in float32, as the reference implementations do.
    dtype = torch.float32 if scores.dtype in _HALF else scores.dtype
    if sinks is not None:  # one more column, the head's sink, dropped after the softmax
        col = sinks.to(scores.dtype).reshape(n_kv, h // n_kv, 1, 1).expand(-1, -1, t, 1).reshape(n_kv, -1, 1)
        probs = torch.softmax(torch.cat([scores, col], -1), -1, dtype=dtype)[..., :-1]
        return _ungroup(torch.matmul(probs.to(v.dtype), v), h)
    probs = torch.softmax(scores, -1, dtype=dtype)
    return _ungroup(torch.matmul(probs.to(v.dtype), v), h)


def _prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of all queries to the committed prefix, with log-sum-exp.

    Unmasked means the query groups can be folded into rows, so the efficient kernel runs
    once per K/V head with no copy of K/V. Returns out [H, T, D] and lse [H, T] (float32+).
    """
    h, t, _ = q.shape
    n_kv = k.shape[0]
    qg = _group(q, n_kv).unsqueeze(0)
    if q.device.type == "cpu":
        out, lse = _flash_cpu(qg, k.unsqueeze(0), v.unsqueeze(0), 0.0, False)
        out, lse = out[0], lse[0]
    elif q.device.type == "cuda" and q.dtype != torch.float64:
        out, lse = _cuda_attention_with_lse(qg, k.unsqueeze(0), v.unsqueeze(0))
    else:
        # No fused kernel returns the log-sum-exp here (float64 on CUDA, other devices).
        out, lse = _blocked_attention_with_lse(qg[0], k, v)
    return _ungroup(out, h), lse.reshape(h, t)


def _cuda_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA: FlashAttention-2 for float16/bfloat16, the memory-efficient kernel for float32.

    Both are PyTorch's own fused SDPA kernels, called through the ops that also return the
    log-sum-exp (the public `scaled_dot_product_attention` drops it). q: [1, Hkv, R, D].

    A verification tree has few query rows and (with GQA) few K/V heads, so one fused call
    would run on a handful of thread blocks of a GPU with a hundred-odd SMs. The prefix is
    therefore split into blocks that run as a batch (split-KV, as in flash-decoding) and the
    partial results are merged by their log-sum-exps, exactly as prefix and tree are.
    """
    r, d = q.shape[2], q.shape[3]
    n_kv, s = k.shape[1], k.shape[2]
    splits = _kv_splits(q, n_kv, r, s)
    if splits == 1:
        out, lse = _fused_with_lse(q, k, v)
        return out[0], lse[0]
    block = s // splits
    full = block * splits
    kb = k[0, :, :full].view(n_kv, splits, block, d).transpose(0, 1)
    vb = v[0, :, :full].view(n_kv, splits, block, d).transpose(0, 1)
    out, lse = _fused_with_lse(q.expand(splits, -1, -1, -1), kb, vb)
    if full < s:  # the remainder, one more small call
        o2, l2 = _fused_with_lse(q, k[:, :, full:], v[:, :, full:])
        out, lse = torch.cat([out, o2]), torch.cat([lse, l2])
    total = torch.logsumexp(lse, 0)
    w = torch.exp(lse - total).unsqueeze(-1)
    return (out.float() * w).sum(0).to(q.dtype), total


def _kv_splits(q: torch.Tensor, n_kv: int, rows: int, keys: int, min_block: int = 512) -> int:
    """Enough prefix blocks to give every SM about two thread blocks of work."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    per_split = n_kv * -(-rows // 128)  # the fused kernels tile query rows by up to 128
    return max(1, min(-(-2 * sms // per_split), keys // min_block))


def _fused_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused call on [B, Hkv, *, D] inputs -> out [B, Hkv, R, D], lse [B, Hkv, R] (float32)."""
    r, d = q.shape[2], q.shape[3]
    if q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)
        out, lse = res[0], res[1]
    else:
        res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
        # The efficient kernel pads its log-sum-exp rows up to a multiple of its block size.
        out, lse = res[0], res[1][:, :, :r]
    return out, lse


def _blocked_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax attention over key blocks: never holds more than [Hkv, rows, block] scores."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    acc_dtype = torch.float32 if q.dtype in _HALF else q.dtype
    m = torch.full(q.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    for start in range(0, k.shape[1], block):
        s = torch.matmul(q, k[:, start : start + block].transpose(-1, -2)).to(acc_dtype) * scale
        m_new = torch.maximum(m, s.amax(-1))
        corr = torch.exp(m - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))
        denom = denom * corr + p.sum(-1)
        acc = acc * corr.unsqueeze(-1) + torch.matmul(p.to(v.dtype), v[:, start : start + block]).to(acc_dtype)
        m = m_new
    return (acc / denom.unsqueeze(-1)).to(q.dtype), m + torch.log(denom)


def _local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention to the last M keys under the tree (or causal) mask, with log-sum-exp.

    T is small for a draft tree (tens of nodes); for a prefill chunk it is a few hundred, so the
    [H, T, T] scores stay small either way.
    """
    h, t, d = q.shape
    n_kv = k.shape[0]
    allowed = _tree_or_causal(tree_mask, t, q.device).repeat(h // n_kv, 1)
    qg = _group(q, n_kv)
    acc_dtype = torch.float32 if q.dtype in _HALF else q.dtype
    s = torch.matmul(qg, k.transpose(-1, -2)).to(acc_dtype) * (1.0 / math.sqrt(d))
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p.to(v.dtype), v)
    return _ungroup(out, h), lse.reshape(h, t)


def merge_by_lse(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Exact combination of two softmax attentions over disjoint key sets.

    softmax over the union = each part's output weighted by exp(lse_part - lse_union).
    """
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return (o1.to(w1.dtype) * w1 + o2.to(w2.dtype) * w2).to(o1.dtype)


def hybrid_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """SpecExtend's Hybrid Tree Attention.

    The long committed prefix goes through the unmasked efficient kernel (it needs no mask, so
    no [T, P] mask is built and no score matrix is materialised); the few tree tokens go
    through a small masked attention; the two are merged exactly by their log-sum-exps.
    Also serves chunked prefill, where the "tree" is the causal triangle of the chunk.
    """
    t = q.shape[1]
    p = k.shape[1] - (tree_mask.shape[1] if tree_mask is not None else t)
    o_local, lse_local = _local_attention(q, k[:, p:], v[:, p:], tree_mask)
    if p == 0:
        return o_local
    o_prefix, lse_prefix = _prefix_attention(q, k[:, :p], v[:, :p])
    return merge_by_lse(o_prefix, lse_prefix, o_local, lse_local)


# Below this many cached tokens the efficient backend runs one small masked attention instead
# of two kernels and a merge, as long as the score matrix stays below the cell limit: on a CPU the
# flash kernel's fixed cost outweighs what it saves over short prefixes, and on CUDA the hybrid's
# many small kernel launches dominate a tree's attention (measured with `python -m
# specextend.bench.kernels`; docs/benchmarks.md, "Measured choices"). Both compute the same attention; a CMR
# draft cache (~1K tokens) always takes the small path.
EFFICIENT_MIN_PREFIX = {"cpu": 2048, "cuda": 65536}
EAGER_MAX_SCORES = {"cpu": 2048 * 1024, "cuda": 64 * 65536}


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree_mask: torch.Tensor | None, backend: Backend,
    scale: float | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
    numbers: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Attention through `backend`; a score `scale` other than 1/sqrt(D) is folded into the queries
    (every kernel scales by 1/sqrt(D)). Soft-capped scores (Gemma 2) and `sinks` (gpt-oss) take the
    row-wise kernel, or else the eager reference, the one other kernel that sees every score.
    `numbers`: a window's (ends, lead), which only the row-wise kernel's blocks follow (kernels.attend)."""
    ends, lead = numbers if numbers is not None else (None, 0)
    if scale is not None:
        q = q * (scale * math.sqrt(q.shape[-1]))
    if sinks is not None:
        if softcap is not None:
            raise ValueError("attention sinks with soft-capped scores are not implemented")
        if backend == "rowwise":
            from .kernels import attend as rowwise
            return rowwise(q, k, v, tree_mask, sinks=sinks, ends=ends, lead=lead)
        return eager_attention(q, k, v, tree_mask, None, None, sinks)
    if softcap is not None and backend != "rowwise":
        return eager_attention(q, k, v, tree_mask, None, softcap)
    if backend == "efficient":
        prefix = k.shape[1] - (tree_mask.shape[1] if tree_mask is not None else q.shape[1])
        dev = q.device.type
        if prefix < EFFICIENT_MIN_PREFIX.get(dev, 2048) and q.shape[1] * k.shape[1] <= EAGER_MAX_SCORES.get(
            dev, 2048 * 1024
        ):
            return eager_attention(q, k, v, tree_mask)
        return hybrid_tree_attention(q, k, v, tree_mask)
    if backend == "eager":
        return eager_attention(q, k, v, tree_mask)
    if backend == "rowwise":
        from .kernels import attend as rowwise

        return rowwise(q, k, v, tree_mask, softcap=softcap, ends=ends, lead=lead)
    raise ValueError(f"unknown attention backend {backend!r}")


def attention_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Softmax attention probabilities of a few query rows over keys, averaged over heads and rows.

    q: [H, r, D] (rows that may attend to every key in k), k: [Hkv, S, D] -> [S] in float32.
    This is the only place scores are materialised for retrieval: one layer, r rows.
    """
    d = q.shape[-1]
    s = torch.matmul(_group(q, k.shape[0]), k.to(q.dtype).transpose(-1, -2)).float() * (1.0 / math.sqrt(d))
    return torch.softmax(s, -1).mean(dim=(0, 1))


def list_ends(keys: int, tree_mask: torch.Tensor | None, t: int) -> torch.Tensor:
    """Each new token's place in its full visible list ([T] int64): the committed `keys - M` and the
    last M keys its mask (or the causal triangle) lets it see, less one. A windowed layer's keys keep
    these numbers, so its blocks lie on the grid of its tokens' slots (csrc/core/attention.h)."""
    if tree_mask is None:
        return torch.arange(keys - t, keys, dtype=torch.long)
    mask = tree_mask.cpu()
    return (keys - mask.shape[1]) + mask.sum(1, dtype=torch.long) - 1


def window_mask(positions: torch.Tensor, keys: int, tree_mask: torch.Tensor | None, window: int
                ) -> tuple[int, torch.Tensor]:
    """The keys a sliding-window layer's new tokens see: (first, mask) such that attending over keys
    [first, keys) of the cache under `mask` [T, keys - first] sees, for each new token, what
    `tree_mask` (or causal) allows and only keys whose position is less than `window` before its own
    (Hugging Face's sliding window: q - k < window). The T new tokens are the last T keys, at
    `positions`; a committed key's position is its slot, as in a target's cache. Every key a token
    sees stays in order, so the row-wise kernel gives a token the same bits alone or in a tree."""
    t = int(positions.shape[0])
    pos = positions.to(torch.long).cpu()
    first = min(max(0, int(pos.min()) - window + 1), keys - t)
    kpos = torch.arange(first, keys)
    kpos[-t:] = pos
    base = _tree_or_causal(None if tree_mask is None else tree_mask.cpu(), t, torch.device("cpu"))
    m = base.shape[1]
    allowed = torch.ones(t, keys - first, dtype=torch.bool)
    if m > keys - first:
        base = base[:, m - (keys - first):]
        m = keys - first
    allowed[:, keys - first - m:] = base
    allowed &= (pos[:, None] - kpos[None, :]) < window
    return first, allowed
