"""The quantized runtime's whole-step forward: every layer of a few new tokens in one C++ call.

A one-row decode step driven from Python (`model.Block.forward_rows`) makes six kernel calls a
layer, each a crossing into C++ and a hand-over to the thread team; for a small draft that is a
visible share of a step whose floor is a dozen milliseconds (docs/benchmarks.md). The C++ core
(csrc/core/step.h) runs the same kernels with the same arguments for every layer in one
parallel region, so its outputs are the Python-driven step's bits. This module describes a
model's layers to it once (`plan`) and runs a forward (`run`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import kernels

if TYPE_CHECKING:
    from .kv_cache import KVCache
    from .model import Linear, Transformer

# Forwards of at most this many rows of one sequence take the whole-step call (a decode step, a
# draft's tree level, a small verification); larger ones (prefill chunks) keep the per-layer
# kernels, where the Python between calls is a small share.
STEP_ROWS = 16


def _weight(lin: Linear) -> tuple[Any, ...]:
    w = lin.qweight
    bias = None if lin.bias is None else lin.bias.detach().float().contiguous()
    return (w.blobs, w.formats, w.widths, w.offsets, w.groups, bias)


def plan(model: Transformer) -> Any:
    """The model's layers as the C++ step takes them (the plan keeps its tensors alive)."""
    cfg = model.cfg
    p = kernels.load().step_plan(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 float(model.layers[0].attn_norm.eps))
    for layer in model.layers:
        q_norm = layer.q_norm.weight.detach().contiguous() if layer.q_norm is not None else None
        k_norm = layer.k_norm.weight.detach().contiguous() if layer.k_norm is not None else None
        p.add_layer(_weight(layer.qkv), _weight(layer.o), _weight(layer.gate_up), _weight(layer.down),
                    layer.attn_norm.weight.detach().contiguous(), layer.mlp_norm.weight.detach().contiguous(),
                    q_norm, k_norm)
    return p


def fits(x: torch.Tensor, cache: KVCache) -> bool:
    """Whether a forward of rows `x` over `cache` can take the whole-step call (the kernels'
    clock, which times per-layer calls, turns it off)."""
    return (not kernels.clocking() and x.dtype == torch.float32 and cache.k.dtype == torch.bfloat16
            and cache.k.is_contiguous() and cache.v.is_contiguous() and cache.k.device.type == "cpu")


def run(step_plan: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
        tree_mask: torch.Tensor | None, keep_q: dict[int, torch.Tensor | None] | None = None,
        heads: int = 0) -> torch.Tensor:
    """Every layer over the new rows x [t, hidden] (overwritten with the last layer's output, returned);
    their K/V go to the cache's pending slots, as the per-layer forward writes them. `keep_q`'s
    layers get their rotated queries [heads, t, head_dim], as the per-layer forward keeps them."""
    layers = sorted(keep_q) if keep_q else []
    queries = [torch.empty(heads, x.shape[0], cache.k.shape[-1]) for _ in layers]
    out = kernels.load().forward_step(step_plan, x.contiguous(), cos, sin, cache.k, cache.v, cache.length,
                                      tree_mask, kernels._path_id(), layers, queries)
    if keep_q is not None:
        keep_q.update(zip(layers, queries, strict=True))
    return out
