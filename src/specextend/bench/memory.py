"""Peak memory of chunked prefill, efficient (flash) vs eager attention, at long lengths.

    python -m specextend.bench.memory [--model REF] [--lengths 8192,16384,32768] [--layers 2]

Each measurement runs in a fresh subprocess and reports the peak resident memory above the
loaded model. To keep a 32K-token prefill affordable on a laptop CPU, only the first `--layers`
transformer layers of the real model run: activation and attention memory is per layer (layers
run one after another), so the peak above the KV cache is the same as for the full model, and the
full model's KV cache size is reported beside it (it grows linearly and is the same for both).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRSS:
    """Samples resident memory every few milliseconds while the block runs (Linux)."""

    def __enter__(self) -> _PeakRSS:
        self.base = self.peak = _rss()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _rss())


def _child(model_ref: str | None, length: int, backend: str, layers: int) -> dict:
    import torch

    from .. import api
    from ..runtime.kv_cache import KVCache

    model = api.load(model_ref, load_draft=False, progress=False).target
    full_layers = model.cfg.num_layers
    kv_bytes_full = 2 * full_layers * model.cfg.num_kv_heads * model.cfg.head_dim * 4 * length
    model.layers = model.layers[:layers]
    c = model.cfg
    cache = KVCache(layers, c.num_kv_heads, c.head_dim, length + 8, model.dtype)
    cache.k.fill_(0.0)
    cache.v.fill_(0.0)  # touch the pages now so they count in the baseline, not the peak
    ids = torch.randint(0, 1000, (length,))
    model.prefill(ids[:8], cache, backend)  # warm-up allocations
    cache.reset()
    sampler = _PeakRSS()
    t = time.perf_counter()
    with sampler:
        model.prefill(ids, cache, backend)
    seconds = time.perf_counter() - t
    base, peak = sampler.base, sampler.peak
    kv_here = 0  # allocated and touched before the baseline
    return {
        "length": length,
        "backend": backend,
        "layers_run": layers,
        "peak_above_model_mb": (peak - base) / 2**20,
        "kv_cache_here_mb": cache.nbytes / 2**20,
        "work_above_kv_mb": max(0.0, (peak - base - kv_here) / 2**20),
        "kv_cache_full_model_mb": kv_bytes_full / 2**20,
        "seconds_for_layers_run": seconds,
        "lxl_matrix_mb_if_materialised": model.cfg.num_heads * length * length * 4 / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--backends", default="efficient,eager")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--child", nargs=3, metavar=("LENGTH", "BACKEND", "LAYERS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.model, int(a.child[0]), a.child[1], int(a.child[2]))))
        return 0
    rows = []
    for length in (int(x) for x in a.lengths.split(",")):
        for backend in a.backends.split(","):
            cmd = [sys.executable, "-m", "specextend.bench.memory", "--child", str(length), backend, str(a.layers)]
            if a.model:
                cmd += ["--model", a.model]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            rows.append(json.loads(out))
            r = rows[-1]
            print(f"{length:>6} {backend:9s} peak above model {r['peak_above_model_mb']:8.0f} MB "
                  f"(KV of {a.layers} layers preallocated: {r['kv_cache_here_mb']:6.0f} MB); "
                  f"full-model KV {r['kv_cache_full_model_mb']:6.0f} MB; "
                  f"an L x L score matrix would be {r['lxl_matrix_mb_if_materialised']:8.0f} MB", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
