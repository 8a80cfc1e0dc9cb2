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

import torch

from ..models.loader import QUANTIZED_WEIGHTS, add_model_arguments, load_model, parse_dtype
from ..models.registry import resolve_model_ref


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


def timed(fn, repeats: int, warmup: bool = True) -> float:
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap, draft=False)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    if a.device != "cpu":
        # The floor is CPU memory bandwidth; GPU kernels are timed by specextend.bench.kernels.
        print("specextend runtime: error: --device cpu only (see python -m specextend.bench.kernels)",
              file=sys.stderr)
        return 2
    path = resolve_model_ref(a.target, "target")
    t = time.perf_counter()
    model = load_model(path, parse_dtype(a.dtype), weights=a.weights)
    load_s = time.perf_counter() - t
    vocab = model.cfg.vocab_size
    res: dict = {"model": str(path), "dtype": a.dtype, "weights": model.weights, "load_s": load_s,
                 "threads": torch.get_num_threads(), "cpu_kernels": cpu_kernels(model)}

    cache = model.new_cache(max(a.context, a.prefill_tokens) + 64)
    ids = torch.randint(0, vocab, (a.prefill_tokens,))
    model.prefill(ids[:512], cache, "eager")  # first-use kernel builds stay out of the timings
    model.prefill(ids[:512], cache, "efficient")
    for backend in ("efficient", "eager"):
        cache.reset()
        t = time.perf_counter()
        model.prefill(ids, cache, backend)
        res[f"prefill_tokens_per_s_{backend}"] = a.prefill_tokens / (time.perf_counter() - t)

    cache.reset()
    model.prefill(torch.randint(0, vocab, (a.context,)), cache, "efficient")
    rows = [int(r) for r in a.rows.split(",")]
    steps = {}
    for r in rows:
        toks = torch.randint(0, vocab, (r,))
        pos = torch.arange(a.context, a.context + r)
        mask = torch.ones(r, r, dtype=torch.bool).tril_()

        def step(toks=toks, pos=pos, mask=mask):
            model(toks, pos, cache, mask, "efficient")
            cache.discard()

        steps[r] = step
        step()  # warm-up
    # Row counts interleaved within each repeat, so a slow spell on a shared machine lands on all
    # of them rather than on one; each keeps its best time.
    per_rows = {r: float("inf") for r in rows}
    for _ in range(a.repeats):
        for r in rows:
            per_rows[r] = min(per_rows[r], timed(steps[r], 1, warmup=False))
    res["forward_s_at_context"] = {str(r): per_rows[r] for r in rows}
    res["context"] = a.context
    if 1 in per_rows:
        res["rows_cost_vs_one"] = {str(r): per_rows[r] / per_rows[1] for r in rows}
    bw = read_bandwidth_gbs()
    wb = weight_bytes_per_forward(model)
    res["read_bandwidth_gbs"] = bw
    res["weight_bytes"] = wb
    res["floor_s"] = wb / (bw * 1e9)

    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    out = sys.stdout
    print(f"model {path} ({a.dtype}, {model.weights} weights, kernels {res['cpu_kernels']}), {res['threads']} "
          f"threads, loaded in {load_s:.1f} s", file=out)
    print(f"prefill: {res['prefill_tokens_per_s_efficient']:.1f} tok/s efficient, "
          f"{res['prefill_tokens_per_s_eager']:.1f} tok/s eager ({a.prefill_tokens} tokens)", file=out)
    print(f"forward over a {a.context}-token cache:", file=out)
    for r in rows:
        extra = f"  ({res['rows_cost_vs_one'][str(r)]:.2f}x one row)" if 1 in per_rows else ""
        print(f"  {r:3d} new tokens: {per_rows[r] * 1e3:7.1f} ms{extra}", file=out)
    print(f"floor: {wb / 1e9:.2f} GB of weights / {bw:.1f} GB/s read bandwidth = {res['floor_s'] * 1e3:.0f} ms",
          file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
