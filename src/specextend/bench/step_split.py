"""Where a one-row step goes: the quantized runtime's decode step split into its parts, against
the memory floor (weight bytes read / measured read bandwidth).

The step is timed two ways over the same cache: driven from Python one layer at a time (six
kernel calls a layer) and as the whole-step C++ call (runtime/fused_step.py). The Python-driven step is split
with the kernels' clock (`kernels.clocked`): the linear layers (the weight stream; the head
included), attention, the other operators (RoPE and the cache write, the embedding lookup and
the rotation angles, timed alone here) and the rest (Python and the hand-overs to the thread
team between calls). Each time is the best of `repeats` rounds, the ways interleaved, so a slow spell
on a shared machine lands on both; each round samples the memory's read rate first, and each ratio to
the floor is the median of the rounds' times against their own rounds' floors."""

from __future__ import annotations

import statistics
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
    row (a convolution layer's convolution: LFM2), called alone (their Python calls included)."""
    ext = kernels.load()
    tok, pos = torch.tensor([1]), torch.tensor([context])
    width = (model.cfg.num_heads + 2 * model.cfg.num_kv_heads) * model.cfg.head_dim
    qkv, bcx = torch.randn(1, width), torch.randn(1, 3 * model.cfg.hidden_size)
    kernel = model.cfg.conv_kernel

    def ops() -> None:
        model.embed(tok)
        cos, sin = model.rope(pos)
        for layer in model.layers:
            if layer.conv is not None:
                state, _, base = cache.layer(layer.index)
                taps = torch.arange(context - kernel + 1, context + 1)[None] - base
                ext.conv_rows(bcx, state[0], taps, layer.conv)
                continue
            q_norm = layer.q_norm.weight if layer.q_norm is not None else None
            k_norm = layer.k_norm.weight if layer.k_norm is not None else None
            k, v, base = cache.layer(layer.index)
            ext.rope_store(qkv, cos, sin, model.cfg.num_heads, q_norm, k_norm, layer.attn_norm.eps, k, v,
                           context - base)

    ops()
    return _best(ops, repeats)


def against_floors(rounds: list[dict[str, float]], parts: tuple[str, ...]) -> dict[str, float]:
    """Each part's best time over rounds, and the median over rounds of its time against its own round's
    floor (`floor_s`, the memory's rate sampled beside it): a round at a slower memory rate meets a higher
    floor, and a round whose rate moved between its sample and its step does not pick the figure (the
    pairing `moe.alternated` makes for an expert model's step)."""
    out = {}
    for part in parts:
        out[f"{part}_s"] = min(r[part] for r in rounds)
        out[f"{part}_of_floor"] = statistics.median(r[part] / r["floor_s"] for r in rounds)
    return out


def split_one_row(model: Any, context: int, weight_bytes: int, rate: Any, repeats: int = 20) -> dict[str, Any]:
    """A one-row step after `context` cached tokens: Python-driven and whole-step seconds, the
    Python-driven step's parts, and each against the memory floor (`weight_bytes` at the read rate
    `rate.sample()` gives in the same round: `runtime.ReadRate`)."""
    cache = model.new_cache(context + 8)
    model.prefill(torch.randint(0, model.cfg.vocab_size, (context,)), cache)
    tok, pos = torch.tensor([7]), torch.tensor([context])
    saved = model.step_rows

    def step(rows: int) -> None:
        model.step_rows = rows
        model(tok, pos, cache)
        cache.discard()

    rounds = []
    try:
        step(0), step(saved)  # warm-up (the whole step's plan is built here)
        for _ in range(repeats):
            floor = weight_bytes / (rate.sample() * 1e9)
            python = _best(lambda: step(0), 1)
            whole = _best(lambda: step(saved), 1)
            model.step_rows = 0
            with kernels.clocked() as clock:
                model(tok, pos, cache)
            cache.discard()
            rounds.append({"floor_s": floor, "python_step": python, "whole_step": whole, "linear": clock.linear_s,
                           "attention": clock.attention_s})
    finally:
        model.step_rows = saved
    out = against_floors(rounds, ("python_step", "whole_step", "linear"))  # the parts that read the weights
    out["attention_s"] = min(r["attention"] for r in rounds)
    out["other_ops_s"] = _other_ops_s(model, cache, context, repeats)
    out["rest_s"] = out["python_step_s"] - out["linear_s"] - out["attention_s"] - out["other_ops_s"]
    floors = [r["floor_s"] for r in rounds]
    out.update(context=context, floor_s=min(floors), floor_s_span=[min(floors), max(floors)])
    out["python_of_floor"], out["whole_of_floor"] = out.pop("python_step_of_floor"), out.pop("whole_step_of_floor")
    return out


def report(split: dict[str, Any]) -> str:
    """The split as text."""
    ms = {k: v * 1e3 for k, v in split.items() if k.endswith("_s")}
    lo, hi = (x * 1e3 for x in split["floor_s_span"])
    floor = f"{lo:.1f} ms" if hi <= 1.1 * lo else f"{lo:.1f}-{hi:.1f} ms, the read rate moving between rounds"
    return (f"one-row step over a {split['context']}-token cache (memory floor {floor}; each ratio the median of "
            f"the rounds' against their own floors): driven from Python {ms['python_step_s']:.1f} ms "
            f"({split['python_of_floor']:.2f}x the floor) = linear layers {ms['linear_s']:.1f} "
            f"({split['linear_of_floor']:.2f}x the floor) + attention {ms['attention_s']:.1f} + other operators "
            f"{ms['other_ops_s']:.1f} + rest {ms['rest_s']:.1f}; whole step in C++ {ms['whole_step_s']:.1f} ms "
            f"({split['whole_of_floor']:.2f}x the floor)")
