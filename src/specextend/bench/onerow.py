"""The one-row quantized product alone: is a decode step's linear layer bound by memory or by
instructions on this CPU?

    python -m specextend.bench.onerow [--formats q4k,q6k] [--threads 1,2] [--shape 1536x8960]
                                      [--rows 1,9] [--stream-mb 512] [--repeats 5] [--json OUT]

A decode step multiplies one row of activations by every weight once, so its floor is the
weights' bytes over the memory bandwidth (`bench.runtime`). This times the kernel path's one-row
product (`quant.qlinear`, the path `SPECEXTEND_CPU` or the CPU picks) of a random matrix in each
format, two ways, best of `--repeats`:

- **cold**: a different copy of the matrix each call, the copies together far larger than the
  caches (`--stream-mb`), as a model's layers stream through a decode step;
- **hot**: the same copy every call, so the weights come from the caches: the kernel with the
  memory taken away, what its instructions alone allow (the matrix must fit the last-level
  cache for this to hold: the default shape does on most CPUs; `--shape` can make it larger).

Both as GB/s of weight bytes beside the read bandwidth measured in the same run with the same
threads. Hot at or below the bandwidth means no overlap of loads and work can reach the memory
floor on this CPU (the product is bound by instructions); hot far above cold means the loads are
what it waits for.

`--rows` asks the same of a few rows at once (a verification's tree, a small batch): the bytes are
the same, the work R times one row's, so where hot falls below the read rate the rows' arithmetic,
not the weights' stream, sets the product's time, and cold against hot says how much of the stream
the arithmetic hides.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ..options import OneLineParser
from ..runtime import hugepages, kernels, quant
from .runtime import ReadRate, moved_note, parse_counts

FORMATS = ("q4k", "q6k", "q5k", "iq4", "iq3s", "iq3xxs", "iq2xxs", "iq1s", "q3k", "iq2xs", "iq1m", "q2k", "q8", "q40",
           "q50", "iq4nl", "q41", "q51", "mxfp4", "f16", "bf16", "bf16d")
# q8's header over 4- and 5-bit codes: (code count, offset) of Q4_0's, Q5_0's and IQ4_NL's grids.
Q8_HEADER_CODES = {"q40": (16, 8), "q50": (32, 16), "iq4nl": (16, 128), "q41": (16, 0), "q51": (32, 0)}


def random_weight(fmt: str, n: int, k: int, seed: int = 0) -> quant.QWeight:
    """A random n x k matrix packed as `fmt` (q4k, q5k and the table formats: 8 groups a super-block; q6k, q3k,
    iq2xs, iq1m, q2k; q8: Q8_0; q40, q50, iq4nl, q41, q51: Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1; mxfp4: MXFP4; f16, bf16;
    bf16d: BF16 on bfloat16 dot products), real layout."""
    rng = np.random.default_rng(seed)
    if fmt == "q4k":
        seg = quant.pack_q4k(rng.uniform(0.01, 0.1, (n, k // 256)).astype(np.float16),
                             rng.uniform(0.01, 0.1, (n, k // 256)).astype(np.float16),
                             rng.integers(0, 64, (n, k // 32), dtype=np.uint8),
                             rng.integers(0, 64, (n, k // 32), dtype=np.uint8),
                             rng.integers(0, 16, (n, k), dtype=np.uint8))
    elif fmt == "q6k":
        seg = quant.pack_q6k(rng.uniform(0.01, 0.1, (n, k // 256)).astype(np.float16),
                             rng.integers(-64, 64, (n, k // 16), dtype=np.int8),
                             rng.integers(0, 64, (n, k), dtype=np.uint8))
    elif fmt in ("q3k", *quant.Q3_FORMATS):  # Q3_K's grid, or a table's (IQ2_XS's, IQ1_M's: six values)
        d = rng.uniform(0.01, 0.1, (n, k // 256)).astype(np.float32 if fmt in quant.F32_D else np.float16)
        seg = quant.pack_q3k(d,
                             rng.integers(-32, 32, (n, k // 16), dtype=np.int8),
                             rng.integers(0, 8 if fmt == "q3k" else 6, (n, k), dtype=np.uint8), fmt)
    elif fmt == "q2k":
        seg = quant.pack_q2k(rng.uniform(0.01, 0.1, (n, k // 256)).astype(np.float16),
                             rng.uniform(0.01, 0.1, (n, k // 256)).astype(np.float16),
                             rng.integers(0, 256, (n, k // 16), dtype=np.uint8),
                             rng.integers(0, 4, (n, k), dtype=np.uint8))
    elif fmt in quant.K_CODE_BYTES:  # Q5_K's grid, or IQ4_XS's and IQ3_S's (no minimums)
        q5 = fmt == "q5k"
        dmin = rng.uniform(0.01, 0.1, (n, k // 256)).astype(np.float16) if q5 else None
        mn = rng.integers(0, 64, (n, k // 32), dtype=np.uint8) if q5 else None
        d = rng.uniform(0.01, 0.1, (n, k // 256)).astype(np.float32 if fmt in quant.F32_D else np.float16)
        seg = quant.pack_kgroups(fmt, d, dmin,
                                 rng.integers(0 if q5 else -32, 64 if q5 else 32, (n, k // 32), dtype=np.int8), mn,
                                 rng.integers(0, 32 if q5 else 16, (n, k), dtype=np.uint8), 0 if q5 else 128, 8)
    elif fmt == "q8":  # Q8_0's blocks: a float16 scale, 32 int8 codes
        scales = rng.uniform(0.01, 0.1, (n, k // 32, 1)).astype(np.float16).view(np.uint8)
        codes = rng.integers(-128, 128, (n, k // 32, 32), dtype=np.int8).view(np.uint8)
        seg = quant.from_gguf_blocks("Q8_0", np.concatenate([scales, codes], axis=2).reshape(n, -1), n, k)
    elif fmt in Q8_HEADER_CODES:
        count, offset = Q8_HEADER_CODES[fmt]
        dmin = rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float16) if fmt in quant.MIN_FORMATS else None
        seg = quant.pack_q8(rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float16),
                            rng.integers(0, count, (n, k), dtype=np.uint8), offset, fmt, dmin)
    elif fmt == "mxfp4":  # an E8M0 exponent a block (scales 2^-13..2^-4), 4-bit codes
        seg = quant.pack_q8(rng.integers(115, 125, (n, k // 32), dtype=np.uint8),
                            rng.integers(0, 16, (n, k), dtype=np.uint8), 128, "mxfp4")
    elif fmt in ("f16", "bf16", "bf16d"):  # the file's 16-bit floats
        w = torch.from_numpy((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
        kind = "F16" if fmt == "f16" else "BF16"
        seg = quant.pack_float(kind, w.to(torch.float16 if fmt == "f16" else torch.bfloat16).view(torch.int16)
                               .numpy(), n, k, dot=fmt == "bf16d")
    else:
        raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    return quant.QWeight(k, [seg])


def parse_formats(ap: argparse.ArgumentParser, value: str) -> list[str]:
    """--formats: a comma-separated list of FORMATS (one-line error otherwise)."""
    formats = [f.strip() for f in value.split(",")]
    if bad := [f for f in formats if f not in FORMATS]:
        ap.error(f"--formats: unknown {', '.join(bad)} (any of {', '.join(FORMATS)})")
    return formats


def _copy(w: quant.QWeight) -> quant.QWeight:
    """A copy in the kind of memory a loaded model's weights get (runtime/hugepages.py)."""
    return quant.QWeight(w.k, [quant.Segment(s.fmt, s.n, hugepages.like_weights(s.nbytes).copy_(s.blob), s.offset,
                                             s.k, s.groups) for s in w.segments])


