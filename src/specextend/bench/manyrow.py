"""The many-row quantized product alone: how near the int8 peak does a prefill's linear layer run
in each format on this CPU?

    python -m specextend.bench.manyrow [--formats q4k,q5k] [--rows 512] [--shapes 1536x1536,1536x8960]
                                       [--threads 2] [--repeats 10] [--json OUT]

A prefill chunk multiplies hundreds of rows by every weight, so its linear layers are bound by
the kernel's arithmetic, not by memory (`bench.onerow` is the one-row, memory-side question).
This times the kernel path's product (`quant.qlinear`: the rows' quantization and the product,
as the model calls it) of `--rows` random rows by a random matrix in each format and shape (the
default shapes are the default target's: q/o and gate|up with 1,536 inputs, down with 8,960),
best of `--repeats`, as G MAC/s beside the peak loop of the instructions it is made of
(`specextend kernels --peak`, the best recorded on this machine as `bench.runtime`'s floor: int8
dot products for the integer formats, float32 FMAs for F16 and BF16). Another process can only
slow a call down, so best-of is the figure to compare; on a shared machine compare two builds by
alternating runs of this and keeping each side's best.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..options import OneLineParser
from ..runtime import kernels, quant
from . import roofline
from .onerow import FORMATS, parse_formats, random_weight
from .runtime import parse_counts

FLOAT_FORMATS = ("f16", "bf16", "bf16d")
DEFAULT_SHAPES = "1536x1536,17920x1536,1536x8960"


def best_call_s(x: torch.Tensor, w: Any, repeats: int) -> float:
    """Best seconds of one product of the rows x by w over `repeats` calls (after a warm-up)."""
    out = torch.empty(x.shape[0], w.n)
    quant.qlinear(x, w, out=out)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        quant.qlinear(x, w, out=out)
        best = min(best, time.perf_counter() - t)
    return best


def measure(fmt: str, rows: int, n: int, k: int, repeats: int) -> dict[str, Any]:
    w = random_weight(fmt, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    s = best_call_s(x, w, repeats)
    return {"format": fmt, "rows": rows, "n": n, "k": k, "ms": s * 1e3, "gmac_per_s": rows * n * k / s / 1e9,
            "peak_kind": "bf16" if fmt in FLOAT_FORMATS else "int8"}


def report(rows: list[dict[str, Any]], peaks: dict[str, float]) -> str:
    lines = ["| format | rows | shape | ms | G MAC/s | of peak |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['rows']} | {r['n']}x{r['k']} | {r['ms']:.2f} | {r['gmac_per_s']:.1f} | "
                     f"{r['gmac_per_s'] / peaks[r['peak_kind']]:.0%} |")
    return "\n".join(lines)


def parse_shapes(ap: argparse.ArgumentParser, value: str) -> list[tuple[int, int]]:
    """--shapes: comma-separated N x K, N a multiple of 16 and K of 256 (one-line error otherwise)."""
    shapes = []
    for s in value.split(","):
        nk = parse_counts(ap, "--shapes", s, sep="x")
        if len(nk) != 2 or nk[0] % 16 or nk[1] % 256:
            ap.error(f"--shapes: N x K with N a multiple of 16 and K of 256, got {s!r}")
        shapes.append((nk[0], nk[1]))
    return shapes


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m specextend.bench.manyrow", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="any of " + ", ".join(FORMATS))
    ap.add_argument("--rows", type=int, default=512, help="rows a product (a prefill chunk's tokens)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="N x K products, comma-separated (N a multiple of 16, "
                    "K of 256; default: the default target's q/o, gate|up and down)")
    ap.add_argument("--threads", type=int, default=None, help="default: torch's")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    formats = parse_formats(ap, a.formats)
    shapes = parse_shapes(ap, a.shapes)
    if a.rows < 1 or a.repeats < 1 or (a.threads is not None and a.threads < 1):
        ap.error("--rows, --repeats and --threads must be positive")
    if not kernels.has_fast_path():
        print("specextend: the many-row product needs the quantized kernels on a vector path "
              f"(here: {kernels.describe()})", file=sys.stderr)
        return 1
    if a.threads:
        torch.set_num_threads(a.threads)
    path = kernels.path()
    rows = [measure(f, a.rows, n, k, a.repeats)
            for f in tqdm(formats, desc="formats", unit="format", file=sys.stderr) for n, k in shapes]
    measured = roofline.measure(paths=[path])
    loops, peaks = measured["paths"][path]["loops"], roofline.floor_peaks(measured, path)
    print(f"many-row product, kernel path {path}, CPU {kernels.cpu_name()}, {torch.get_num_threads()} threads; "
          f"peaks (best recorded here, as bench.runtime's floor): int8 {peaks['int8']:.0f} G MAC/s "
          f"({loops['int8']['instruction']}), float {peaks['bf16']:.0f} ({loops['bf16']['instruction']})\n")
    print(report(rows, peaks))
    if a.json:
        tmp = a.json.with_suffix(a.json.suffix + ".tmp")
        tmp.write_text(json.dumps({"path": path, "cpu": kernels.cpu_name(), "threads": torch.get_num_threads(),
                                   "peaks_gmac_per_s": peaks, "rows": rows}, indent=1))
        tmp.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
