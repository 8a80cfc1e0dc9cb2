"""Two builds of the kernels side by side in one process: is a kernel change faster, and are its
bits the same?

    python -m specextend.bench.kernel_ab --against ../before/src [--formats q3k,q6k] [--rows 1,64]
        [--shapes 8960x1536] [--threads 1] [--rounds 21] [--cold-mb 0] [--json OUT]

On a host whose speed swings from one run to the next (other tenants on the same cores), two
processes minutes apart cannot tell a 10% change from the host. This loads the kernels of another
checkout (`--against`: its `src` folder; built into the kernel cache on first use, about a minute)
beside this checkout's, under their own module names; gives both the same random weights
(`bench.onerow`'s) and rows; checks that their outputs are bit-equal; and alternates their calls
(before, after, after, before, ...), each timing about 0.2 s of products. It reports the median
over rounds of the time ratio before / after (above 1: this checkout is faster) with its range,
and each side's best G MAC/s. `--cold-mb` cycles copies of the weights far above the caches, as a
decode step streams them; 0 (the default) times the same copy, from the caches.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tqdm import tqdm

from ..common.errors import UserError
from ..options import OneLineParser
from ..runtime import kernels
from .manyrow import parse_shapes
from .onerow import FORMATS, _copy, parse_formats, random_weight
from .report import write_text_atomic
from .runtime import parse_counts

# Where a checkout keeps its kernels' module: this layout, or the flat one before 2026-12-02.
KERNEL_MODULES = ("specextend.runtime.kernels", "specextend.kernels")
_BUILD_DIR = "import importlib; k = importlib.import_module({!r}); k.load(); print(k.build_dir())"


def kernels_module(src: Path) -> str | None:
    """The module that builds the kernels in the checkout whose package folder is `src`, or None."""
    return next((m for m in KERNEL_MODULES if (src / (m.replace(".", "/") + ".py")).is_file()), None)


def other_build(src: Path) -> ModuleType:
    """The compiled kernels of the checkout whose package folder is `src` (built on first use)."""
    builder = kernels_module(src)
    if builder is None:
        raise UserError(f"--against: {src} is not a checkout's src folder (no specextend/runtime/kernels.py in it)")
    env = {**os.environ, "PYTHONPATH": str(src)}
    run = subprocess.run([sys.executable, "-c", _BUILD_DIR.format(builder)], cwd=src, env=env, capture_output=True,
                         text=True)
    if run.returncode != 0 or not run.stdout.strip():
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"--against: cannot build the kernels of {src}: {last}")
    folder = Path(run.stdout.strip().splitlines()[-1])
    if folder == kernels.build_dir():
        return kernels.load()  # the same sources: the same build
    so = sorted(folder.glob("*.so"))
    if not so:
        raise UserError(f"--against: no compiled kernels in {folder}")
    name = so[0].name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(so[0]))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def compare(before: ModuleType, fmt: str, rows: int, n: int, k: int, threads: int, rounds: int,
            cold_mb: int) -> dict[str, Any]:
    """One format and shape: both builds' outputs compared, then `rounds` alternated timings."""
    torch.set_num_threads(threads)
    after = kernels.load()
    w = random_weight(fmt, n, k)
    copies = [w] + ([_copy(w) for _ in range(max(1, cold_mb * 2**20 // w.nbytes) - 1)] if cold_mb else [])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    out = torch.empty(rows, n)
    path = kernels.path_index(kernels.path())
    args = [(x, v.blobs, v.formats, v.widths, v.offsets, v.groups, None, None, 0.0, False, None, path, out)
            for v in copies]
    before.qlinear(*args[0])
    first = out.clone()
    after.qlinear(*args[0])
    equal = torch.equal(first, out)
    calls = max(len(args), round(0.2 / max(1e-6, _seconds(after, args, 1))))
    times: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(rounds):
        order = (("before", before), ("after", after)) if r % 2 == 0 else (("after", after), ("before", before))
        for side, module in order:
            times[side].append(_seconds(module, args, calls))
    ratios = [b / a for b, a in zip(times["before"], times["after"], strict=True)]
    macs = rows * n * k
    return {"format": fmt, "rows": rows, "n": n, "k": k, "threads": threads, "rounds": rounds, "cold_mb": cold_mb,
            "bits_equal": equal, "before_gmacs_best": macs / min(times["before"]) / 1e9,
            "after_gmacs_best": macs / min(times["after"]) / 1e9, "speedup_median": statistics.median(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios)}


def _seconds(module: ModuleType, args: list[tuple], calls: int) -> float:
    t = time.perf_counter()
    for i in range(calls):
        module.qlinear(*args[i % len(args)])
    return (time.perf_counter() - t) / calls


def report(rows: list[dict[str, Any]]) -> str:
    lines = ["| format | rows | shape | threads | before G MAC/s (best) | after (best) | after speed, median (range) "
             "| bits |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['rows']} | {r['n']}x{r['k']} | {r['threads']} | "
                     f"{r['before_gmacs_best']:.1f} | {r['after_gmacs_best']:.1f} | **{r['speedup_median']:.3f}x** "
                     f"({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | {'equal' if r['bits_equal'] else 'DIFFER'} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m specextend.bench.kernel_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", type=Path, required=True, help="the other checkout's src folder (the before side)")
    ap.add_argument("--formats", default="q4k,q6k", help="any of " + ", ".join(FORMATS))
    ap.add_argument("--rows", default="1,64", help="rows a product, comma-separated")
    ap.add_argument("--shapes", default="8960x1536,1536x8960", help="N x K products (N a multiple of 16, K of 256)")
    ap.add_argument("--threads", default="1", help="thread counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=21, help="alternated timings a side")
    ap.add_argument("--cold-mb", type=int, default=0,
                    help="MB of weight copies cycled, as a decode streams them (0: one copy, hot)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    formats = parse_formats(ap, a.formats)
    rows = parse_counts(ap, "--rows", a.rows)
    threads = parse_counts(ap, "--threads", a.threads)
    shapes = parse_shapes(ap, a.shapes)
    if a.rounds < 1 or a.cold_mb < 0:
        ap.error("--rounds must be at least 1 and --cold-mb at least 0")
    if kernels_module(a.against) is None:
        ap.error(f"--against: {a.against} is not a checkout's src folder (no specextend/runtime/kernels.py in it)")
    if not kernels.has_fast_path():
        print(f"specextend: the kernels run portable here ({kernels.describe()}): nothing to compare",
              file=sys.stderr)
        return 1
    try:
        before = other_build(a.against.resolve())
    except UserError as e:
        print(f"specextend: {e}", file=sys.stderr)
        return 2
    cases = [(f, m, n, k, t) for f in formats for m in rows for n, k in shapes for t in threads]
    out = [compare(before, f, m, n, k, t, a.rounds, a.cold_mb)
           for f, m, n, k, t in tqdm(cases, desc="products", unit="product", file=sys.stderr)]
    print(f"before: {a.against}; after: this checkout; kernel path {kernels.path()}, CPU {kernels.cpu_name()}\n")
    print(report(out))
    if a.json:
        write_text_atomic(a.json, json.dumps({"path": kernels.path(), "cpu": kernels.cpu_name(),
                                              "against": str(a.against), "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
