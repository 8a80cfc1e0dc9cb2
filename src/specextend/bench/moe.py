"""Mixture-of-experts speed side by side with llama.cpp on one GGUF file (issue 68's goals; a dense file too).

    python -m specextend.bench.moe --target FILE [--prefill 512,2048] [--decode 32] [--rows 1,4,8]
                                   [--llama-bench PATH] [--json OUT]

Ours: prefill of random prompts of each length (one run each after a warm-up), decode tokens per
second (one-row steps after a 16-token context: llama-bench's `tg`), the cost of a verification
forward of 1, 4 and 8 rows over a 512-token context (a causal block, like `bench.runtime`), the
one-row step's read rate against the machine's, counting only the bytes a token reads
(`models.footprint.expert_share`): the medians of steps each followed by a plain read of 1 GB
(`alternated`; `one_row_s` is the fastest step), and the process's peak resident memory
(which counts the file's mapped pages; a windowed model's cache keeps its window and a prefill
chunk's room, as a generation's does). Then `llama-bench -m FILE -t THREADS -p ... -n DECODE`
in the same run (by default the one `make peers` built beside its server) and its peak memory, and
the ratios.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..common.errors import UserError
from ..options import OneLineParser
from .llamacpp import find_peer
from .runtime import ReadRate, elapsed, parse_counts


def peak_rss_gb() -> float:
    """This process's peak resident set (VmHWM), GB: file pages mapped and touched count."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def active_bytes(path: Path) -> int:
    """Bytes of weights a token reads (its experts' share of the stacked tensors, all of the rest)."""
    from ..models.footprint import expert_share
    from ..models.gguf import open_gguf

    r = open_gguf(path)
    arch = _arch(r)
    keys = (f"{arch}.expert_count", f"{arch}.expert_used_count")
    # A dense model (the verification costs' comparison) reads every weight a token.
    count, used = (int(r.fields[k].contents()) for k in keys) if keys[0] in r.fields else (1, 1)

    class T:  # expert_share's view of a tensor
        def __init__(self, t: Any) -> None:
            self.shape, self.file_bytes = tuple(int(s) for s in t.shape), int(t.n_bytes)

    return expert_share(count, used, [(t.name, T(t)) for t in r.tensors])["active_bytes"]


def _arch(reader: Any) -> str:
    return str(reader.fields["general.architecture"].contents())


def ours(path: Path, prefill: list[int], decode: int, rows: list[int], repeats: int,
         active: int) -> dict[str, Any]:
    from .. import api
    from ..speculation.decoder import window_room

    t = time.perf_counter()
    model = api.load(path, load_draft=False, progress=False).target
    res: dict[str, Any] = {"load_s": time.perf_counter() - t, "threads": torch.get_num_threads()}
    vocab = model.cfg.vocab_size
    # The windowed layers keep their window and a prefill chunk's room, as a generation's cache does.
    cache = model.new_cache(max([*prefill, 528 + max(rows)]) + 64, room=window_room(model.cfg, max(rows)))
    gen = torch.Generator().manual_seed(0)
    model.prefill(torch.randint(0, vocab, (64,), generator=gen), cache)  # warm-up
    for n in prefill:
        cache.reset()
        ids = torch.randint(0, vocab, (n,), generator=gen)
        res[f"prefill_{n}_tok_s"] = n / elapsed(lambda ids=ids: model.prefill(ids, cache))
    cache.reset()
    model.prefill(torch.randint(0, vocab, (16,), generator=gen), cache)
    one = torch.ones(1, 1, dtype=torch.bool)

    def step() -> None:
        pos = torch.tensor([cache.length])
        model(torch.randint(0, vocab, (1,), generator=gen), pos, cache, one, "efficient")
        cache.commit()

    step()
    res["decode_tok_s"] = decode / elapsed(lambda: [step() for _ in range(decode)])
    res["one_row_s"] = min(elapsed(step) for _ in range(decode))
    cache.reset()
    model.prefill(torch.randint(0, vocab, (512,), generator=gen), cache)
    costs = {}
    for r in rows:
        toks, pos = torch.randint(0, vocab, (r,), generator=gen), torch.arange(512, 512 + r)
        mask = torch.ones(r, r, dtype=torch.bool).tril_()

        def fwd(toks=toks, pos=pos, mask=mask) -> None:
            model(toks, pos, cache, mask, "efficient")
            cache.discard()

        fwd()
        costs[r] = min(elapsed(fwd) for _ in range(repeats))
    res["rows_s"] = {str(r): costs[r] for r in rows}
    res["rows_vs_one"] = {str(r): costs[r] / costs[rows[0]] for r in rows}
    res["peak_rss_gb"] = peak_rss_gb()  # before the read buffer below
    cache.reset()
    model.prefill(torch.randint(0, vocab, (16,), generator=gen), cache)
    res.update(read_share(active, *alternated(step, max(1, min(decode, 64)))))
    return res


