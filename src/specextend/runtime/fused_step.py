"""The quantized runtime's whole-step forward: every layer of a few new tokens, of one sequence or
of several (a batch step), and the LM head in one C++ call.

A one-row decode step driven from Python (`model.Block.forward_rows`) makes six kernel calls a
layer, each a crossing into C++ and a hand-over to the thread team; for a small draft that is a
visible share of a step whose floor is a dozen milliseconds (docs/log/2026-11-step-costs.md). The C++ core
(csrc/core/step.h) runs the same kernels with the same arguments for every layer in one
parallel region, so its outputs are the Python-driven step's bits. A batch's sequences share the
call: every product takes all their rows at once (a weight is read once for all), attention runs
per sequence over its own cache, and since every kernel is row-independent each sequence's
logits and K/V are the bits it gets alone. This module describes a model's layers (`plan`) and
its head (`head`) to it once and runs a forward (`run`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import kernels
from .layers import conv_slots
from .quant import FORMATS

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .config import ModelConfig
    from .experts import Experts
    from .kv_cache import KVCache
    from .layers import Block, Linear, RMSNorm, Rows
    from .quant import QWeight

# Forwards of at most this many rows of one sequence take the whole-step call (a decode step, a
# draft's tree level, a small verification); larger ones (prefill chunks) keep the per-layer
# kernels, where the Python between calls is a small share. A batch's forward of several
# sequences takes it whatever its rows: driven from Python, its attention calls grow with the
# sequences.
STEP_ROWS = 16


def _weight(lin: Linear) -> tuple[Any, ...]:
    w = lin.qweight
    bias = None if lin.bias is None else lin.bias.detach().float().contiguous()
    return (w.blobs, w.formats, w.widths, w.offsets, w.groups, bias)


def _norm(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight.detach().contiguous()


def plan(cfg: ModelConfig, layers: Iterable[Block]) -> Any:
    """A model's layers as the C++ step takes them (the plan keeps its tensors alive), with their
    family's switches (`ModelConfig.stepped`)."""
    p = kernels.load().step_plan(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 float(cfg.rms_norm_eps))
    p.set_family(float(cfg.attn_scale or 0.0), float(cfg.residual_scale), int(cfg.rotary_dim),
                 float(cfg.attn_softcap or 0.0), cfg.layer_norm, cfg.parallel)
    identity = rope_kinds(cfg)  # a layer without rope takes the table of angle zero, after the others
    for layer in layers:
        per_head = not layer.qk_full
        moe = layer.moe
        if layer.conv is not None:  # LFM2's convolution (its pre-norms, its dense MLP or experts)
            p.add_conv_layer(_weight(layer.qkv), _weight(layer.o), None if moe else _weight(layer.gate_up),
                             None if moe else _weight(layer.down), layer.conv.detach().float().contiguous(),
                             _norm(layer.attn_norm), _norm(layer.mlp_norm))
            if moe is not None:
                _experts(p, moe)
            continue
        p.add_layer(_weight(layer.qkv), _weight(layer.o), None if moe else _weight(layer.gate_up),
                    None if moe else _weight(layer.down), _norm(layer.attn_norm), _norm(layer.mlp_norm),
                    _norm(layer.q_norm) if per_head else None, _norm(layer.k_norm) if per_head else None,
                    layer.rope_kind if layer.rope_kind >= 0 else identity)
        sinks = None if layer.sinks is None else layer.sinks.detach().float().contiguous()
        p.layer_family(_norm(layer.attn_out_norm), _norm(layer.mlp_out_norm), None if per_head else _norm(layer.q_norm),
                       None if per_head else _norm(layer.k_norm), bool(layer.window), layer.gelu, sinks)
        p.layer_key_offset(layer.k_offset)
        if moe is not None:
            _experts(p, moe)
    return p


def _experts(p: Any, moe: Experts) -> None:
    """A layer's experts as the C++ step takes them: the router's exact bfloat16 parts (with the
    shared expert's gate where there is one) and bias, the stacked tensors, their biases and
    activation, the shared expert's two products and whether a gate weighs it, and the router's
    selection bias (ERNIE's)."""
    if moe.q_stacked is None or moe.q_router is None:
        raise ValueError("the whole-step call runs quantized experts only")
    shared = (_weight(moe.shared_gate_up), _weight(moe.shared_down)) if moe.shared else (None, None)
    router = moe.q_router
    bias = None if moe.router.bias is None else moe.router.bias.detach().float().contiguous()
    stacked = [(s.blob, FORMATS[s.fmt], s.n, s.offset, s.groups) for s in moe.q_stacked]
    p.layer_experts((router.blobs, router.formats, router.widths, router.offsets, router.groups, None), bias,
                    *stacked, moe.count, moe.used, moe.ff, moe.weighting_id, *moe.q_stacked_bias, moe.act.kernel,
                    *shared, moe.shared_gated, moe.kernel_select_bias)