def best_call_s(x: torch.Tensor, weights: list[quant.QWeight], repeats: int) -> float:
    """Best over `repeats` passes of the mean seconds of one product, cycling through `weights`."""
    out = torch.empty(x.shape[0], weights[0].n)
    for w in weights:  # first touch and a warm-up
        quant.qlinear(x, w, out=out)
    calls = max(len(weights), 64)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(calls):
            quant.qlinear(x, weights[i % len(weights)], out=out)
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def measure(fmt: str, n: int, k: int, threads: int, stream_mb: int, repeats: int, rows: int = 1) -> dict[str, Any]:
    """One format's cold and hot product of `rows` rows on `threads` threads (`against_floor` adds the
    memory's floor)."""
    torch.set_num_threads(threads)
    w = random_weight(fmt, n, k)
    copies = [w] + [_copy(w) for _ in range(max(1, stream_mb * 2**20 // w.nbytes) - 1)]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    cold, hot = best_call_s(x, copies, repeats), best_call_s(x, [w], repeats)
    del copies
    return {"format": fmt, "n": n, "k": k, "threads": threads, "rows": rows, "weight_mb": w.nbytes / 1e6,
            "cold_us": cold * 1e6, "hot_us": hot * 1e6, "cold_gbs": w.nbytes / cold / 1e9,
            "hot_gbs": w.nbytes / hot / 1e9, "gmacs_cold": rows * n * k / cold / 1e9,
            "gmacs_hot": rows * n * k / hot / 1e9}


def against_floor(row: dict[str, Any], span: tuple[float, float]) -> dict[str, Any]:
    """`row` against the machine's read rate on its threads: the highest of `span` (GB/s, sampled beside
    every product on those threads; one figure a thread count, not one a format), both ends reported."""
    bw = span[1]
    return {**row, "read_bandwidth_gbs": bw, "read_bandwidth_gbs_span": list(span),
            "cold_of_floor": bw / row["cold_gbs"], "hot_of_floor": bw / row["hot_gbs"]}


def report(rows: list[dict[str, Any]]) -> str:
    lines = ["| format | shape | threads | rows | MB | cold GB/s | hot GB/s | read GB/s | cold / floor | hot / floor "
             "| hot G MAC/s | cold vs one row |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    one = {(r["format"], r["threads"]): r["cold_us"] for r in rows if r.get("rows", 1) == 1}
    for r in rows:
        base = one.get((r["format"], r["threads"]))
        vs_one = f"{r['cold_us'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['format']} | {r['n']}x{r['k']} | {r['threads']} | {r.get('rows', 1)} | "
                     f"{r['weight_mb']:.1f} | {r['cold_gbs']:.1f} | {r['hot_gbs']:.1f} | "
                     f"{r['read_bandwidth_gbs']:.1f} | "
                     f"{r['cold_of_floor']:.2f}x | {r['hot_of_floor']:.2f}x | {r['gmacs_hot']:.0f} | {vs_one} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m specextend.bench.onerow", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="any of " + ", ".join(FORMATS))
    ap.add_argument("--threads", default=None, help="thread counts (default: 1 and all of torch's)")
    ap.add_argument("--shape", default="2048x1536", help="N x K: output channels x inputs (default: 1.8 MB "
                    "in q4k, 2.5 in q6k: inside most CPUs' last-level cache, so that hot means hot)")
    ap.add_argument("--rows", default="1", help="row counts a product takes (default 1: a decode step; "
                    "e.g. 1,4,9: a verification's tree)")
    ap.add_argument("--stream-mb", type=int, default=512, help="the cold copies together (far above the caches)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    formats = parse_formats(ap, a.formats)
    shape = parse_counts(ap, "--shape", a.shape, sep="x")
    if len(shape) != 2:
        ap.error(f"--shape: N x K, e.g. 8960x1536, got {a.shape!r}")
    n, k = shape
    if n % 16 or k % 256:
        ap.error(f"--shape: N must be a multiple of 16 and K of 256, got {n}x{k}")
    threads = parse_counts(ap, "--threads", a.threads) if a.threads else sorted({1, torch.get_num_threads()})
    row_counts = parse_counts(ap, "--rows", a.rows)
    if min(row_counts) < 1:
        ap.error("--rows: each count must be at least 1")
    if not kernels.has_fast_path():
        print("specextend: the one-row product needs the quantized kernels on a vector path "
              f"(here: {kernels.describe()})", file=sys.stderr)
        return 1
    rate, seen = ReadRate(), {t: [] for t in threads}

    def sample(t: int, passes: int = 2) -> None:  # the memory's rate can move within the run: beside each product
        torch.set_num_threads(t)
        seen[t].append(rate.sample(passes))

    for t in threads:
        sample(t, 5)
    rows = []
    for f in tqdm(formats, desc="formats", unit="format", file=sys.stderr):
        for t in threads:
            for r in row_counts:
                rows.append(measure(f, n, k, t, a.stream_mb, a.repeats, r))
                sample(t)
    rows = [against_floor(r, (min(seen[r["threads"]]), max(seen[r["threads"]]))) for r in rows]
    what = "one-row product" if row_counts == [1] else f"product of {','.join(map(str, row_counts))} rows"
    print(f"{what}, kernel path {kernels.path()}, CPU {kernels.cpu_name()}\n")
    print(report(rows))
    for t in threads:
        note = moved_note((min(seen[t]), max(seen[t])))
        if note:
            print(f"\n{t} thread{'s' if t > 1 else ''}: read GB/s is the highest rate seen{note}")
    if a.json:
        tmp = a.json.with_suffix(a.json.suffix + ".tmp")
        tmp.write_text(json.dumps({"path": kernels.path(), "cpu": kernels.cpu_name(), "rows": rows}, indent=1))
        tmp.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