def alternated(step: Callable[[], None], pairs: int, mb: int = 1024) -> tuple[list[float], list[float]]:
    """`pairs` one-row steps, each followed by a plain read of a buffer far larger than the caches in
    the weights' kind of memory: the seconds of each step and the GB/s of the read after it. A step's
    read rate is judged against the read beside it, so a machine whose memory speed drifts during a
    run (a VM whose neighbours come and go: 17-22 GB/s within minutes on one) does not skew it."""
    rate = ReadRate(mb)
    steps, reads = [], []
    for _ in range(pairs):
        steps.append(elapsed(step))
        reads.append(rate.sample(passes=1))
    return steps, reads


def read_share(active: int, steps: list[float], reads: list[float]) -> dict[str, float]:
    """The one-row step's read rate (bytes a token reads over the step's time) and its share of the
    machine's, as the medians of alternated pairs (`alternated`)."""
    return {"one_row_read_gbs": active / statistics.median(steps) / 1e9, "read_gbs": statistics.median(reads),
            "of_read_rate": statistics.median(active / s / 1e9 / r for s, r in zip(steps, reads, strict=True))}


def llama(binary: Path, path: Path, threads: int, prefill: list[int], decode: int, reps: int) -> dict[str, Any]:
    cmd = [str(binary), "-m", str(path), "-t", str(threads), "-p", ",".join(map(str, prefill)), "-n", str(decode),
           "-r", str(reps), "-o", "json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:  # our half of the run is kept: the peer's failure is a result too
        lines = (done.stderr or done.stdout).strip().splitlines()
        why = next((x for x in reversed(lines) if "error" in x.lower()), lines[-1] if lines else "")
        signal = f" (signal {-done.returncode})" if done.returncode < 0 else ""
        return {"command": " ".join(cmd), "error": f"exit {done.returncode}{signal}: {why.strip()}"}
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out: dict[str, Any] = {"command": " ".join(cmd), "peak_rss_gb": max(peak, before) * 1024 / 1e9}
    for r in json.loads(done.stdout[done.stdout.index("["):]):
        key = f"prefill_{r['n_prompt']}_tok_s" if r["n_prompt"] else "decode_tok_s"
        out[key] = float(r["avg_ts"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m specextend.bench.moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, type=Path, help="a GGUF file of an expert model")
    ap.add_argument("--prefill", default="512,2048", help="prompt lengths to prefill (default: 512,2048)")
    ap.add_argument("--decode", type=int, default=32, help="one-row decode steps (default: 32)")
    ap.add_argument("--rows", default="1,4,8", help="verification forwards' row counts (default: 1,4,8)")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many per row count (default: 3)")
    ap.add_argument("--llama-bench", type=Path, default=None,
                    help="llama.cpp's llama-bench (default: the one beside `make peers`'s server; '' skips it)")
    ap.add_argument("--llama-repeats", type=int, default=2, help="llama-bench -r")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args(argv)
    prefill, rows = parse_counts(ap, "--prefill", a.prefill), parse_counts(ap, "--rows", a.rows)
    if not a.target.is_file():
        ap.error(f"--target {a.target}: no such file")
    if a.llama_bench is None:
        try:
            a.llama_bench = find_peer().binary.parent / "llama-bench"
        except UserError as e:
            ap.error(f"{e} (--llama-bench '' skips llama.cpp)")
    peer = str(a.llama_bench) not in ("", ".")
    if peer and not a.llama_bench.is_file():  # said now, not after our half of the run
        ap.error(f"--llama-bench {a.llama_bench}: no such file (`make peers` builds it; --llama-bench '' skips it)")
    from ..runtime import kernels

    res: dict[str, Any] = {"file": str(a.target), "file_gb": a.target.stat().st_size / 1e9,
                           "cpu": kernels.cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    res["active_bytes"] = active_bytes(a.target)
    res["ours"] = ours(a.target, prefill, a.decode, rows, a.repeats, res["active_bytes"])
    res["path"] = kernels.path()
    res["read_gbs"] = res["ours"].pop("read_gbs")
    if peer:
        res["llama"] = llama(a.llama_bench, a.target, res["ours"]["threads"], prefill, a.decode, a.llama_repeats)
        res["ratio"] = {k: res["ours"][k] / v for k, v in res["llama"].items() if k.endswith("tok_s")}
        if "error" in res["llama"]:
            print(f"bench.moe: llama-bench failed, {res['llama']['error']}", file=sys.stderr)
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