def rope_kinds(cfg: ModelConfig) -> int:
    """How many rope tables the layers rotate with (`Transformer.ropes`); a NoPE layer's identity
    table comes after them."""
    return 2 if cfg.local_rope_theta is not None else 1


def rope_tables(cfg: ModelConfig, ropes: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's cos and sin [kinds, T, head_dim]: the model's ropes, then, where some layer has no
    rope, the identity (cos 1, sin 0: rope_tokens' arithmetic leaves q and k exactly as they are,
    as the per-layer kernels' rope_store does with the same table)."""
    cos, sin = [c for c, _ in ropes], [s for _, s in ropes]
    if cfg.rope_layers and not all(cfg.rope_layers):
        cos.append(torch.ones_like(cos[0]))
        sin.append(torch.zeros_like(sin[0]))
    if len(cos) == 1:
        return cos[0], sin[0]
    return torch.stack(cos), torch.stack(sin)


def head(step_plan: Any, norm: RMSNorm, weight: QWeight) -> Any:
    """The final `norm` and the head `weight` (the model's, or a draft's trimmed one) as the C++
    step takes them."""
    args = (weight.blobs, weight.formats, weight.widths, weight.offsets, weight.groups, None)
    return kernels.load().step_head(step_plan, args, norm.weight.detach().contiguous(), float(norm.eps))


def fits(x: torch.Tensor, cache: KVCache) -> bool:
    """Whether a forward of rows `x` over `cache` can take the whole-step call (the kernels'
    clock, which times per-layer calls, turns it off)."""
    return (not kernels.clocking() and x.dtype == torch.float32 and cache.k.dtype in (torch.bfloat16, torch.int8)
            and all(k.is_contiguous() and v.is_contiguous() for k, v, _ in cache.buffers())
            and cache.k.device.type == "cpu")


def logit_rows(parts: list[Rows]) -> tuple[torch.Tensor, list[int]]:
    """The rows of the parts' rows together that need logits (each part's `logits_rows`, None: all),
    and how many each part has."""
    picked, counts, off = [], [], 0
    for p in parts:
        rows = torch.arange(off, off + p.size)
        rows = rows if p.logits_rows is None else rows[p.logits_rows]
        picked.append(rows)
        counts.append(int(rows.shape[0]))
        off += p.size
    return (picked[0] if len(picked) == 1 else torch.cat(picked)), counts


def run(step_plan: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: list[Rows], heads: int,
        step_head: Any = None, rows: torch.Tensor | None = None, window: int = 0, conv: int = 0
        ) -> torch.Tensor | None:
    """Every layer over the parts' new rows x [T, hidden] (one part after another; overwritten with
    the last layer's output), cos/sin [kinds, T, rotary dims] or [T, rotary dims] (`rope_tables`);
    each part's K/V go to its cache's pending slots and its `keep_q`'s layers get their rotated
    queries [heads, rows, head_dim], as the per-layer forward writes and keeps them. `window`: the
    windowed layers' (0: none), whose keys and mask each part's positions give (`window_mask`, as
    the per-layer forward computes them). `conv`: the convolution layers' kernel (0: none), whose states each
    part's cache keeps as its windowed layers' and whose taps its rows give (`Rows.conv_taps`); the parts keep
    no queries of them. With a head: the logits of x's rows `rows`, else None."""
    args, kept = [], []
    for p in parts:
        layers = sorted(p.keep_q) if p.keep_q else []
        queries = [torch.empty(heads, p.size, p.cache.head_dim) for _ in layers]
        part = (p.cache.k, p.cache.v, p.size, p.cache.length, p.tree_mask, layers, queries)
        if window:
            part += (*p.window(p.cache.length + p.size, window), p.cache.wk, p.cache.wv, p.cache.woffset)
        if conv:
            part += (p.cache.wk, conv_slots(p.conv_taps(conv), p.cache.woffset))
        args.append(part)
        kept.append((layers, queries))
    logits = kernels.load().forward_batch(step_plan, x, cos, sin, args, kernels.path_id(), step_head, rows)
    for p, (layers, queries) in zip(parts, kept, strict=True):
        if p.keep_q is not None:
            p.keep_q.update(zip(layers, queries, strict=True))
    return logits


def release_thread_team() -> bool:
    """Free the calling thread's idle OpenMP team, before other threads run the steps.

    libgomp keeps a team for every thread that has opened a parallel region (ours, or PyTorch's)
    until that thread exits, and counts their threads against the CPUs: once they outnumber them,
    every team's waits at the regions' ends and starts spin briefly and then sleep. A thread that
    loaded the models, measured their costs or ran `generate` and then hands the steps to a batch's
    thread leaves its team behind; with it, the batch thread's steps over an 8K document measured
    ~15% slower than the same forwards in `generate` (docs/log/2026-11-server-steps.md, "A lone 8K
    document through the server"). The team comes back if this thread opens a region again. Whether one was
    freed (False: no OpenMP 5.0 pause in this runtime, or the kernels are not built)."""
    if not kernels.available():
        return False
    return bool(kernels.load().release_thread_team())
