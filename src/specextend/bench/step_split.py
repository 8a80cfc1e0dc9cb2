"""Where a one-row step goes: the quantized runtime's decode step split into its parts, against
the memory floor (weight bytes read / measured read bandwidth).

The step is timed two ways over the same cache: driven from Python one layer at a time (six
kernel calls a layer) and as the whole-step C++ call (runtime/fused_step.py). The Python-driven step is split
with the kernels' clock (`kernels.clocked`): the linear layers (the weight stream; the head
included), attention, the other operators (RoPE and the cache write, the embedding lookup and
the rotation angles, timed alone here) and the rest (Python and the hand-overs to the thread
team between calls). Each time is the best of `repeats`, the ways interleaved, so a slow spell
on a shared machine lands on both."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..runtime import kernels


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _other_ops_s(model: Any, cache: Any, context: int, repeats: int) -> float:
    """The embedding lookup, the rotation angles and every layer's RoPE and cache write of one
    row, called alone (their Python calls included)."""
    ext = kernels.load()
    tok, pos = torch.tensor([1]), torch.tensor([context])
    width = (model.cfg.num_heads + 2 * model.cfg.num_kv_heads) * model.cfg.head_dim
    qkv = torch.randn(1, width)

    def ops() -> None:
        model.embed(tok)
        cos, sin = model.rope(pos)
        for layer in model.layers:
            q_norm = layer.q_norm.weight if layer.q_norm is not None else None
            k_norm = layer.k_norm.weight if layer.k_norm is not None else None
            k, v, base = cache.layer(layer.index)
            ext.rope_store(qkv, cos, sin, model.cfg.num_heads, q_norm, k_norm, layer.attn_norm.eps, k, v,
                           context - base)

    ops()
    return _best(ops, repeats)


def split_one_row(model: Any, context: int, floor_s: float, repeats: int = 20) -> dict[str, Any]:
    """A one-row step after `context` cached tokens: Python-driven and whole-step seconds, the
    Python-driven step's parts, and each against `floor_s`."""
    cache = model.new_cache(context + 8)
    model.prefill(torch.randint(0, model.cfg.vocab_size, (context,)), cache)
    tok, pos = torch.tensor([7]), torch.tensor([context])
    saved = model.step_rows

    def step(rows: int) -> None:
        model.step_rows = rows
        model(tok, pos, cache)
        cache.discard()

    try:
        step(0), step(saved)  # warm-up (the whole step's plan is built here)
        python_s, whole_s = float("inf"), float("inf")
        for _ in range(repeats):
            python_s = min(python_s, _best(lambda: step(0), 1))
            whole_s = min(whole_s, _best(lambda: step(saved), 1))
        linear_s = attention_s = float("inf")
        for _ in range(repeats):
            model.step_rows = 0
            with kernels.clocked() as clock:
                model(tok, pos, cache)
            cache.discard()
            linear_s, attention_s = min(linear_s, clock.linear_s), min(attention_s, clock.attention_s)
    finally:
        model.step_rows = saved
    other_s = _other_ops_s(model, cache, context, repeats)
    rest_s = python_s - linear_s - attention_s - other_s
    return {"context": context, "floor_s": floor_s, "python_step_s": python_s, "whole_step_s": whole_s,
            "linear_s": linear_s, "attention_s": attention_s, "other_ops_s": other_s, "rest_s": rest_s,
            "python_of_floor": python_s / floor_s, "whole_of_floor": whole_s / floor_s,
            "linear_of_floor": linear_s / floor_s}


def report(split: dict[str, Any]) -> str:
    """The split as text."""
    ms = {k: v * 1e3 for k, v in split.items() if k.endswith("_s")}
    return (f"one-row step over a {split['context']}-token cache (memory floor {ms['floor_s']:.1f} ms): "
            f"driven from Python {ms['python_step_s']:.1f} ms ({split['python_of_floor']:.2f}x the floor) = "
            f"linear layers {ms['linear_s']:.1f} ({split['linear_of_floor']:.2f}x the floor) + attention "
            f"{ms['attention_s']:.1f} + other operators {ms['other_ops_s']:.1f} + rest {ms['rest_s']:.1f}; "
            f"whole step in C++ {ms['whole_step_s']:.1f} ms ({split['whole_of_floor']:.2f}x the floor)")
