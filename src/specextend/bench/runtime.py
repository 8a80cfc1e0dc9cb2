"""Runtime micro-benchmark: load time, prefill speed, decode and verification cost, and the
memory-bandwidth floor of a decode step.

    python -m specextend.bench.runtime [--target REF] [--dtype float32] [--context 2048]
                                       [--rows 1,4,8,16] [--json]

The floor is (weight bytes read per forward) / (measured memory read bandwidth): no
implementation can run a decode step faster on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from ..models.loader import QUANTIZED_WEIGHTS
from ..options import add_model_arguments, model_options


def read_bandwidth_gbs(mb: int = 1024, repeats: int = 5) -> float:
    """Streaming read bandwidth: sum a buffer far larger than the caches (best of several)."""
    buf = torch.ones(mb * 1024 * 1024 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def cpu_kernels(model) -> str | None:
    """The kernel path the model's quantized weights run on (None for float weights)."""
    from .. import kernels

    return kernels.path() if model.weights in QUANTIZED_WEIGHTS else None


def weight_bytes_per_forward(model) -> int:
    """Bytes of weights one forward reads: everything except the embedding table (a lookup)."""
    total = 0
    for name, mod in model.named_modules():
        if name.endswith("embed"):
            continue
        if getattr(mod, "qweight", None) is not None:
            total += mod.qweight.nbytes
        elif getattr(mod, "packed", None) is not None:
            total += mod.packed.numel() * mod.packed.element_size()
        elif getattr(mod, "weight", None) is not None:
            total += mod.weight.numel() * mod.weight.element_size()
    return total


def elapsed(fn) -> float:
    """Seconds of one call of `fn`."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap, draft=False)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    from .. import api

    ap = _parser()
    a = ap.parse_args(argv)
    try:
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: comma-separated whole numbers, not {a.rows!r}")
    if min([a.context, a.prefill_tokens, a.repeats, *rows]) < 1:
        ap.error("--context, --prefill-tokens, --repeats and --rows must be at least 1")
    if a.device != "cpu":
        # The floor is CPU memory bandwidth; GPU kernels are timed by specextend.bench.kernels.
        print("specextend runtime: error: --device cpu only (see python -m specextend.bench.kernels)",
              file=sys.stderr)
        return 2
    prepared = api.prepare(a.target, load_draft=False, **model_options(a))
    t = time.perf_counter()
    pair = prepared.load()
    res: dict[str, Any] = {"model": str(pair.target_path), "dtype": a.dtype, "weights": pair.target.weights,
                           "load_s": time.perf_counter() - t, "threads": torch.get_num_threads(),
                           "cpu_kernels": cpu_kernels(pair.target)}
    res.update(prefill_speed(pair.target, a.prefill_tokens))
    res.update(step_costs(pair.target, a.context, rows, a.repeats))
    bw = read_bandwidth_gbs()
    wb = weight_bytes_per_forward(pair.target)
    res.update(read_bandwidth_gbs=bw, weight_bytes=wb, floor_s=wb / (bw * 1e9))
    print(json.dumps(res, indent=2) if a.json else report(res, a.prefill_tokens))
    return 0


def prefill_speed(model: Any, tokens: int) -> dict[str, float]:
    """Prefill tokens per second of a random prompt, per attention backend."""
    cache = model.new_cache(tokens + 64)
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,))
    for backend in ("eager", "efficient"):  # first-use kernel builds stay out of the timings
        cache.reset()
        model.prefill(ids[:512], cache, backend)
    out = {}
    for backend in ("efficient", "eager"):
        cache.reset()
        t = time.perf_counter()
        model.prefill(ids, cache, backend)
        out[f"prefill_tokens_per_s_{backend}"] = tokens / (time.perf_counter() - t)
    return out


def step_costs(model: Any, context: int, rows: list[int], repeats: int) -> dict[str, Any]:
    """Seconds of one forward of each row count (a causal block) over a cache of `context` tokens."""
    cache = model.new_cache(context + max(rows) + 64)
    model.prefill(torch.randint(0, model.cfg.vocab_size, (context,)), cache, "efficient")
    steps = {}
    for r in rows:
        toks = torch.randint(0, model.cfg.vocab_size, (r,))
        pos = torch.arange(context, context + r)
        mask = torch.ones(r, r, dtype=torch.bool).tril_()

        def step(toks=toks, pos=pos, mask=mask):
            model(toks, pos, cache, mask, "efficient")
            cache.discard()

        steps[r] = step
        step()  # warm-up
    # Row counts interleaved within each repeat, so a slow spell on a shared machine lands on all
    # of them rather than on one; each keeps its best time.
    per_rows = {r: float("inf") for r in rows}
    for _ in range(repeats):
        for r in rows:
            per_rows[r] = min(per_rows[r], elapsed(steps[r]))
    out: dict[str, Any] = {"forward_s_at_context": {str(r): per_rows[r] for r in rows}, "context": context}
    if 1 in per_rows:
        out["rows_cost_vs_one"] = {str(r): per_rows[r] / per_rows[1] for r in rows}
    return out


def report(res: dict[str, Any], prefill_tokens: int) -> str:
    """The measurements as text."""
    lines = [f"model {res['model']} ({res['dtype']}, {res['weights']} weights, kernels {res['cpu_kernels']}), "
             f"{res['threads']} threads, loaded in {res['load_s']:.1f} s",
             f"prefill: {res['prefill_tokens_per_s_efficient']:.1f} tok/s efficient, "
             f"{res['prefill_tokens_per_s_eager']:.1f} tok/s eager ({prefill_tokens} tokens)",
             f"forward over a {res['context']}-token cache:"]
    vs_one = res.get("rows_cost_vs_one", {})
    for r, seconds in res["forward_s_at_context"].items():
        extra = f"  ({vs_one[r]:.2f}x one row)" if vs_one else ""
        lines.append(f"  {int(r):3d} new tokens: {seconds * 1e3:7.1f} ms{extra}")
    lines.append(f"floor: {res['weight_bytes'] / 1e9:.2f} GB of weights / {res['read_bandwidth_gbs']:.1f} GB/s read "
                 f"bandwidth = {res['floor_s'] * 1e3:.0f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
