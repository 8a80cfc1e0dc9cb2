"""Decode speed at long context, per KV cache kind, side by side: does a step hold its speed to 32K?

    python -m specextend.bench.long_decode --data ../shared/data/govreport/govreport_16K.jsonl \\
        --lengths 2048,8192,16384 --kv-caches bf16,q8 [--new-tokens 48] [--repeats 2] [--json]

The texts are joined into one token stream and its first max(lengths) tokens prefilled once (the
target alone, bfloat16 cache); for each length the cache is cut back to that many tokens and the
target decodes `--new-tokens` greedy tokens one at a time, as `ar` does (the first step untimed).
A q8 cache is the prefilled cache's rows quantized by the kernels' own write (its values differ
slightly from a q8 prefill's, which saw q8 attention; its cost per step is the same), so every kind
decodes over the same prompt in the same process, lengths and kinds interleaved within each
repeat and each keeping its best. Beside the speeds, the memory floor of a step: the weights and
the KV read once, at the read bandwidth `bench.runtime` measures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..common.jsonl import read_texts
from ..options import OneLineParser, add_model_arguments, model_options
from .runtime import ReadRate, cpu_kernels, moved_note, parse_counts, weight_bytes_per_forward


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m specextend.bench.long_decode", description=__doc__.splitlines()[0])
    add_model_arguments(ap, draft=False)
    ap.add_argument("--data", required=True, help="JSONL file(s) with a `text` field, joined in order")
    ap.add_argument("--lengths", default="2048,8192,16384", help="context lengths (default: 2048,8192,16384)")
    ap.add_argument("--kv-caches", default="bf16,q8", help="KV cache kinds side by side (default: bf16,q8)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    return ap


def as_q8(model: Any, cache: Any) -> Any:
    """A q8 copy of a bfloat16 cache's committed rows, written by the kernels' own quantizer."""
    from ..runtime import kernels

    ext = kernels.load()
    model.kv_cache = "q8"
    out = model.new_cache(cache.capacity)
    model.kv_cache = "bf16"
    d, kvh = cache.head_dim, cache.k.shape[1]
    out.woffset = cache.woffset
    for layer in range(model.cfg.num_layers):
        k, v, base = cache.layer(layer)
        ok, ov, _ = out.layer(layer)
        n = cache.length - base  # a windowed layer's: its kept tokens
        rows = [t[:, :n].float().transpose(0, 1).reshape(n, kvh * d) for t in (k, v)]
        h = torch.cat([torch.zeros(n, d), *rows], 1).contiguous()
        # keys less the layer's offset where the model has one, as its own writes store them
        ext.rope_store(h, torch.ones(n, d), torch.zeros(n, d), 1, None, None, 1e-6, ok, ov, 0,
                       model.layers[layer].k_offset)
    out.length = cache.length
    return out


def decode_speed(model: Any, cache: Any, ids: torch.Tensor, length: int, new: int) -> float:
    """Tokens per second of `new` greedy one-row steps after the first `length` tokens of `ids`."""
    # Back (or forward) to `length` committed slots: a shorter length's decode has overwritten a few
    # prompt slots with its own tokens' KV, which costs a step the same.
    cache.length, cache.pending = length, 0
    nxt, t0 = int(ids[length - 1]), 0.0
    for i in range(new + 1):
        if i == 1:
            t0 = time.perf_counter()
        logits = model(torch.tensor([nxt]), torch.tensor([length + i]), cache, None, "efficient")
        cache.commit()
        nxt = int(logits[-1].argmax())
    return new / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    from .. import api

    ap = _parser()
    a = ap.parse_args(argv)
    lengths = parse_counts(ap, "--lengths", a.lengths)
    kinds = [k for k in a.kv_caches.split(",") if k]
    if any(k not in ("bf16", "q8") for k in kinds) or not kinds or a.new_tokens < 1 or a.repeats < 1:
        ap.error("--kv-caches takes bf16 and/or q8; --new-tokens and --repeats at least 1")
    prepared = api.prepare(a.target, load_draft=False, **model_options(a))
    model, tok = prepared.load().target, prepared.tokenizer
    if "q8" in kinds and not model.fused:
        ap.error("a q8 cache needs the quantized CPU kernels")
    ids: list[int] = []
    for p in a.data.split(","):
        for text in read_texts(Path(p)):
            ids += tok.encode(text, add_special_tokens=False)
    if len(ids) < max(lengths) or max(lengths) + a.new_tokens + 1 > model.cfg.max_position:
        ap.error(f"--lengths: {max(lengths)} tokens (+ --new-tokens) is beyond the texts' {len(ids)} tokens "
                 f"or the model's {model.cfg.max_position} positions")
    prompt = torch.tensor(ids[: max(lengths)])
    base = model.new_cache(max(lengths) + a.new_tokens + 8)
    t = time.perf_counter()
    model.prefill(prompt, base, "efficient")
    res: dict[str, Any] = {"prefill_tokens": len(prompt), "prefill_s": time.perf_counter() - t,
                           "cpu_kernels": cpu_kernels(model), "threads": torch.get_num_threads()}
    caches = {k: base if k == "bf16" else as_q8(model, base) for k in kinds}
    speed = {f"{k}@{n}": 0.0 for n in lengths for k in kinds}
    rate = ReadRate()  # sampled beside every decode: the memory's rate can move within the run
    rate.sample()
    for _ in range(a.repeats):
        for n in lengths:
            for k in kinds:
                speed[f"{k}@{n}"] = max(speed[f"{k}@{n}"], decode_speed(model, caches[k], prompt, n, a.new_tokens))
                rate.sample()
    res["decode_tokens_per_s"] = speed
    res.update(floors(model, kinds, lengths, rate.span))
    print(json.dumps(res, indent=2) if a.json else report(res, kinds, lengths))
    return 0


def floors(model: Any, kinds: list[str], lengths: list[int], span: tuple[float, float]) -> dict[str, Any]:
    """Bytes a one-row step reads (weights, and each kind's KV at each length) and the tokens per
    second that reading them once allows at the highest read rate of `span` (GB/s, sampled beside the
    decodes; both ends reported)."""
    from ..runtime.kv_cache import row_bytes

    c, bw, wb = model.cfg, span[1], weight_bytes_per_forward(model)
    dtypes = {"bf16": torch.bfloat16, "q8": torch.int8}
    kv = {f"{k}@{n}": 2 * c.num_layers * c.num_kv_heads * n * row_bytes(c.head_dim, dtypes[k])
          for k in kinds for n in lengths}
    return {"read_bandwidth_gbs": bw, "read_bandwidth_gbs_span": list(span), "weight_bytes": wb, "kv_bytes": kv,
            "floor_tokens_per_s": {key: bw * 1e9 / (wb + b) for key, b in kv.items()}}


def report(res: dict[str, Any], kinds: list[str], lengths: list[int]) -> str:
    sp, fl = res["decode_tokens_per_s"], res["floor_tokens_per_s"]
    lines = [f"prefill {res['prefill_tokens']} tokens in {res['prefill_s']:.1f} s; kernels {res['cpu_kernels']}, "
             f"{res['threads']} threads; read bandwidth {res['read_bandwidth_gbs']:.1f} GB/s"
             f"{moved_note(res.get('read_bandwidth_gbs_span'))}, weights {res['weight_bytes'] / 1e6:.0f} MB", "",
             "| context | " + " | ".join(f"{k} tok/s (vs its {lengths[0]}) | {k} floor" for k in kinds) + " |",
             "|---:|" + "---:|---:|" * len(kinds)]
    for n in lengths:
        cells = [f"{sp[f'{k}@{n}']:.2f} ({sp[f'{k}@{n}'] / sp[f'{k}@{lengths[0]}']:.2f}x) | {fl[f'{k}@{n}']:.1f}"
                 for k in kinds]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
